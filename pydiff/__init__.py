"""pydiff: differentiable compute on Slang shaders, built on SlangPy.

    import pydiff, numpy as np
    m = pydiff.load_module("polynomial.slang")
    x = pydiff.tensor([1.0, 2.0, 3.0], requires_grad=True)
    y = m.polynomial(2.0, 8.0, -1.0, x, _result="tensor")
    m.polynomial.bwds(2.0, 8.0, -1.0, x, _result=y.with_grads(ones=True))
    print(x.grad.numpy())        # 4x + 8

Everything listed in ``__all__`` is public; other names may change.
"""

from ._errors import (
    DeviceUnavailableError,
    PydiffError,
    ShaderTrapError,
    ShaderTrapWarning,
    SlangCompileError,
    StaleGradientError,
)
from .device import (
    Device,
    available_devices,
    create_device,
    default_device,
    set_default_device,
    shader_dir,
)
from .capturing import CapturedStep, CaptureError, capture
from .checks import GradcheckError, gradcheck
from .determinism import NondeterminismWarning, deterministic, is_deterministic, set_deterministic
from .fixed_point import GradientOverflowError
from .function import Function, FunctionCtx
from .forward import hessian, hvp, jvp, vjp
from .module import BackwardFunction, Module, ShaderFunction, load_module, load_module_from_source
from .policy import ZeroPolicy, get_zero_policy, set_zero_policy, zero_policy
from . import nn, ops, optim
from .tape import Tape
from .tensor import Tensor, empty, empty_cache, ones, tensor, zeros

__version__ = "0.1.0"

__all__ = [
    "BackwardFunction",
    "CaptureError",
    "CapturedStep",
    "Device",
    "DeviceUnavailableError",
    "Function",
    "FunctionCtx",
    "GradcheckError",
    "GradientOverflowError",
    "Module",
    "NondeterminismWarning",
    "PydiffError",
    "ShaderFunction",
    "ShaderTrapError",
    "ShaderTrapWarning",
    "SlangCompileError",
    "StaleGradientError",
    "Tape",
    "Tensor",
    "ZeroPolicy",
    "available_devices",
    "create_device",
    "capture",
    "default_device",
    "deterministic",
    "empty",
    "empty_cache",
    "gradcheck",
    "hessian",
    "hvp",
    "is_deterministic",
    "jvp",
    "vjp",
    "get_zero_policy",
    "load_module",
    "load_module_from_source",
    "nn",
    "ops",
    "optim",
    "ones",
    "set_default_device",
    "set_deterministic",
    "set_zero_policy",
    "shader_dir",
    "tensor",
    "zero_policy",
    "zeros",
]
