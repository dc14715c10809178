"""Every public op of pydiff.ops, and the optimizers' update kernels, at the edges of its
domain (issue 21, section 1): value, gradient and (where the op has one) forward-mode
derivative against float64 references, on one grid of edge inputs per op and shape class.

Grid: 0 and -0; +-1e-30 ... +-1e-6; the joints and singular points of each op and their
neighbours; +-1e4 ... +-3e38; +-inf; NaN; tied maxima (large and small); rows masked with
-inf and fully masked rows; one-element, one-row and long-row shapes.

References are closed forms in NumPy float64 (so the test runs without PyTorch); where PyTorch
is installed, ``test_closed_forms_match_torch`` checks those closed forms against PyTorch's
float64 autograd. A closed form is evaluated the stable way (tanh' = 4e/(1+e)^2 with
e = exp(-2|x|), not 1 - tanh^2, which rounds to 0 from |x| = 19 in float64).

Expected (``mismatches``): where the reference is NaN, NaN; where it rounds to +-inf in float32,
that infinity; otherwise finite and within 1e-5 relative, with an absolute floor of float32's
smallest normal number (Vulkan may flush subnormal results to zero) and, for reductions and
products, 1e-6 times the sum of the absolute values of the terms of that output: float32
pairwise/sequential summation errs by up to about log2(n) 2^-24 sum|terms|, so a sum that
cancels (1e20 + 1 - 1e20) is exact only to that scale. Conventions at points where the math
has no derivative follow PyTorch (docs/op-domains.md).
"""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import ops, optim
from pydiff.module import library

# NumPy's float64 references meet inf and NaN on purpose
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")

F32 = np.finfo(np.float32)
RNG = np.random.default_rng(21)

# The one-dimensional edge grid (float32 values; each op adds its own joints).
_MAGS = [0.0, 1e-30, 1e-20, 1e-10, 1e-6, 1e-3, 0.1, 0.5, 1.0, 2.0, 20.0, 88.0, 89.0]
_MAGS += [1e4, 1e10, 1e19, 1e20, 1e30, 3e38, F32.max, np.inf]
GRID = np.array(_MAGS + [-v for v in _MAGS] + [np.nan], np.float32)
GRID[len(_MAGS)] = -0.0  # -0 (the negated 0)


def f64(a):
    return np.asarray(a, np.float32).astype(np.float64)


def mismatches(got, ref, floor=0.0, rtol=1e-5):
    """Indices where ``got`` (float32) is not ``ref`` (float64) by the rule of this file."""
    got = np.asarray(got, np.float64).ravel()
    ref = np.asarray(ref, np.float64).ravel()
    floor = np.asarray(floor, np.float64)
    floor = floor.ravel() if floor.size == ref.size else np.broadcast_to(floor, ref.shape)
    with np.errstate(all="ignore"):
        ref32 = ref.astype(np.float32).astype(np.float64)
        close = np.abs(got - ref) <= rtol * np.abs(ref) + np.maximum(floor, F32.tiny)
        ok = np.where(
            np.isnan(ref),
            np.isnan(got),
            np.where(np.isinf(ref32), got == ref32, np.isfinite(got) & close),
        )
    return np.flatnonzero(~ok)


class Report:
    """Collects mismatches of every op checked in one test; fails once, listing them all."""

    def __init__(self):
        self.lines: list[str] = []

    def check(self, op, what, got, ref, inputs, floor=0.0):
        got_a = np.asarray(got, np.float64).ravel()
        ref_a = np.asarray(ref, np.float64).ravel()
        bad = mismatches(got_a, ref_a, floor)
        for k in bad[:6]:
            if isinstance(inputs, str):
                inp = f"{inputs}[{k}]"
            else:
                inp = inputs(k) if callable(inputs) else np.asarray(inputs).ravel()[k]
            self.lines.append(f"{op} {what} at {inp}: got {got_a[k]!r}, expected {ref_a[k]!r}")
        if len(bad) > 6:
            self.lines.append(f"{op} {what}: {len(bad) - 6} more")

    def done(self):
        assert not self.lines, "\n".join(self.lines)


def _e(x):
    return np.exp(x)


def _sech2(u):
    e = _e(-2 * np.abs(u))
    return 4 * e / (1 + e) ** 2


def _sigmoid(x):
    e = _e(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + e), e / (1 + e))


_GK, _GC = np.sqrt(2 / np.pi), 0.044715


def _gelu(x):
    # 0.5 x (1 + tanh(u)) = x sigmoid(2u): the tanh form cancels to 0 for x < -9 in float64
    return x * _sigmoid(2 * _GK * (x + _GC * x**3))


def _gelu_d(x):
    u = _GK * (x + _GC * x**3)
    du = _GK * (1 + 3 * _GC * x * x)
    # PyTorch's formula 0.5 (1 + tanh u) + 0.5 x sech^2(u) u'; where sech^2(u) is exactly 0
    # its term is 0 * x, which is NaN only where x is infinite (as in PyTorch).
    s = _sech2(u)
    term = np.where(s == 0, 0.0 * x, 0.5 * x * s * du)
    return _sigmoid(2 * u) + term


def _silu_d(x):
    s = _sigmoid(x)
    return s * (1 + x * (1 - s))


# op -> (value, derivative, extra joint points), float64 closed forms (PyTorch's conventions:
# relu'(0) = 0 and relu' = 1 at NaN, as torch.relu's backward; log'(x < 0) = 1/x; sqrt'(-0)
# = -inf).
UNARY = {
    "neg": (lambda x: -x, lambda x: -np.ones_like(x), []),
    "exp": (np.exp, np.exp, [-87.0, -104.0, 88.7, 88.73]),
    "log": (np.log, lambda x: 1 / x, [2e-38, 0.5, 0.75, 1.0 - 2**-24, 1.0 + 2**-23, 1.5, 2.0]),
    "sqrt": (np.sqrt, lambda x: 0.5 / np.sqrt(x), [2e-38, 1e-8, 1e-7, 1.1e-7]),
    "sin": (np.sin, np.cos, [np.pi, np.pi / 2, 1e5, 3e5, 1e6]),
    "cos": (np.cos, lambda x: -np.sin(x), [np.pi, np.pi / 2, 1e5, 3e5, 1e6]),
    "tanh": (np.tanh, _sech2, [0.05, 0.1, 0.55, 9.0, 10.0, 45.0]),
    "sigmoid": (_sigmoid, lambda x: _sigmoid(x) * _sigmoid(-x), [17.0, 40.0, 104.0]),
    "relu": (
        lambda x: np.where(np.isnan(x), x, np.maximum(x, 0)),
        lambda x: np.where(np.isnan(x) | (x > 0), 1.0, 0.0),
        [2e-38, -2e-38],
    ),
    "gelu": (_gelu, _gelu_d, [3.0, 5.0, -5.0, 10.0, -10.0, 1e13, 1e18]),
    "silu": (lambda x: x * _sigmoid(x), _silu_d, [-40.0, 40.0, -104.0]),
}


def _around(*points):
    """Each point and its float32 neighbours (the joints of a piecewise formula)."""
    out = []
    for p in np.array(points, np.float32):
        out += [np.nextafter(p, np.float32(-np.inf)), p, np.nextafter(p, np.float32(np.inf))]
    return [float(v) for v in out]


