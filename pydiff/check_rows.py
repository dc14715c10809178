"""The rows of ``pydiff check``'s report (``CheckResult``) and the rows of its checks along
a direction: forward mode (``forward_row``) and, for a function with parameters checked at
different precisions, the worst of the rows of each block of them (``worst_row``).

A ``half`` parameter beside ``float`` ones loosened the adjoint and forward rows of all of
them before 2026-11-29: a ``[ForwardDerivative]`` 2% off in a float parameter PASSed
beside a half one. Each block (parameters at half's tolerances, the others) is now checked
along its own direction, at its own tolerances.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from . import finite_diff as fd
from .sampling import Layout


@dataclass
class CheckResult:
    """One row of the report: a (function, parameter, mode) check and its outcome."""

    function: str
    parameter: str
    mode: str  # "backward", "forward", "adjoint" or "-" for a skipped function
    status: str  # "PASS", "FAIL", "SKIPPED", or "ERROR" (the call itself failed)
    max_abs_error: float | None = None
    max_rel_error: float | None = None
    points: int = 0
    near_kinks: int = 0
    outside_domain: int = 0
    why: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The row as strict-JSON values: a NaN or infinite error becomes the string
        "nan", "inf" or "-inf" (bare NaN is not JSON)."""
        return {
            k: (repr(v) if isinstance(v, float) and not np.isfinite(v) else v)
            for k, v in asdict(self).items()
        }


def row(
    function: str,
    parameter: str,
    mode: str,
    cmp: fd.Comparison | None,
    valid: np.ndarray,
    finite: np.ndarray | None = None,
    unit: str = "sample point",
) -> CheckResult:
    """A report row; of the valid.size points (or elements) the invalid ones are outside the
    domain (not finite) or near kinks."""
    used = int(valid.sum())
    outside = 0 if finite is None else int((~finite).sum())
    counts = dict(near_kinks=valid.size - used - outside, outside_domain=outside)
    if cmp is None:
        why = f"no {unit} where the function is finite and smooth"
        return CheckResult(function, parameter, mode, "SKIPPED", why=why, **counts)
    status = "FAIL" if cmp.failed else "PASS"
    why = ""
    if cmp.nonfinite:
        why = (
            f"the derivative is NaN or infinite at {cmp.nonfinite} {unit}(s) where finite "
            "differences are finite"
        )
    return CheckResult(
        function, parameter, mode, status, cmp.max_abs, cmp.max_rel, used, why=why, **counts
    )


def forward_row(
    layout: Layout, device, values, u, d1, d2, valid, points, atol, rtol, finite, base
) -> CheckResult:
    fn = layout.fn
    args, made = layout.arguments(values, points, device)
    for key, direction in u.items():
        made[key].with_tangent(direction)
    try:
        result = fn.fwds(*args)
    except Exception as exc:  # e.g. a result type forward mode cannot return
        why = f"forward mode unavailable: {str(exc).splitlines()[0]}"
        return CheckResult(fn.name, "(all)", "forward", "SKIPPED", why=why)
    pairs = [tuple(result)] if fn.signature.return_type != "void" else []
    pairs += [(made[leaf.key], made[leaf.key].tangent) for leaf in layout.outputs()]
    got, jvp = (
        np.concatenate([p[k].numpy().astype(np.float64).reshape(points, -1) for p in pairs], 1)
        for k in (0, 1)
    )
    fd_u, small = np.concatenate(d1, axis=1), np.concatenate(d2, axis=1)
    ok = valid & np.all(fd.smooth(fd_u, small, atol, rtol), axis=1)
    cmp = fd.compare(jvp, fd_u, np.repeat(ok[:, None], fd_u.shape[1], axis=1), atol, rtol)
    result = row(fn.name, "(all)", "forward", cmp, ok, finite)
    want = np.concatenate(base, axis=1)  # its value too: a wrong one passed before
    off = fd.compare(got, want, np.repeat(finite[:, None], want.shape[1], axis=1), atol, rtol)
    if off is not None and off.failed:
        result.status, result.why = (
            "FAIL",
            f"forward value is not the function's (off {off.max_abs:.3g})",
        )
    return result


def worst_row(rows: list[tuple[bool, CheckResult]], blocks: int) -> CheckResult:
    """One row of (half, row) pairs, one per block of parameters: the one that FAILs (saying
    which block), else the one of the largest error; the row itself where there is one."""
    if blocks == 1:
        return rows[0][1]
    for h, r in rows:
        if r.status == "FAIL":
            where = f"along the {'half' if h else 'float'} parameters (checked apart)"
            r.why = f"{r.why}; {where}" if r.why else where
            return r
    return max((r for _, r in rows), key=lambda r: r.max_abs_error or 0.0)
