"""What ``pydiff.Function.apply`` checks: tensors nested in list, tuple and dict arguments
(which a hand-written backward cannot give gradients), the outputs (tensors of their own;
integer, bool and marked outputs without gradients; a forward without backward whose
outputs no recorded call connects to its inputs), and the gradients ``backward`` returns.

    outputs = own_outputs(cls, items, inputs, device)       # copies of inputs, arrays wrapped
    refuse_nested(name, args, lambda t: t.requires_grad, "requires grad", "a gradient")
    check_reached(name, tape, [(0, y)], {id(x.storage)})    # pattern 1 on a tape
    grads = gradients(cls, ctx, cls.backward(ctx, g), inputs)
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import numpy as np

from . import capturing, foreign
from .creation import tensor as make_tensor
from .errors import GradientOverflowError, warn_once
from .tensor import Tensor, float4_ready
from .unrecorded import note_marked


def nested_tensors(value: Any, label: str) -> list[tuple[str, Tensor]]:
    """The pydiff tensors inside lists, tuples and dicts of ``value`` (not ``value`` itself),
    each with where it is: ``nested_tensors([a, {"w": w}], "argument 0")`` ->
    ``[("argument 0[0]", a), ("argument 0[1]['w']", w)]``."""
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return []
    found: list[tuple[str, Tensor]] = []
    for key, v in items:
        if isinstance(v, Tensor):
            found.append((f"{label}[{key!r}]", v))
        elif isinstance(v, (list, tuple, dict)):
            found += nested_tensors(v, f"{label}[{key!r}]")
    return found


def refuse_nested(
    name: str, args: Sequence[Any], wants: Callable[[Tensor], bool], has: str, gets: str
) -> None:
    """TypeError for a tensor inside a list, tuple or dict argument of which ``wants`` holds
    (needs a gradient, has a tangent): ``backward`` returns, and ``jvp`` takes, one value per
    tensor *argument*, so such a tensor would silently get none."""
    for k, a in enumerate(args):
        if not isinstance(a, (list, tuple, dict)):
            continue
        for where, t in nested_tensors(a, f"argument {k}"):
            if wants(t):
                raise TypeError(
                    f"{name}.apply: {where}, a pydiff Tensor of shape {t.shape} inside a "
                    f"{type(a).__name__}, {has}; {name} has a hand-written derivative, which "
                    f"gives {gets} only to tensors passed as arguments of their own, so it "
                    f"would get none. Pass the tensors as separate arguments ({name}.apply(a, b) "
                    "with forward(ctx, a, b)), or t.detach() to mean a constant"
                )


def check_reached(
    name: str, tape: Any, outputs: Sequence[tuple[int, Tensor]], sources: set
) -> None:
    """A forward without backward on a tape (pattern 1): its float outputs must be connected
    to the inputs that require grad (storage ids ``sources``) by recorded calls, else the tape
    would treat them as constants (a forward computed on the host: ``.numpy()``). None of them
    connected: RuntimeError; some: a GradientFlowWarning for each of the others (an output
    that is a constant on purpose beside ones that are not; marked ones are not given here)."""
    outputs = [(k, o) for k, o in outputs if o.differentiable]
    cut = [(k, o) for k, o in outputs if not tape.reaches(o, sources)]
    if not cut:
        return
    fix = (
        f"Give {name} a backward (then forward may compute on the host), or compute it with "
        "pydiff ops or shader calls; ctx.mark_non_differentiable(out) says that an output "
        "does not depend on the inputs"
    )
    if len(cut) == len(outputs):
        which = f"output {cut[0][0]}" if len(outputs) == 1 else "any of its outputs"
        raise RuntimeError(
            f"{name}.apply: {name} has no backward, and its forward did not compute {which} "
            f"(shape {cut[0][1].shape}) from its inputs with recorded pydiff calls (a host round "
            "trip, such as .numpy()?), so the tape could not pass a gradient through it to the "
            f"inputs that require one. {fix}"
        )
    for k, o in cut:
        warn_once(
            f"{name}.apply: output {k} (shape {o.shape}) of {name}, which has no backward, was "
            "not computed from its inputs with recorded pydiff calls: it is a constant on the "
            f"tape, no gradient flows through it to the inputs. {fix}"
        )


def as_tensor(value: Any, device: Any, cls: type, where: str, k: int) -> Tensor:
    """Output ``k`` of ``cls.forward`` (or of its ``jvp``) as a pydiff tensor."""
    if isinstance(value, Tensor):
        return value
    if isinstance(value, list) and any(isinstance(v, Tensor) for v in value):
        raise TypeError(
            f"{cls.__name__}.{where}() returned a list holding pydiff Tensors; return several "
            "outputs as a tuple (return a, b)"
        )
    if isinstance(value, (np.ndarray, list, float, int)):
        if where != "forward":
            return make_tensor(np.asarray(value, dtype=np.float32), device=device)
        arr = np.asarray(value)  # indices, a mask: an integer or bool tensor, no gradient (as
        kind = None if arr.dtype.kind in "iub" else "float"  # documented; a float one rounded
        try:  # past 2^24); floats checked as pydiff.tensor checks them (1e39: not inf)
            return make_tensor(arr, dtype=kind, device=device)
        except ValueError as exc:  # (int64 values beyond int32, floats beyond float32)
            raise ValueError(f"{cls.__name__}.forward() output {k}: {exc}") from None
    raise TypeError(
        f"{cls.__name__}.{where}() output {k} is a {type(value).__name__}; return pydiff "
        "Tensors (or NumPy arrays)"
    )


def own_outputs(cls: type, items: tuple, inputs: list, device: Any) -> tuple[Tensor, ...]:
    """The outputs as tensors of their own: an output that is an input, a view of one (same
    storage) or another output again is copied. Sharing an input's gradient buffers would
    count that input's gradient twice (the seed and backward's gradient land in one buffer),
    and marking the output written would look like an overwrite of the input."""
    taken = {id(t.storage) for _, t in inputs}
    outputs = []
    for k, o in enumerate(items):
        t = as_tensor(o, device, cls, "forward", k)
        if id(t.storage) in taken:
            t = t.copy_values()
        taken.add(id(t.storage))
        outputs.append(t)
    return tuple(outputs)


GRAD_TYPES = "a pydiff.Tensor, a NumPy array (or number) or None"


def expected(cls: type, inputs: list[Tensor]) -> str:
    shapes = ", ".join(f"input {k}: shape {x.expected_numpy_shape()}" for k, x in enumerate(inputs))
    return (
        f"{cls.__name__}.backward() must return one gradient per tensor input of forward "
        f"({len(inputs)}: {shapes}), each {GRAD_TYPES} (None: no gradient for that input); "
        "several as a tuple"
    )


def gradients(cls: type, ctx: Any, grads: Any, inputs: list[Tensor]) -> tuple:
    """backward's return value as one checked entry per tensor input."""
    if type(grads) is tuple and len(grads) == len(inputs):
        # The usual return (float tensors and Nones): nothing to check further or convert.
        for g in grads:  # (a loop: no generator frames)
            if g is not None and (type(g) is not Tensor or g.dtype != "float"):
                break
        else:
            return grads
    name = cls.__name__
    if grads is None and not ctx.targets:
        raise TypeError(
            f"{name}.backward() returned None (a missing return?). {expected(cls, inputs)}; "
            f"to give no gradient at all return {'(None,)' if len(inputs) == 1 else 'Nones'}"
        )
    if isinstance(grads, list) and len(inputs) > 1:
        if len(grads) == len(inputs) and all(
            g is None or isinstance(g, (Tensor, np.ndarray)) for g in grads
        ):
            grads = tuple(grads)  # a list of one gradient per input
    if not isinstance(grads, tuple):
        grads = (grads,)
    if len(grads) != len(inputs):
        raise RuntimeError(
            f"{name}.backward() returned {len(grads)} gradients but expected "
            f"{len(inputs)} (one per tensor input of forward, None where there is none). "
            f"{expected(cls, inputs)}"
        )
    checked = []
    for k, g in enumerate(grads):
        what = f"{name}.backward() gradient {k} is a {type(g).__name__}"
        if foreign.framework(g) is not None:  # ("is a Tensor" read as a pydiff one)
            what = f"{name}.backward() gradient {k} is a {foreign.framework(g)} tensor"
            raise TypeError(f"{what} (pydiff.from_torch(g) converts it); it must be {GRAD_TYPES}")
        if isinstance(g, Tensor) and g.scalar_type == "bool":
            raise _boolean(what, k, cls, inputs)
        if isinstance(g, Tensor) and _wider(g, inputs[k]) and inputs[k].requires_grad:
            _fits(name, k, g.numpy(), inputs[k])  # (added in the input's dtype: may be inf)
        if g is None or isinstance(g, Tensor):
            checked.append(g)
            continue
        if isinstance(g, (str, bytes, dict, set)) or not isinstance(
            g, (np.ndarray, list, tuple, float, int, np.number, np.bool_)
        ):
            raise TypeError(f"{what}; it must be {GRAD_TYPES}. {expected(cls, inputs)}")
        try:
            arr = np.asarray(g)
            if arr.dtype.kind not in "biuf":
                raise TypeError(f"elements of type {arr.dtype}")
        except (TypeError, ValueError) as exc:
            raise TypeError(
                f"{what} that is not an array of numbers ({exc}); it must be {GRAD_TYPES}. "
                f"{expected(cls, inputs)}"
            ) from None
        if arr.dtype.kind == "b":
            raise _boolean(what, k, cls, inputs)
        checked.append(arr.astype(np.float64))  # integers are numbers (as PyTorch takes them)
        if inputs[k].requires_grad:
            _fits(name, k, checked[-1], inputs[k])
    return tuple(checked)