# The joints of pydiff's own piecewise formulas (shaders/ops/elementwise.slang): log's series
# on (0.5, 2); tanh's series below 0.1; sigmoid's branches at 0 and -80 (x_sigmoid); the
# argument reduction of sin and cos from pi/4; gelu's 2u = -80 near x = -5.4.
JOINTS = {
    "log": _around(0.5, 2.0),
    "tanh": _around(0.1, 40.0),
    "sigmoid": _around(-80.0),
    "silu": _around(-80.0),
    "gelu": _around(-5.43, -5.44),
    "sin": _around(0.78539816),
    "cos": _around(0.78539816),
}


def _grid_for(name):
    extra = UNARY[name][2] + JOINTS.get(name, [])
    return np.concatenate([GRID, np.array(extra + [-v for v in extra], np.float32)])


def _tensor(device, data, grad=True):
    return pydiff.tensor(np.asarray(data, np.float32), device=device, requires_grad=grad)


def _fwds(device, slang_name, *args):
    """The forward-mode derivative of a library function: one call per argument's tangent."""
    fn = getattr(library(device), slang_name)
    outs = []
    for k in range(len(args)):
        call = [
            pydiff.tensor(a, device=device).with_tangent(np.ones_like(a))
            if j == k
            else pydiff.tensor(a, device=device).with_tangent(np.zeros_like(a))
            for j, a in enumerate(args)
        ]
        _, dy = fn.fwds(*call)
        outs.append(dy.numpy())
    return outs


def test_unary_elementwise(device):
    rep = Report()
    for name, (f, df, _) in UNARY.items():
        xs = _grid_for(name)
        x64 = f64(xs)
        with np.errstate(all="ignore"):
            ref, dref = f(x64), df(x64)
        for shape_class, data in (("grid", xs), ("one element", xs[8:9])):
            x = _tensor(device, data)
            with pydiff.Tape() as tape:
                y = getattr(ops, name)(x)
            tape.backward(y, grad=np.ones(data.shape, np.float32))
            sel = slice(None) if shape_class == "grid" else slice(8, 9)
            rep.check(name, f"value ({shape_class})", y.numpy(), ref[sel], data)
            rep.check(name, f"gradient ({shape_class})", x.grad.numpy(), dref[sel], data)
        (dy,) = _fwds(device, f"op_{name}", xs)
        rep.check(name, "forward-mode derivative", dy, dref, xs)
    rep.done()


# binary ops on every pair of a smaller grid (one call per op)
_B = [0.0, -0.0, 1e-30, -1e-30, 1e-6, 1.0, -1.0, 2.0, 1e4, 1e20, -1e20, 3e38, -3e38]
_B += [np.inf, -np.inf, np.nan]
PA, PB = (g.ravel().astype(np.float32) for g in np.meshgrid(_B, _B, indexing="ij"))

BINARY = {
    "add": (lambda a, b: a + b, lambda a, b: (np.ones_like(a), np.ones_like(b))),
    "sub": (lambda a, b: a - b, lambda a, b: (np.ones_like(a), -np.ones_like(b))),
    "mul": (lambda a, b: a * b, lambda a, b: (b, a)),
    "div": (lambda a, b: a / b, lambda a, b: (1 / b, -a / (b * b))),
    "swiglu": (
        lambda a, b: a * _sigmoid(a) * b,
        lambda a, b: (b * _silu_d(a), a * _sigmoid(a)),
    ),
}


def test_binary_elementwise(device):
    rep = Report()
    a64, b64 = f64(PA), f64(PB)
    pairs = lambda k: (float(PA[k]), float(PB[k]))  # noqa: E731
    for name, (f, df) in BINARY.items():
        with np.errstate(all="ignore"):
            ref, (da_ref, db_ref) = f(a64, b64), df(a64, b64)
        a, b = _tensor(device, PA), _tensor(device, PB)
        with pydiff.Tape() as tape:
            y = getattr(ops, name)(a, b)
        tape.backward(y, grad=np.ones(PA.shape, np.float32))
        rep.check(name, "value", y.numpy(), ref, pairs)
        rep.check(name, "gradient of a", a.grad.numpy(), da_ref, pairs)
        rep.check(name, "gradient of b", b.grad.numpy(), db_ref, pairs)
        # forward mode is a JVP: the tangent (1, 0) gives d/da * 1 + d/db * 0, NaN where d/db
        # is infinite (as torch.func.jvp with an explicit zero tangent)
        da, db = _fwds(device, f"op_{name}", PA, PB)
        with np.errstate(all="ignore"):
            # a partial that overflows float32 is inf, times the zero tangent NaN
            da32, db32 = da_ref.astype(np.float32), db_ref.astype(np.float32)
            jvp_a, jvp_b = da_ref + db32 * 0.0, da32 * 0.0 + db_ref
            if name == "div":  # torch.func.jvp's form (ta - tb y) / b, y the float32 quotient
                y32 = f64((a64 / b64).astype(np.float32))
                jvp_a, jvp_b = (1.0 - 0.0 * y32) / b64, (0.0 - 1.0 * y32) / b64
        rep.check(name, "forward-mode d/da", da, jvp_a, pairs)
        rep.check(name, "forward-mode d/db", db, jvp_b, pairs)
    rep.done()


def test_closed_forms_match_torch():
    """The closed forms above are PyTorch's float64 autograd where both are well conditioned."""
    torch = pytest.importorskip("torch")
    fns = {
        "neg": torch.neg,
        "exp": torch.exp,
        "log": torch.log,
        "sqrt": torch.sqrt,
        "sin": torch.sin,
        "cos": torch.cos,
        "tanh": torch.tanh,
        "sigmoid": torch.sigmoid,
        "relu": torch.relu,
        "gelu": lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
        "silu": torch.nn.functional.silu,
    }
    for name, (f, df, _) in UNARY.items():
        x64 = f64(_grid_for(name))
        xt = torch.tensor(x64, requires_grad=True)
        yt = fns[name](xt)
        yt.backward(torch.ones_like(yt))
        with np.errstate(all="ignore"):
            ref, dref = f(x64), df(x64)
        y, g = yt.detach().numpy(), xt.grad.numpy()
        # torch's tanh-form gelu cancels to 0 below x = -9, and 1 - tanh^2 rounds to 0
        kept = ~np.isfinite(y) | (np.abs(y) > 1e-6)
        np.testing.assert_allclose(ref[kept], y[kept], rtol=1e-8, err_msg=name)
        # 1 - tanh^2 and friends round to 0 in float64 where the true derivative is tiny
        finite = np.isfinite(x64) & (np.abs(g) > 1e-14)
        np.testing.assert_allclose(dref[finite], g[finite], rtol=1e-7, err_msg=name)
        nan_at = np.isnan(dref) & ~np.isinf(x64)
        assert np.array_equal(nan_at, np.isnan(g) & ~np.isinf(x64)), name


