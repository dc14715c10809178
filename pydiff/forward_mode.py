"""Forward mode of one shader function (``fn.fwds``): f(x) and its directional derivative
J u in one pass, through a generated wrapper around Slang's ``fwd_diff``.

    y, dy = m.f.fwds(x.with_tangent(u))                 # f(x) and J u
    y, dy = m.f.fwds((2.0, 1.0), x)                     # a (value, tangent) pair for a number

Slang derives the forward derivative; pydiff generates a small wrapper per function that
splits each differentiable value into primal and tangent, and SlangPy vectorises it like
any call.
"""

from __future__ import annotations

import re
from typing import Any, Protocol, Sequence

import numpy as np

from . import capturing, foreign, generated_calls
from .arguments import bind_arguments, check_device, fwd_tensor_struct
from .arguments import prepare_arguments
from .forward_args import NO_TANGENT, described, gives_tangent, given, input_pair, primals_only
from .forward_args import refuse_listed_tangents, refuse_on_tape, tangent_tensor, warn_dropped
from .call_shape import param_type
from .errors import ShaderTrapError, SlangCompileError
from .forward_call import forward_call
from .forward_pair import direct_pair, out_entry, split_pair, wrapper_calls
from .signature import FunctionTarget, stem
from .tensor import Tensor


class GeneratingFunction(FunctionTarget, Protocol):
    """A shader function that can compile a generated wrapper of itself (ShaderFunction)."""

    @property
    def differentiable(self) -> bool: ...

    def generated(self, kind: str, source: str) -> "GeneratingFunction": ...


_FLOATISH = re.compile(
    r"^(?:(?:float|half|double)(?:\d(?:x\d)?)?|vector<(?:float|half|double),\s*\d>|"
    r"matrix<(?:float|half|double),\s*\d,\s*\d>)$"
)


def wrapper_header(fn: GeneratingFunction) -> str:
    uses_pydiff = any(p.tensor_kind == "fwd" for p in fn.params)
    return (
        "import slangpy;\n"
        + ("import pydiff;\n" if uses_pydiff else "")
        # exported: SlangPy binds struct (dict) arguments by the user module's types
        + f"__exported import {fn.module.import_spec};\n"
    )


def need_differentiable(fn: GeneratingFunction, what: str) -> None:
    """Refuse forward mode (``what``: .fwds, hvp) of a function that is not differentiable,
    or whose forward derivative Slang gets wrong (``Finding.wrong_jvp``: pow, fmod, a call of
    a function with a hand-written backward and no forward derivative)."""
    if not fn.differentiable:
        raise TypeError(
            f"{fn.label} is not differentiable: mark it [Differentiable] in {fn.module.file} "
            f"to use {what}"
        )
    found = fn.module.traps.get(fn.name, ())
    wrong = [str(f) for f in found if f.wrong_jvp or (what == "hvp" and f.crashes_hvp)]
    if wrong:  # pow/fmod: Slang's forward derivative rule is the backward's, wrong the same way
        raise ShaderTrapError(
            f"{fn.label}{what if what.startswith('.') else ' ' + what} refused: Slang's "
            "derivative is wrong (or crashes) here: " + "\n  ".join(wrong)  # (first: check's)
        )


def generic_types(fn: GeneratingFunction, bound: list, what: str = "") -> dict[str, str]:
    """The concrete type of each generic parameter type in this call (``{'T': 'float'}`` for
    ``T f<T : IFloat>(T x)`` called on a float tensor or number; ``vector<float,3>`` for
    ``vector<float, N>`` on a float3 tensor, a ``spy.float3`` or a NumPy array of rows of 3),
    as SlangPy specialises it; TypeError (naming ``what``, by default ``fn.fwds``) where the
    argument fixes no size for a generic size ``N``."""
    types: dict[str, str] = {}
    for p, value in bound:
        if p.generic and p.tensor_kind is None:
            if isinstance(value, tuple) and len(value) == 2:  # a (value, tangent) pair
                value = value[0]
            found = param_type(p, value)
            if found == p.type_name:
                found = _slangpy_value_type(value) or found
            if found == p.type_name and isinstance(value, float):
                found = "float"
            sized = _GENERIC_SIZE.match(p.type_name)
            if sized and (found == p.type_name or not found.startswith(sized.group(1) + "<")):
                found = _sized_type(fn, p, value, sized, what or f"{fn.label}.fwds")
            if found != p.type_name:
                types.setdefault(p.type_name, found)
            if sized and sized.group(2) not in _SLANGPY_ELEMENTS:  # vector<T,N>: T as well
                types.setdefault(sized.group(2), found[found.index("<") + 1 :].split(",")[0])
    return types


