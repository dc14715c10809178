"""``pydiff check`` for functions that take whole tensors and an index (the SlangPy style
``void f(int i, IDiffTensor<float, 1> x, IRWDiffTensor<float, 1> y)``).

    rows = check_tensor_function(fn, device, size=4, seed=0)

Every tensor parameter gets a small tensor of ``size`` elements per dimension; the index
parameter (the first ``int`` or ``int[N]``/``intN``) runs over a grid of that size, so the
function may read any element of its inputs; further ints are held at a small value (1 to
size - 1, a valid index) and float numbers at a value in [0.5, 1.5]. Read-only float
tensors are inputs (random values, half positive and half negative); written tensors and
the result are outputs. A function with
no index parameter is called once. The gradient of each differentiable input tensor comes
from ``.bwds`` for a random upstream gradient and is compared, element by element, with
central differences of <v, outputs> (pydiff.finite_diff, steps eps and eps/4 to leave out
kinks): one element perturbed at a time, so this suits small tensors. A second probe at
31 elements for 1-D tensors, 15 per axis for 2-D, 7 for 3-D (not a multiple of 4, as every
first size is) perturbs a sample of the elements past the first 4 per axis, and output
elements that are NaN or infinite are left out (pydiff.tensorcheck_entries).
"""

from __future__ import annotations

import re
from typing import Any, Callable

import numpy as np
import slangpy as spy

from . import finite_diff as fd
from .creation import tensor as make_tensor
from .device import Device
from .module import ShaderFunction
from .tensor import Tensor
from .tensorcheck_entries import ROUNDINGS, Entries, along, larger_size, per_element
from .tensorcheck_entries import element_label, sampled_elements, unresolved

_DIMS = re.compile(r"<\s*float\s*,\s*(\d+)\s*>$|^(?:RW)?FwdDiffTensor<\s*(\d+)\s*>$")
#: modcheck's reason for a row with no entry compared (rewritten where the step was at fault)
SMOOTH_NOWHERE = "no element where the function is finite and smooth"
_FIXED = ("float", "int", "uint")  # held fixed beside tensors (ints after the first: 1..size-1)
_INDEX = re.compile(
    r"^(?:int|uint)(?:\[(\d)\]|(\d))?$|^(?:int|uint)\[(\d)\]$|^vector<(?:int|uint),\s*(\d)>$"
)


def tensor_dims(type_name: str) -> int | None:
    """N of a float tensor type (IDiffTensor<float, N>, FwdDiffTensor<N>, ...), else None.

    >>> tensor_dims("IDiffTensor<float, 2>"), tensor_dims("FwdDiffTensor<1>"), tensor_dims("int")
    (2, 1, None)
    """
    m = _DIMS.search(type_name)
    return int(m.group(1) or m.group(2)) if m else None


def index_dims(type_name: str) -> int | None:
    """How many grid dimensions an index parameter takes (int: 1, int[2]/int2: 2), else None.

    >>> index_dims("int"), index_dims("int2"), index_dims("float")
    (1, 2, None)
    """
    m = _INDEX.match(type_name)
    if not m:
        return None
    return int(next((g for g in m.groups() if g), 1))


def skip_reason(fn: ShaderFunction) -> str | None:
    """Why ``pydiff check`` cannot generate inputs for this tensor function, or None.

    skip_reason(m.dense)           # None: void dense(int i, IDiffTensor<float, 2> w, ...)
    """
    index = [p for p in fn.params if index_dims(p.type_name) is not None and p.tensor_kind is None]
    for p in fn.params:
        if p.tensor_kind is not None:
            if tensor_dims(p.type_name) is None:
                return (
                    f"tensor parameter '{p.name}' ({p.type_name}): only float tensors are generated"
                )
        elif p.io != "in" or not (p in index[:1] or p.type_name in _FIXED):
            return (
                f"parameter '{p.name}' ({p.io} {p.type_name}) beside tensor parameters: only "
                "an index, float numbers and further ints (held fixed) are generated"
            )
    if fn.signature.return_type not in ("void", "float"):
        return (
            f"result type {fn.signature.return_type}: only float or void results are checked "
            "with tensor parameters"
        )
    if not any(p.is_diff_tensor and p.access in ("read", "read_write") for p in fn.params):
        return "no differentiable tensor input (DiffTensor, IDiffTensor or FwdDiffTensor) to check"
    return None


