"""Check every [Differentiable] function of a Slang file against finite differences.

    results = check_module("my_shaders.slang", seed=0)
    print(format_table(results))        # function, parameter, errors, PASS/FAIL/SKIPPED
    any(r.status == "FAIL" for r in results)

Each function is called vectorised over ``points`` random sample points (half positive, half
negative, none near 0). Threads are independent, so perturbing one input component at every
point at once gives every point's central difference from two calls. A point where the
difference with step eps and with eps/4 disagree lies near a kink (or a discontinuity) and
is left out; points where the function is not finite are outside its domain and left out too.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Callable

import numpy as np

from . import finite_diff as fd
from . import tensorcheck, tensorcheck_entries
from .device import Device, resolve_device
from .file_argument import existing_file
from .module import OverloadedFunction, ShaderFunction
from .module_files import load_module
from .creation import tensor as make_tensor
from .sampling import Layout, value_shape
from .check_rows import CheckResult, forward_row, worst_row
from .check_rows import row as _row

#: The most sample points a function is checked at (``--points``). More buys nothing, as a
#: wrong derivative is wrong at nearly every point, while memory and time grow in proportion
#: (here about 0.5 GB and seconds for tests/shaders/check_good.slang; 10^10 points asked for
#: 75 GB at once), and so does the chance of a point closer to a kink than the kink test
#: sees, which FAILs a correct function.
MAX_POINTS = 65536


class _Sampler:
    """Calls one function on NumPy inputs (one row per sample point) and returns its
    outputs: the result, then out and inout parameters. Arguments are built afresh each
    call, so an inout argument always starts from the values given."""

    def __init__(self, layout: Layout, device: Device, points: int):
        self.layout, self.device, self.points = layout, device, points
        self.fn = layout.fn

    def run(self, values: dict[str, np.ndarray]) -> list[np.ndarray]:
        args, made = self.layout.arguments(values, self.points, self.device)
        outs = []
        if self.fn.signature.return_type != "void":
            outs.append(self.fn(*args, _result="tensor"))
        else:
            self.fn(*args)
        outs += [made[leaf.key] for leaf in self.layout.outputs()]
        return [o.numpy().astype(np.float64).reshape(self.points, -1) for o in outs]


def _analytic_vjp(
    layout: Layout,
    device: Device,
    values: dict[str, np.ndarray],
    upstream: list[np.ndarray],
    points: int,
) -> dict[str, np.ndarray]:
    """J^T v by the function's own .bwds, per checked leaf. The bwds arguments hold the
    sampled values (never run forward first: an inout argument would hold the written
    value); the upstream gradients of outputs go in as separate grad_in buffers."""
    fn = layout.fn
    args, made = layout.arguments(values, points, device, grads=True)
    at = 0 if fn.signature.return_type == "void" else 1
    for leaf in layout.outputs():
        t = made[leaf.key]
        up = make_tensor(
            upstream[at].reshape((points,) + leaf.elem).astype(np.float32),
            dtype=leaf.dtype,
            device=device,
        )
        grad_out = t.grad if t.requires_grad else None
        view = t.with_grads(grad_in=up, grad_out=grad_out)
        args[[p.name for p in fn.params].index(leaf.key)] = view
        made[leaf.key] = view
        at += 1
    kwargs = {}
    if fn.signature.return_type != "void":
        dtype, elem = value_shape(fn.signature.return_type)
        res = make_tensor(np.zeros((points,) + elem, np.float32), dtype=dtype, device=device)
        res = res.with_grads()
        res.grad_in.copy_from_numpy(upstream[0].reshape((points,) + elem))
        kwargs["_result"] = res
    fn.bwds(*args, **kwargs)
    return {
        leaf.key: made[leaf.key].grad.numpy().astype(np.float64).reshape(points, -1)
        for leaf in layout.checked()
    }


def check_function(
    fn: ShaderFunction,
    device: Device,
    *,
    seed: int = 0,
    points: int = 16,
    eps: float = 1e-3,
    atol: float = 1e-3,
    rtol: float = 1e-2,
    forward: bool | str = True,
    backward: bool = True,
) -> list[CheckResult]:
    """Backward (per differentiable parameter or struct field), adjoint and forward checks
    of one function; ``backward=False`` for a function with only a ``[ForwardDerivative]``
    (forward mode checked, backward rows SKIPPED); ``forward`` a string: the forward row
    SKIPPED with that reason. Steps and tolerances follow half
    precision where a checked input or an output is half (``finite_diff.for_precision``).

    rows = check_function(load_module("my_shaders.slang").f, resolve_device(None))
    """
    name = fn.name
    if any(p.tensor_kind is not None for p in fn.params):
        return _check_with_tensors(fn, device, seed=seed, eps=eps, atol=atol, rtol=rtol)
    layout = Layout.of(fn)
    if isinstance(layout, str):
        return [CheckResult(name, "-", "-", "SKIPPED", why=layout)]
    checked = layout.checked()
    if not checked:
        return [CheckResult(name, "-", "-", "SKIPPED", why="no differentiable parameter")]
    given = (atol, rtol)  # a float leaf's tolerances (Layout.half_leaf)
    eps, second, atol, rtol = fd.for_precision(eps, atol, rtol, layout.half_precision())
    no_bwds = layout.no_gradients() if backward else _ONE_SIDED["forward"]  # double inputs
    backward = backward and no_bwds is None
    rng = np.random.default_rng(seed)
    sampler = _Sampler(layout, device, points)
    values = layout.random_values(points, rng)
    base = sampler.run(values)
    finite = np.all([np.all(np.isfinite(o), axis=1) for o in base], axis=0)
    upstream = [rng.uniform(-1.0, 1.0, o.shape) for o in base]

    def project(outs: list[np.ndarray]) -> np.ndarray:  # <v, f> per point
        return fd.dot(upstream, outs, axis=1)

    results: list[CheckResult] = []
    analytic = _analytic_vjp(layout, device, values, upstream, points) if backward else {}
    for leaf in checked if backward else ():
        lt = (atol, rtol) if layout.half_leaf(leaf) else given  # steps eps, eps/4: all points
        d1, d2 = (
            fd.per_element(sampler.run, values, leaf.key, h, batch=1, project=project)
            for h in (eps, second)
        )
        valid = finite & np.all(fd.smooth(d1, d2, *lt), axis=1)
        cmp = fd.compare(
            analytic[leaf.key], d1, np.repeat(valid[:, None], d1.shape[1], axis=1), *lt
        )
        results.append(_row(name, leaf.key, "backward", cmp, valid, finite))

    # adjoint (dot-product) test and forward mode along one random direction u, per block
    # of parameters checked at one precision (a half one loosened a float one's: to 11-29)
    u = layout.direction(rng)
    tols = {True: (atol, rtol), False: given}
    blocks: dict[bool, list[str]] = {}
    for leaf in checked:
        blocks.setdefault(layout.half_leaf(leaf), []).append(leaf.key)
    adjoint, fwd = [], []
    for h, keys in blocks.items():
        ub = {k: u[k] for k in keys}
        d1, d2 = (fd.central(sampler.run, values, ub, step) for step in (eps, second))
        ju1 = project(d1)
        valid = finite & fd.smooth(ju1, project(d2), *tols[h])
        if backward:
            ut_jtv = fd.dot({k: ub[k].reshape(points, -1) for k in ub}, analytic, axis=1)
            cmp = fd.compare(ut_jtv, ju1, valid, *tols[h])
            adjoint.append((h, _row(name, "(all)", "adjoint", cmp, valid, finite)))
        if not (isinstance(forward, str) and backward) and (forward or not backward):
            at = (layout, device, values, ub, d1, d2, valid, points, *tols[h], finite, base)
            fwd.append((h, forward_row(*at)))
    if backward:
        results.append(worst_row(adjoint, len(blocks)))
    else:
        results.append(CheckResult(name, "(all)", "backward", "SKIPPED", why=no_bwds))
    if isinstance(forward, str) and backward:
        results.append(CheckResult(name, "(all)", "forward", "SKIPPED", why=forward))
    elif fwd:
        results.append(worst_row(fwd, len(blocks)))
    return results


def _check_with_tensors(
    fn: ShaderFunction, device: Device, *, seed: int, eps: float, atol: float, rtol: float
) -> list[CheckResult]:
    """Functions taking whole tensors and an index: see pydiff.tensorcheck."""
    why = tensorcheck.skip_reason(fn)
    if why:
        return [CheckResult(fn.name, "-", "-", "SKIPPED", why=why)]

    given_atol = atol

    def row(parameter, mode, ad, numeric, valid, finite, atol=atol, **notes) -> CheckResult:  # noqa: ANN001
        cmp = fd.compare(ad, numeric, valid, atol, rtol)
        result = _row(fn.name, parameter, mode, cmp, valid, finite, unit="element")
        note = tensorcheck_entries.widened(atol, valid, given_atol, **notes)  # (said, not hidden)
        result.why = "; ".join(w for w in (result.why, note) if w)
        return result

    return tensorcheck.check_tensor_function(
        fn, device, seed=seed, eps=eps, atol=atol, rtol=rtol, row=row
    )


def differentiable_functions(module: Any) -> list[ShaderFunction]:
    """The [Differentiable] functions of a loaded module, overloads one by one.

    [f.name for f in differentiable_functions(load_module("my_shaders.slang"))]
    """
    found = []
    for name in module.function_names():
        fn = getattr(module, name)
        overloads = fn.overloads if isinstance(fn, OverloadedFunction) else [fn]
        found += [f for f in overloads if f.differentiable]
    return found


_GENERIC = re.compile(
    r"\[\s*Differentiable\s*\](?:\s*\[[^\]]*\])*\s*(?:public\s+)?[\w<>,\s]+?\s+(\w+)\s*"
    r"<(?:[^<>()]|<[^<>()]*>)*>\s*\("  # (a constraint may be generic: T : IArray<float>)
)


def _generic_differentiable(path: Path, module: Any) -> list[str]:
    """Names of [Differentiable] generic functions (Slang reflection does not list them)."""
    try:
        text = re.sub(r"//[^\n]*", "", path.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return []
    known = set(module.function_names())
    return sorted({m.group(1) for m in _GENERIC.finditer(text)} - known)


_DECL = re.compile(r"((?:\[[^\]]*\]\s*)+)(?:public\s+)?[\w<>,\s]+?\b(\w+)\s*\(")
_ONE_SIDED = {
    "forward": (
        "no backward derivative: the function has a [ForwardDerivative] only (not "
        "[Differentiable], no [BackwardDerivative]), so .bwds cannot run; checked in "
        "forward mode"
    ),
    "backward": (
        "no forward derivative: the function has a [BackwardDerivative] only (not "
        "[Differentiable], no [ForwardDerivative]), so .fwds cannot run; checked by "
        "backward and adjoint"
    ),
}


def _one_sided(path: Path) -> dict[str, str]:
    """Functions with a hand-written derivative in one direction only, and not
    [Differentiable] (which would derive the other): name -> "forward" or "backward"."""
    try:
        text = re.sub(r"//[^\n]*", "", path.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return {}
    found = {}
    for m in _DECL.finditer(text):
        attrs, name = m.group(1), m.group(2)
        if re.search(r"\bDifferentiable\b", attrs):
            continue
        fwd = re.search(r"\bForwardDerivative\s*\(", attrs) or re.search(
            rf"ForwardDerivativeOf\s*\(\s*{name}\s*\)", text
        )
        bwd = re.search(r"\bBackwardDerivative\s*\(", attrs) or re.search(
            rf"BackwardDerivativeOf\s*\(\s*{name}\s*\)", text
        )
        if bool(fwd) != bool(bwd):
            found[name] = "forward" if fwd else "backward"
    return found


def check_module(
    path: str | Path,
    functions: list[str] | None = None,
    device: Device | str | None = None,
    seed: int = 0,
    points: int = 16,
    eps: float = 1e-3,
    atol: float = 1e-3,
    rtol: float = 1e-2,
    progress: Callable[[str], None] | None = None,
) -> list[CheckResult]:
    """Check every [Differentiable] function of ``path`` (or those named in ``functions``).

    failed = [r for r in check_module("my_shaders.slang", ["f"]) if r.status == "FAIL"]
    """
    fd.check_settings("check_module", eps, atol, rtol)
    if isinstance(points, bool) or not isinstance(points, int) or not 1 <= points <= MAX_POINTS:
        raise ValueError(
            f"check_module: points={points!r} must be a whole number from 1 to {MAX_POINTS}"
        )
    path = existing_file(path, "check_module")  # not a name on the search path
    dev = resolve_device(device)
    module = load_module(path, device=dev)
    found = differentiable_functions(module)
    generic = _generic_differentiable(Path(path), module)  # (reported, not sampled)
    if functions:
        names = {f.name for f in found}
        missing = [n for n in functions if n not in names and n not in generic]
        if missing:
            raise ValueError(
                f"{path}: no [Differentiable] function named {', '.join(missing)} "
                f"(it has: {', '.join(sorted(names)) or 'none'})"
            )
        found = [f for f in found if f.name in functions]
    results = []
    one_sided = _one_sided(Path(path))
    for name in generic:
        if not functions or name in functions:
            results.append(
                CheckResult(
                    name,
                    "-",
                    "-",
                    "SKIPPED",
                    why="generic function: pydiff check cannot choose its type arguments",
                )
            )
    for fn in found:
        if progress:
            progress(fn.name)
        try:
            results += check_function(
                fn,
                dev,
                seed=seed,
                points=points,
                eps=eps,
                atol=atol,
                rtol=rtol,
                backward=one_sided.get(fn.name) != "forward",
                forward=_ONE_SIDED["backward"] if one_sided.get(fn.name) == "backward" else True,
            )
        except Exception as exc:  # report it with the others rather than stop the whole check
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            first = " ".join(x.strip() for x in lines[: 2 if lines[0].endswith(":") else 1])
            results.append(
                CheckResult(fn.name, "-", "-", "ERROR", why=f"{type(exc).__name__}: {first}")
            )
    return results


def format_table(results: list[CheckResult]) -> str:
    """The report as an aligned text table, one row per result.

    print(format_table(check_module("my_shaders.slang")))
    """
    head = ("function", "parameter", "mode", "max abs err", "max rel err", "points", "status")
    rows = [head]

    def err(v: float | None) -> str:
        return "-" if v is None else f"{v:.2e}"

    for r in results:
        status = r.status + (f": {r.why}" if r.why else "")
        left_out = [f"{r.near_kinks} near kinks"] * bool(r.near_kinks) + [
            f"{r.outside_domain} outside the domain"
        ] * bool(r.outside_domain)
        kinks = f" ({', '.join(left_out)})" if left_out else ""
        rows.append(
            (
                r.function,
                r.parameter,
                r.mode,
                err(r.max_abs_error),
                err(r.max_rel_error),
                f"{r.points}{kinks}",
                status,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head) - 1)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1] for row in rows
    ]
    lines.insert(1, "-" * min(120, max(len(ln) for ln in lines)))
    return "\n".join(lines)