_HOST = {"float": np.float32, "half": np.float16}
_BITS = {"half": 16, "float": 32, "double": 64}


def _wider(g: Tensor, x: Tensor) -> bool:
    """A gradient tensor of a wider float dtype than its input (double for float or half,
    float for half): its finite values may not fit the input's."""
    return _BITS.get(g.scalar_type, 0) > _BITS.get(x.scalar_type, 64)


def _fits(name: str, k: int, arr: np.ndarray, x: Tensor) -> None:
    """Refuse a gradient with finite values that become inf in input ``k``'s dtype (float32,
    half): PyTorch casts such a gradient to the input's dtype without a word (inf). An inf or
    NaN returned as such is kept, as PyTorch keeps it."""
    host = _HOST.get(x.scalar_type)
    if host is None or arr.dtype == host:
        return
    with np.errstate(over="ignore"):
        lost = np.isfinite(arr) & ~np.isfinite(arr.astype(host))
    if lost.any():
        at = tuple(int(i) for i in np.argwhere(lost)[0])
        value = float(arr[at])
        raise GradientOverflowError(
            f"{name}.backward() gradient {k} (for input {k}, {x.dtype}) holds {value!r} at "
            f"{at}, finite but beyond the range of {x.scalar_type} ({np.finfo(host).max:.4g}): "
            "it would be added as inf. Scale the loss or the gradient, or keep the input in a "
            "wider dtype"
        )