# vector<float,N> / matrix<T,R,C>: a type whose sizes (some at least) are generic values
_GENERIC_SIZE = re.compile(r"^(vector|matrix)<(\w+),(\w+)(?:,(\w+))?>$")
_SLANGPY_VALUE = re.compile(r"^(float16_t|float|double|int|uint|bool)(\d)(?:x(\d))?$")


def _slangpy_value_type(value: Any) -> str | None:
    """The Slang type of a SlangPy vector or matrix value (``spy.float3`` -> vector<float,3>)."""
    found = _SLANGPY_VALUE.match(type(value).__name__)
    if found is None or not type(value).__module__.startswith("slangpy"):
        return None
    elem, rows, cols = found.groups()
    elem = "half" if elem == "float16_t" else elem
    return f"matrix<{elem},{rows},{cols}>" if cols else f"vector<{elem},{rows}>"


def _sized_type(fn: GeneratingFunction, p: Any, value: Any, sized: Any, what: str) -> str:
    """``vector<float,N>`` at a NumPy array or list: N from its last axis (as a float3
    tensor's elements); at anything else no size can be read, refused naming the generic size."""
    kind, elem, *sizes = sized.groups()
    sizes = [d for d in sizes if d is not None]
    host = np.asarray(value) if type(value) in (np.ndarray, list) else None
    axes = host.shape[-len(sizes) :] if host is not None and host.ndim >= len(sizes) else ()
    if host is not None and host.dtype.kind in "fi" and len(axes) == len(sizes):
        elem = elem if elem in _SLANGPY_ELEMENTS else (param_type(p, host) or "float")
        return f"{kind}<{elem},{','.join(str(int(n)) for n in axes)}>"
    generic = ", ".join(d for d in sizes if not d.isdigit())
    got = f"a {value.dtype} tensor" if type(value) is Tensor else f"{type(value).__name__}"
    example = "float3" if kind == "vector" else "float3x3"
    raise TypeError(
        f"{what}: parameter '{p.name}' of {fn.name} has type {p.type_name}, whose size "
        f"{generic} is a generic value parameter; {got} does not fix it, so {fn.name} cannot "
        f"be specialised. Pass a tensor of dtype '{example}' (pydiff.tensor(a, "
        f"dtype='{example}')), a slangpy.{example} or a NumPy array whose last axes are the "
        "sizes"
    )


_SLANGPY_ELEMENTS = ("float", "half", "double")