# ---------------------------------------------------------------- rows: softmax family, CE
INF, NAN, BIG = np.inf, np.nan, F32.max
ROWS = np.array(
    [
        [0.0, -0.0, 1e-30, -1e-30, 1e-6, -1e-6],
        [3e38, 3e38, 3e38, -3e38, 0.0, 1.0],  # tied large maxima
        [1e10] * 6,  # all tied
        [1e-30] * 6,  # tied small
        [1e4, 1e4, -1e4, 0.0, 1e4, 1e4],
        [1e4, 1e4 + 1, 1e4 - 1, 1e4 + 2, -INF, 1e4],  # close values: the log term matters
        [-INF, 1.0, 2.0, -INF, 3.0, -INF],  # masked
        [-INF] * 6,  # fully masked
        [INF, 1.0, 2.0, 3.0, 4.0, 5.0],
        [NAN, 1.0, 2.0, 3.0, 4.0, 5.0],
        [1e20, -1e20, 1e19, 0.0, 1.0, 2.0],
        [BIG] * 6,
        [INF, INF, 0.0, 0.0, 0.0, 0.0],
        [-3e38, -3e38, -3e38, -3e38, -3e38, -3e38],
    ],
    np.float32,
)
LABELS = np.array([0, 1, 2, 3, 4, 1, 2, 1, 3, 3, 2, 5, 2, 0], np.int32)


def _shape_classes(rows):
    """(name, z) for every shape class of the row ops: the grid, one element, one row (the
    tied-large row), a long row (4099 values: ties at 1e10 with masked entries)."""
    long = np.full((1, 4099), 1e10, np.float32)
    long[0, ::7] = -INF
    long[0, 5] = 1e10 + 1024  # the next float32 above 1e10
    return [
        ("grid", rows),
        ("one element", np.array([[5.0]], np.float32)),
        ("one masked element", np.array([[-INF]], np.float32)),
        ("one row", rows[1:2]),
        ("long row", long),
    ]


def _softmax_ref(z, g, log_space):
    with np.errstate(all="ignore"):
        m = np.max(z, axis=1, keepdims=True)
        e = np.exp(z - m)
        tot = np.sum(e, axis=1, keepdims=True)
        y = (z - m) - np.log(tot)
        p = e / tot
        if log_space:
            dz = g - p * np.sum(g, axis=1, keepdims=True)
            floor = 1e-6 * (np.abs(g) + p * np.sum(np.abs(g), axis=1, keepdims=True))
            return y, dz, floor
        dot = np.sum(g * p, axis=1, keepdims=True)
        dz = p * (g - dot)
        floor = 1e-6 * p * (np.abs(g) + np.sum(np.abs(g * p), axis=1, keepdims=True))
        return p, dz, floor


def _at(z):
    return lambda k: f"row {k // z.shape[1]} {z[k // z.shape[1]].tolist()[:8]} col {k % z.shape[1]}"


def test_softmax_family(device):
    rep = Report()
    for name, log_space in (("softmax", False), ("log_softmax", True)):
        for shape_class, z in _shape_classes(ROWS):
            g = RNG.standard_normal(z.shape).astype(np.float32)
            x = _tensor(device, z)
            with pydiff.Tape() as tape:
                y = getattr(ops, name)(x)
            tape.backward(y, grad=g)
            ref, dref, floor = _softmax_ref(f64(z), f64(g), log_space)
            rep.check(name, f"value ({shape_class})", y.numpy(), ref, _at(z))
            rep.check(name, f"gradient ({shape_class})", x.grad.numpy(), dref, _at(z), floor)
            # the same rows as columns: over axis 0 (the (outer, n, inner) kernels)
            xt = _tensor(device, np.ascontiguousarray(z.T))
            with pydiff.Tape() as tape:
                y = getattr(ops, name)(xt, axis=0)
            tape.backward(y, grad=np.ascontiguousarray(g.T))
            rep.check(name, f"value, axis 0 ({shape_class})", y.numpy().T, ref, _at(z))
            what = f"gradient, axis 0 ({shape_class})"
            rep.check(name, what, xt.grad.numpy().T, dref, _at(z), floor)
    rep.done()


def _ce_ref(z, labels):
    with np.errstate(all="ignore"):
        m = np.max(z, axis=1, keepdims=True)
        tot = np.sum(np.exp(z - m), axis=1, keepdims=True)
        rows = np.arange(len(z))
        loss = (m[:, 0] - z[rows, labels]) + np.log(tot[:, 0])
        p = np.exp(z - m) / tot
        onehot = np.zeros_like(z)
        onehot[rows, labels] = 1.0
        return loss, (p - onehot) / len(z)


# Rows whose maximum is large and tied (or whose log term is small next to |max|): their
# cross-entropy loses the log term (see test_cross_entropy_tied_maxima).
CE_TIED = [1, 2, 4, 5, 11, 13]


def _check_cross_entropy(device, rep, rows, labels):
    """The loss of each row alone (a NaN row makes the mean NaN) and of the finite rows
    together; the gradient of all rows at once (each row's gradient is its own)."""
    loss_rows, dz_ref = _ce_ref(f64(rows), labels)
    x = _tensor(device, rows)
    with pydiff.Tape() as tape:
        loss = ops.cross_entropy(x, labels)
    tape.backward(loss)
    rep.check("cross_entropy", "loss (all rows)", loss.numpy(), [np.mean(loss_rows)], "all")
    rep.check("cross_entropy", "gradient (all rows)", x.grad.numpy(), dz_ref, _at(rows))
    for i in range(len(rows)):
        got = ops.cross_entropy(_tensor(device, rows[i : i + 1], grad=False), labels[i : i + 1])
        rep.check("cross_entropy", "loss (one row)", got.numpy(), [loss_rows[i]], [rows[i]])
    finite = np.isfinite(loss_rows)
    if finite.any():
        got = ops.cross_entropy(_tensor(device, rows[finite], grad=False), labels[finite])
        want = [np.mean(loss_rows[finite])]
        rep.check("cross_entropy", "loss (finite rows)", got.numpy(), want, "")


def test_cross_entropy(device):
    rep = Report()
    kept = [i for i in range(len(ROWS)) if i not in CE_TIED]
    _check_cross_entropy(device, rep, ROWS[kept], LABELS[kept])
    # a label on a masked logit: loss +inf
    _check_cross_entropy(device, rep, np.array([[-INF, 0.0, 1.0]], np.float32), np.array([0]))
    rep.done()


# Fixed: lse = m + log(sum) lost the log term when the maximum was large and tied (the loss
# of [1e10]*6 was 0.0, not log 6; its gradient 0.0714 where 0.0238); m and log(sum) are now
# kept apart (stats (B, 2)), as in softmax.slang.
def test_cross_entropy_tied_maxima(device):
    rep = Report()
    _check_cross_entropy(device, rep, ROWS[CE_TIED], LABELS[CE_TIED])
    long = _shape_classes(ROWS)[-1][1]
    _check_cross_entropy(device, rep, long, np.array([5]))
    rep.done()


# ---------------------------------------------------------------- norms and silu_and_mul
NORM_ROWS = np.array(
    [
        [0.0, -0.0, 0.0, 0.0, 0.0, 0.0],
        [1e20] * 6,  # constant, large
        [1e20, -1e20, 0.0, 1.0, 2.0, 3.0],
        [1e-30, -1e-30, 2e-30, 0.0, 0.0, 0.0],
        [3e38, 3e38, -3e38, 0.0, 0.0, 0.0],
        [-3e38, -3e38, -3e38, 3e38, 3e38, 3e38],
        [1e4, 1e4 + 1, 1e4 - 1, 1e4 + 2, 1e4, 1e4 - 2],
        [1e-6, -1e-6, 0.0, 1.0, -1.0, 2.0],
        [BIG] * 6,
        [INF, 0.0, 1.0, 2.0, 3.0, 4.0],
        [NAN, 0.0, 1.0, 2.0, 3.0, 4.0],
        [-INF, INF, 0.0, 0.0, 0.0, 0.0],
    ],
    np.float32,
)
W6 = np.array([0.5, -1.5, 2.0, 1.0, -0.25, 3.0], np.float32)
B6 = np.array([0.1, 0.0, -0.3, 1.0, 2.0, -1.0], np.float32)


