"""pydiff: differentiable compute on Slang shaders, built on SlangPy.

    import pydiff, numpy as np
    m = pydiff.load_module("polynomial.slang")
    x = pydiff.tensor([1.0, 2.0, 3.0], requires_grad=True)
    y = m.polynomial(2.0, 8.0, -1.0, x, _result="tensor")
    m.polynomial.bwds(2.0, 8.0, -1.0, x, _result=y.with_grads(ones=True))
    print(x.grad.numpy())        # 4x + 8

Everything listed in ``__all__`` is public; other names may change.
"""

from . import slangpy_loader  # noqa: F401 (first: loads SlangPy, without torch if it cannot help)
from importlib.metadata import PackageNotFoundError as _NotInstalled
from importlib.metadata import version as _version

from .errors import (
    CacheWarning,
    CaptureError,
    ConvergenceError,
    DeviceUnavailableError,
    DistributedError,
    EnvironmentSettingError,
    GradcheckError,
    BuiltinNameError,
    GradientOverflowError,
    GradientFlowWarning,
    NondeterminismWarning,
    OpenFileLimitError,
    PydiffError,
    ShaderTrapError,
    ShaderTrapWarning,
    SlangCompileError,
    StaleGradientError,
    StaleInputError,
    TapeReuseWarning,
    TensorTooLargeError,
    OpDtypeError,
)
from .device import (
    Device,
    available_devices,
    create_device,
    default_device,
    set_default_device,
    shader_dir,
)
from . import forkguard  # noqa: F401 (a forked child's inherited devices: never a hang)
from .capturing import CapturedStep, capture
from .creation import empty, empty_cache, ones, tensor, zeros
from .creation_ranges import arange, full, linspace, ones_like, rand, randn, zeros_like
from .determinism import deterministic, is_deterministic, set_deterministic
from .function import Function, FunctionCtx
from .gradcheck import gradcheck
from .module import (
    BackwardFunction,
    Module,
    OverloadedFunction,
    ShaderFunction,
    load_module_from_source,
)
from .module_files import load_module
from .forward_mode import ForwardFunction
from .policy import ZeroPolicy, get_zero_policy, set_zero_policy, zero_policy
from .signature import ParamInfo, Signature
from .storage import Storage
from .tape import Tape
from .tensor import Tensor
from .transforms import hessian, hvp, jvp, vjp
from .grad_transforms import grad, value_and_grad
from .jacobians import jacfwd, jacrev
from .implicit import fixed_point
from .dlpack_interop import from_dlpack
from .torch_interop import from_torch, to_torch, torch_function
from . import distributed, nn, ops, optim
from . import tensor_api  # noqa: F401 (provides Tensor's operators and methods)

try:  # one place: the version pyproject.toml gives the installed package
    __version__ = _version("pydiff")
except _NotInstalled:  # a source checkout that is not installed
    __version__ = "0+unknown"

__all__ = [
    "zeros_like",
    "randn",
    "rand",
    "ones_like",
    "linspace",
    "full",
    "arange",
    "BackwardFunction",
    "CacheWarning",
    "ForwardFunction",
    "OverloadedFunction",
    "ParamInfo",
    "Signature",
    "Storage",
    "CaptureError",
    "ConvergenceError",
    "CapturedStep",
    "Device",
    "DeviceUnavailableError",
    "DistributedError",
    "EnvironmentSettingError",
    "Function",
    "FunctionCtx",
    "BuiltinNameError",
    "GradcheckError",
    "GradientOverflowError",
    "Module",
    "GradientFlowWarning",
    "NondeterminismWarning",
    "OpDtypeError",
    "OpenFileLimitError",
    "PydiffError",
    "ShaderFunction",
    "ShaderTrapError",
    "ShaderTrapWarning",
    "SlangCompileError",
    "StaleGradientError",
    "StaleInputError",
    "TapeReuseWarning",
    "TensorTooLargeError",
    "Tape",
    "Tensor",
    "ZeroPolicy",
    "available_devices",
    "create_device",
    "capture",
    "default_device",
    "deterministic",
    "distributed",
    "empty",
    "empty_cache",
    "fixed_point",
    "from_dlpack",
    "from_torch",
    "grad",
    "gradcheck",
    "hessian",
    "hvp",
    "jacfwd",
    "jacrev",
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
    "to_torch",
    "torch_function",
    "value_and_grad",
    "zero_policy",
    "zeros",
]