def fwd_wrapper(
    fn: GeneratingFunction, types: dict[str, str] | None = None, fixed: frozenset = frozenset()
) -> GeneratingFunction:
    """``void/R[2] f__pydiff_fwd(primal, tangent, ...)``: fwd_diff(f) with every
    differentiable value split into its primal and tangent; a result comes back as
    {primal, tangent}. ``types`` specialises a generic function's type parameters (one
    wrapper per specialisation: ``f__pydiff_fwd_float``); inputs in ``fixed`` take no
    tangent: ``T.dzero()``, for the driver to fold (no ``0 * inf`` NaN): ``f__pydiff_fwd_c0111``."""
    need_differentiable(fn, ".fwds")
    types = types or {}
    params, args, pre, post, aliases = [], [], [], [], []
    taken = {p.name for p in fn.params}  # (a tangent's name is no parameter's: x, x__t)
    for p in fn.params:
        n, t = p.name, types.get(p.type_name, p.type_name)
        if p.differentiable:
            tn, pn = _fresh(f"{n}__t", taken), _fresh(f"{n}__p", taken)
            named = f"{stem(fn.name)}__pydiff_{n}_type" if "[" in t else t
            if "[" in t:  # Slang parses no member of an array type written inline (float[3])
                aliases.append(f"typealias {named} = {t};\n")
            dt = f"{named}.Differential"
            if p.io == "in" and n in fixed:
                params.append(f"{t} {n}")
                args.append(f"diffPair({n}, {named}.dzero())")
            elif p.io == "in":
                params += [f"{t} {n}", f"{dt} {tn}"]
                args.append(f"diffPair({n}, {tn})")
            else:
                params += [f"{p.io} {t} {n}", f"{p.io} {dt} {tn}"]
                pre.append(
                    f"DifferentialPair<{t}> {pn};"
                    if p.io == "out"
                    else f"var {pn} = diffPair({n}, {tn});"
                )
                args.append(pn)
                post += [f"{n} = {pn}.p;", f"{tn} = {pn}.d;"]
        else:
            io = "" if p.io == "in" else f"{p.io} "
            params.append(f"{io}{t} {n}")
            args.append(n)
    ret = types.get(fn.signature.return_type, fn.signature.return_type)
    call = f"fwd_diff({fn.name})({', '.join(args)})"
    if ret == "void":
        rtype, body = "void", [*pre, f"{call};", *post]
    elif _FLOATISH.match(ret):
        rtype = f"{ret}[2]"
        body = [
            *pre,
            f"let __pydiff_r = {call};",
            *post,
            f"{ret} __pydiff_o[2] = {{ __pydiff_r.p, __pydiff_r.d }};",
            "return __pydiff_o;",
        ]
    else:
        generic = " (a generic type: pass a float tensor or number to specialise it)" * (
            ret in {p.type_name for p in fn.params if p.generic}
        )
        raise TypeError(
            f"{fn.label}.fwds: the result type {ret} has no tangent pydiff can return (float "
            f"scalars, vectors and matrices only){generic}; return the value through an out "
            "parameter"
        )
    kind = "fwd" + "".join("_" + re.sub(r"\W+", "_", types[k]).strip("_") for k in sorted(types))
    kind += "_c" + "".join("01"[p.name in fixed] for p in fn.params) if fixed else ""
    source = (
        wrapper_header(fn)
        + "".join(aliases)
        + f"{rtype} {stem(fn.name)}__pydiff_{kind}({', '.join(params)})\n{{\n    "
        + "\n    ".join(body)
        + "\n}\n"
    )
    if rtype != "void":  # value and tangent into two outputs (forward_pair)
        source += out_entry(f"{stem(fn.name)}__pydiff_{kind}", ret, params, pre, call, post)
    return _compiled(fn, kind, source)


def _compiled(fn: GeneratingFunction, kind: str, source: str) -> GeneratingFunction:
    """``fn.generated(kind, source)``; a function with a hand-written backward and no forward
    derivative (Slang: "'fwd_diff' is not a member of 'f'") is a TypeError saying so."""
    try:
        return fn.generated(kind, source)
    except SlangCompileError as exc:
        if f"'fwd_diff' is not a member of '{fn.name}'" not in str(exc):
            raise
        raise TypeError(
            f"{fn.label} has no forward derivative (a hand-written [BackwardDerivative] only, "
            f"not [Differentiable]), so forward mode (.fwds, jvp, hvp) cannot run: mark it "
            f"[Differentiable] in {fn.module.file} (Slang keeps your backward and derives "
            "the forward from the body) or give it a [ForwardDerivative]"
        ) from exc


def _fresh(name: str, taken: set) -> str:
    """``name``, or with ``_`` appended until no parameter (nor earlier pick) has it."""
    while name in taken:
        name += "_"
    taken.add(name)
    return name