def _layer_norm_ref(x, w, b, g, eps):
    """Value, gradients and their floors: float32 rounds x - mean to ulp(max |x|), an error
    in xh of about 2^-24 max|x| / sd (cancellation when the mean is large against the spread),
    so each floor counts 1e-6 (|xh| + max|x| / sd) per xh it holds."""
    with np.errstate(all="ignore"):
        mu = np.mean(x, axis=1, keepdims=True)
        sd = np.sqrt(np.mean((x - mu) ** 2, axis=1, keepdims=True) + eps)
        xh = (x - mu) / sd
        e = 1e-6 * (np.abs(xh) + np.max(np.abs(x), axis=1, keepdims=True) / sd)
        gh = g * w
        c1, c2 = np.mean(gh, axis=1, keepdims=True), np.mean(gh * xh, axis=1, keepdims=True)
        dx = (gh - c1 - xh * c2) / sd
        scale = np.abs(gh) + np.mean(np.abs(gh), 1, keepdims=True)
        floor_dx = (
            1e-6 * (scale + np.abs(xh) * np.mean(np.abs(gh * xh), 1, keepdims=True))
            + e * np.mean(np.abs(gh), 1, keepdims=True)
        ) / sd
        return (
            xh * w + b,
            e * np.abs(w) + 1e-6 * np.abs(b),
            dx,
            floor_dx,
            np.sum(g * xh, axis=0),
            np.sum(np.abs(g) * e, axis=0),
            np.sum(g, axis=0),
            1e-6 * np.sum(np.abs(g), axis=0),
        )


def _rms_norm_ref(x, w, g, eps):
    with np.errstate(all="ignore"):
        r = 1 / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + eps)
        xh = x * r
        c = np.mean(w * g * xh, axis=1, keepdims=True)
        dx = r * (w * g - xh * c)
        floor_dx = (
            1e-6 * r * (np.abs(w * g) + np.abs(xh) * np.mean(np.abs(w * g * xh), 1, keepdims=True))
        )
        return xh * w, dx, floor_dx, np.sum(g * xh, axis=0), 1e-6 * np.sum(np.abs(g * xh), axis=0)


def _norm_classes():
    long = np.linspace(-3e38, 3e38, 4099, dtype=np.float32)[None, :]
    return [
        ("grid", NORM_ROWS),
        ("one element", np.array([[3e38]], np.float32)),
        ("one row", NORM_ROWS[2:3]),
        ("long row", long),
    ]


def test_layer_norm(device):
    rep = Report()
    for shape_class, x0 in _norm_classes():
        n = x0.shape[1]
        w0 = np.resize(W6, n)
        b0 = np.resize(B6, n)
        g0 = RNG.standard_normal(x0.shape).astype(np.float32)
        for affine in (True, False):
            x = _tensor(device, x0)
            w, b = (_tensor(device, w0), _tensor(device, b0)) if affine else (None, None)
            with pydiff.Tape() as tape:
                y = ops.layer_norm(x, w, b, eps=1e-5)
            tape.backward(y, grad=g0)
            wr, br = (w0, b0) if affine else (np.ones(n, np.float32), np.zeros(n, np.float32))
            ref, fy, dx, fdx, dw, fdw, db, fdb = _layer_norm_ref(
                f64(x0), f64(wr), f64(br), f64(g0), 1e-5
            )
            what = f"({shape_class}, affine={affine})"
            rep.check("layer_norm", f"value {what}", y.numpy(), ref, _at(x0), fy)
            rep.check("layer_norm", f"gradient of x {what}", x.grad.numpy(), dx, _at(x0), fdx)
            if affine:
                rep.check("layer_norm", f"gradient of weight {what}", w.grad.numpy(), dw, "w", fdw)
                rep.check("layer_norm", f"gradient of bias {what}", b.grad.numpy(), db, "b", fdb)
    rep.done()


def test_rms_norm(device):
    rep = Report()
    for shape_class, x0 in _norm_classes():
        n = x0.shape[1]
        w0 = np.resize(W6, n)
        g0 = RNG.standard_normal(x0.shape).astype(np.float32)
        x, w = _tensor(device, x0), _tensor(device, w0)
        with pydiff.Tape() as tape:
            y = ops.rms_norm(x, w, eps=1e-6)
        tape.backward(y, grad=g0)
        ref, dx, fdx, dw, fdw = _rms_norm_ref(f64(x0), f64(w0), f64(g0), 1e-6)
        rep.check("rms_norm", f"value ({shape_class})", y.numpy(), ref, _at(x0))
        rep.check("rms_norm", f"gradient of x ({shape_class})", x.grad.numpy(), dx, _at(x0), fdx)
        rep.check("rms_norm", f"gradient of weight ({shape_class})", w.grad.numpy(), dw, "w", fdw)
    rep.done()


def test_silu_and_mul(device):
    """[gate | up] rows of every pair of the binary grid: one long row, and one row per pair."""
    rep = Report()
    f, df = BINARY["swiglu"]
    with np.errstate(all="ignore"):
        ref, (dg_ref, du_ref) = f(f64(PA), f64(PB)), df(f64(PA), f64(PB))
    pairs = lambda k: (float(PA[k % len(PA)]), float(PB[k % len(PA)]))  # noqa: E731
    for shape_class, x0 in (
        ("long row", np.concatenate([PA, PB])[None, :]),
        ("one row per pair", np.stack([PA, PB], axis=1)),
    ):
        x = _tensor(device, x0)
        with pydiff.Tape() as tape:
            y = ops.silu_and_mul(x)
        tape.backward(y, grad=np.ones(y.shape, np.float32))
        dx = x.grad.numpy()
        h = x0.shape[1] // 2
        rep.check("silu_and_mul", f"value ({shape_class})", y.numpy(), ref, pairs)
        rep.check("silu_and_mul", f"d gate ({shape_class})", dx[:, :h], dg_ref, pairs)
        rep.check("silu_and_mul", f"d up ({shape_class})", dx[:, h:], du_ref, pairs)
    rep.done()


# ---------------------------------------------------------------- reductions and mse_loss
SUM_ROWS = np.array(
    [
        [0.0, -0.0, 1e-30, -1e-30],
        [3e38, 3e38, 0.0, 0.0],  # the sum overflows, the mean does not
        [BIG, BIG, BIG, BIG],
        [1e20, 1.0, -1e20, 2.0],  # cancels
        [1e4, 1e-6, -1e4, 1e-30],
        [INF, 1.0, 2.0, 3.0],
        [INF, -INF, 0.0, 0.0],
        [NAN, 1.0, 2.0, 3.0],
        [-3e38, -3e38, -3e38, -3e38],
    ],
    np.float32,
)


def _reduce_classes():
    long = np.full((1, 5000), 3e38, np.float32)  # two passes (chunks, then partial sums)
    long[0, 1::2] = 1e30
    return [
        ("grid", SUM_ROWS),
        ("one element", np.array([[3e38]], np.float32)),
        ("one row", SUM_ROWS[3:4]),
        ("long row", long),
    ]