#: Elements before and past each tensor that the size probe fills (fitting_setup): a read
#: further out goes unseen (Vulkan reads 0 there, a GPU whatever memory holds).
HEAD, SLACK = 64, 8192
#: The largest tensor the size probe tries, in elements: a shader that still reads outside
#: that is refused (the check perturbs one element at a time, six calls each: a 1024-element
#: tensor over a 1024-thread grid took 20 s on lavapipe with four, 4096 six minutes).
PROBE_MAX_ELEMENTS = 1024
#: The two fillings compared: a function reading outside its tensors sees them differ
#: (random values in the sampled range: a tent or max(-x, 0) that is 0 at chosen values
#: reads a draw where it is not).
FILLS = tuple(
    np.random.default_rng(seed).uniform(-1.5, 1.5, HEAD + SLACK).astype(np.float32)
    for seed in (101, 202)
)


def reads_past_the_end(setup: "_Setup") -> bool:
    """Whether ``setup``'s call reads outside its tensors: its outputs change when what lies
    before and past them does (``FILLS``).

        reads_past_the_end(_Setup(m.residual_sq, dev, 4, rng))   # True: it reads 32
    """
    first, second = (setup.with_slack(v).run(setup.values) for v in FILLS)
    setup.with_slack(None)
    return any(not np.array_equal(first[k], second[k], equal_nan=True) for k in first)


def fitting_setup(fn: ShaderFunction, device: Device, size: int, seed: int) -> "_Setup":
    """The arguments at ``size`` elements per axis, doubled until the function reads nothing
    past its tensors' ends (a shader that loops over a fixed count, as samples/pinn_poisson's
    32 units, gets tensors of that size). Checked at a size it overran, a function's
    results held whatever memory followed its tensors: zeros on Vulkan, earlier tests'
    leftovers on CUDA (a wrong check, found on an H200). ValueError if no size fits.

        setup = fitting_setup(m.residual_sq, device, 4, seed=0)   # setup.size: 32
    """
    while True:
        setup = _Setup(fn, device, size, np.random.default_rng(seed))
        if not reads_past_the_end(setup):
            return setup
        dims = _shared_dims(fn)
        if (2 * size) ** dims > PROBE_MAX_ELEMENTS:
            raise ValueError(
                f"{fn.name}: reads past the end of its tensor arguments at every size tried "
                f"(up to {size} elements per axis, shared by every tensor argument: "
                f"{size**dims} for a {dims}-D one): what lies outside a tensor changes its "
                "results. Check its loops and indices against the tensors' "
                "shapes, or check it with pydiff.gradcheck on tensors of the shapes it reads"
            )
        size *= 2


def _shared_dims(fn: ShaderFunction) -> int:
    """The most axes of a tensor argument: the size per axis, shared by every tensor
    argument, is bounded by that one's element count."""
    return max((tensor_dims(p.type_name) or 1 for p in fn.params if p.tensor_kind), default=1)


