"""Forward mode (JVPs) and second order (Hessian-vector products) on Slang functions.

    y, dy = m.f.fwds(x.with_tangent(u))                 # f(x) and J u in one pass
    y, dy = pydiff.jvp(m.f, (x,), (u,))
    y, (gx,) = pydiff.vjp(m.f, (x,), (v,))              # f(x) and J^T v
    (hv,) = pydiff.hvp(m.energy, (x,), (v,))            # H v for a scalar-valued function

Slang derives the forward derivative (``fwd_diff``); pydiff generates a small wrapper per
function that SlangPy vectorises like any call. Hessian-vector products are reverse over
forward: ``bwd_diff`` of a generated directional derivative, the composition the bundled
Slang compiles reliably (forward-over-reverse fails to build, and writing
``bwd_diff(fwd_diff(f))`` in one expression crashes the compiler).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Sequence

import numpy as np
import slangpy as spy

from . import capturing
from .call import _bind, _check_device, fwd_tensor_struct, forward_call, scratch
from .kernels import flush_pending
from .module import OverloadedFunction, ShaderFunction, load_module_from_source
from .policy import zero_policy
from .tape import Tape, suspend_recording
from .tensor import Tensor, tensor as make_tensor

_FLOATISH = re.compile(
    r"^(?:(?:float|half|double)(?:\d(?:x\d)?)?|vector<(?:float|half|double),\s*\d>|"
    r"matrix<(?:float|half|double),\s*\d,\s*\d>)$"
)


def _generated(fn: ShaderFunction, kind: str, source: str) -> ShaderFunction:
    """Compile a generated wrapper module once per function and kind."""
    cache = fn.__dict__.setdefault("_generated", {})
    if kind not in cache:
        digest = hashlib.sha1(source.encode()).hexdigest()[:12]
        module = load_module_from_source(f"pydiff_{kind}_{fn.name}_{digest}", source, device=fn.module.device)
        cache[kind] = getattr(module, f"{fn.name}__pydiff_{kind}")
    return cache[kind]


def _header(fn: ShaderFunction) -> str:
    uses_pydiff = any(p.tensor_kind == "fwd" for p in fn.params)
    return "import slangpy;\n" + ("import pydiff;\n" if uses_pydiff else "") + f"import {fn.module._import_spec};\n"


def _need_differentiable(fn: ShaderFunction, what: str) -> None:
    if not fn.differentiable:
        raise TypeError(
            f"{fn.label} is not differentiable: mark it [Differentiable] in {fn.module.file} "
            f"to use {what}"
        )


def fwd_wrapper(fn: ShaderFunction) -> ShaderFunction:
    """``void/R[2] f__pydiff_fwd(primal, tangent, ...)``: fwd_diff(f) with every
    differentiable value split into its primal and tangent; a result comes back as
    {primal, tangent}."""
    _need_differentiable(fn, ".fwds")
    params, args, pre, post = [], [], [], []
    for p in fn.params:
        n, t = p.name, p.type_name
        if p.differentiable:
            if p.io == "in":
                params += [f"{t} {n}", f"{t}.Differential {n}__t"]
                args.append(f"diffPair({n}, {n}__t)")
            else:
                params += [f"{p.io} {t} {n}", f"{p.io} {t}.Differential {n}__t"]
                pre.append(f"DifferentialPair<{t}> {n}__p;" if p.io == "out"
                           else f"var {n}__p = diffPair({n}, {n}__t);")
                args.append(f"{n}__p")
                post += [f"{n} = {n}__p.p;", f"{n}__t = {n}__p.d;"]
        else:
            io = "" if p.io == "in" else f"{p.io} "
            params.append(f"{io}{t} {n}")
            args.append(n)
    ret = fn._ret_name
    call = f"fwd_diff({fn.name})({', '.join(args)})"
    if ret == "void":
        rtype, body = "void", [*pre, f"{call};", *post]
    elif _FLOATISH.match(ret):
        rtype = f"{ret}[2]"
        body = [*pre, f"let __r = {call};", *post, f"{ret} __o[2] = {{ __r.p, __r.d }};", "return __o;"]
    else:
        raise TypeError(
            f"{fn.label}.fwds: the result type {ret} has no tangent pydiff can return (float "
            "scalars, vectors and matrices only); return the value through an out parameter"
        )
    source = (_header(fn) + f"{rtype} {fn.name}__pydiff_fwd({', '.join(params)})\n{{\n    "
              + "\n    ".join(body) + "\n}\n")
    return _generated(fn, "fwd", source)


def _zero_like(value: Any) -> Any:
    if isinstance(value, (float, int)) and not isinstance(value, bool):
        return 0.0
    if isinstance(value, np.ndarray):
        return np.zeros_like(value, dtype=np.float32)
    return value * 0.0  # slangpy vector/matrix values


def _tangent_tensor(t: Tensor) -> Tensor:
    if t._tangent is None:
        zero = Tensor(spy.Tensor.zeros(t.device.native, t._native.shape, t._native.dtype), t.device)
        t._tangent = zero
    return t._tangent


def _primal_and_tangent(fn: ShaderFunction, p: Any, value: Any) -> tuple[Any, Any]:
    if isinstance(value, tuple) and len(value) == 2:
        primal, tangent = value
        if isinstance(primal, Tensor):
            view = Tensor(primal._native, primal._device, _state=primal._state)
            try:
                view.with_tangent(tangent)
            except ValueError as exc:
                raise ValueError(f"{fn.label}.fwds: parameter '{p.name}': {exc}") from None
            return view, view._tangent
        if isinstance(primal, np.ndarray) or isinstance(tangent, np.ndarray):
            a, b = np.asarray(primal), np.asarray(tangent)
            if a.shape != b.shape:
                raise ValueError(
                    f"{fn.label}.fwds: parameter '{p.name}': tangent has shape {b.shape} but the "
                    f"value has shape {a.shape}"
                )
        return primal, tangent
    if isinstance(value, Tensor):
        _check_device(fn, value, f"parameter '{p.name}'")
        return value, (value._tangent if value._tangent is not None
                       else Tensor(scratch(fn.module.device, value, "zeros"), value.device))
    return value, _zero_like(value)


def _split_pair(result: Tensor, type_name: str, wrapper: ShaderFunction) -> tuple[Tensor, Tensor]:
    """Views of a tensor of R[2] elements as two tensors of R: primal and tangent."""
    native = result.native
    rtype = wrapper.module.native.layout.find_type_by_name(type_name)
    strides = [2 * s for s in native.strides]
    shape = list(native.shape)
    primal = spy.Tensor(native.storage, rtype, shape, strides, 2 * native.offset)
    tangent = spy.Tensor(native.storage, rtype, shape, strides, 2 * native.offset + 1)
    return Tensor(primal, result.device), Tensor(tangent, result.device)


def forward_mode_call(fn: ShaderFunction, args: tuple, kwargs: dict) -> Any:
    """``fn.fwds(...)``: see ForwardFunction."""
    _need_differentiable(fn, ".fwds")
    capturing.refuse(f"{fn.module.name}.{fn.name}.fwds (SlangPy)")
    flush_pending()
    bound, options = _bind(fn, args, kwargs)
    want = options.pop("_result", "tensor")
    if want not in ("tensor", "numpy"):
        raise ValueError(f"{fn.label}.fwds: _result={want!r}; use 'tensor' or 'numpy'")
    if options:
        raise TypeError(f"{fn.label}.fwds: unsupported options {sorted(options)}")
    call_args: list[Any] = []
    any_array = False
    for p, value in bound:
        any_array = any_array or isinstance(value, (Tensor, np.ndarray))
        if p.differentiable:
            if p.io == "in":
                call_args += list(_primal_and_tangent(fn, p, value))
                continue
            if not isinstance(value, Tensor):
                raise TypeError(f"{fn.label}.fwds: parameter '{p.name}' is {p.io}: pass a pydiff.Tensor to receive it")
            call_args += [value, _tangent_tensor(value)]
        elif p.tensor_kind == "fwd" and isinstance(value, Tensor):
            _check_device(fn, value, f"parameter '{p.name}'")
            tangent = _tangent_tensor(value) if p.writes_value else (
                value._tangent if value._tangent is not None else None)
            call_args.append(fwd_tensor_struct(fn, p, value, tangent._native if tangent is not None else None))
        elif p.tensor_kind is not None and isinstance(value, Tensor):
            if value._tangent is not None or p.writes_value:
                what = "would ignore its tangent" if not p.writes_value else "cannot give the tangents it writes"
                raise TypeError(
                    f"{fn.label}.fwds: parameter '{p.name}' is a {p.type_name}, whose loads and "
                    f"stores have no forward derivative in SlangPy, so forward mode {what}; "
                    f"declare it pydiff's {'RW' if p.writes_value else ''}FwdDiffTensor<{len(value.shape)}> "
                    "(import pydiff;) to use forward mode"
                )
            call_args.append(value)
        else:
            if isinstance(value, tuple) and len(value) == 2 and not p.no_diff and p.io == "in":
                raise TypeError(
                    f"{fn.label}.fwds: parameter '{p.name}' ({p.type_name}) carries no derivative "
                    "(not differentiable or no_diff), so it takes no (value, tangent) pair"
                )
            call_args.append(value)
    ret = fn._ret_name
    wrapper = fwd_wrapper(fn)
    with suspend_recording():
        out = forward_call(wrapper, tuple(call_args), {"_result": "tensor"} if ret != "void" else {})
    if ret == "void":
        return None
    if not isinstance(out, Tensor):  # not vectorised: SlangPy returned the value itself
        pair = np.asarray(out)
        return (pair[0], pair[1]) if any_array else (_scalar(pair[0]), _scalar(pair[1]))
    primal, tangent = _split_pair(out, ret, wrapper)
    if not any_array and not primal.shape:
        return _scalar(primal.numpy()), _scalar(tangent.numpy())
    if want == "numpy":
        return primal.numpy(), tangent.numpy()
    return primal, tangent


def _scalar(x: Any) -> Any:
    a = np.asarray(x)
    return float(a) if a.ndim == 0 else a


class ForwardFunction:
    """``fn.fwds``: forward mode. Give each differentiable argument a tangent (a tensor's
    ``.with_tangent(u)``, or a ``(value, tangent)`` pair); returns ``(result, result_tangent)``
    and fills ``.tangent`` of out/inout and RWFwdDiffTensor arguments. Arguments without a
    tangent are held fixed (tangent 0).

    >>> y, dy = m.polynomial.fwds(2.0, 8.0, -1.0, x.with_tangent(np.ones(4)))
    """

    def __init__(self, fn: ShaderFunction):
        self._fn = fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return forward_mode_call(self._fn, args, kwargs)

    def __repr__(self) -> str:
        return f"<pydiff fwds of {self._fn!r}>"


def _shader_function(fn: Any, what: str, args: Sequence[Any]) -> ShaderFunction:
    if isinstance(fn, OverloadedFunction):
        return fn.select(tuple(args), {})
    if isinstance(fn, ShaderFunction):
        return fn
    raise TypeError(
        f"{what} needs a Slang function of a loaded module (m.f), not {type(fn).__name__}: "
        "forward mode runs Slang's fwd_diff; for Python compositions of pydiff calls use pydiff.vjp"
    )


def jvp(fn: Any, primals: Sequence[Any], tangents: Sequence[Any]) -> tuple[Any, Any]:
    """Jacobian-vector product: ``(f(primals), J tangents)`` in one forward-mode pass.

    ``tangents`` lines up with ``primals`` (None for arguments held fixed). For a function
    returning void, the outputs are the tensors it writes.
    >>> y, dy = pydiff.jvp(m.f, (x, 2.0), (np.ones(x.shape), None))
    """
    primals, tangents = tuple(primals), tuple(tangents)
    f = _shader_function(fn, "jvp", primals)
    if len(tangents) != len(primals):
        raise ValueError(f"jvp: {len(primals)} primals but {len(tangents)} tangents (use None for fixed ones)")
    args = []
    for x, t in zip(primals, tangents):
        if t is None:
            args.append(x)
        elif isinstance(x, Tensor):
            view = Tensor(x._native, x._device, _state=x._state)
            args.append(view.with_tangent(t))
        else:
            args.append((x, t))
    result = f.fwds(*args)
    if f._ret_name != "void":
        return result
    written = [a for (p, a) in zip(f.params, args) if isinstance(a, Tensor) and p.writes_value]
    return tuple(written), tuple(w.tangent for w in written)


def vjp(fn: Any, primals: Sequence[Any], cotangents: Any) -> tuple[Any, tuple]:
    """Vector-Jacobian product: ``(f(primals), J^T cotangents)`` by reverse mode on a tape.

    ``fn`` is a module function or a Python callable of pydiff calls; gradients come back for
    tensor primals (None for the rest) in fresh buffers (the primals' own are untouched).
    >>> y, (gx, _) = pydiff.vjp(m.f, (x, 2.0), np.ones(x.shape))
    """
    call = (lambda *a: fn(*a, _result="tensor")) if isinstance(fn, (ShaderFunction, OverloadedFunction)) else fn
    if not callable(call):
        raise TypeError(f"vjp: fn must be a module function or a callable, not {type(fn).__name__}")
    inputs = []
    for x in primals:
        if isinstance(x, Tensor) and x.differentiable:
            x = Tensor(x._native, x._device, _state=x._state).requires_grad_(True)
        inputs.append(x)
    with Tape() as tape:
        out = call(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    cots = tuple(cotangents) if isinstance(out, tuple) else (cotangents,)
    if len(cots) != len(outs):
        raise ValueError(f"vjp: fn returned {len(outs)} outputs but {len(cots)} cotangents were given")
    with zero_policy("accumulate"):
        for o, c in zip(outs, cots):
            if not isinstance(o, Tensor):
                raise TypeError(f"vjp: fn returned a {type(o).__name__}; it must return pydiff Tensors")
            tape.backward(o, grad=c.numpy() if isinstance(c, Tensor) else c)
    grads = tuple(x.grad if isinstance(x, Tensor) and x.requires_grad else None for x in inputs)
    return out, grads


def dir_wrapper(fn: ShaderFunction) -> ShaderFunction:
    """``[Differentiable] float f__pydiff_dir(x, no_diff v, ...) = fwd_diff(f)(x; v).d``:
    the directional derivative, whose reverse-mode gradient w.r.t. x is H v."""
    _need_differentiable(fn, "hvp")
    if fn._ret_name not in ("float", "double", "half"):
        raise TypeError(f"hvp: {fn.label} returns {fn._ret_name}; hvp needs a scalar (float) result")
    params, args = [], []
    for p in fn.params:
        n, t = p.name, p.type_name
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
            params += [f"{t} {n}", f"no_diff {t} {n}__v"]
            args.append(f"diffPair({n}, {n}__v)")
        else:
            params.append(f"{'no_diff ' if p.no_diff else ''}{t} {n}")
            args.append(n)
    ret = fn._ret_name
    source = (_header(fn) + f"[Differentiable]\n{ret} {fn.name}__pydiff_dir({', '.join(params)})\n{{\n"
              f"    return fwd_diff({fn.name})({', '.join(args)}).d;\n}}\n")
    return _generated(fn, "dir", source)


def hvp(fn: Any, primals: Sequence[Any], v: Sequence[Any]) -> tuple:
    """Hessian-vector product of a scalar-valued Slang function (summed over a vectorised
    call): one ``H v`` per differentiable argument (None for the others).

    ``v`` lines up with ``primals``: a direction for each differentiable argument.
    >>> (hv,) = pydiff.hvp(m.energy, (x,), (np.ones(x.shape),))
    """
    primals, v = tuple(primals), tuple(v)
    f = _shader_function(fn, "hvp", primals)
    if len(v) != len(primals):
        raise ValueError(f"hvp: {len(primals)} primals but {len(v)} directions (use None for fixed arguments)")
    d = dir_wrapper(f)
    dev = f.module.device
    call_args, leaves = [], []
    for p, x, u in zip(f.params, primals, v):
        if not p.differentiable:
            if u is not None:
                raise ValueError(f"hvp: parameter '{p.name}' ({p.type_name}) is not differentiable; give None as its direction")
            call_args.append(x)
            leaves.append(None)
            continue
        host = not isinstance(x, Tensor)
        if host:
            x = make_tensor(np.asarray(x, dtype=np.float32), device=dev)
        leaf = Tensor(x._native, x._device, _state=x._state).requires_grad_(True)
        want = leaf.expected_numpy_shape()
        if u is None:
            u = np.zeros(want)
        if isinstance(u, Tensor):
            u_arr = u.numpy()
        else:
            u_arr = np.asarray(u, dtype=np.float64)
        if u_arr.shape != want:
            if u_arr.size != int(np.prod(want)) or (u_arr.ndim and want != (1,) + u_arr.shape):
                raise ValueError(f"hvp: direction for '{p.name}' has shape {u_arr.shape}; the value has shape {want}")
            u_arr = u_arr.reshape(want)  # a number given for a number
        direction = make_tensor(u_arr.astype(np.float32), dtype=leaf.dtype, device=dev) if leaf.shape else float(u_arr)
        call_args += [leaf, direction]
        leaves.append((leaf, host))
    with suspend_recording():
        r = d(*call_args, _result="tensor")
        if not isinstance(r, Tensor):
            r = make_tensor(np.asarray([r], np.float32), device=dev)
        with zero_policy("accumulate"):
            d.bwds(*call_args, _result=r.with_grads(ones=True))
    out = []
    for item in leaves:
        if item is None:
            out.append(None)
            continue
        leaf, host = item
        out.append(_scalar(leaf.grad.numpy()) if host else leaf.grad)
    return tuple(out)


def hessian(fn: Any, primals: Sequence[Any], max_inputs: int = 1024) -> np.ndarray:
    """The Hessian of a scalar-valued Slang function (of the sum over a vectorised call)
    w.r.t. all its differentiable arguments, flattened and concatenated: one HVP per input.

    >>> H = pydiff.hessian(m.energy, (x,))        # (n, n) float64, n = x's element count
    """
    primals = tuple(primals)
    f = _shader_function(fn, "hessian", primals)
    shapes = []
    for p, x in zip(f.params, primals):
        if p.differentiable:
            shapes.append(x.expected_numpy_shape() if isinstance(x, Tensor) else np.shape(np.asarray(x)))
        else:
            shapes.append(None)
    sizes = [int(np.prod(s)) if s is not None else 0 for s in shapes]
    n = sum(sizes)
    if n == 0:
        raise ValueError(f"hessian: {f.label} has no differentiable argument to differentiate")
    if n > max_inputs:
        raise ValueError(f"hessian: {n} inputs need {n} HVPs; above max_inputs={max_inputs}, use pydiff.hvp")
    H = np.zeros((n, n))
    for col in range(n):
        e = np.zeros(n)
        e[col] = 1.0
        dirs, at = [], 0
        for s, size in zip(shapes, sizes):
            dirs.append(None if s is None else e[at:at + size].reshape(s))
            at += size
        hv = hvp(f, primals, dirs)
        H[:, col] = np.concatenate([np.asarray(h.numpy() if isinstance(h, Tensor) else h, np.float64).ravel()
                                    for h in hv if h is not None])
    return H