def test_sum_mean(device):
    """Along the last axis, the first axis and all elements; floor 1e-6 sum |x| (float32
    summation errs by about log2(n) 2^-24 sum |x|)."""
    rep = Report()
    for shape_class, x0 in _reduce_classes():
        x64 = f64(x0)
        for name in ("sum", "mean"):
            for axis in (-1, 0, None):
                with np.errstate(all="ignore"):
                    n = x0.size if axis is None else x0.shape[axis]
                    ref = np.sum(x64 / n if name == "mean" else x64, axis=axis)
                    floor = 1e-6 * np.sum(np.abs(x64 / n if name == "mean" else x64), axis=axis)
                x = _tensor(device, x0)
                with pydiff.Tape() as tape:
                    y = getattr(ops, name)(x, axis=axis)
                g0 = RNG.standard_normal(y.shape).astype(np.float32)
                tape.backward(y, grad=g0)
                g64 = f64(g0).reshape(np.sum(x64, axis=axis, keepdims=True).shape)
                dref = np.broadcast_to(g64 / n if name == "mean" else g64, x0.shape)
                what = f"({shape_class}, axis={axis})"
                rep.check(name, f"value {what}", y.numpy(), np.ravel(ref), "out", np.ravel(floor))
                rep.check(name, f"gradient {what}", x.grad.numpy(), dref, _at(x0))
    rep.done()


def test_mse_loss(device):
    """Pairs of the binary grid, one pair per call, plus all finite pairs in one call."""
    rep = Report()
    with np.errstate(all="ignore"):
        d = f64(PA) - f64(PB)
    keep = np.isfinite(d.astype(np.float32))  # see test_mse_loss_difference_overflows
    for shape_class, (p0, t0) in (
        ("finite pairs", (PA[keep], PB[keep])),
        ("one element", (PA[-40:-39], PB[-40:-39])),
        ("inf pair", (np.array([INF, 0.0], np.float32), np.array([0.0, 0.0], np.float32))),
        ("nan pair", (np.array([NAN, 0.0], np.float32), np.array([0.0, 0.0], np.float32))),
        ("large", (np.array([1e19, -1e19], np.float32), np.array([-1e19, 1e19], np.float32))),
    ):
        with np.errstate(all="ignore"):
            dd = f64(p0) - f64(t0)
            ref, floor = np.mean(dd * dd), 1e-6 * np.mean(dd * dd)
            dref = 2 * dd / len(dd)
        p, t = _tensor(device, p0), _tensor(device, t0)
        with pydiff.Tape() as tape:
            loss = ops.mse_loss(p, t)
        tape.backward(loss)
        rep.check("mse_loss", f"value ({shape_class})", loss.numpy(), [ref], "loss", floor)
        rep.check("mse_loss", f"gradient of prediction ({shape_class})", p.grad.numpy(), dref, p0)
        rep.check("mse_loss", f"gradient of target ({shape_class})", t.grad.numpy(), -dref, t0)
    rep.done()


# Fixed: the composed sub overflowed (p - t = inf where 2 (p - t) / n = 3e38 is finite); the
# backward is now one pass computing 4/n (p/2 - t/2) there (op_mse_grad).
def test_mse_loss_difference_overflows(device):
    rep = Report()
    p0, t0 = np.array([3e38, 0.0, 0.0, 0.0], np.float32), np.array([-3e38, 0, 0, 0], np.float32)
    p, t = _tensor(device, p0), _tensor(device, t0)
    with pydiff.Tape() as tape:
        loss = ops.mse_loss(p, t)
    tape.backward(loss)
    rep.check("mse_loss", "value", loss.numpy(), [np.mean((f64(p0) - f64(t0)) ** 2)], "loss")
    dref = 2 * (f64(p0) - f64(t0)) / 4
    rep.check("mse_loss", "gradient of prediction", p.grad.numpy(), dref, p0)
    rep.done()


# ---------------------------------------------------------------- matmul, linear, attention
# Every dot product below holds at most one term past float32's range (so the float64
# reference does not depend on the summation order); floors 1e-6 sum_k |a_ik b_kj|.
MM_A = np.array(
    [
        [0.0, -0.0, 1e-30, 1e-6],
        [1.0, -1.0, 1e4, -1e4],
        [3e38, 0.0, 0.0, 0.0],
        [INF, 0.0, 0.0, 0.0],
        [NAN, 1.0, 1.0, 1.0],
        [1e20, 1e-20, 1e10, -1e10],
        [-3e38, 1e-30, 0.0, 0.0],
        [1e-30, 1e-30, 1e-30, 1e-30],
    ],
    np.float32,
)
MM_B = np.array(
    [
        [1.0, 0.0, 1e-6, -1.0, 1e4, 0.0, 2.0, 1e-30],
        [1.0, 1e30, 0.0, 1.0, 1.0, -0.0, 0.5, 1.0],
        [1.0, 1e-30, 1.0, 1e4, -1.0, 0.0, 0.25, -1.0],
        [1.0, 0.0, 1.0, 1e4, 1.0, 0.0, 0.125, 1.0],
    ],
    np.float32,
)


def _mm_classes():
    long_a = np.where(np.arange(4096) % 2 == 0, 1e4, -1e4).astype(np.float32)[None, :]
    long_a[0, 7] = 1e20
    long_b = np.ones((4096, 4), np.float32)
    long_b[:, 1] = 1e-30
    long_b[5, 2] = INF
    return [
        ("grid, N % 4 = 0", MM_A, MM_B),
        ("grid, N = 5", MM_A, MM_B[:, :5]),
        ("grid, K = 3", MM_A[:, :3], MM_B[:3, :5]),
        ("one element", np.array([[3e38]], np.float32), np.array([[2.0]], np.float32)),
        ("one element, inf * 0", np.array([[INF]], np.float32), np.array([[0.0]], np.float32)),
        ("one row", MM_A[1:2], MM_B),
        ("long row", long_a, long_b),
    ]


def _mm_ref(a, b):
    with np.errstate(all="ignore"):
        return a @ b, 1e-6 * (np.abs(a) @ np.abs(b))


def test_matmul(device):
    rep = Report()
    for shape_class, a0, b0 in _mm_classes():
        a, b = _tensor(device, a0), _tensor(device, b0)
        g0 = RNG.standard_normal((a0.shape[0], b0.shape[1])).astype(np.float32)
        with pydiff.Tape() as tape:
            y = ops.matmul(a, b)
        tape.backward(y, grad=g0)
        a64, b64, g64 = f64(a0), f64(b0), f64(g0)
        ref, floor = _mm_ref(a64, b64)
        da, fda = _mm_ref(g64, b64.T)
        db, fdb = _mm_ref(a64.T, g64)
        rep.check("matmul", f"value ({shape_class})", y.numpy(), ref, "out", floor)
        rep.check("matmul", f"gradient of a ({shape_class})", a.grad.numpy(), da, "da", fda)
        rep.check("matmul", f"gradient of b ({shape_class})", b.grad.numpy(), db, "db", fdb)
    rep.done()


LIN_BIAS = np.array([0.0, -0.0, INF, 1e-30, -3e38, NAN, 1.0, -1e4], np.float32)