def forward_mode_call(fn: GeneratingFunction, args: tuple, kwargs: dict) -> Any:
    """``fn.fwds(...)``: see ForwardFunction."""
    need_differentiable(fn, ".fwds")
    capturing.refuse(f"{fn.module.name}.{fn.name}.fwds (SlangPy)")
    fn.module.device.flush()  # kernels queued in a batched backward run first
    bound, options = bind_arguments(fn, args, kwargs)
    refuse_on_tape(fn, bound)  # (its result would be a constant to a recording tape)
    want = options.pop("_result", "tensor")
    if type(want) is str and want not in ("tensor", "numpy"):
        raise ValueError(f"{fn.label}.fwds: _result={want!r}; use 'tensor' or 'numpy'")
    if type(want) is not str:
        raise TypeError(
            f"{fn.label}.fwds: _result is {described(want)}; .fwds returns a new (value, "
            "tangent) pair and writes into nothing given: use _result='tensor' (the default) "
            "or 'numpy', then copy the value where you want it (y.copy_(value))"
        )
    for p, value in bound:
        pair = isinstance(value, tuple) and len(value) == 2
        refuse_listed_tangents(fn, p, value[0] if pair else value, p.name)
    prepare_arguments(fn, bound, {"_result": "tensor", **options})
    if options:
        raise TypeError(f"{fn.label}.fwds: unsupported options {sorted(options)}")
    call_args: list[Any] = []
    fixed: list[str] = []  # inputs given no tangent
    any_array = False
    for p, value in bound:
        any_array = any_array or isinstance(value, (Tensor, np.ndarray))
        if p.differentiable:
            if p.io == "in":
                call_args += input_pair(fn, p, value)
                fixed += [p.name] * (call_args[-1] is NO_TANGENT)  # see fwd_wrapper
                continue
            if not isinstance(value, Tensor):
                raise TypeError(
                    f"{fn.label}.fwds: parameter '{p.name}' is {p.io}: pass a pydiff.Tensor to "
                    "receive it"
                )
            call_args += [value, tangent_tensor(value)]
        elif p.tensor_kind == "fwd" and isinstance(value, Tensor):
            check_device(fn, value, f"parameter '{p.name}'")
            tangent = (
                tangent_tensor(value)
                if p.writes_value
                else (value.tangent if value.tangent is not None else None)
            )
            call_args.append(
                fwd_tensor_struct(fn, p, value, tangent.native if tangent is not None else None)
            )
        elif p.tensor_kind is not None and isinstance(value, Tensor):
            if value.tangent is not None or p.writes_value:
                what = (
                    "would ignore its tangent"
                    if not p.writes_value
                    else "cannot give the tangents it writes"
                )
                raise TypeError(
                    f"{fn.label}.fwds: parameter '{p.name}' is a {p.type_name}, whose loads and "
                    f"stores have no forward derivative in SlangPy, so forward mode {what}; "
                    "declare it pydiff's "
                    f"{'RW' if p.writes_value else ''}FwdDiffTensor<{len(value.shape)}> "
                    "(import pydiff;) to use forward mode"
                )
            call_args.append(value)
        else:
            pair = isinstance(value, tuple) and len(value) == 2 and p.io == "in"
            if pair and not p.no_diff:
                raise TypeError(
                    f"{fn.label}.fwds: parameter '{p.name}' ({p.type_name}) carries no derivative "
                    "(not differentiable or no_diff), so it takes no (value, tangent) pair"
                )
            if pair or gives_tangent(value):
                warn_dropped(fn, p, struct=isinstance(value, dict))
                value = value[0] if pair else primals_only(value)
            call_args.append(value)
    done = generated_calls.call_fwds(fn, bound, call_args, want)
    if done is not None:
        return done
    types = generic_types(fn, bound)
    ret = types.get(fn.signature.return_type, fn.signature.return_type)
    try:
        wrapper = fwd_wrapper(fn, types, frozenset(fixed))
    except SlangCompileError as e:
        if not types:
            raise
        raise _specialisation_error(fn, bound, types) from e
    with wrapper_calls(wrapper, fn):  # (errors name fn.fwds; counted once, by call_fwds)
        direct = direct_pair(wrapper, bound, call_args, ret, types) if ret != "void" else None
    if direct is not None:  # one call into two contiguous tensors
        return (direct[0].numpy(), direct[1].numpy()) if want == "numpy" else direct
    with wrapper_calls(wrapper, fn):
        out = forward_call(
            wrapper, given(call_args), {"_result": "tensor"} if ret != "void" else {}
        )
    if ret == "void":
        return None
    if not isinstance(out, Tensor):  # not vectorised: SlangPy returned the value itself
        pair = np.asarray(out)
        return (pair[0], pair[1]) if any_array else (as_scalar(pair[0]), as_scalar(pair[1]))
    primal, tangent = split_pair(out, ret, wrapper)
    if not any_array and not primal.shape:
        return as_scalar(primal.numpy()), as_scalar(tangent.numpy())
    if want == "numpy":
        return primal.numpy(), tangent.numpy()
    return primal, tangent


def _specialisation_error(fn: GeneratingFunction, bound: list, types: dict) -> TypeError:
    """The refusal of a generic function whose forward mode Slang could not build at the
    types this call's arguments give (``T : __BuiltinFloatingPointType`` at a ``float3``
    tensor: vectors do not conform), naming the parameters; Slang's report is the cause."""
    at = ", ".join(f"{k} = {v}" for k, v in types.items())
    named = [p.name for p, _ in bound if p.generic and p.type_name in types]
    return TypeError(
        f"{fn.label}.fwds: the generic {fn.name} cannot be specialised with {at} (from "
        f"parameter(s) {', '.join(repr(n) for n in named)}): Slang could not build its forward "
        "mode at that type (a vector for a constraint such as __BuiltinFloatingPointType, "
        "which takes scalars only); pass values of a type the constraint takes, or relax it "
        "(IFloat takes vectors). Slang's report is this error's __cause__"
    )


