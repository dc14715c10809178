"""Slang source of pydiff's generated elementwise kernels (pydiff.generated): forward values,
``.bwds`` gradients and ``.fwds`` tangents of a user's function, eight elements per thread.

An argument's kind, per parameter: ``"n"`` a number (a uniform), ``"t"`` a tensor of the
call's shape (read as float4s), ``"s"`` a one-element tensor broadcast over the call (its
element read once per thread), ``"z"`` (tangents only) a zero tangent.

    src = forward_source(fn, ("n", "n", "n", "t"), typed_loads=True)
    src = backward_source(fn, ("s", "n", "n", "t"), sums=((3,),), scalars=(0,), typed=True)
    src = fwds_source(fn, ("n", "n", "n", "t"), ("z", "z", "z", "t"), typed=True)
"""

from __future__ import annotations

from .generated_helpers import imports
from .signature import FunctionTarget

#: Threads per group for calls of more than SMALL_COUNT float4s.
GROUP = 256
#: Adjacent float4s per thread: lavapipe's per-invocation load/store code, not the memory,
#: limits elementwise kernels. The polynomial's forward + backward at 2^24 (inline): 67 ms
#: with 1 per thread, 37-40 ms with 2, 54 ms with 4, 55 ms with 8 (bench_generated.py).
CHUNK = 2


#: How the kernels read and write a float4 (``pydiff_load4``, ``pydiff_store4``: in a helper
#: module, generated_helpers). Typed loads read the words as uint4: a float texel load
#: followed by a conversion to half in the user's function is folded by Mesa into one load
#: that rounds toward zero (half(0.3337) gave 0.33349609, not 0.33374023 as NumPy and
#: SlangPy's path give), which a uint load followed by asfloat cannot be.
_FLOAT4_IN = {True: "Buffer<uint4>", False: "StructuredBuffer<float4>"}
_FLOAT4_OUT = {True: "RWStructuredBuffer<uint64_t2>", False: "RWStructuredBuffer<float4>"}


def _header(fn: FunctionTarget, typed_loads: bool, paired: bool, words: bool = False) -> str:
    """``words``: float4s read as two 64-bit words (``StructuredBuffer<uint64_t2>``)."""
    read = "StructuredBuffer<uint64_t2>" if words else _FLOAT4_IN[typed_loads]
    return (
        f"import {fn.module.import_spec};\n{imports(typed_loads, paired, words)}"
        f"typealias Float4In = {read};\n"
        f"typealias Float4Out = {_FLOAT4_OUT[paired]};\n\n"
    )


def _params(kinds: tuple[str, ...], name: str = "a") -> list[str]:
    out = []
    for i, kind in enumerate(kinds):
        if kind in "ts":
            out.append(f"uniform Float4In pydiff_{name}{i}")
        elif kind == "n":
            out.append(f"uniform float pydiff_{name}{i}")
    return out


def _element(kinds: tuple[str, ...], i: int, name: str = "a") -> str:
    """The expression for argument ``i``'s element ``pydiff_k`` of float4 ``pydiff_q``."""
    kind = kinds[i]
    if kind == "t":
        return f"pydiff_v{name}{i}[pydiff_k]"
    if kind == "s":
        return f"pydiff_s{name}{i}"
    return "0.0" if kind == "z" else f"pydiff_{name}{i}"


def _loads(kinds: tuple[str, ...], name: str = "a") -> str:
    """Each tensor's float4; in the last one, lanes past the call's end repeat its first
    element: the function runs on every lane, and on the padding's stale values a loop that
    ends only for real inputs spun forever (a call of 4097 elements hung)."""
    return "".join(
        f"        float4 pydiff_v{name}{i} = pydiff_load4(pydiff_{name}{i}, pydiff_q);\n"
        f"        if (pydiff_q + 1 == pydiff_count)\n"
        f"            pydiff_v{name}{i} = pydiff_select4(uint4(0, 1, 2, 3)"
        f" < pydiff_tail, pydiff_v{name}{i}, pydiff_v{name}{i}.xxxx);\n"
        for i, kind in enumerate(kinds)
        if kind == "t"
    )


def _scalar_loads(kinds: tuple[str, ...], name: str = "a") -> str:
    """Broadcast one-element tensors: read once per thread, before the loop."""
    return "".join(
        f"    float pydiff_s{name}{i} = pydiff_load4(pydiff_{name}{i}, 0).x;\n"
        for i, kind in enumerate(kinds)
        if kind == "s"
    )


