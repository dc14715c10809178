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

import numbers
from typing import Any, Callable, Sequence, Union

import numpy as np

from . import foreign, forward_trace
from .backward_scope import separate_backward
from .creation import tensor as make_tensor
from .forward_mode import as_scalar, dir_wrapper
from .forward_program import float_primal, lent_grads, program_hessian, program_hvp, program_jvp
from .forward_program import hessian_by_columns, holds_integers
from .unrecorded import refuse_copied
from .forward_program import refuse_inside_tape
from .module import OverloadedFunction, ShaderFunction
from .policy import zero_policy
from .seeds import seed_values
from .shader_primals import check_arity, one_array, takes_grads, torch_primals, void_outputs
from .tape import Tape, active_tape, suspend_recording
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


def arguments(value: Any, what: str, name: str) -> tuple:
    """``primals`` (or their directions) as a tuple; a TypeError naming ``name`` for a tensor,
    an array or a number given where a tuple of arguments is expected."""
    if isinstance(value, (tuple, list)):
        return tuple(value)
    raise TypeError(
        f"{what}: {name} must be a tuple (one entry per argument of fn), got a "
        f"{type(value).__module__}.{type(value).__name__}; for one argument write (x,)"
    )


def _refuse_struct(what: str, fn: ShaderFunction, k: int, x: Any) -> None:
    """A struct (dict) primal given a direction of a module function: refused, with the way
    that works."""
    if isinstance(x, dict):
        name = fn.params[k].name if k < len(fn.params) else str(k)
        how = (
            "differentiate a Python function of the tensors inside instead: pydiff.jvp(lambda "
            "a: m.f({'field': a, ...}, ..., _result='tensor'), (a,), (u,))"
            if what == "jvp"
            else "second order through struct fields is not supported: make the value a "
            "parameter of its own (a float, vector or array)"
        )
        raise TypeError(
            f"{what}: primal {k} ('{name}' of {fn.label}) is a struct (dict); {what} of a module "
            f"function takes directions of tensors and numbers only: {how}"
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
    primals, tangents = arguments(primals, "jvp", "primals"), arguments(tangents, "jvp", "tangents")
    if not isinstance(fn, (ShaderFunction, OverloadedFunction)):
        return program_jvp(fn, primals, tangents)
    f = _shader_function(fn, "jvp", primals)
    if len(tangents) != len(primals):
        raise ValueError(
            f"jvp: {len(primals)} primals but {len(tangents)} tangents (use None for fixed ones)"
        )
    primals = torch_primals("jvp", f, primals, tangents)
    if active_tape() is not None and any(
        isinstance(v, Tensor) and v.requires_grad for v in (*primals, *tangents)
    ):
        return _jvp_on_tape(f, primals, tangents)
    args = []
    for k, (x, t) in enumerate(zip(primals, tangents)):
        if t is None:
            args.append(x)
            continue
        _refuse_struct("jvp", f, k, x)
        if isinstance(x, Tensor):
            if not isinstance(t, Tensor):  # (refused naming jvp's argument, not with_tangent)
                t = seed_values(t, f"jvp: tangents[{k}]", x.scalar_type)
                if t.shape != x.expected_numpy_shape():  # (with_tangent's would name neither)
                    name = f.params[k].name if k < len(f.params) else f"#{k}"
                    raise ValueError(
                        f"jvp: tangents[{k}] (for {f.label}'s parameter '{name}') has shape "
                        f"{t.shape}; primal {k} has shape {x.expected_numpy_shape()}"
                    )
            view = x.detach()
            args.append(view.with_tangent(t))
        else:
            args.append((x, t))
    result = f.fwds(*args)
    if f.signature.return_type != "void":
        return result
    written = [a for (p, a) in zip(f.params, args) if isinstance(a, Tensor) and p.writes_value]
    return tuple(written), tuple(w.tangent for w in written)


def _jvp_on_tape(f: ShaderFunction, primals: tuple, tangents: tuple) -> tuple[Any, Any]:
    """``jvp`` of a module function while a tape records and a tensor given requires a
    gradient: as the Python function calling it (its value and tangent recorded, a
    ``ShaderTangent``), so gradients reach the primals and tangents. (``fn.fwds`` records
    nothing: its result was a constant to the tape, the gradient through it silently 0.)"""
    if f.signature.return_type == "void" or any(p.writes_value for p in f.params):
        raise RuntimeError(
            f"jvp: {f.label} writes its arguments (out/inout), and a pydiff.Tape is recording "
            "with an argument that requires a gradient: the tangents it writes would be "
            "constants to the tape (their gradient silently 0). Call it outside the tape, or "
            "pass x.detach() to take the JVP without a gradient through it"
        )
    xs, us = list(primals), list(tangents)
    for k, p in enumerate(f.params[: len(xs)]):  # one host array for an array parameter
        if us[k] is not None:  # is one value, as .fwds takes it
            xs[k], us[k] = one_array(p, xs[k]), one_array(p, us[k])
    primals, tangents = tuple(xs), tuple(us)
    return program_jvp(lambda *a: f(*a, _result="tensor"), primals, tangents)


def vjp(
    fn: Shader | Callable[..., Any], primals: Sequence[Any], cotangents: Any
) -> tuple[Any, tuple]:
    """Vector-Jacobian product: ``(f(primals), J^T cotangents)`` by reverse mode on a tape.

    ``fn`` is a module function or a Python callable of pydiff calls; ``cotangents`` lines up
    with its outputs (a tuple for several; None: zero). Gradients come back for tensor
    primals in fresh buffers (the primals' own are untouched), for floats and float arrays
    as numbers and arrays (of a module function: at differentiable parameters), None for the
    rest (ints, int tensors, other values); a struct (dict) or torch tensor primal raises a
    TypeError (its gradients would be lost). No other tensor's ``.grad`` changes (a model's
    parameters the function closes over keep theirs).
    >>> y, (gx, gs) = pydiff.vjp(m.f, (x, 2.0), np.ones(x.shape))
    """
    refuse_inside_tape("vjp")
    shader = isinstance(fn, (ShaderFunction, OverloadedFunction))
    call = (lambda *a: fn(*a, _result="tensor")) if shader else fn
    if not callable(call):
        raise TypeError(f"vjp: fn must be a module function or a callable, not {type(fn).__name__}")
    primals = arguments(primals, "vjp", "primals")
    params = _shader_function(fn, "vjp", primals).params if shader else None
    if shader:
        call = void_outputs(_shader_function(fn, "vjp", primals), primals) or call
    inputs, leaves = [], []
    for k, x in enumerate(primals):
        _refuse_vjp_primal(x, k, params, fn)
        leaf = None
        if params is not None and k < len(params) and params[k].io == "out":
            pass  # written by a void function: one of its outputs (_void_outputs)
        elif isinstance(x, Tensor) and x.differentiable:  # (inside jvp: refused at backward)
            leaf = forward_trace.derived(x, x.detach().requires_grad_(True), lambda t: t)
        elif params is None and _float_value(x):  # (integers held fixed: integer_primals)
            leaf = float_primal(x, "vjp", k).requires_grad_(True)
        elif params is not None and k < len(params) and takes_grads(params[k]):
            if _float_value(x) or holds_integers(x):  # the parameter's type decides
                leaf = float_primal(one_array(params[k], x), "vjp", k).requires_grad_(True)
        inputs.append(x if leaf is None else leaf)
        leaves.append(leaf)
    taken = [(x.storage, x.storage.replaced[0]) for x in leaves if x is not None]
    with Tape(reads_other_tapes=True) as tape:
        out = call(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    cots = tuple(cotangents) if isinstance(out, tuple) else (_single(cotangents, out),)
    if len(cots) != len(outs):
        raise ValueError(
            f"vjp: fn returned {len(outs)} outputs but {len(cots)} cotangents were given"
        )
    for o in outs:
        if not isinstance(o, Tensor):
            raise TypeError(f"vjp: fn returned a {type(o).__name__}; it must return pydiff Tensors")
    # A backward of its own (inside another one too: a Function's backward), as grad's.
    lend = lent_grads(tape, [x for x in leaves if x is not None])
    with zero_policy("accumulate"), lend, separate_backward():
        for k, (o, c) in enumerate(zip(outs, cots)):
            if c is None:
                continue  # a cotangent of zero
            refuse_copied(o, "vjp")
            if not o.requires_grad:
                continue  # an output no primal reaches
            which = f"vjp: cotangents[{k}]" if isinstance(out, tuple) else "vjp: cotangents"
            seed = seed_values(c.numpy() if isinstance(c, Tensor) else c, which, o.scalar_type)
            _check_cotangent(seed, o, k, isinstance(out, tuple))
            if o.producer is tape:
                tape.backward(o, grad=seed)
            elif any(o.storage is st and st.replaced[0] == n for st, n in taken):
                _add_into(o.grad, seed, k)  # an input (or a view of one) returned as it is
    grads = tuple(
        None if leaf is None else leaf.grad if isinstance(x, Tensor) else _as_given(leaf, x)
        for x, leaf in zip(primals, leaves)
    )
    return out, grads


def _refuse_vjp_primal(x: Any, k: int, params: Any, fn: Any) -> None:
    """A struct (dict) or another framework's tensor as a vjp primal: refused (as ``grad``
    refuses it), for the gradients of what it holds would be lost and None returned."""
    kind = "struct (dict)" if _holds_dict(x) else None
    if kind is None and foreign.framework(x) is not None:
        kind = f"{foreign.framework(x)} tensor"
    if kind is None:
        return
    label = getattr(fn, "label", "fn")
    name = f" ('{params[k].name}' of {label})" if params and k < len(params) else ""
    how = (
        "pass the tensors and numbers inside as primals of their own (vjp(lambda a: "
        "m.f({'a': a, 'b': 1.0}, x), (a,), ...)), or close over the dict to hold it fixed"
        if kind.startswith("struct")
        else foreign.advice(x) or "convert it to a pydiff tensor"
    )
    raise TypeError(
        f"vjp: primal {k}{name} {'holds' if isinstance(x, (list, tuple)) else 'is'} a "
        f"{kind}; vjp differentiates with respect to pydiff "
        f"tensors, NumPy arrays, lists and numbers, so the gradient of what it holds would be "
        f"lost: {how}"
    )


def _holds_dict(x: Any) -> bool:
    """A dict, or a list/tuple with one inside (an array of structs)."""
    if isinstance(x, (list, tuple)):
        return any(_holds_dict(v) for v in x)
    return isinstance(x, dict)


def _single(cotangents: Any, out: Any) -> Any:
    """The cotangent of a one-output function: ``(u,)`` (one per output, as jvp takes its
    tangents) taken as ``u`` where unambiguous: one entry, itself None or an array of the
    output's shape (a list of numbers stays the cotangent itself)."""
    if not isinstance(cotangents, (tuple, list)) or len(cotangents) != 1:
        return cotangents
    (c,) = cotangents
    if c is None:
        return None
    want = out.expected_numpy_shape() if isinstance(out, Tensor) else None
    shape = c.expected_numpy_shape() if isinstance(c, Tensor) else np.shape(c)
    array_like = isinstance(c, (Tensor, np.ndarray, list, tuple, float, int, np.generic))
    return c if array_like and want is not None and shape == want else cotangents


def _check_cotangent(seed: Any, out: Tensor, k: int, many: bool) -> None:
    """A ValueError naming vjp's ``cotangents`` for one of the wrong shape."""
    shape, want = np.shape(seed), out.expected_numpy_shape()
    if shape != want and not (int(np.prod(shape)) == 1 == int(np.prod(want))):
        which = f"cotangents[{k}]" if many else "cotangents"
        raise ValueError(
            f"vjp: {which} has shape {shape}; output {k} has shape {want}"
            + ("" if many else " (one output: pass its cotangent, or a 1-tuple of it)")
        )


def _float_value(x: Any) -> bool:
    """A Python float or a float array (list): a primal vjp differentiates (ints: fixed)."""
    if isinstance(x, (float, np.floating)):
        return True
    return isinstance(x, (np.ndarray, list, tuple)) and np.asarray(x).dtype.kind == "f"


def _as_given(leaf: Tensor, given: Any) -> Any:
    """A gradient in the form its primal was given: a number, or an array of its shape."""
    values = np.asarray(leaf.grad.numpy(), np.float64)
    return (
        float(values.reshape(-1)[0])
        if isinstance(given, numbers.Real)  # (an int given to a float parameter too)
        else values.reshape(np.shape(given))
    )


def _add_into(grad: Tensor, cotangent: Any, k: int) -> None:
    """grad += cotangent (of output k, which is a primal passed through)."""
    want = grad.expected_numpy_shape()
    seed = np.asarray(cotangent, np.float64)
    if seed.size == 1 == int(np.prod(want)):
        seed = seed.reshape(want)
    if seed.shape != want:
        raise ValueError(f"vjp: cotangent {k} has shape {seed.shape}; output {k} has {want}")
    grad.copy_from_numpy(grad.numpy() + seed)


def hvp(fn: Shader | Callable[..., Any], primals: Sequence[Any], v: Sequence[Any]) -> tuple:
    """Hessian-vector product of a scalar-valued function: a Slang function (summed over a
    vectorised call; one ``H v`` per differentiable argument, None for the others) or a
    Python function of pydiff calls returning one element (reverse over forward: its
    tangent recorded on a tape; one ``H v`` per primal given a direction, None for the rest).

    ``v`` lines up with ``primals``.
    >>> (hv,) = pydiff.hvp(m.energy, (x,), (np.ones(x.shape),))
    >>> (hv,) = pydiff.hvp(lambda x: (x * x * x).sum(), (x,), (np.ones(x.shape),))
    """
    primals, v = arguments(primals, "hvp", "primals"), arguments(v, "hvp", "v")
    if not isinstance(fn, (ShaderFunction, OverloadedFunction)):
        return program_hvp(fn, primals, v)
    f = _shader_function(fn, "hvp", primals)
    if len(v) != len(primals):
        raise ValueError(
            f"hvp: {len(primals)} primals but {len(v)} directions (use None for fixed arguments)"
        )
    check_arity("hvp", f, primals)
    held = {k for k, x in enumerate(primals) if foreign.framework(x) is not None}
    primals = torch_primals("hvp", f, primals, v)
    doubles = frozenset(p.name for p in f.params if p.differentiable and not takes_grads(p))
    d = dir_wrapper(f, primals, doubles)  # (a double parameter: no direction, held fixed)
    dev = f.module.device
    call_args, leaves = [], []
    for k, (p, x, u) in enumerate(zip(f.params, primals, v)):
        if p.differentiable:  # (a fixed struct of no derivative is passed as it is)
            _refuse_struct("hvp", f, k, x)
        if not takes_grads(p):
            if u is not None:
                why = (
                    "double (no gradient buffers in SlangPy)"
                    if p.name in doubles
                    else ("not differentiable")
                )
                raise ValueError(
                    f"hvp: parameter '{p.name}' ({p.type_name}) is {why}; give None as its "
                    "direction"
                )
            # No gradient is wanted through a fixed argument (it would warn that none comes).
            call_args.append(x.detach() if isinstance(x, Tensor) else x)
            leaves.append(None)
            continue
        host = np.shape(x) if not isinstance(x, Tensor) else None
        if host is not None:
            x = make_tensor(np.asarray(one_array(p, x), dtype=np.float32), device=dev)
        leaf = x.detach().requires_grad_(True)
        want = leaf.expected_numpy_shape()
        if u is None:
            u = np.zeros(want)
        where = f"hvp: direction for '{p.name}' (v[{k}])"
        u_arr = seed_values(u.numpy() if isinstance(u, Tensor) else u, where, leaf.scalar_type)
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
            if u_arr.ndim  # (a 0-d float3 tensor too: its direction is a float3)
            else float(u_arr)
        )
        call_args += [leaf, direction]
        leaves.append((leaf, host))
    with suspend_recording():
        r = d(*call_args, _result="tensor")
        if not isinstance(r, Tensor):
            r = make_tensor(np.asarray([r], np.float32), device=dev)
        with zero_policy("accumulate"), separate_backward():
            d.bwds(*call_args, _result=r.with_grads(ones=True))
    out = []
    for k, item in enumerate(leaves):
        if item is None or k in held:  # (a torch primal: held fixed, as by a Python fn's hvp)
            out.append(None)
            continue
        leaf, host = item
        out.append(leaf.grad if host is None else as_scalar(leaf.grad.numpy().reshape(host)))
    return tuple(out)


def hessian(
    fn: Shader | Callable[..., Any], primals: Sequence[Any], max_inputs: int = 1024
) -> np.ndarray:
    """The Hessian of a scalar-valued function, one HVP per input element: of shape
    ``x.shape + x.shape`` for one differentiated input ``x`` (PyTorch's, JAX's: () for a
    0-d x), (n, n) flattened and concatenated over several. A Slang function (of the sum
    over a vectorised call): w.r.t. all its differentiable arguments; a Python function:
    w.r.t. its float primals (tensors, float arrays, floats; ints and int tensors held fixed).

    >>> H = pydiff.hessian(m.energy, (x,))        # float64, x.shape + x.shape
    >>> H = pydiff.hessian(lambda x: (x * x * x).sum(), (x,))
    """
    primals = arguments(primals, "hessian", "primals")
    if not isinstance(fn, (ShaderFunction, OverloadedFunction)):
        return program_hessian(fn, primals, max_inputs)
    f = _shader_function(fn, "hessian", primals)
    check_arity("hessian", f, primals)
    primals = torch_primals("hessian", f, primals, None)
    shapes = []
    for k, (p, x) in enumerate(zip(f.params, primals)):
        if takes_grads(p):  # (double parameters held fixed, as by hvp)
            _refuse_struct("hessian", f, k, x)
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
    return hessian_by_columns(shapes, lambda dirs: hvp(f, primals, dirs))
