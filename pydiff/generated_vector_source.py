"""Slang source of the generated kernels for functions on float vectors (pydiff.generated_vector):
forward values, ``.bwds`` gradients and ``.fwds`` tangents, one call element per thread.

Each parameter's layout is ``(kind, width)``: ``width`` 1 for a ``float``, N for a
``vector<float,N>``; ``kind`` ``"n"`` a number (a uniform), ``"t"`` a tensor of the call's
elements (element i: the N floats from ``i * N``, read from a ``StructuredBuffer<float>``:
a float tensor of shape ``(call..., N)`` and a ``floatN`` tensor of the call's shape lie the
same way), ``"s"`` a one-element float tensor broadcast over the call (read once per
thread), ``"z"`` (tangents only) a zero tangent.

    src = forward_source(fn, (("t", 3), ("t", 3), ("n", 1)), 3, group=256, looped=False)
    src = backward_source(fn, layout, 3, sums=((0,), (1,)), scalars=(), group=256, looped=False)
    src = fwds_source(fn, layout, (("t", 3), ("z", 3), ("z", 1)), 3, group=256, looped=False)
"""

from __future__ import annotations

from .generated_helpers import imports
from .signature import FunctionTarget

Layout = tuple[tuple[str, int], ...]


def value_type(width: int) -> str:
    """The Slang type of ``width`` floats: ``float`` or ``vector<float,N>``."""
    return "float" if width == 1 else f"vector<float,{width}>"


def _read(buffer: str, width: int, index: str) -> str:
    if width == 1:
        return f"{buffer}[{index}]"
    parts = ", ".join(f"{buffer}[{index} * {width} + {k}]" for k in range(width))
    return f"{value_type(width)}({parts})"


def _store(buffer: str, width: int, value: str) -> str:
    if width == 1:
        return f"{buffer}[pydiff_i] = {value};\n"
    return "".join(f"{buffer}[pydiff_i * {width} + {k}] = {value}[{k}];\n" for k in range(width))


def _component(value: str, width: int, k: int) -> str:
    return value if width == 1 else f"{value}[{k}]"


def _params(layout: Layout, name: str = "a") -> list[str]:
    out = []
    for i, (kind, _) in enumerate(layout):
        if kind in "ts":
            out.append(f"uniform StructuredBuffer<float> pydiff_{name}{i}")
        elif kind == "n":
            out.append(f"uniform float pydiff_{name}{i}")
    return out


def _value(layout: Layout, i: int, name: str = "a") -> str:
    """Argument ``i``'s value for the thread's element."""
    kind, width = layout[i]
    if kind == "t":
        return f"pydiff_v{name}{i}"
    if kind == "s":
        return f"pydiff_s{name}{i}"
    return f"{value_type(width)}(0.0)" if kind == "z" else f"pydiff_{name}{i}"


def _loads(layout: Layout, name: str = "a") -> str:
    return "".join(
        f"{value_type(w)} pydiff_v{name}{i} = {_read(f'pydiff_{name}{i}', w, 'pydiff_i')};\n"
        for i, (kind, w) in enumerate(layout)
        if kind == "t"
    )


def _scalar_loads(layout: Layout, name: str = "a") -> str:
    return "".join(
        f"    float pydiff_s{name}{i} = pydiff_{name}{i}[0];\n"
        for i, (kind, _) in enumerate(layout)
        if kind == "s"
    )


def _kernel(
    fn: FunctionTarget,
    entry: str,
    params: list[str],
    prologue: str,
    body: str,
    group: int,
    looped: bool,
) -> str:
    params = ["uint3 pydiff_tid: SV_DispatchThreadID", *params]
    params += ["uniform uint pydiff_n", "uniform uint pydiff_stride"]
    joined = ",\n    ".join(params)
    body = "".join(f"        {line}\n" for line in body.splitlines())
    # past the dispatch limit the threads walk the call; a loop where none is needed costs
    # lavapipe (generated_grid: 18 -> 26 ms at 2^22)
    walk = (
        "    for (uint pydiff_i = pydiff_tid.x; pydiff_i < pydiff_n; pydiff_i += pydiff_stride)\n"
        if looped
        else "    uint pydiff_i = pydiff_tid.x;\n    if (pydiff_i < pydiff_n)\n"
    )
    return (
        f"import {fn.module.import_spec};\n{imports()}\n"
        f'[shader("compute")][numthreads({group}, 1, 1)]\nvoid {entry}(\n    {joined})\n{{\n'
        f"{prologue}{walk}    {{\n{body}    }}\n}}\n"
    )


