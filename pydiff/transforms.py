"""Function transforms: Jacobian-vector products (forward mode), vector-Jacobian products
(reverse mode on a tape), Hessian-vector products and Hessians.

    y, dy = pydiff.jvp(m.f, (x,), (u,))                 # f(x) and J u
    y, (gx,) = pydiff.vjp(m.f, (x,), (v,))              # f(x) and J^T v
    (hv,) = pydiff.hvp(m.energy, (x,), (v,))            # H v for a scalar-valued function

Hessian-vector products are reverse over forward: ``bwd_diff`` of a generated directional
derivative, the composition the bundled Slang compiles reliably (forward-over-reverse fails
to build, and writing ``bwd_diff(fwd_diff(f))`` in one expression crashes the compiler).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, Union

import numpy as np

from . import forward_trace
from .creation import tensor as make_tensor
from .forward_mode import as_scalar, dir_wrapper
from .forward_program import program_hessian, program_hvp, program_jvp
from .module import OverloadedFunction, ShaderFunction
from .policy import zero_policy
from .tape import Tape, suspend_recording
from .tensor import Tensor

#: A function of a loaded module (forward mode and second order need Slang's fwd_diff).
Shader = Union[ShaderFunction, OverloadedFunction]


def _shader_function(fn: Shader, what: str, args: Sequence[Any]) -> ShaderFunction:
    if isinstance(fn, OverloadedFunction):
        return fn.select(tuple(args), {})
    if isinstance(fn, ShaderFunction):
        return fn
    raise TypeError(
        f"{what} needs a Slang function of a loaded module (m.f), not {type(fn).__name__}: "
        "forward mode runs Slang's fwd_diff; for Python compositions of pydiff calls use pydiff.vjp"
    )


def jvp(
    fn: Shader | Callable[..., Any], primals: Sequence[Any], tangents: Sequence[Any]
) -> tuple[Any, Any]:
    """Jacobian-vector product: ``(f(primals), J tangents)`` in one forward-mode pass.

    ``fn`` is a module function or a Python function of pydiff ops, operators, slicing and
    shader calls (each op's ``jvp`` rule; tangents of several outputs as a tuple).
    ``tangents`` lines up with ``primals`` (None for arguments held fixed). For a module
    function returning void, the outputs are the tensors it writes.
    >>> y, dy = pydiff.jvp(m.f, (x, 2.0), (np.ones(x.shape), None))
    >>> y, dy = pydiff.jvp(lambda x: (x * x).sum(), (x,), (np.ones(x.shape),))
    """
    if not isinstance(fn, (ShaderFunction, OverloadedFunction)):
        return program_jvp(fn, primals, tangents)
    primals, tangents = tuple(primals), tuple(tangents)
    f = _shader_function(fn, "jvp", primals)
    if len(tangents) != len(primals):
        raise ValueError(
            f"jvp: {len(primals)} primals but {len(tangents)} tangents (use None for fixed ones)"
        )
    args = []
    for x, t in zip(primals, tangents):
        if t is None:
            args.append(x)
        elif isinstance(x, Tensor):
            view = x.detach()
            args.append(view.with_tangent(t))
        else:
            args.append((x, t))
    result = f.fwds(*args)
    if f.signature.return_type != "void":
        return result
    written = [a for (p, a) in zip(f.params, args) if isinstance(a, Tensor) and p.writes_value]
    return tuple(written), tuple(w.tangent for w in written)


def vjp(
    fn: Shader | Callable[..., Any], primals: Sequence[Any], cotangents: Any
) -> tuple[Any, tuple]:
    """Vector-Jacobian product: ``(f(primals), J^T cotangents)`` by reverse mode on a tape.

    ``fn`` is a module function or a Python callable of pydiff calls; gradients come back for
    tensor primals (None for the rest) in fresh buffers (the primals' own are untouched).
    >>> y, (gx, _) = pydiff.vjp(m.f, (x, 2.0), np.ones(x.shape))
    """
    call = (
        (lambda *a: fn(*a, _result="tensor"))
        if isinstance(fn, (ShaderFunction, OverloadedFunction))
        else fn
    )
    if not callable(call):
        raise TypeError(f"vjp: fn must be a module function or a callable, not {type(fn).__name__}")
    inputs = []
    for x in primals:
        if isinstance(x, Tensor) and x.differentiable:  # (inside jvp: refused at backward)
            x = forward_trace.derived(x, x.detach().requires_grad_(True), lambda t: t)
        inputs.append(x)
    with Tape() as tape:
        out = call(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    cots = tuple(cotangents) if isinstance(out, tuple) else (cotangents,)
    if len(cots) != len(outs):
        raise ValueError(
            f"vjp: fn returned {len(outs)} outputs but {len(cots)} cotangents were given"
        )
    with zero_policy("accumulate"):
        for o, c in zip(outs, cots):
            if not isinstance(o, Tensor):
                raise TypeError(
                    f"vjp: fn returned a {type(o).__name__}; it must return pydiff Tensors"
                )
            tape.backward(o, grad=c.numpy() if isinstance(c, Tensor) else c)
    grads = tuple(x.grad if isinstance(x, Tensor) and x.requires_grad else None for x in inputs)
    return out, grads


def hvp(fn: Shader | Callable[..., Any], primals: Sequence[Any], v: Sequence[Any]) -> tuple:
    """Hessian-vector product of a scalar-valued function: a Slang function (summed over a
    vectorised call; one ``H v`` per differentiable argument, None for the others) or a
    Python function of pydiff calls returning one element (reverse over forward: its
    tangent recorded on a tape; one ``H v`` per primal given a direction, None for the rest).

    ``v`` lines up with ``primals``.
    >>> (hv,) = pydiff.hvp(m.energy, (x,), (np.ones(x.shape),))
    >>> (hv,) = pydiff.hvp(lambda x: (x * x * x).sum(), (x,), (np.ones(x.shape),))
    """
    if not isinstance(fn, (ShaderFunction, OverloadedFunction)):
        return program_hvp(fn, primals, v)
    primals, v = tuple(primals), tuple(v)
    f = _shader_function(fn, "hvp", primals)
    if len(v) != len(primals):
        raise ValueError(
            f"hvp: {len(primals)} primals but {len(v)} directions (use None for fixed arguments)"
        )
    d = dir_wrapper(f)
    dev = f.module.device
    call_args, leaves = [], []
    for p, x, u in zip(f.params, primals, v):
        if not p.differentiable:
            if u is not None:
                raise ValueError(
                    f"hvp: parameter '{p.name}' ({p.type_name}) is not differentiable; give None "
                    "as its direction"
                )
            # No gradient is wanted through a fixed argument (it would warn that none comes).
            call_args.append(x.detach() if isinstance(x, Tensor) else x)
            leaves.append(None)
            continue
        host = not isinstance(x, Tensor)
        if host:
            x = make_tensor(np.asarray(x, dtype=np.float32), device=dev)
        leaf = x.detach().requires_grad_(True)
        want = leaf.expected_numpy_shape()
        if u is None:
            u = np.zeros(want)
        if isinstance(u, Tensor):
            u_arr = u.numpy()
        else:
            u_arr = np.asarray(u, dtype=np.float64)
        if u_arr.shape != want:
            one = u_arr.size == 1 == int(np.prod(want))  # [v] for a number, v for a (1,)
            if not one and (u_arr.size != int(np.prod(want)) or want != (1,) + u_arr.shape):
                raise ValueError(
                    f"hvp: direction for '{p.name}' has shape {u_arr.shape}; the value has shape "
                    f"{want}"
                )
            u_arr = u_arr.reshape(want)  # one value given for one value
        direction = (
            make_tensor(u_arr.astype(np.float32), dtype=leaf.dtype, device=dev)
            if leaf.shape
            else float(u_arr)
        )
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
        out.append(as_scalar(leaf.grad.numpy()) if host else leaf.grad)
    return tuple(out)


def hessian(
    fn: Shader | Callable[..., Any], primals: Sequence[Any], max_inputs: int = 1024
) -> np.ndarray:
    """The Hessian of a scalar-valued function, flattened and concatenated over its inputs:
    one HVP per input. A Slang function (of the sum over a vectorised call): w.r.t. all its
    differentiable arguments; a Python function: w.r.t. its float primals (tensors, float
    arrays, floats; ints and int tensors held fixed).

    >>> H = pydiff.hessian(m.energy, (x,))        # (n, n) float64, n = x's element count
    >>> H = pydiff.hessian(lambda x: (x * x * x).sum(), (x,))
    """
    if not isinstance(fn, (ShaderFunction, OverloadedFunction)):
        return program_hessian(fn, primals, max_inputs)
    primals = tuple(primals)
    f = _shader_function(fn, "hessian", primals)
    shapes = []
    for p, x in zip(f.params, primals):
        if p.differentiable:
            shapes.append(
                x.expected_numpy_shape() if isinstance(x, Tensor) else np.shape(np.asarray(x))
            )
        else:
            shapes.append(None)
    sizes = [int(np.prod(s)) if s is not None else 0 for s in shapes]
    n = sum(sizes)
    if n == 0:
        raise ValueError(f"hessian: {f.label} has no differentiable argument to differentiate")
    if n > max_inputs:
        raise ValueError(
            f"hessian: {n} inputs need {n} HVPs; above max_inputs={max_inputs}, use pydiff.hvp"
        )
    H = np.zeros((n, n))
    for col in range(n):
        e = np.zeros(n)
        e[col] = 1.0
        dirs, at = [], 0
        for s, size in zip(shapes, sizes):
            dirs.append(None if s is None else e[at : at + size].reshape(s))
            at += size
        hv = hvp(f, primals, dirs)
        H[:, col] = np.concatenate(
            [
                np.asarray(h.numpy() if isinstance(h, Tensor) else h, np.float64).ravel()
                for h in hv
                if h is not None
            ]
        )
    return H