def _kernel(entry: str, params: list[str], prologue: str, body: str, group: int) -> str:
    params = ["uint3 pydiff_tid: SV_DispatchThreadID", *params]
    params += [
        "uniform uint pydiff_count",
        "uniform uint pydiff_tail",
        "uniform uint pydiff_stride",
    ]
    joined = ",\n    ".join(params)
    body = "".join(f"        {line}\n" if line else "\n" for line in body.splitlines())
    return (
        f'[shader("compute")][numthreads({group}, 1, 1)]\nvoid {entry}(\n    {joined})\n{{\n'
        f"{prologue}"
        f"    for (uint pydiff_c = pydiff_tid.x * {CHUNK}; pydiff_c < pydiff_count; "
        f"pydiff_c += pydiff_stride * {CHUNK})\n    {{\n"
        f"        [ForceUnroll] for (uint pydiff_j = 0; pydiff_j < {CHUNK}; pydiff_j++)\n"
        "        {\n            uint pydiff_q = pydiff_c + pydiff_j;\n"
        "            if (pydiff_q < pydiff_count)\n            {\n"
        f"{body}            }}\n        }}\n    }}\n}}\n"
    )


def forward_source(
    fn: FunctionTarget,
    kinds: tuple[str, ...],
    typed_loads: bool,
    group: int = GROUP,
    paired: bool = False,
) -> str:
    """The kernel ``pydiff_gen_fwd``: result[q] = f(args[q]) for each float4 q."""
    call = f"{fn.name}({', '.join(_element(kinds, i) for i in range(len(kinds)))})"
    body = (
        _loads(kinds) + "        float4 pydiff_r;\n"
        "        [ForceUnroll] for (int pydiff_k = 0; pydiff_k < 4; pydiff_k++)\n"
        f"            pydiff_r[pydiff_k] = {call};\n"
        "        pydiff_store4(pydiff_result, pydiff_q, pydiff_r);\n"
    )
    params = _params(kinds) + ["uniform Float4Out pydiff_result"]
    return _header(fn, typed_loads, paired) + _kernel(
        "pydiff_gen_fwd", params, _scalar_loads(kinds), body, group
    )