def forward_source(
    fn: FunctionTarget, layout: Layout, result: int, group: int, looped: bool
) -> str:
    """The kernel ``pydiff_vec_fwd``: ``result[i] = f(args[i])`` (``result`` floats each)."""
    call = f"{fn.name}({', '.join(_value(layout, i) for i in range(len(layout)))})"
    body = f"{_loads(layout)}{value_type(result)} pydiff_r = {call};\n"
    body += _store("pydiff_result", result, "pydiff_r")
    params = _params(layout) + ["uniform RWStructuredBuffer<float> pydiff_result"]
    return _kernel(fn, "pydiff_vec_fwd", params, _scalar_loads(layout), body, group, looped)


def backward_source(
    fn: FunctionTarget,
    layout: Layout,
    result: int,
    sums: tuple[tuple[int, ...], ...],
    scalars: tuple[int, ...],
    group: int,
    looped: bool,
) -> str:
    """The kernel ``pydiff_vec_bwd``: ``bwd_diff(f)`` of the thread's element with the
    upstream gradient ``up[i]``, then each gradient buffer j (adding the parameters in
    ``sums[j]``, all of one width) ``g_j[i] += d`` component by component, and for each
    broadcast float parameter in ``scalars`` its partial ``sg_i[i] = 0 + d_i`` into a
    full-shape buffer the caller sums (as generated_source's float kernel does)."""
    params = _params(layout) + ["uniform StructuredBuffer<float> pydiff_up"]
    params += [f"uniform RWStructuredBuffer<float> pydiff_g{j}" for j in range(len(sums))]
    params += [f"uniform RWStructuredBuffer<float> pydiff_sg{i}" for i in scalars]
    params.append("uniform uint pydiff_zero")
    body = _loads(layout)
    body += f"{value_type(result)} pydiff_u = {_read('pydiff_up', result, 'pydiff_i')};\n"
    args = []
    for i, p in enumerate(fn.signature.params):
        if p.no_diff:
            args.append(_value(layout, i))
            continue
        body += f"var pydiff_p{i} = diffPair({_value(layout, i)});\n"
        args.append(f"pydiff_p{i}")
    body += f"bwd_diff({fn.name})({', '.join(args)}, pydiff_u);\n"
    for j, members in enumerate(sums):
        width = layout[members[0]][1]
        for k in range(width):
            # Partials added one after another, last parameter first (SlangPy's order: the
            # backward of its loads runs in reverse), each through the integer
            # op the compiler cannot fold (pydiff_zero is 0): the add into the buffer is not
            # fused with the gradient's last product (an fma would round once where
            # SlangPy's path, adding into memory, rounds twice).
            index = "pydiff_i" if width == 1 else f"pydiff_i * {width} + {k}"
            adds = f"pydiff_g{j}[{index}]"
            for i in reversed(members):
                d = _component(f"pydiff_p{i}.d", width, k)
                adds = f"({adds} + pydiff_apart({d}, pydiff_zero))"
            body += f"pydiff_g{j}[{index}] = {adds};\n"
    body += "".join(f"pydiff_sg{i}[pydiff_i] = 0.0 + pydiff_p{i}.d;\n" for i in scalars)
    return _kernel(fn, "pydiff_vec_bwd", params, _scalar_loads(layout), body, group, looped)


def fwds_source(
    fn: FunctionTarget,
    layout: Layout,
    tangents: Layout,
    result: int,
    group: int,
    looped: bool,
) -> str:
    """The kernel ``pydiff_vec_fwds``: ``fwd_diff(f)`` of the thread's element on (value,
    tangent) pairs of the differentiable parameters: the value into ``result``, the tangent
    into ``tangent``."""
    args = []
    for i, p in enumerate(fn.signature.params):
        value = _value(layout, i)
        args.append(value if p.no_diff else f"diffPair({value}, {_value(tangents, i, 't')})")
    body = _loads(layout) + _loads(tangents, "t")
    body += f"let pydiff_pair = fwd_diff({fn.name})({', '.join(args)});\n"
    body += _store("pydiff_result", result, "pydiff_pair.p")
    body += _store("pydiff_tangent", result, "pydiff_pair.d")
    params = _params(layout) + _params(tangents, "t")
    params += [
        "uniform RWStructuredBuffer<float> pydiff_result",
        "uniform RWStructuredBuffer<float> pydiff_tangent",
    ]
    prologue = _scalar_loads(layout) + _scalar_loads(tangents, "t")
    return _kernel(fn, "pydiff_vec_fwds", params, prologue, body, group, looped)
