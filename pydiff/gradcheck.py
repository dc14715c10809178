"""gradcheck: compare backward gradients with central finite differences in float64.

ok = pydiff.gradcheck(m.polynomial, (2.0, 8.0, -1.0, x))           # x requires_grad
pydiff.gradcheck(Legendre3, (x,), eps=1e-3, atol=1e-3, rtol=1e-2)
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import numpy as np

from . import finite_diff as fd
from . import foreign
from .backward_scope import separate_backward
from .errors import GradcheckError
from . import gradcheck_blocks as gb
from .forward_program import lent_grads, refuse_inside_tape
from .function import Function
from .module import OverloadedFunction, ShaderFunction
from .policy import zero_policy
from .tape import Tape
from .tensor import Tensor
from .unrecorded import is_marked


def as_callable(fn: Any) -> Callable[..., Any]:
    """``fn`` as a plain callable returning tensors: a module function returns its result
    tensor and then every tensor argument it writes (out, inout, RW tensors), in order.

    as_callable(m.square)(x)       # a pydiff.Tensor, as m.square(x, _result="tensor")
    as_callable(m.scale_inout)(s, v)   # (v,): the value the call wrote into v
    """
    if isinstance(fn, OverloadedFunction):
        return lambda *a: as_callable(fn.select(a, {}))(*a)
    if isinstance(fn, ShaderFunction):
        if not fn.signature.written:
            return lambda *a: fn(*a, _result="tensor")

        def call(*a: Any) -> tuple:
            out = fn(*a, _result="tensor") if fn.signature.return_type != "void" else fn(*a)
            written = [a[i] for i in fn.signature.written if i < len(a)]
            return tuple(o for o in [out, *written] if isinstance(o, Tensor))

        return call
    if inspect.isclass(fn) and issubclass(fn, Function):
        return fn.apply
    if callable(fn):
        return fn
    raise TypeError(
        f"gradcheck: fn must be a module function, a pydiff.Function or a callable, not {fn!r}"
    )


def leaves(value: Any, label: str) -> list[tuple[str, Tensor]]:
    """Every pydiff tensor in ``value``, through dicts (structs), lists and tuples, with a
    label saying where: ``leaves({"w": w, "k": 2.0}, "input 1")`` -> [("input 1['w']", w)]."""
    if isinstance(value, Tensor):
        return [(label, value)]
    found: list[tuple[str, Tensor]] = []
    if isinstance(value, dict):
        for k, v in value.items():
            found += leaves(v, f"{label}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found += leaves(v, f"{label}[{i}]")
    return found


def _outputs(value: Any, keep: list[int] | None = None) -> list[Tensor]:
    """The outputs checked: every floating-point tensor ``fn`` returned. Integer ones (an
    index) have no derivative and are left out, as torch's gradcheck leaves them out, and
    so are marked ones. ``keep`` appends the positions chosen when empty, and chooses by
    them when not: off a tape, ``apply`` returns a marked input as itself, not a marked
    copy (its finite differences had the marked values too: a raw NumPy error)."""
    found = leaves(value, "output")
    if not found:
        raise TypeError("gradcheck: fn returned no pydiff.Tensor")
    if keep is None or not keep:
        chosen = [i for i, (_, t) in enumerate(found) if t.differentiable and not is_marked(t)]
        if keep is None:
            keep = chosen
        else:
            keep += chosen  # (the caller's list: later evaluations choose the same)
    outs = [found[i][1] for i in keep if i < len(found)]
    if not outs:
        kinds = ", ".join(f"{label} ({t.dtype})" for label, t in found)
        raise ValueError(
            f"gradcheck: fn returned no floating-point tensor to check, only {kinds}: "
            "integer outputs and marked ones have no derivative, so there is nothing to check"
        )
    return outs


def _flat_outputs(f: Callable, inputs: Sequence[Any], keep: list[int]) -> np.ndarray:
    with foreign.data_calls():  # off the tape too, torch data fn closes over gives pydiff
        outs = _outputs(f(*inputs), keep)
    return np.concatenate([o.numpy().astype(np.float64).ravel() for o in outs])


class _Inputs:
    """Every tensor among the inputs (nested ones too), their values at the start, and a
    ``load`` that puts the values wanted back before each evaluation: the checked ones at
    their perturbed values, the others at their start values. A tensor written since (an
    in-place call: ``inout``, ``IRWDiffTensor``) is found by its storage version and
    restored, so every evaluation starts from the same inputs."""

    def __init__(self, inputs: Sequence[Any]):
        self.keep: list[int] = []  # the positions of the outputs checked (_outputs)
        self.tensors: dict[int, tuple[str, Tensor]] = {}
        for k, value in enumerate(inputs):
            for label, t in leaves(value, f"input {k}"):
                self.tensors.setdefault(id(t.storage), (label, t))
        self.originals = {sid: t.numpy() for sid, (_, t) in self.tensors.items()}
        self.loaded = {
            sid: (self.originals[sid], t.storage.version) for sid, (_, t) in self.tensors.items()
        }

        #: The tensors with gradients at the start: the ones checked.
        self.checked = [(label, t) for label, t in self.tensors.values() if t.requires_grad]

    def load(self, values: dict[str, np.ndarray]) -> None:
        for sid, (label, t) in self.tensors.items():
            want = values.get(label, self.originals[sid])
            held, version = self.loaded[sid]
            if want is not held or t.storage.version != version:
                t.copy_from_numpy(want)
                self.loaded[sid] = (want, t.storage.version)

    def label_of(self, t: Tensor) -> str | None:
        """The label under which ``t``'s storage is checked (the first argument holding it)."""
        found = self.tensors.get(id(t.storage))
        return None if found is None else found[0]

    def versions(self) -> dict[int, int]:
        """Each input storage's write count now (see ``unchanged_input``)."""
        return {sid: t.storage.version for sid, (_, t) in self.tensors.items()}

    def unchanged_input(self, out: Tensor, versions: dict[int, int]) -> str | None:
        """The label of the input ``out`` is (or views whole) when no call wrote it since
        ``versions``: an input returned as it is (an identity ``Function``), whose
        derivative no tape records. None for anything a call produced or wrote."""
        sid = id(out.storage)
        if sid not in self.tensors or out.storage.version != versions[sid]:
            return None
        label, t = self.tensors[sid]
        return label if out.numel == t.numel else None

    def restore(self, finish: bool = False) -> None:
        """Start values back; with ``finish``, also drop the gradient buffers a tape gave
        to written tensors that had none."""
        self.load({})
        if finish:
            wanted = {id(t) for _, t in self.checked}
            for _, t in self.tensors.values():
                if id(t) not in wanted and t.requires_grad:
                    t.requires_grad_(False)