class _Setup:
    """Builds the arguments of one call and reads its outputs back."""

    def __init__(self, fn: ShaderFunction, device: Device, size: int, rng: np.random.Generator):
        self.fn, self.device, self.size = fn, device, size
        self.slack: Any = None  # what lies outside each tensor (FILLS), when set
        self.rng = rng
        self.index = next(
            (p for p in fn.params if p.tensor_kind is None and index_dims(p.type_name) is not None),
            None,
        )
        self.grid_shape = (size,) * index_dims(self.index.type_name) if self.index else ()
        # Read-write (in-place) tensors are inputs and outputs: each call gets fresh tensors
        # of the values, so a call's writes never reach the next one.
        self.inputs = [p for p in fn.params if p.tensor_kind is not None and p.reads_value]
        self.outputs = [p for p in fn.params if p.tensor_kind is not None and p.access != "read"]
        self.numbers: dict[str, float | int] = {
            p.name: float(rng.uniform(0.5, 1.5))
            if p.type_name == "float"
            else int(rng.integers(1, 4))  # a further int: 1 to 3 whatever the size (an index)
            for p in fn.params
            if p.tensor_kind is None and p is not self.index
        }
        self.values = {}
        for p in self.inputs:
            shape = (size,) * tensor_dims(p.type_name)
            # half negative, shuffled: a sign by position left column 0 of an (n, 4) tensor,
            # or every even element, always positive (a breaker's wrong leaky-relu passed)
            sign = np.resize([1.0, -1.0], int(np.prod(shape)))
            rng.shuffle(sign)
            self.values[p.name] = rng.uniform(0.2, 1.5, shape) * sign.reshape(shape)

    def with_slack(self, value: Any) -> "_Setup":
        self.slack = value
        return self

    def tensor(self, values: np.ndarray) -> Tensor:
        """A float32 tensor of ``values``; with ``slack`` set, a view into a buffer with
        ``HEAD`` elements before and ``SLACK`` after it holding that filling (one of
        ``FILLS``), so that what a function reads outside a tensor shows in its
        results (on every backend: outside the buffer, Vulkan reads 0, CUDA whatever memory
        holds)."""
        values = values.astype(np.float32)
        if self.slack is None:
            return make_tensor(values, device=self.device)
        fill = self.slack
        padded = np.concatenate([fill[:HEAD], values.ravel(), fill[HEAD:]])
        base = make_tensor(padded, device=self.device)
        view = base.native.view(values.shape, offset=HEAD)
        return Tensor(view, self.device, storage=base.storage)

    def args(
        self,
        values: dict[str, np.ndarray],
        grads: bool = False,
        upstream: dict[str, np.ndarray] | None = None,
    ) -> tuple[list, dict[str, Tensor]]:
        args, made = [], {}
        for p in self.fn.params:
            if p is self.index:
                args.append(spy.grid(self.grid_shape))
            elif p.name in self.numbers:
                args.append(self.numbers[p.name])
            elif p in self.inputs:
                t = self.tensor(values[p.name])
                if (grads and p.is_diff_tensor) or p.tensor_kind == "diff":
                    t.requires_grad_(True)
                if grads and p in self.outputs and upstream is not None:
                    up = make_tensor(upstream[p.name].astype(np.float32), device=self.device)
                    t = t.with_grads(grad_in=up, grad_out=t.grad)  # separate: read and written
                made[p.name] = t
                args.append(t)
            else:
                t = self.tensor(np.zeros((self.size,) * tensor_dims(p.type_name)))
                if grads or p.tensor_kind == "diff":
                    t = t.with_grads()
                    if upstream is not None:
                        t.grad_in.copy_from_numpy(upstream[p.name])
                made[p.name] = t
                args.append(t)
        return args, made

    def run(self, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        args, made = self.args(values)
        out = {}
        if self.fn.signature.return_type != "void":
            if self.grid_shape:
                result = self.fn(*args, _result="tensor").numpy()
            else:
                result = self.fn(*args)  # one call: SlangPy returns the number itself
            out["(result)"] = np.asarray(result, np.float64).reshape(self.grid_shape or (1,))
        else:
            self.fn(*args)
        for p in self.outputs:
            out[p.name] = made[p.name].numpy().astype(np.float64)
        return out


def check_tensor_function(
    fn: ShaderFunction,
    device: Device,
    *,
    size: int = 4,
    seed: int = 0,
    eps: float = 1e-3,
    atol: float = 1e-3,
    rtol: float = 1e-2,
    row: Callable[..., Any],
) -> list[Any]:
    """Backward rows (one per differentiable input tensor) and the adjoint row, each made by
    ``row(parameter, mode, ad, fd, valid, finite, atol=..., unresolved=..., note=...)`` from
    AD, FD, the entries compared and those left out as outside the domain, atol widened per
    entry by how far float32 rounding of the outputs the step moved can shift the difference
    (``along``), entries it cannot resolve left out (``unresolved``). When every row passes
    at ``size`` (or the size the function needs), a second probe at a larger size
    (``larger_size``: 31 per axis for 1-D tensors, 15 for 2-D, 7 for 3-D) perturbs a sample
    of the elements the first left out (``sampled_elements``); its entries join the rows.

        rows = check_tensor_function(m.dense, device, row=lambda *a, **kw: a[:2])
    """
    setup = fitting_setup(fn, device, size, seed)
    probes, why_not = [_measure(setup, eps, atol, rtol)], ""
    if not any(e.worst(rtol) for e in probes[0].values()):  # (a failing row is said already)
        larger, why_not = _larger_setup(fn, device, setup.size, seed)
        if larger is not None:
            elements = {
                p.name: sampled_elements(larger.values[p.name].shape, setup.size, larger.rng)
                for p in larger.inputs
                if p.is_diff_tensor
            }
            probes.append(_measure(larger, eps, atol, rtol, elements))
    numbers = [k for k, v in setup.numbers.items() if isinstance(v, float)]
    held = f"float parameter(s) {', '.join(map(repr, numbers))} held fixed: not checked" * bool(
        numbers
    )
    rows = []
    for name in probes[0]:
        e = Entries.join([probe[name] for probe in probes])
        note = "; ".join(n for n in (e.notes(), e.worst(rtol), why_not) if n)
        parameter, mode = (name, "backward") if name != "(all)" else (name, "adjoint")
        result = row(
            parameter, mode, e.ad, e.numeric, e.valid, e.finite, atol=e.atol,
            unresolved=e.unresolved, note=note,
        )  # fmt: skip
        if e.excused and result.status == "PASS":
            result.status = "SKIPPED"
            result.why = "; ".join(w for w in (e.excused_note(), result.why) if w)
        if e.unresolved and not e.valid.any():  # (not the domain's doing, nor kinks')
            result.why = result.why.replace(SMOOTH_NOWHERE, "no element the step can resolve")
        if held:
            result.why = "; ".join(w for w in (result.why, held) if w)
        rows.append(result)
    return rows


def _larger_setup(fn: ShaderFunction, device: Device, size: int, seed: int) -> tuple:
    """The second probe's arguments (None where no larger size fits the bounds) and why it
    was not run, when that is worth saying: a function reading past its tensors' ends at
    the larger size is not checked there (its results would hold what lies outside)."""
    larger = larger_size(size, _shared_dims(fn), PROBE_MAX_ELEMENTS)
    if larger is None:  # (every first size is a multiple of 4: a larger probe was due)
        return None, f"not checked past {size} per axis (a larger size exceeds the bounds)"
    setup = _Setup(fn, device, larger, np.random.default_rng([seed, larger]))
    if reads_past_the_end(setup):
        return None, f"not checked at {larger} per axis: it reads past its tensors' ends there"
    return setup, ""


def _measure(
    setup: "_Setup", eps: float, atol: float, rtol: float, elements: dict | None = None
) -> dict[str, Entries]:
    """Per differentiable input (and "(all)": the adjoint test) the entries at ``setup``'s
    size, perturbing the flat ``elements`` of each input (all by default). Output elements
    that are NaN or infinite are left out of <v, outputs> (v is 0 there), and the entries
    still not finite on either side then (a NaN thread's backward times 0) as outside the
    domain: the rest is checked, as the scalar path checks the finite points."""
    rng = setup.rng
    base = setup.run(setup.values)
    upstream = {k: rng.uniform(-1.0, 1.0, v.shape) for k, v in base.items()}
    kept = {k: np.isfinite(v) for k, v in base.items()}
    dropped = sum(int((~m).sum()) for m in kept.values())
    total = sum(m.size for m in kept.values())
    upstream = {k: np.where(kept[k], v, 0.0) for k, v in upstream.items()}
    where = f"{setup.size} per axis"
    dropped_note = [f"{dropped} of {total} at {where}"] * bool(dropped)

    # One output at a time: a large, right Jacobian entry of one output must not hide a small
    # wrong one of another in <v, outputs> (a breaker's 1000 x beside a 50% wrong square).
    outputs = list(base)
    analytic = {o: _analytic(setup.fn, setup, _only(upstream, o)) for o in outputs}

    found: dict[str, Entries] = {}
    diff_inputs = [p for p in setup.inputs if p.is_diff_tensor]
    for p in diff_inputs:
        shape = setup.values[p.name].shape
        chosen = elements_of(p.name, elements, setup.values)
        (d1, r1), (d2, r2) = per_element(setup, upstream, p.name, (eps, eps / 4), chosen)
        joined = [np.concatenate([x[o] for o in outputs]) for x in (d1, r1, d2, r2)]
        ad = np.concatenate([analytic[o][p.name].reshape(-1)[chosen] for o in outputs])
        # kinks: the two steps may disagree by 2 roundings (not ROUNDINGS: a pairwise
        # |x_j - x_i| with a pair 3e-4 apart went unseen under the comparison's allowance)
        noise = 2 / ROUNDINGS * (joined[1] + joined[3])
        smooth = fd.smooth(joined[0], joined[2], atol + noise, rtol)
        finite = np.ones(ad.size, bool)
        excused = 0
        if dropped:
            any_kept = np.repeat([kept[o].any() for o in outputs], chosen.size)
            finite = any_kept & np.isfinite(joined[0]) & np.isfinite(joined[2]) & np.isfinite(ad)
            # a derivative not finite where the differences are: a NaN thread's backward times
            # 0, or a wrong derivative beside an unrelated NaN output (a breaker's x * x): the
            # row cannot PASS (check_tensor_function makes it SKIPPED, saying why)
            excused = int((any_kept & np.isfinite(joined[0]) & ~np.isfinite(ad)).sum())
        blind = unresolved(joined[0], ad, joined[1], atol)
        labels = [
            element_label(p.name, np.unravel_index(k, shape), o, where)
            for o in outputs
            for k in chosen
        ]
        found[p.name] = Entries(
            ad, joined[0], smooth & finite & ~blind, finite, atol + joined[1], labels,
            int((blind & smooth & finite).sum()), dropped_note, excused,
        )  # fmt: skip
    # adjoint: <J u, v> along one random direction u over all differentiable inputs, less
    # the elements whose entries were left out (not finite)
    u = {p.name: rng.uniform(-1.0, 1.0, setup.values[p.name].shape) for p in diff_inputs}
    for p in diff_inputs if dropped else ():
        left_out = ~found[p.name].finite.reshape(len(outputs), -1).all(axis=0)
        u[p.name].reshape(-1)[elements_of(p.name, elements, u)[left_out]] = 0.0
    ((d, r),) = along(setup, upstream, u, (eps,))
    ju_v, rounding = sum(d.values()), sum(r.values())
    u_jtv = sum(
        float(fd.dot(u, {k: np.where(u[k] != 0, g[k], 0.0) for k in u})) for g in analytic.values()
    )
    blind = unresolved(np.array([ju_v]), np.array([u_jtv]), np.array([rounding]), atol)
    directions = any(np.any(v != 0) for v in u.values())  # (all left out: nothing to compare)
    finite = np.array(
        [not dropped or bool(np.isfinite(ju_v + u_jtv) and dropped < total and directions)]
    )
    found["(all)"] = Entries(
        np.array([u_jtv]), np.array([ju_v]), finite & ~blind, finite,
        np.array([atol + rounding]), [f"the {setup.size}-per-axis probe"],
        int(blind[0] and finite[0]), dropped_note,
    )  # fmt: skip
    return found


def elements_of(name: str, elements: dict | None, values: dict) -> np.ndarray:
    """The flat indices of input ``name`` a probe perturbs: ``elements[name]``, else all."""
    return np.arange(values[name].size) if elements is None else elements[name]


def _only(upstream: dict, output: str) -> dict:
    """``upstream`` on ``output`` alone (zeros elsewhere)."""
    return {k: v if k == output else np.zeros_like(v) for k, v in upstream.items()}


def _analytic(fn: ShaderFunction, setup: "_Setup", upstream: dict) -> dict[str, np.ndarray]:
    """Each differentiable input's gradient from ``.bwds`` with ``upstream`` on the outputs."""
    args, made = setup.args(setup.values, grads=True, upstream=upstream)
    kwargs = {}
    if fn.signature.return_type != "void" and setup.grid_shape:
        res = fn(*args, _result="tensor").with_grads()
        res.grad_in.copy_from_numpy(upstream["(result)"])
        kwargs["_result"] = res
    elif fn.signature.return_type != "void":
        kwargs["_result"] = float(upstream["(result)"][0])  # one call: a number seeds it
    fn.bwds(*args, **kwargs)
    return {
        p.name: made[p.name].grad.numpy().astype(np.float64)
        for p in setup.inputs
        if p.is_diff_tensor
    }
