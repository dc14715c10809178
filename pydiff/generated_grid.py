"""Generated kernels for calls over a grid: a function that indexes its own tensors
(``void f(int idx, float a, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)``, called as
``m.f(spy.grid(shape), 2.0, x, y)`` and ``m.f.bwds(...)``, the pattern of SlangPy's
differentiable-tensor docs).

SlangPy's generic kernel for such a call costs about three times what the function does
(2^22 floats on lavapipe: forward 59 ms where the same function called from a plain kernel
took 18 ms, ``.bwds`` 93 against 28). The kernel generated here gives each thread its grid
index and SlangPy's own tensor types, the ones SlangPy binds (``PrimalTensor``,
``WPrimalTensor``, ``Tensor``, ... forward; ``DiffTensor``, ``WDiffTensor`` backward), built
from the buffers, shapes, strides and offsets of the SlangPy tensors the call would bind, so
the function runs the same code on the same memory. Covered: a grid of one, two or three
dimensions (stride 1, offset 0 on each axis) at an ``int``/``uint``, ``int2``/``uint2`` or
``int3``/``uint3`` parameter, float numbers, float tensors at interface tensor parameters,
on Vulkan and D3D12 (CUDA's buffers are pointers); the rest keeps SlangPy's path. A grid of
shape (H, W) gives the thread of row i, column j ``int2(j, i)``, as SlangPy does (a vector's
``.x`` is the last axis): the threads run the grid's elements in row-major order, each
decomposing its flat index.

    ran = generated_grid.forward(fn, bound)                  # False: SlangPy's path
    ran = generated_grid.backward(fn, bound, native_args)    # inside the backward's scope
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import Any

from . import grid_args, kernel_sources
from .buffer_pool import BoundedDict
from .fork_locks import renewed_lock
from .generated_helpers import left_to_slangpy
from .grid_args import is_grid
from .kernels import KERNELS_MAX
from .signature import FunctionTarget
from .tensor import Tensor

GROUP = 256
MAX_GROUPS = 65535  # (Vulkan's and D3D12's least maxComputeWorkGroupCount)
_FLOAT_MAX = 3.4028234663852886e38
_INTERFACE = re.compile(r"I(RW|W)?(Diff)?Tensor<float, ([1-4])>")
_READ, _WRITE = "StructuredBuffer<float>", "RWStructuredBuffer<float>"
_ATOMIC = "RWByteAddressBuffer"
# The concrete types SlangPy binds at an interface tensor parameter, by (access, pydiff's
# tensor kind): forward, and backward (None: not covered), each as (type, its tensor fields:
# (field, buffer type, which SlangPy tensor: the value, its grad_in or its grad_out)).
_FORWARD = {
    ("read", "idiff"): ("PrimalTensor", (("", _READ, ""),)),
    ("write", "idiff"): ("WPrimalTensor", (("", _WRITE, ""),)),
    ("read_write", "idiff"): ("RWPrimalTensor", (("", _WRITE, ""),)),
    ("read", "plain"): ("Tensor", (("", _READ, ""),)),
    ("write", "plain"): ("WTensor", (("", _WRITE, ""),)),
    ("read_write", "plain"): ("RWTensor", (("", _WRITE, ""),)),
}
_BACKWARD = {
    ("read", "idiff"): ("DiffTensor", (("._primal", _READ, ""), ("._grad_out", _ATOMIC, "out"))),
    ("write", "idiff"): ("WDiffTensor", (("._primal", _WRITE, ""), ("._grad_in", _READ, "in"))),
    ("read", "plain"): _FORWARD[("read", "plain")],
    ("write", "plain"): _FORWARD[("write", "plain")],
    ("read_write", "plain"): _FORWARD[("read_write", "plain")],
}
# A tensor the backward counts stores into (pydiff.written_mask): its wrapper's type, with the
# WDiffTensor SlangPy would bind (``inner``) and the counts (``written``).
_MASKED = re.compile(r"PydiffMaskedWDiffTensor<float, ([1-4])>")
_MASKED_FIELDS = (
    (".inner._primal", _WRITE, "inner"),
    (".inner._grad_in", _READ, "inner.in"),
    (".written", _ATOMIC, "written"),
)
_lock = renewed_lock(globals(), "_lock")  # (new in a forked child)


def call_size(bound: list) -> int:
    """The threads of a call over a grid: its grid's elements (the first grid's)."""
    return next((math.prod(v.shape) for _, v in bound if is_grid(v)), 0)


def _part(native: Any, which: str) -> Any:
    if type(native) is dict:  # a masked tensor's fields (WrittenMask.bind)
        base, _, rest = which.partition(".")
        return _part(native[base], rest)
    return native if which == "" else native.grad_in if which == "in" else native.grad_out


def _layout(fn: FunctionTarget, bound: list, natives: list | None, target: Any) -> tuple | None:
    """Per parameter: ("g", dims) the grid, ("n", differentiable) a number, ("t", D, type,
    fields, innermost strides are 1) a tensor; None where the call is not covered.
    ``natives``: the SlangPy values a backward binds (None: a forward call); ``target``:
    the function the kernel calls (``fn``, or its masked wrapper, of the same parameters)."""
    if fn.signature.return_type != "void" or left_to_slangpy(fn) is not None:
        return None
    if fn.module.device.type == "cuda":
        return None
    types = _FORWARD if natives is None else _BACKWARD
    layout, grids, storages = [], 0, set()
    for i, (p, value) in enumerate(bound):
        if p.io != "in" or p.generic:
            return None
        wrapped = target.signature.params[i].type_name
        if natives is not None and type(natives[i]) is dict:
            masked = _MASKED.fullmatch(wrapped)
            if masked is None or type(value) is not Tensor or value.dtype != "float":
                return None
            layout.append(("t", int(masked.group(1)), "PydiffMaskedWDiffTensor", _MASKED_FIELDS))
            storages.add(id(value.storage))
            continue
        if is_grid(value):
            if not grid_args.plain(value, grid_args.index_type(p.type_name)[1]):  # (int2: 2)
                return None
            grids += 1
            layout.append(("g", len(value.shape)))
        elif type(value) in (float, int) and p.type_name == "float":
            if not -_FLOAT_MAX <= float(value) <= _FLOAT_MAX:
                return None  # (SlangPy's path names it)
            layout.append(("n", natives is not None and p.differentiable))
        elif type(value) is Tensor and (m := _INTERFACE.fullmatch(p.type_name)):
            kind, dims = types.get((p.access, p.tensor_kind)), int(m.group(3))
            if kind is None or value.dtype != "float" or len(value.shape) != dims:
                return None
            if value.device is not fn.module.device or id(value.storage) in storages:
                return None  # (another device, or one storage twice: SlangPy's path decides)
            storages.add(id(value.storage))
            layout.append(("t", dims, kind[0], kind[1]))
        else:
            return None
    if grids != 1:
        return None
    out = []  # each tensor's parts' innermost strides: 1 (a constant in the kernel) or not
    for i, kind in enumerate(layout):
        if kind[0] == "t":
            native = bound[i][1].bind(True) if natives is None else natives[i]
            parts = [_part(native, which) for _, _, which in kind[3]]
            if any(n is None or len(n.shape) != kind[1] or min(n.strides) < 0 for n in parts):
                return None  # (negative strides: SlangPy's path)
            kind = (*kind, tuple(int(n.strides[-1] == 1) for n in parts))
        out.append(kind)
    return tuple(out)


def _grid_index(type_name: str, dims: int) -> str:
    """The grid index of the thread at flat index ``pydiff_i`` (row-major, the last axis the
    fastest, as SlangPy's call ids): a vector's ``.x`` is the last axis, as SlangPy's grid
    gives it. ``pydiff_gs{a}``: axis a's row-major stride; ``pydiff_gd{a}``: its size."""
    scalar, parts = grid_args.index_type(type_name)[0], []
    if dims == 1:
        return f"{scalar}(pydiff_i)"
    for axis in reversed(range(dims)):
        at = "pydiff_i" if axis == dims - 1 else f"pydiff_i / pydiff_gs{axis}"
        if axis > 0:  # (axis 0 needs no modulo: the flat index is below the grid's size)
            at = f"({at}) % pydiff_gd{axis}"
        parts.append(f"{scalar}({at})")
    return f"{scalar}{dims}({', '.join(parts)})"


def _grid_uniforms(shape: Any) -> dict:
    """The values of the uniforms ``_grid_index`` reads, for a grid of ``shape``."""
    sizes = [int(size) for size in shape]
    out = {f"pydiff_gd{a}": sizes[a] for a in range(1, len(sizes))}
    out.update({f"pydiff_gs{a}": math.prod(sizes[a + 1 :]) for a in range(len(sizes) - 1)})
    return out


def _leaf(var: str, name: str, buffer: str, dims: int, unit: int) -> tuple[list, str]:
    """A SlangPy tensor's uniforms and the statements that fill ``var`` from them (the
    innermost stride a constant where it is 1: its index arithmetic folds, 2^22 elements
    27 -> 19 ms on lavapipe)."""
    params = [f"uniform {buffer} {name}"] + [f"uniform uint {name}_s{k}" for k in range(dims)]
    params += [f"uniform uint {name}_d{k}" for k in range(dims - unit)]
    params.append(f"uniform uint {name}_o")
    shape = ", ".join(f"{name}_s{k}" for k in range(dims))
    strides = ", ".join([f"{name}_d{k}" for k in range(dims - unit)] + ["1"] * unit)
    return params, (
        f"    {var}._data = {name};\n    {var}._shape = {{{shape}}};\n"
        f"    {var}._strides = {{{strides}}};\n    {var}._offset = {name}_o;\n"
    )


def _source(fn: FunctionTarget, layout: tuple, backward: bool, looped: bool) -> str:
    """The kernel calling ``fn`` (or ``bwd_diff(fn)``) with each thread's grid index."""
    params = ["uint3 pydiff_tid: SV_DispatchThreadID", "uniform uint pydiff_n"]
    params.append("uniform uint pydiff_stride")
    build, args = [], []
    for i, kind in enumerate(layout):
        if kind[0] == "g":
            dims = kind[1]
            params += [f"uniform uint pydiff_gd{a}" for a in range(1, dims)]
            params += [f"uniform uint pydiff_gs{a}" for a in range(dims - 1)]
            args.append(_grid_index(fn.signature.params[i].type_name, dims))
        elif kind[0] == "n":
            params.append(f"uniform float pydiff_a{i}")
            if kind[1]:  # a differentiable number: its gradient is not wanted
                build.append(f"    var pydiff_p{i} = diffPair(pydiff_a{i}, 0.0);\n")
            args.append(f"pydiff_p{i}" if kind[1] else f"pydiff_a{i}")
        else:
            _, dims, concrete, fields, units = kind
            build.append(f"    {concrete}<float, {dims}> pydiff_t{i};\n")
            for j, ((field, buffer, _), unit) in enumerate(zip(fields, units)):
                leaf_params, fill = _leaf(
                    f"pydiff_t{i}{field}", f"pydiff_b{i}_{j}", buffer, dims, unit
                )
                params += leaf_params
                build.append(fill)
            args.append(f"pydiff_t{i}")
    call = f"bwd_diff({fn.name})" if backward else fn.name
    joined = ",\n    ".join(params)
    return (
        f"import slangpy;\nimport {fn.module.import_spec};\n\n"
        f'[shader("compute")][numthreads({GROUP}, 1, 1)]\n'
        f"void pydiff_grid(\n    {joined})\n{{\n"
        + "".join(build)
        # past MAX_GROUPS groups (a GPU's dispatch limit) the threads walk the grid; a loop
        # when none is needed cost lavapipe's forward 18 -> 26 ms at 2^22
        + (
            "    for (uint pydiff_i = pydiff_tid.x; pydiff_i < pydiff_n;"
            " pydiff_i += pydiff_stride)\n"
            if looped
            else "    uint pydiff_i = pydiff_tid.x;\n    if (pydiff_i < pydiff_n)\n"
        )
        + f"        {call}({', '.join(args)});\n}}\n"
    )


def _kernel(fn: FunctionTarget, layout: tuple, backward: bool, looped: bool) -> Any:
    """The compiled kernel calling ``fn`` (the user's function or its masked wrapper) for
    ``layout`` (None, remembered, where it fails to build)."""
    dev = fn.module.device
    cache = dev.cached("pydiff.generated_grid", lambda: BoundedDict(KERNELS_MAX), kernels=True)
    key = (fn.module.import_spec, fn.name, layout, backward, looped)
    with _lock:
        if key in cache:
            return cache[key]
    source = _source(fn, layout, backward, looped)
    digest = hashlib.sha1(source.encode()).hexdigest()[:12]
    try:
        name = f"pydiff_grid_{fn.name}_{digest}"
        kernel = kernel_sources.build_kernel(dev.native, dev.native, name, source, "pydiff_grid")
    except Exception:  # an overload or a type the kernel cannot pass: SlangPy's path
        kernel = None
    with _lock:
        cache[key] = kernel
    return kernel


def _run(fn: FunctionTarget, bound: list, natives: list | None, target: Any) -> bool:
    layout = _layout(fn, bound, natives, target)
    looped = call_size(bound) > MAX_GROUPS * GROUP
    kernel = None if layout is None else _kernel(target, layout, natives is not None, looped)
    if kernel is None:
        return False
    bindings: dict = {"pydiff_n": call_size(bound)}
    for i, ((_, value), kind) in enumerate(zip(bound, layout)):
        if kind[0] == "g":
            bindings.update(_grid_uniforms(value.shape))
        elif kind[0] == "n":
            bindings[f"pydiff_a{i}"] = float(value)
        elif kind[0] == "t":
            native = value.bind(True) if natives is None else natives[i]
            for j, ((_, _, which), unit) in enumerate(zip(kind[3], kind[4])):
                part, name = _part(native, which), f"pydiff_b{i}_{j}"
                bindings[name] = part.storage
                for k, (size, stride) in enumerate(zip(part.shape, part.strides)):
                    bindings[f"{name}_s{k}"] = int(size)
                    if k < kind[1] - unit:
                        bindings[f"{name}_d{k}"] = int(stride)
                bindings[f"{name}_o"] = int(part.offset)
    if bindings["pydiff_n"] == 0:
        return False
    threads = min(-(-bindings["pydiff_n"] // GROUP), MAX_GROUPS) * GROUP
    bindings["pydiff_stride"] = threads
    fn.module.device.kernels.dispatch(kernel, threads, **bindings)
    return True


def forward(fn: FunctionTarget, bound: list) -> bool:
    """Run the forward call (``(param, value)`` pairs) as a generated kernel; False, nothing
    done, where it is not covered."""
    return _run(fn, bound, None, fn)


def backward(fn: FunctionTarget, bound: list, natives: list, target: Any) -> bool:
    """Run ``.bwds`` as a generated kernel binding ``natives`` (per parameter, the SlangPy
    value the backward binds: tensors with the gradient buffers it chose, a masked tensor's
    fields) and calling ``bwd_diff(target)`` (``fn``, or the masked wrapper the backward
    would run), appended where the backward's scope dispatches; False, nothing done, where
    it is not covered."""
    return _run(fn, bound, natives, target)