def test_linear(device):
    """linear(x, W, b) with W = B^T, with and without bias, fused relu or not (relu' = 0 at 0
    and the upstream gradient at NaN, as ops.relu and PyTorch's relu)."""
    rep = Report()
    for shape_class, a0, b0 in _mm_classes():
        w0 = np.ascontiguousarray(b0.T)
        bias0 = np.resize(LIN_BIAS, w0.shape[0])
        g0 = RNG.standard_normal((a0.shape[0], w0.shape[0])).astype(np.float32)
        for has_bias in (True, False):
            for activation in (None, "relu"):
                x, w = _tensor(device, a0), _tensor(device, w0)
                bias = _tensor(device, bias0) if has_bias else None
                x64, w64, g64 = f64(a0), f64(w0), f64(g0)
                with np.errstate(all="ignore"):
                    pre, floor = _mm_ref(x64, w64.T)
                    if has_bias:
                        pre, floor = pre + f64(bias0), floor + 1e-6 * np.abs(f64(bias0))
                    ref = pre
                    if activation == "relu":
                        # where float32 cannot tell the sign of x W^T + b (|pre| within the
                        # floor, or below float32's smallest normal number) either mask is
                        # right: the upstream gradient is 0 there
                        g64[np.abs(pre) <= np.maximum(floor, F32.tiny)] = 0.0
                        ref = np.where(np.isnan(pre) | (pre > 0), pre, 0.0)
                        g64 = np.where(np.isnan(pre) | (pre > 0), g64, 0.0)
                with pydiff.Tape() as tape:
                    y = ops.linear(x, w, bias, activation=activation)
                tape.backward(y, grad=g64.astype(np.float32))
                dx, fdx = _mm_ref(g64, w64)
                dw, fdw = _mm_ref(g64.T, x64)
                what = f"({shape_class}, bias={has_bias}, activation={activation})"
                rep.check("linear", f"value {what}", y.numpy(), ref, "out", floor)
                rep.check("linear", f"gradient of x {what}", x.grad.numpy(), dx, "dx", fdx)
                rep.check("linear", f"gradient of weight {what}", w.grad.numpy(), dw, "dw", fdw)
                if has_bias:
                    db, fdb = g64.sum(axis=0), 1e-6 * np.abs(g64).sum(axis=0)
                    rep.check(
                        "linear", f"gradient of bias {what}", bias.grad.numpy(), db, "db", fdb
                    )
    rep.done()


ATT_Q = np.array(
    [[1e4, 0.0], [0.0, 0.0], [-INF, 1.0], [NAN, 0.0], [1e19, 0.0], [1e-30, -1e-30]], np.float32
)
ATT_K = np.array([[1e4, 1.0], [1e4, 1.0], [1.0, 0.0], [1e-30, 2.0]], np.float32)
ATT_V = np.array(
    [[1.0, 1e-30, 1e30], [1.0, -1e-30, -1e30], [1e4, 0.0, 1.0], [0.0, 1.0, 2.0]], np.float32
)


def _attention_ref(q, k, v, g, scale):
    with np.errstate(all="ignore"):
        s = scale * (q @ k.T)
        m = np.max(s, axis=1, keepdims=True)
        e = np.exp(s - m)
        p = e / np.sum(e, axis=1, keepdims=True)
        out, fout = _mm_ref(p, v)
        dv, fdv = _mm_ref(p.T, g)
        dp, fdp = _mm_ref(g, v.T)
        dot = np.sum(p * dp, axis=1, keepdims=True)
        ds = scale * p * (dp - dot)
        fds = (
            scale * p * (fdp + np.abs(dp) * 1e-6 + np.sum(p * (np.abs(dp) + fdp), 1, keepdims=True))
        )
        dq, fdq = _mm_ref(ds, k)
        dk, fdk = _mm_ref(ds.T, q)
        fdq = fdq + fds @ np.abs(k)
        fdk = fdk + fds.T @ np.abs(q)
        return out, fout, dq, fdq, dk, fdk, dv, fdv


def test_attention(device):
    """Tied large scores (1e8 twice, 1e23 twice), uniform scores, a fully masked query (every
    score -inf: NaN, as PyTorch's), a NaN query. Rows masked in part need a +inf or NaN score
    here (q k = -inf * 0), so partial masking is covered by test_softmax_family."""
    rep = Report()
    g0 = (0.1 * RNG.standard_normal((ATT_Q.shape[0], ATT_V.shape[1]))).astype(np.float32)
    for shape_class, sel in (("grid", slice(None)), ("one row", slice(0, 1))):
        q0, k0, v0 = ATT_Q[sel], ATT_K, ATT_V
        gg = g0[sel]
        q, k, v = _tensor(device, q0), _tensor(device, k0), _tensor(device, v0)
        with pydiff.Tape() as tape:
            y = ops.attention(q, k, v, scale=1.0)
        tape.backward(y, grad=gg)
        ref = _attention_ref(f64(q0), f64(k0), f64(v0), f64(gg), 1.0)
        out, fout, dq, fdq, dk, fdk, dv, fdv = ref
        rep.check("attention", f"value ({shape_class})", y.numpy(), out, "out", fout)
        rep.check("attention", f"gradient of q ({shape_class})", q.grad.numpy(), dq, "dq", fdq)
        rep.check("attention", f"gradient of k ({shape_class})", k.grad.numpy(), dk, "dk", fdk)
        rep.check("attention", f"gradient of v ({shape_class})", v.grad.numpy(), dv, "dv", fdv)
        # the same head as a (1, 1, T, D) batch: the batched kernels
        q, k, v = (_tensor(device, a[None, None]) for a in (q0, k0, v0))
        with pydiff.Tape() as tape:
            y = ops.attention(q, k, v, scale=1.0)
        tape.backward(y, grad=gg[None, None])
        what = f"({shape_class}, batched)"
        rep.check("attention", f"value {what}", y.numpy(), out, "out", fout)
        rep.check("attention", f"gradient of q {what}", q.grad.numpy(), dq, "dq", fdq)
        rep.check("attention", f"gradient of k {what}", k.grad.numpy(), dk, "dk", fdk)
        rep.check("attention", f"gradient of v {what}", v.grad.numpy(), dv, "dv", fdv)
    rep.done()


def test_dropout(device):
    """Every grid value kept (scaled, in float32: 3e38 * 2 = inf) or dropped (0, also at inf
    and NaN), by the reference mask; p = 0 is the identity, p = 1 all zeros; the gradient
    likewise with the grid as the upstream gradient."""
    from philox_ref import keep_mask

    rep = Report()
    for shape_class, x0 in (("grid", GRID), ("long row", np.resize(GRID, 4099))):
        g0 = np.roll(x0, 7)
        for p in (0.0, 0.3, 1.0):
            keep = keep_mask(x0.size, p, 99)
            scale = 0.0 if p == 1 else float(np.float32(1 / (1 - p)))
            x = _tensor(device, x0)
            with pydiff.Tape() as tape:
                y = ops.dropout(x, p, seed=99)
            tape.backward(y, grad=g0)
            with np.errstate(all="ignore"):
                ref, dref = np.where(keep, f64(x0) * scale, 0.0), np.where(keep, f64(g0) * scale, 0)
            rep.check("dropout", f"value (p={p}, {shape_class})", y.numpy(), ref, x0)
            rep.check("dropout", f"gradient (p={p}, {shape_class})", x.grad.numpy(), dref, g0)
    rep.done()


