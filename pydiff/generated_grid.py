"""Generated kernels for forward calls over a grid: a function that indexes its own tensors
(``void f(int idx, float a, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)``, called as
``m.f(spy.grid(shape), 2.0, x, y)``, the pattern of SlangPy's differentiable-tensor docs).

SlangPy's generic kernel for such a call costs about ten times what the function does (2^22
floats on lavapipe: 59 ms where the same function called from a plain kernel took 18 ms). The
kernel generated here gives each thread its grid index and SlangPy's own tensor types
(``PrimalTensor``, ``WPrimalTensor``, ``Tensor``, ...: what SlangPy binds for the forward
pass), built from the buffers, shapes, strides and offsets of the tensors passed. Off a tape,
a one-dimensional grid (stride 1, offset 0) at an ``int``/``uint`` parameter, float numbers,
and float tensors at interface tensor parameters; the rest keeps SlangPy's path.

    ran = generated_grid.forward(fn, bound)     # False: SlangPy's path
"""

from __future__ import annotations

import hashlib
import math
import re
import threading
from typing import Any

from .buffer_pool import BoundedDict
from .kernels import KERNELS_MAX
from .signature import FunctionTarget, overloaded
from .tensor import Tensor

GROUP = 256
_FLOAT_MAX = 3.4028234663852886e38
# Interface tensor types of float elements, by (access, pydiff's tensor kind): the concrete
# type SlangPy binds for a forward call, and its buffer's type.
_TYPES = {
    ("read", "idiff"): ("PrimalTensor", "StructuredBuffer<float>"),
    ("write", "idiff"): ("WPrimalTensor", "RWStructuredBuffer<float>"),
    ("read_write", "idiff"): ("RWPrimalTensor", "RWStructuredBuffer<float>"),
    ("read", "plain"): ("Tensor", "StructuredBuffer<float>"),
    ("write", "plain"): ("WTensor", "RWStructuredBuffer<float>"),
    ("read_write", "plain"): ("RWTensor", "RWStructuredBuffer<float>"),
}
_INTERFACE = re.compile(r"I(RW|W)?(Diff)?Tensor<float, ([1-4])>")
_lock = threading.Lock()


def is_grid(value: Any) -> bool:
    """Whether ``value`` is SlangPy's ``grid(...)`` argument."""
    return type(value).__name__ == "GridArg"


def call_size(bound: list) -> int:
    """The threads of a call over a grid: its grid's elements (the first grid's)."""
    return next((math.prod(v.shape) for _, v in bound if is_grid(v)), 0)


def _layout(fn: FunctionTarget, bound: list) -> tuple | None:
    """Per parameter: ("g",) the grid, ("n",) a number, ("t", D, concrete type, buffer
    type, innermost stride is 1) a tensor; None where this generator does not cover the
    call."""
    sig = fn.signature
    if sig.return_type != "void" or fn.module.traps.get(fn.name) or overloaded(fn):
        return None
    layout, grids, storages = [], 0, set()
    for p, value in bound:
        if p.io != "in" or p.generic:
            return None
        if is_grid(value):
            if p.type_name not in ("int", "uint") or not _plain_1d_grid(value):
                return None
            grids += 1
            layout.append(("g",))
        elif type(value) in (float, int) and p.type_name == "float":
            if not -_FLOAT_MAX <= float(value) <= _FLOAT_MAX:
                return None  # (SlangPy's path names it)
            layout.append(("n",))
        elif type(value) is Tensor and (m := _INTERFACE.fullmatch(p.type_name)):
            kind = _TYPES.get((p.access, p.tensor_kind))
            dims = int(m.group(3))
            if kind is None or value.dtype != "float" or len(value.shape) != dims:
                return None
            if value.device is not fn.module.device or id(value.storage) in storages:
                return None  # (another device, or one storage twice: SlangPy's path decides)
            storages.add(id(value.storage))
            unit = int(value.bind(True).strides[-1] == 1)
            layout.append(("t", dims, *kind, unit))
        else:
            return None
    return tuple(layout) if grids == 1 else None


def _plain_1d_grid(grid: Any) -> bool:
    return len(grid.shape) == 1 and list(grid.stride) == [1] and list(grid.offset) == [0]