def _foreign_as_data(inputs: Sequence[Any]) -> tuple:
    """The inputs with every torch tensor (in dicts, lists and tuples too) converted to a
    pydiff tensor of its values, held fixed as any other input without ``requires_grad``.
    Before, a module function evaluated off a tape with torch data returned torch tensors
    and gradcheck failed ("fn returned no pydiff.Tensor"). One that requires a gradient is
    refused: its gradient would go unchecked (only pydiff tensors are perturbed)."""

    def held(value: Any, label: str, name: str) -> Any:
        if getattr(value, "requires_grad", False) is True:
            raise TypeError(
                f"gradcheck: {label} is a {name} tensor with "
                "requires_grad=True; gradcheck checks the gradients of pydiff tensors only, "
                "so its gradient would not be checked. Pass "
                "pydiff.from_torch(t, requires_grad=True) instead"
            )
        return foreign.data(value, f"gradcheck: {label}")

    return tuple(foreign.map_nested(value, f"input {k}", held) for k, value in enumerate(inputs))


def _nested(inputs: Sequence[Any]) -> bool:
    return any(isinstance(a, (dict, list, tuple)) for a in inputs)


def _listed(value: Any) -> bool:
    """A list or tuple in an argument (inside dicts too): fwds cannot carry tangents there."""
    if isinstance(value, dict):
        return any(_listed(v) for v in value.values())
    return isinstance(value, (list, tuple))