def _boolean(what: str, k: int, cls: type, inputs: list[Tensor]) -> TypeError:
    # A bool mask returned as a gradient is a forgotten "* grad" (a ReLU's x > 0).
    return TypeError(
        f"{what} of booleans (for input {k}); a gradient holds numbers: multiply a mask by the "
        f"upstream gradient. {expected(cls, inputs)}"
    )


def boolean_tangent(t: Any) -> bool:
    """Whether ``jvp`` returned booleans (a mask) as a tangent."""
    if isinstance(t, Tensor):
        return t.scalar_type == "bool"
    if isinstance(t, (bool, np.bool_)):
        return True
    if isinstance(t, (np.ndarray, list)):
        try:
            return np.asarray(t).dtype.kind == "b"
        except ValueError:
            return False
    return False


def tangent_in_dtype(t: Any, o: Tensor, name: str, k: int, host: Callable[[str], None]) -> Any:
    """``jvp``'s tangent ``k`` in output ``k``'s dtype, as ``backward``'s gradients are
    converted: a float tangent of a half output (ops compute in float) and back through the
    tape (``astype``, so ``hvp`` differentiates it); an integer or double tensor on the host
    (``host`` is told: such a tangent is first order only). Booleans are refused (a mask
    returned for ``mask * tangent``); before, an int or half tangent was kept and the next op
    or shader call failed naming neither the Function nor the tangent."""
    if boolean_tangent(t):
        raise TypeError(
            f"{name}.jvp() tangent {k} holds booleans (for output {k}); a tangent holds "
            "numbers: multiply a mask by the input's tangent"
        )
    if not isinstance(t, Tensor) or t.dtype == o.dtype or o.dtype not in ("float", "half"):
        return t
    if t.dtype in ("float", "half"):
        return t.astype(o.dtype)
    host(f"{name}.jvp() returned a {t.dtype} tensor, converted on the host")
    return make_tensor(t.numpy().astype(np.float32), dtype=o.dtype, device=o.device)