def _source(fn: FunctionTarget, layout: tuple) -> str:
    params, build, args = ["uint3 pydiff_tid: SV_DispatchThreadID", "uniform uint pydiff_n"], [], []
    for i, kind in enumerate(layout):
        if kind[0] == "g":
            args.append(f"{fn.signature.params[i].type_name}(pydiff_tid.x)")
        elif kind[0] == "n":
            params.append(f"uniform float pydiff_a{i}")
            args.append(f"pydiff_a{i}")
        else:
            _, dims, concrete, buffer = kind[:4]
            params.append(f"uniform {buffer} pydiff_b{i}")
            params += [f"uniform uint pydiff_s{i}_{k}" for k in range(dims)]
            # the innermost stride as a constant where it is 1 (its index arithmetic folds:
            # 2^22 elements 27 -> 19 ms on lavapipe), else a uniform as the others
            unit = kind[4]
            params += [f"uniform uint pydiff_d{i}_{k}" for k in range(dims - unit)]
            params.append(f"uniform uint pydiff_o{i}")
            shape = ", ".join(f"pydiff_s{i}_{k}" for k in range(dims))
            strides = ", ".join([f"pydiff_d{i}_{k}" for k in range(dims - unit)] + ["1"] * unit)
            build.append(
                f"    {concrete}<float, {dims}> pydiff_t{i};\n"
                f"    pydiff_t{i}._data = pydiff_b{i};\n"
                f"    pydiff_t{i}._shape = {{{shape}}};\n"
                f"    pydiff_t{i}._strides = {{{strides}}};\n"
                f"    pydiff_t{i}._offset = pydiff_o{i};\n"
            )
            args.append(f"pydiff_t{i}")
    joined = ",\n    ".join(params)
    return (
        f"import slangpy;\nimport {fn.module.import_spec};\n\n"
        f'[shader("compute")][numthreads({GROUP}, 1, 1)]\n'
        f"void pydiff_grid_fwd(\n    {joined})\n{{\n"
        "    if (pydiff_tid.x >= pydiff_n)\n        return;\n"
        + "".join(build)
        + f"    {fn.name}({', '.join(args)});\n}}\n"
    )


def _kernel(fn: FunctionTarget, layout: tuple) -> Any:
    """The compiled kernel of ``layout`` (None, remembered, where it fails to build)."""
    dev = fn.module.device
    cache = dev.cached("pydiff.generated_grid", lambda: BoundedDict(KERNELS_MAX))
    key = (fn.module.import_spec, fn.name, layout)
    with _lock:
        if key in cache:
            return cache[key]
    source = _source(fn, layout)
    digest = hashlib.sha1(source.encode()).hexdigest()[:12]
    try:
        module = dev.native.load_module_from_source(f"pydiff_grid_{fn.name}_{digest}", source)
        program = dev.native.link_program([module], [module.entry_point("pydiff_grid_fwd")])
        kernel = dev.native.create_compute_kernel(program)
    except Exception:  # an overload or a type the kernel cannot pass: SlangPy's path
        kernel = None
    with _lock:
        cache[key] = kernel
    return kernel


def forward(fn: FunctionTarget, bound: list) -> bool:
    """Run the forward call (``(param, value)`` pairs) as a generated kernel; False, nothing
    done, where it is not covered."""
    layout = _layout(fn, bound)
    if layout is None:
        return False
    kernel = _kernel(fn, layout)
    if kernel is None:
        return False
    bindings: dict = {}
    threads = 0
    for i, ((_, value), kind) in enumerate(zip(bound, layout)):
        if kind[0] == "g":
            threads = math.prod(value.shape)
        elif kind[0] == "n":
            bindings[f"pydiff_a{i}"] = float(value)
        else:
            native = value.bind(True)
            bindings[f"pydiff_b{i}"] = native.storage
            for k, (size, stride) in enumerate(zip(native.shape, native.strides)):
                bindings[f"pydiff_s{i}_{k}"] = int(size)
                if k < kind[1] - kind[4]:
                    bindings[f"pydiff_d{i}_{k}"] = int(stride)
            bindings[f"pydiff_o{i}"] = int(native.offset)
    if threads == 0:
        return False
    bindings["pydiff_n"] = threads
    fn.module.device.kernels.dispatch(kernel, threads, **bindings)
    return True