def backward_source(
    fn: FunctionTarget,
    kinds: tuple[str, ...],
    sums: tuple[tuple[int, ...], ...],
    scalars: tuple[int, ...],
    typed: bool,
    group: int = GROUP,
    paired: bool = False,
    result: bool = False,
) -> str:
    """The kernel ``pydiff_gen_bwd``: for each float4 q, ``bwd_diff(f)`` per element with the
    upstream gradient, then each gradient buffer j (adding the parameters in ``sums[j]``)
    ``g_j[q] = g_j_in[q] + d`` (in the last float4 only the call's elements), and for each
    broadcast parameter i in ``scalars`` its partials ``sg_i[q] = 0 + d_i`` into a full-shape
    buffer the caller sums (``0 +``: the bits SlangPy's zeroed buffer gets, -0 included).
    ``result``: the kernel ``pydiff_gen_fused`` also stores ``f`` per element into ``result``
    as ``forward_source``'s kernel does (generated_fused)."""
    params = _params(kinds) + ["uniform Float4In pydiff_up"]
    for j in range(len(sums)):
        params += [
            f"uniform Float4Out pydiff_g{j}",
            f"uniform Float4In pydiff_g{j}_in",
        ]
    params += [f"uniform Float4Out pydiff_sg{i}" for i in scalars]
    wanted = sorted({i for members in sums for i in members} | set(scalars))
    body = _loads(kinds) + "        float4 pydiff_u = pydiff_load4(pydiff_up, pydiff_q);\n"
    body += "".join(f"        float4 pydiff_d{i} = float4(0.0);\n" for i in wanted)
    if result:
        params.append("uniform Float4Out pydiff_result")
        body += "        float4 pydiff_r;\n"
    body += "        [ForceUnroll] for (int pydiff_k = 0; pydiff_k < 4; pydiff_k++)\n        {\n"
    if result:
        call = ", ".join(_element(kinds, i) for i in range(len(kinds)))
        body += f"            pydiff_r[pydiff_k] = {fn.name}({call});\n"
    args = []
    for i, p in enumerate(fn.signature.params):
        if p.no_diff:
            args.append(_element(kinds, i))
            continue
        body += f"            var pydiff_p{i} = diffPair({_element(kinds, i)});\n"
        args.append(f"pydiff_p{i}")
    body += f"            bwd_diff({fn.name})({', '.join(args)}, pydiff_u[pydiff_k]);\n"
    body += "".join(f"            pydiff_d{i}[pydiff_k] = pydiff_p{i}.d;\n" for i in wanted)
    body += "        }\n"
    if result:
        body += "        pydiff_store4(pydiff_result, pydiff_q, pydiff_r);\n"
    body += "        bool4 pydiff_in = pydiff_q + 1 < pydiff_count"
    body += " ? bool4(true) : uint4(0, 1, 2, 3) < pydiff_tail;\n"
    for j, members in enumerate(sums):
        # A tensor passed to several parameters: its partials are added into the value one
        # after another, last parameter first (as SlangPy's path adds them into memory: the
        # backward of its loads runs in reverse), each through the integer op: the compiler
        # cannot factor d0 + d1 = a g + b g into (a + b) g, which overflows where the
        # partials do not (mul(a, a) at a = -3e38).
        adds = f"pydiff_o{j}"
        for i in reversed(members):
            adds = f"({adds} + pydiff_apart(pydiff_d{i}, pydiff_zero))"
        body += (
            f"        float4 pydiff_o{j} = pydiff_load4(pydiff_g{j}_in, pydiff_q);\n"
            f"        float4 pydiff_n{j} = {adds};\n"
            f"        pydiff_store4(pydiff_g{j}, pydiff_q,"
            f" pydiff_select4(pydiff_in, pydiff_n{j}, pydiff_o{j}));\n"
        )
    body += "".join(
        f"        pydiff_store4(pydiff_sg{i}, pydiff_q, float4(0.0) + pydiff_d{i});\n"
        for i in scalars
    )
    # pydiff_zero (0): the sum goes through an integer op the compiler cannot fold, so the
    # add into the buffer is not fused with the gradient's last product (an fma rounds once
    # where SlangPy's path, adding into memory, rounds twice: other bits).
    params.append("uniform uint pydiff_zero")
    # Paired (lavapipe): the backward reads its float4s as two 64-bit words, as they are
    # stored: 25-40% less CPU than typed loads for the polynomial's backward (2^23, 10M), where
    # the forward (one input) was 5-10% slower that way and keeps its typed loads.
    entry = "pydiff_gen_fused" if result else "pydiff_gen_bwd"
    return _header(fn, typed, paired, words=paired) + _kernel(
        entry, params, _scalar_loads(kinds), body, group
    )


def fwds_source(
    fn: FunctionTarget,
    kinds: tuple[str, ...],
    tangents: tuple[str, ...],
    typed: bool,
    group: int = GROUP,
    paired: bool = False,
) -> str:
    """The kernel ``pydiff_gen_fwds``: for each float4 q, ``fwd_diff(f)`` per element on
    (value, tangent) pairs of the differentiable parameters: the value into ``result``, the
    tangent into ``tangent``."""
    args = []
    for i, p in enumerate(fn.signature.params):
        value = _element(kinds, i)
        if p.no_diff:
            args.append(value)
        else:
            args.append(f"diffPair({value}, {_element(tangents, i, 't')})")
    body = (
        _loads(kinds)
        + _loads(tangents, "t")
        + "        float4 pydiff_r;\n        float4 pydiff_dr;\n"
        "        [ForceUnroll] for (int pydiff_k = 0; pydiff_k < 4; pydiff_k++)\n        {\n"
        f"            let pydiff_pair = fwd_diff({fn.name})({', '.join(args)});\n"
        "            pydiff_r[pydiff_k] = pydiff_pair.p;\n"
        "            pydiff_dr[pydiff_k] = pydiff_pair.d;\n        }\n"
        "        pydiff_store4(pydiff_result, pydiff_q, pydiff_r);\n"
        "        pydiff_store4(pydiff_tangent, pydiff_q, pydiff_dr);\n"
    )
    params = _params(kinds) + _params(tangents, "t")
    params += [
        "uniform Float4Out pydiff_result",
        "uniform Float4Out pydiff_tangent",
    ]
    prologue = _scalar_loads(kinds) + _scalar_loads(tangents, "t")
    return _header(fn, typed, paired) + _kernel("pydiff_gen_fwds", params, prologue, body, group)