def as_scalar(x: Any) -> Any:
    """A Python float for a 0-d value, the array otherwise.

    >>> as_scalar(np.asarray(2.0)), as_scalar(np.ones(2))
    (2.0, array([1., 1.]))
    """
    a = np.asarray(x)
    return float(a) if a.ndim == 0 else a


class ForwardFunction:
    """``fn.fwds``: forward mode. Give each differentiable argument a tangent (a tensor's
    ``.with_tangent(u)``, or a ``(value, tangent)`` pair); returns ``(result, result_tangent)``
    and fills ``.tangent`` of out/inout and RWFwdDiffTensor arguments. Arguments without a
    tangent are held fixed (tangent 0).

    >>> y, dy = m.polynomial.fwds(2.0, 8.0, -1.0, x.with_tangent(np.ones(4)))
    """

    def __init__(self, fn: GeneratingFunction):
        self._fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = foreign.as_data(self._fn, args, kwargs, f"{self._fn.label}.fwds")
        self._fn.check_traps(forward=True)  # what refuses the forward call refuses this too
        return forward_mode_call(self._fn, args, kwargs)

    def __repr__(self) -> str:
        return f"<pydiff fwds of {self._fn!r}>"


def dir_wrapper(
    fn: GeneratingFunction, args: Sequence[Any] = (), fixed: frozenset[str] = frozenset()
) -> GeneratingFunction:
    """``[Differentiable] float f__pydiff_dir(x, no_diff v, ...) = fwd_diff(f)(x; v).d``:
    the directional derivative, whose reverse-mode gradient w.r.t. x is H v. ``args`` (the
    call's arguments, by position) specialise a generic function, as ``fn.fwds`` does. The
    differentiable parameters named in ``fixed`` take no direction (a zero one, ``dzero()``,
    of their own type: a struct's tangent type need not be the struct)."""
    need_differentiable(fn, "hvp")
    types = generic_types(fn, list(zip(fn.params, args)), f"hvp of {fn.label}")
    ret = types.get(fn.signature.return_type, fn.signature.return_type)
    if ret not in ("float", "double", "half"):
        generic = (
            f" (the generic type {fn.signature.return_type} is {ret} at this call)"
            if fn.signature.return_type in types
            else ""
        )
        raise TypeError(
            f"hvp: {fn.label} returns {ret}{generic}; hvp needs a scalar (float) result"
        )
    params, call_args, aliases = [], [], []
    taken = {p.name for p in fn.params}  # (a direction's name is no parameter's: x, x__v)
    for p in fn.params:
        n, t = p.name, types.get(p.type_name, p.type_name)
        if p.is_diff_tensor or (p.tensor_kind is not None and p.access != "read"):
            raise TypeError(
                f"hvp: parameter '{n}' of {fn.label} is a {t}: a second derivative through "
                "differentiable tensor loads crashes the bundled Slang compiler (segfault), so "
                "pydiff refuses it. For hvp, declare read-only tensor inputs ITensor<float, N> and "
                "read them with no_diff(t[i]), or pass them as no_diff arrays"
            )
        if p.differentiable and p.io != "in":
            raise TypeError(f"hvp: parameter '{n}' of {fn.label} is {p.io}; hvp needs inputs only")
        if p.differentiable:
            named = t
            if "[" in t:  # Slang parses no member of an array type written inline (float[3])
                aliases.append(f"typealias {stem(fn.name)}__pydiff_{n}_type = {t};\n")
                named = f"{stem(fn.name)}__pydiff_{n}_type"
            params.append(f"{t} {n}")
            if n in fixed:
                call_args.append(f"diffPair({n}, {named}.dzero())")
            else:
                vn = _fresh(f"{n}__v", taken)
                params.append(f"no_diff {named}.Differential {vn}")
                call_args.append(f"diffPair({n}, {vn})")
        else:
            params.append(f"{'no_diff ' if p.no_diff else ''}{t} {n}")
            call_args.append(n)
    kind = "dir" + "".join("_" + re.sub(r"\W+", "_", types[k]).strip("_") for k in sorted(types))
    kind += "".join(f"_fixed_{n}" for n in sorted(fixed))
    source = (
        wrapper_header(fn)
        + "".join(aliases)
        + f"[Differentiable]\n{ret} {stem(fn.name)}__pydiff_{kind}({', '.join(params)})\n{{\n"
        f"    return fwd_diff({fn.name})({', '.join(call_args)}).d;\n}}\n"
    )
    return _compiled(fn, kind, source)