# ---------------------------------------------------------------- optimizers' update kernels
def _optim_inputs(long):
    """Parameter and gradient: every pair of the binary grid (256), or those pairs repeated
    to 4099 values (the float4 kernels' padding, several threads)."""
    p, g = PA.copy(), PB.copy()
    return (np.resize(p, 4099), np.resize(g, 4099)) if long else (p, g)


def _step(device, make, p0, g0, state=None):
    p = pydiff.tensor(p0, device=device, requires_grad=True)
    opt = make([p])
    if state is not None:
        opt.load_state_dict(state(opt, p))
    p.grad.copy_from_numpy(g0)
    opt.step()
    return p.numpy(), opt


def test_sgd_step(device):
    """p - lr (g + wd p) (the first step: the momentum buffer is the gradient), then a second
    step from a loaded buffer of edge values: buf = momentum buf + g'."""
    rep = Report()
    lr, mom = 0.1, 0.9
    for long, wd in ((False, 0.01), (True, 0.01), (False, 0.0)):
        p0, g0 = _optim_inputs(long)
        pairs = lambda k, p0=p0, g0=g0: (float(p0[k]), float(g0[k]))  # noqa: E731
        got, opt = _step(device, lambda ps: optim.SGD(ps, lr, mom, wd), p0, g0)
        with np.errstate(all="ignore"):
            gp = f64(g0) + wd * f64(p0) if wd else f64(g0)  # PyTorch adds no 0 * p
            ref = f64(p0) - lr * gp
            floor = 1e-6 * (np.abs(f64(p0)) + np.abs(lr * gp))
        rep.check("SGD", f"first step (n={len(p0)}, wd={wd})", got, ref, pairs, floor)
        rep.check("SGD", "momentum buffer", opt.state[0]["momentum_buffer"].numpy(), gp, pairs)
        buf0 = np.resize(np.array(_B[::-1], np.float32), len(p0))

        def loaded(o, p, buf0=buf0):
            state = o.state_dict()
            state["step"] = 1
            state["state"][0] = {"momentum_buffer": buf0}
            return state

        got, opt = _step(device, lambda ps: optim.SGD(ps, lr, mom, wd), p0, g0, loaded)
        with np.errstate(all="ignore"):
            buf = mom * f64(buf0) + gp
            ref = f64(p0) - lr * buf
            floor = 1e-6 * (np.abs(f64(p0)) + lr * (mom * np.abs(f64(buf0)) + np.abs(gp)))
        rep.check("SGD", f"loaded buffer (n={len(p0)}, wd={wd})", got, ref, pairs, floor)
    rep.done()


def _adamw_ref(p, g, m, v, t, lr, b1, b2, eps, wd):
    """torch.optim.AdamW's step in float64 (decoupled decay, bias correction)."""
    with np.errstate(all="ignore"):
        p = p * (1 - lr * wd)
        m = m + (1 - b1) * (g - m)
        v = b2 * v + (1 - b2) * g * g
        denom = np.sqrt(v) / np.sqrt(1 - b2**t) + eps
        step = lr / (1 - b1**t) * (m / denom)
        return p - step, m, v, 1e-6 * (np.abs(p) + np.abs(step))


def test_adamw_step(device):
    """One step from zero state, and one from a loaded state of edge moments (m, v up to
    3e38), against the float64 formula; the moments as stored (float32) too."""
    rep = Report()
    for long, wd in ((False, 0.01), (True, 0.01), (False, 0.0)):
        hp = dict(lr=1e-3, b1=0.9, b2=0.999, eps=1e-8, wd=wd)

        def make(ps, hp=hp):
            b = (hp["b1"], hp["b2"])
            return optim.AdamW(ps, lr=hp["lr"], betas=b, eps=hp["eps"], weight_decay=hp["wd"])

        p0, g0 = _optim_inputs(long)
        pairs = lambda k, p0=p0, g0=g0: (float(p0[k]), float(g0[k]))  # noqa: E731
        n = len(p0)
        # moments as training leaves them: v >= m^2 (the step m / sqrt(v) stays bounded)
        m0 = np.resize(np.array([0.0, 1e-30, -1.0, 1e4, -3e38, 1e20, 1e-20], np.float32), n)
        v0 = np.minimum(2.0 * f64(m0) ** 2 + np.resize([0.0, 1.0, 1e-30], n), 3e38)
        v0 = v0.astype(np.float32)
        for start, state in (
            ("zero state", None),
            ("loaded state", (m0, v0)),
        ):
            loaded = None
            if state is not None:

                def loaded(o, p, m0=m0, v0=v0):
                    s = o.state_dict()
                    s["step"] = 4
                    s["state"][0] = {"exp_avg": m0, "exp_avg_sq": v0}
                    return s

            got, opt = _step(device, make, p0, g0, loaded)
            m_in, v_in, t = (f64(m0), f64(v0), 5) if state else (0.0, 0.0, 1)
            ref, m, v, floor = _adamw_ref(f64(p0), f64(g0), m_in, v_in, t, **hp)
            what = f"({start}, n={n}, wd={wd})"
            rep.check("AdamW", f"parameter {what}", got, ref, pairs, floor)
            st = opt.state[0]
            rep.check("AdamW", f"exp_avg {what}", st["exp_avg"].numpy(), m, pairs)
            rep.check("AdamW", f"exp_avg_sq {what}", st["exp_avg_sq"].numpy(), v, pairs)
    rep.done()


# ---------------------------------------------------------------- dtypes
def _dtype_calls(device, bad):
    """(op, argument, call) for every op family, with ``bad`` (a non-float tensor) given as
    that argument and float tensors elsewhere."""
    f = lambda *shape: pydiff.tensor(np.ones(shape, np.float32), device=device)  # noqa: E731
    b = lambda *shape: pydiff.tensor(np.ones(shape, bad), device=device)  # noqa: E731
    calls = [(name, "x", lambda n=name: getattr(ops, n)(b(4))) for name in UNARY]
    calls += [
        (name, "a", lambda n=name: getattr(ops, n)(b(4), f(4)))
        for name in BINARY
        if name != "swiglu"
    ]
    calls += [
        (name, "b", lambda n=name: getattr(ops, n)(f(4), b(4)))
        for name in BINARY
        if name != "swiglu"
    ]
    calls += [
        ("swiglu", "gate", lambda: ops.swiglu(b(4), f(4))),
        ("swiglu", "up", lambda: ops.swiglu(f(4), b(4))),
        ("sum", "x", lambda: ops.sum(b(2, 3))),
        ("mean", "x", lambda: ops.mean(b(2, 3), axis=0)),
        ("mse_loss", "prediction", lambda: ops.mse_loss(b(3), f(3))),
        ("mse_loss", "target", lambda: ops.mse_loss(f(3), b(3))),
        ("cross_entropy", "logits", lambda: ops.cross_entropy(b(2, 3), [0, 1])),
        ("softmax", "logits", lambda: ops.softmax(b(2, 3))),
        ("log_softmax", "logits", lambda: ops.log_softmax(b(2, 3))),
        ("layer_norm", "x", lambda: ops.layer_norm(b(2, 3))),
        ("layer_norm", "weight", lambda: ops.layer_norm(f(2, 3), b(3), f(3))),
        ("layer_norm", "bias", lambda: ops.layer_norm(f(2, 3), f(3), b(3))),
        ("rms_norm", "x", lambda: ops.rms_norm(b(2, 3), f(3))),
        ("rms_norm", "weight", lambda: ops.rms_norm(f(2, 3), b(3))),
        ("silu_and_mul", "x", lambda: ops.silu_and_mul(b(2, 4))),
        ("matmul", "a", lambda: ops.matmul(b(2, 3), f(3, 4))),
        ("matmul", "b", lambda: ops.matmul(f(2, 3), b(3, 4))),
        ("linear", "x", lambda: ops.linear(b(2, 3), f(4, 3), f(4))),
        ("linear", "weight", lambda: ops.linear(f(2, 3), b(4, 3), f(4))),
        ("linear", "bias", lambda: ops.linear(f(2, 3), f(4, 3), b(4))),
        ("attention", "q", lambda: ops.attention(b(2, 3), f(4, 3), f(4, 2))),
        ("attention", "k", lambda: ops.attention(f(2, 3), b(4, 3), f(4, 2))),
        ("attention", "v", lambda: ops.attention(f(2, 3), f(4, 3), b(4, 2))),
        ("dropout", "x", lambda: ops.dropout(b(2, 3), 0.5, seed=0)),
    ]
    return calls