def bound_args(name: str, forward: Callable[..., Any], args: tuple, kwargs: dict) -> tuple:
    """``Function.apply``'s keyword arguments bound to ``forward(ctx, ...)``'s parameters and
    made positional, defaults filled in between (as torch's ``Function.apply``), so that the
    gradients ``backward`` returns line up with the tensor arguments as for positional ones.
    A name ``forward`` does not have raises TypeError naming the Function."""
    try:
        bound = inspect.signature(forward).bind(None, *args, **kwargs)  # (None: ctx)
    except TypeError as exc:
        raise TypeError(f"{name}.apply: {exc} (of {name}.forward)") from None
    bound.apply_defaults()
    if bound.kwargs:  # (keyword-only or **kwargs parameters of forward)
        raise TypeError(
            f"{name}.apply: keyword arguments {sorted(bound.kwargs)} reach keyword-only or "
            f"**kwargs parameters of {name}.forward; apply passes forward positional "
            "arguments (keywords bound to named parameters, as torch does)"
        )
    return tuple(bound.args[1:])


def _no_check(saved: dict[int, int]) -> None:
    pass


def forward_writes(name: str, inputs: list, on_tape: Any) -> Callable[[dict], None]:
    """A check, after a Function's ``forward`` (with a ``backward``) on a tape, that it wrote
    no tensor input that requires a gradient in place: the tape's record of that input's
    values is gone and the gradient ``backward`` returns for it silently never reached what
    computed it (0 for an intermediate; torch's ``mark_dirty`` case, not offered here). An
    input saved before the write is left to the backward's overwrite check, which names it.

    check = forward_writes("Exp", [(0, x)], True); Exp.forward(ctx, x); check(ctx.saved_versions)
    """
    if not on_tape:
        return _no_check
    before = [(k, t, t.storage.version) for k, (_, t) in enumerate(inputs) if t.requires_grad]

    def check(saved: dict[int, int]) -> None:
        for k, t, version in before:
            now = t.storage.version
            if now != version and saved.get(id(t.storage), now) == now:
                raise RuntimeError(
                    f"{name}.forward wrote input {k} (shape {t.shape}) in place, and it "
                    "requires a gradient on a tape: the gradient backward returns for it would "
                    "not reach what computed it (pydiff has no mark_dirty). Write the result "
                    "into a new tensor and return that (x.clone() first, or pydiff.empty_like), "
                    "or pass x.detach() where no gradient is wanted"
                )

    return check


def captured_reads(name: str, inputs: list) -> None:
    """In ``pydiff.capture``: the tensor inputs of a Function call (pydiff's ops: linear,
    matmul, relu, cross_entropy, dropout) are what its recorded kernels read, so a replay
    refuses once one that came from outside the step was dropped (``xb =
    pydiff.tensor(batch)`` re-binding the name): it would read the old buffer, which nothing
    writes any more, and train on the captured batch without a word."""
    if (rec := capturing.recording()) is not None:
        rec.record_reads(name, [(f"its argument {i}, shape {t.shape}", t) for i, t in inputs])


def detach_marked(result: Any, ctx: Any) -> Any:
    """``result`` (one output or a tuple) with every output ``ctx.marked`` non-differentiable
    replaced by a detached view: under ``pydiff.jvp`` it carries no tangent, as it carries no
    gradient on a tape (before 2026-11-29 jacfwd gave 3 I where jacrev gave 0)."""
    items = result if isinstance(result, tuple) else (result,)
    out = tuple(o.detach() if isinstance(o, Tensor) and ctx.marked(o) else o for o in items)
    note_marked([o for o, i in zip(out, items) if o is not i], ctx.name)
    return out if isinstance(result, tuple) else out[0]


def add_on_device(dst: Tensor, src: Tensor) -> None:
    """dst += src for float tensors of one device and shape."""
    dev = dst.device
    if src.shape == dst.shape and float4_ready(src, dst):
        count = -(-src.numel // 4)
        kernel = dev.kernels.get("tensor_helpers.slang", "accumulate4")
        dev.kernels.dispatch(
            kernel,
            count,
            dst=dst.buffer,
            dst_in=dst.buffer,
            src=src.buffer,
            count=count,
        )
    else:
        dev.flush()  # SlangPy runs it now: what is queued goes first
        dev.library.accumulate(dst.native, src.native)
    dst.storage.wrote("a Function's gradient")