def _wants_forward(fn: Any, inputs: Sequence[Any], check_forward: bool | None) -> bool:
    if check_forward and _nested(inputs):  # (a module function's fwds: tensors in dicts)
        if not isinstance(fn, ShaderFunction) or any(_listed(a) for a in inputs):
            raise TypeError(
                "gradcheck: check_forward=True with struct (dict) or list arguments of "
                f"{getattr(fn, 'label', fn)}: forward mode of it takes tangents of tensors "
                "and numbers (and, for a module function, of tensors in dicts) only; leave "
                "check_forward=None to check the backward alone"
            )
    if check_forward is not None:
        return check_forward
    if isinstance(fn, type) and issubclass(fn, Function):  # a hand-written jvp: checked too
        return fn.jvp is not Function.jvp and not _nested(inputs)
    if not isinstance(fn, ShaderFunction) or not fn.differentiable or any(map(_listed, inputs)):
        return False  # (struct (dict) arguments checked too: a wrong one passed to 2026-11-29)
    if any(f.wrong_jvp for f in fn.module.traps.get(fn.name, ())):
        return False  # (forward mode refused: Slang's is wrong there; the backward checked)
    return all(p.tensor_kind in (None, "fwd", "plain") for p in fn.params)  # (all seen)


def _analytic(f: Callable, inputs: Sequence[Any], checked: list, state: _Inputs, rng: Any) -> tuple:
    """J^T v for random upstream v, summed here over one backward per output, each on a
    tape of its own from the start values: an in-place input is also an output, and a
    second backward over one recording would start from the values the first one left.
    Every tensor the backward adds into lends its gradient buffers for it, the checked
    inputs and those the function closes over (a model's parameters) alike, as the
    transforms' do: the caller's ``.grad`` stays as it was, values, STRICT's mark and what
    the optimizers read (written since zeroed) included. Each backward is one of its own,
    also inside another (a Function's backward): joined, that one's zeroing policy would
    count these buffers as done. Summed apart for half and other outputs (keyed by
    ``half``): each group is checked at its own precision's tolerances."""
    analytic = {g: {k: np.zeros(t.expected_numpy_shape()) for k, t in checked} for g in (0, 1)}
    vs: list[np.ndarray] = []
    own = [t if t.base is None else t.base for a in inputs for _, t in leaves(a, "")]
    j = 0
    with zero_policy("accumulate"):
        while j == 0 or j < len(vs):
            state.restore()
            versions = state.versions()
            # Lent before the recording: a tape's copy of an in-place input shares the
            # gradient buffers its input has when the call is recorded.
            lent = [t.lend_grads() for _, t in checked]
            try:
                with Tape(reads_other_tapes=True) as tape:
                    outs = _outputs(f(*inputs), state.keep)
                if not vs:
                    vs = [rng.uniform(-1.0, 1.0, o.expected_numpy_shape()) for o in outs]
                source = state.unchanged_input(outs[j], versions)
                group = analytic[int(outs[j].dtype.startswith("half"))]
                if source is not None and outs[j].producer is not tape:
                    # an input returned as it is, by nothing on the tape (a Function without
                    # backward): d out/d in = identity
                    if source in group:
                        group[source] += vs[j].reshape(group[source].shape)
                elif not outs[j].requires_grad:
                    # no checked input reaches it (a constant, a host computation): a zero
                    # Jacobian, as pydiff.vjp has; the finite differences must agree
                    pass
                else:
                    for _, t in checked:  # not zeros: a backward must add (grad_target)
                        t.grad.fill(_HELD)
                    with lent_grads(tape, own), separate_backward():
                        tape.backward(outs[j], grad=vs[j])
                    for k, t in checked:
                        group[k] += t.grad.numpy().astype(np.float64) - _HELD
            finally:
                for give_back in reversed(lent):
                    give_back()
            j += 1
    return analytic, vs, [o.dtype for o in outs]