@pytest.mark.parametrize("bad, name", [(np.float16, "half"), (np.int32, "int"), (np.bool_, "bool")])
def test_non_float_tensors_refused(device, bad, name):
    """A half, int or bool tensor given to a float op: an error (TypeError, and ValueError as
    before) naming the op, the argument, the dtype it got and the one it accepts."""
    from pydiff.ops_args import OpDtypeError

    calls = _dtype_calls(device, bad)
    assert {c[0] for c in calls} >= set(ops.__all__) - {"ACTIVATIONS", "library"}
    for op, arg, call in calls:
        with pytest.raises(OpDtypeError) as err:
            call()
        assert isinstance(err.value, TypeError) and isinstance(err.value, ValueError)
        want = f"{op}: {arg} has dtype {name}; {op} accepts float (float32) tensors only"
        assert str(err.value).startswith(want), (op, arg, str(err.value))


def test_cross_entropy_labels_of_any_exact_dtype(device):
    """Labels are class indices: int tensors, and any values that convert exactly (bool, half
    or float tensors and arrays holding integers) work; fractional values are refused."""
    z = pydiff.tensor(np.array([[0.0, 1.0, 2.0], [1.0, 0.0, -1.0]], np.float32), device=device)
    want = ops.cross_entropy(z, np.array([1, 0], np.int32)).item()
    for labels in (
        pydiff.tensor(np.array([1, 0], np.int32), device=device),
        pydiff.tensor(np.array([True, False]), device=device),
        pydiff.tensor(np.array([1.0, 0.0], np.float16), device=device),
        np.array([1.0, 0.0]),
        [1, 0],
    ):
        assert ops.cross_entropy(z, labels).item() == want
    with pytest.raises(ValueError, match="labels must be integer class indices"):
        ops.cross_entropy(z, np.array([0.5, 1.0]))


def _same(ref, want, what, rtol=1e-9):
    ref, want = np.asarray(ref, np.float64), np.asarray(want, np.float64)
    assert np.array_equal(np.isnan(ref), np.isnan(want)), what
    ok = ~np.isnan(ref)
    np.testing.assert_allclose(ref[ok], want[ok], rtol=rtol, atol=1e-300, err_msg=what)


def test_row_references_match_torch():
    """The NumPy references of the row ops are PyTorch's float64 autograd on the same grids."""
    torch = pytest.importorskip("torch")
    tt = lambda a: torch.tensor(f64(a), requires_grad=True)  # noqa: E731
    z0 = ROWS
    g0 = RNG.standard_normal(z0.shape)
    for log_space, fn in ((False, torch.softmax), (True, torch.log_softmax)):
        z = tt(z0)
        y = fn(z, dim=1)
        y.backward(torch.tensor(g0))
        ref, dref, _ = _softmax_ref(f64(z0), g0, log_space)
        _same(ref, y.detach().numpy(), f"softmax log_space={log_space}")
        _same(dref, z.grad.numpy(), f"softmax gradient log_space={log_space}", rtol=1e-7)
    z = tt(z0)
    loss = torch.nn.functional.cross_entropy(
        z, torch.tensor(LABELS, dtype=torch.long), reduction="none"
    )
    loss.sum().backward()
    ref, dref = _ce_ref(f64(z0), LABELS)
    _same(ref, loss.detach().numpy(), "cross_entropy")
    _same(dref * len(z0), z.grad.numpy(), "cross_entropy gradient")
    x0, g0 = NORM_ROWS, RNG.standard_normal(NORM_ROWS.shape)
    x, w, b = tt(x0), tt(W6), tt(B6)
    # composed (two-pass): torch.nn.functional.layer_norm's float64 backward gives dx = 0 for
    # rows of 1e20 (its variance cancels), where the math gives (gh - mean gh) / sqrt(eps)
    mu = x.mean(dim=1, keepdim=True)
    var = ((x - mu) ** 2).mean(dim=1, keepdim=True)
    y = (x - mu) / torch.sqrt(var + 1e-5) * w + b
    y.backward(torch.tensor(g0))
    ref, _, dx, _, dw, _, db, _ = _layer_norm_ref(f64(x0), f64(W6), f64(B6), g0, 1e-5)
    _same(ref, y.detach().numpy(), "layer_norm", rtol=1e-6)
    _same(dx, x.grad.numpy(), "layer_norm dx", rtol=1e-6)
    x, w = tt(x0), tt(W6)
    y = x * torch.rsqrt(torch.mean(x * x, dim=1, keepdim=True) + 1e-6) * w
    y.backward(torch.tensor(g0))
    ref, dx, _, dw, _ = _rms_norm_ref(f64(x0), f64(W6), g0, 1e-6)
    _same(ref, y.detach().numpy(), "rms_norm", rtol=1e-6)
    _same(dx, x.grad.numpy(), "rms_norm dx", rtol=1e-6)
    q, k, v = tt(ATT_Q), tt(ATT_K), tt(ATT_V)
    g0 = RNG.standard_normal((ATT_Q.shape[0], ATT_V.shape[1]))
    out = torch.softmax(q @ k.T, dim=1) @ v
    out.backward(torch.tensor(g0))
    ref, _, dq, _, dk, _, dv, _ = _attention_ref(f64(ATT_Q), f64(ATT_K), f64(ATT_V), g0, 1.0)
    _same(ref, out.detach().numpy(), "attention")
    _same(dv, v.grad.numpy(), "attention dv")


# Fixed: the partials of one tensor were summed first, and the compiler factored a g + b g into
# (a + b) g, which overflows (-inf for a = -3e38); now added one by one, as SlangPy's path does.
def test_mul_of_one_tensor_twice_generated(device, monkeypatch):
    from pydiff import generated

    monkeypatch.setattr(generated, "MIN_ELEMENTS", 1)
    a = _tensor(device, np.full(8, -3e38, np.float32))
    with pydiff.Tape() as tape:
        y = ops.mul(a, a)
    tape.backward(y, grad=np.full(8, 1 / 167, np.float32))
    rep = Report()
    rep.check("mul", "gradient of a, a (generated)", a.grad.numpy(), np.full(8, -6e38 / 167), "a")
    rep.done()