#: Lent gradient buffers hold this before a backward (exact in half): one overwriting
#: ``ctx.grad_target(k)`` instead of adding passed against zeros before 2026-11-29.
_HELD = 0.5

#: How a checked input of each scalar type holds a float64 value (others: exactly).
_HOLDS = {"float": fd.f32, "half": lambda a: np.asarray(a, np.float16).astype(np.float64)}


def gradcheck(
    fn: Any,
    inputs: Sequence[Any],
    *,
    eps: float = 1e-3,
    atol: float = 1e-3,
    rtol: float = 1e-2,
    raise_exception: bool = True,
    seed: int = 0,
    check_forward: bool | None = None,
) -> bool:
    """Check the backward of ``fn`` at ``inputs`` against central finite differences.

    ``fn`` is a module function (called with ``_result="tensor"``), a ``pydiff.Function``
    subclass, or a Python callable of pydiff calls returning tensor(s); a module function's
    outputs are its result and the tensors it writes (out, inout, read-write). Tensors with
    ``requires_grad`` are checked, also inside dicts (structs), lists and tuples; others are
    held fixed (a torch tensor with ``requires_grad`` is refused: pass
    ``pydiff.from_torch(t, requires_grad=True)``). Integer outputs are left out; a float
    output no checked input reaches has a zero Jacobian. Inputs written in place are put
    back before every evaluation. A NaN or
    infinite gradient, or a finite difference that is not finite, fails. When a checked
    input or an output is half, ``eps`` is raised to what half can resolve (at least 2^-5),
    and ``atol`` and ``rtol`` (to 2e-2, 3e-2: ``pydiff.finite_diff.for_precision``) for a
    half input's elements and for half outputs only; float outputs keep them.

    Pass rule, with random upstream v and direction u (fixed by ``seed``):
      1. vector-Jacobian product: for every element i of every checked input,
         ``|AD_i - FD_i| <= atol + rtol * |FD_i|`` where AD = (J^T v)_i from the tape and
         FD_i = <v, (f(x + eps e_i) - f(x - eps e_i)) / (2 eps)>;
      2. adjoint test: ``|<J u, v> - <u, J^T v>| <= atol + rtol * |<J u, v>|`` with J u by a
         central difference along u (exact up to rounding for linear maps).
      3. forward mode (module functions: ``check_forward=None`` checks it whenever the
         function supports ``.fwds``; Python functions and Functions with
         ``check_forward=True``, by ``pydiff.jvp``'s rules): the JVP ``J u`` against the
         central difference along u, element by element, and ``<JVP(u), v> = <u, J^T v>``.
    Returns True, or raises GradcheckError naming the worst element (input, index, analytic,
    numeric); with ``raise_exception=False`` returns False instead.

    >>> x = pydiff.tensor([0.3, -1.2], requires_grad=True)
    >>> pydiff.gradcheck(m.polynomial, (2.0, 8.0, -1.0, x))
    True
    """
    fd.check_settings("gradcheck", eps, atol, rtol)
    refuse_inside_tape("gradcheck")
    f = as_callable(fn)
    if isinstance(inputs, Tensor) or foreign.framework(inputs) is not None:
        inputs = (inputs,)  # one tensor, as torch.autograd.gradcheck takes it (was "no input")
    elif not isinstance(inputs, (tuple, list)):
        raise TypeError(f"gradcheck: inputs must be a tuple of fn's arguments, not {inputs!r}")
    inputs = _foreign_as_data(inputs)  # torch data held fixed as pydiff tensors
    state = _Inputs(inputs)
    checked = state.checked
    if not checked:
        raise ValueError("gradcheck: no input has requires_grad=True; nothing to check")
    rng = np.random.default_rng(seed)
    originals = {k: t.numpy().astype(np.float64) for k, t in checked}
    worst: tuple[float, str] | None = None
    try:
        groups, vs, of = _analytic(f, inputs, checked, state, rng)
        v_flat = np.concatenate([v.ravel() for v in vs])
        analytic = {k: groups[0][k] + groups[1][k] for k, _ in checked}
        # half: a step half resolves (fd.for_precision), its tolerances only where half is
        # involved (one half value loosened all: a float32 gradient 2% off passed, to 11-29)
        in_half = {k: t.dtype.startswith("half") for k, t in checked}
        out_half = np.concatenate([np.full(v.size, d[:4] == "half") for v, d in zip(vs, of)])
        half = bool(out_half.any()) or any(in_half.values())
        tols = {h: fd.for_precision(eps, atol, rtol, h)[2:] for h in (False, True)}
        eps, _, atol, rtol = fd.for_precision(eps, atol, rtol, half)
        present = [g for g in (0, 1) if np.any(out_half == g)]

        def evaluate(values: dict[str, np.ndarray]) -> np.ndarray:  # f at values, flattened
            state.load(values)
            return _flat_outputs(f, inputs, state.keep)

        # x +- eps as the inputs hold them: the quotients divide by the step really taken
        held = {k: _HOLDS[t.scalar_type] for k, t in checked if t.scalar_type in _HOLDS}
        for k, g in ((k, g) for k, _ in checked for g in present):
            vg = v_flat if len(present) == 1 else np.where(out_half == g, v_flat, 0.0)
            a, r = tols[bool(g) or in_half[k]]
            numeric = fd.per_element(
                evaluate, originals, k, eps, project=lambda d, vg=vg: float(vg @ d), held=held
            )
            ad = groups[g][k].ravel()
            i, excess = fd.worst_excess(ad, numeric, a, r)
            if excess > 0 and (worst is None or excess > worst[0]):
                index = tuple(int(j) for j in np.unravel_index(i, originals[k].shape))
                x = float(originals[k].ravel()[i])
                no_step = k in held and held[k](x + eps) == held[k](x - eps)
                stuck = f"x = {x:g} +- eps = {eps:g}" if no_step else ""
                message = fd.element_message(k, index, ad[i], numeric[i], a, r, stuck)
                worst = (excess, message)
        # Adjoint dot-product test and forward mode along a random direction u, per block
        # of inputs of one precision (a half input loosened a float one's: to 2026-11-29)
        us = {k: rng.uniform(-1.0, 1.0, originals[k].shape) for k, _ in checked}
        if half:  # quarters: x + eps u stays on half's grid
            us = {k: np.round(u * 4) / 4 for k, u in us.items()}
        blocks = gb.input_blocks(checked, in_half)
        gap, along = gb.adjoint_gaps(
            evaluate, originals, us, eps, held, groups, blocks, v_flat, out_half, tols
        )
        worst = worst or gap
        if worst is None and _wants_forward(fn, inputs, check_forward):
            want = evaluate(originals)  # f(x), which forward mode's value must be
            state.restore()  # forward mode runs at x itself
            worst = gb.forward_checks(
                fn, f, inputs, state, along, blocks, want, v_flat, analytic, out_half, tols
            )
    finally:
        state.restore(finish=True)
    if worst is None:
        return True
    name = getattr(fn, "label", getattr(fn, "__name__", repr(fn)))
    message = f"gradcheck failed for {name}: {worst[1]}"
    singles = [np.abs(originals[k]).max() for k, t in checked if t.scalar_type == "float"]
    hint = "" if half or not singles else fd.float32_step_hint(max(singles), eps, rtol)
    if hint:
        message += f" (hint: {hint})"
    if raise_exception:
        raise GradcheckError(message)
    return False
