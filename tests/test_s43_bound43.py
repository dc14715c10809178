"""A bound shader object's uniforms are compared inline (bound_objects.BoundObjects.bound:
the pairs' equality, then type and, for a zero, sign): each change of a uniform must reach
the kernel, and each unchanged one must not be written again. Checked with a recording
stand-in for Slang's cursor (exact writes), through planned generated calls (float32 closed
forms, zero signs, NaN and infinities), and through AdamW's held object against a float64
NumPy AdamW while the learning rate and weight decay change and return."""

from __future__ import annotations

import math

import numpy as np
import pytest

import pydiff
from pydiff import optim
from pydiff.bound_objects import BoundObjects

SOURCE = "[Differentiable] float b43_scale(float a, float x) { return a * x; }\n"
N = 16


class _Field:
    def __init__(self, log: list, name: str):
        self.log, self.name = log, name

    def write(self, value):
        self.log.append((self.name, value))


class _Cursor:
    """Slang's entry-point cursor as BoundObjects.bound uses it: set by name, or a field's write."""

    def __init__(self):
        self.log: list = []

    def __setitem__(self, name, value):
        self.log.append((name, value))

    def __getitem__(self, name):
        return _Field(self.log, name)


def _writes(sequence: list) -> list:
    """The uniforms written for each call of ``sequence`` (lists of (name, value) pairs) on one
    held object binding no buffers."""
    objects = object.__new__(BoundObjects)  # (no device: only the uniforms' logic runs)
    kernel, cursor = object(), _Cursor()
    held = [(kernel,), [object(), cursor, 0, None, {}], []]
    out = []
    for scalars in sequence:
        cursor.log.clear()
        objects.bound(kernel, [], scalars, held)
        out.append(
            [
                (n, v if not isinstance(v, float) else (v, math.copysign(1.0, v)))
                for n, v in cursor.log
            ]
        )
    return out


def _sig(n, v):
    return (n, v if not isinstance(v, float) else (v, math.copysign(1.0, v)))


def test_each_changed_uniform_is_written_and_no_other():
    nan = float("nan")
    seq = [
        [("a", 2.0), ("b", 0.0), ("c", 3)],  # first: all set
        [("a", float("2.0")), ("b", 0.0), ("c", 3)],  # equal values, other objects: none
        [("a", 2.0), ("b", -0.0), ("c", 3)],  # -0.0 == 0.0 but binds apart
        [("a", 2.0), ("b", -0.0), ("c", 3.0)],  # 3 == 3.0 but another type
        [("a", 2.0), ("b", 0.0), ("c", True)],  # True == 1 ... and from 3.0: changed
        [("a", 2.0), ("b", 0.0), ("c", 1)],  # True == 1, another type
        [("a", nan), ("b", 0.0), ("c", 1)],
        [("a", float("nan")), ("b", 0.0), ("c", 1)],  # NaN != NaN: written again
        [("a", -math.inf), ("b", 0), ("c", 1)],  # 0 == 0.0, another type
        [("a", -math.inf), ("b", 0), ("c", 0)],
        [("a", -math.inf), ("b", 0), ("c", False)],  # 0 == False, another type
    ]
    got = _writes(seq)
    assert got[0] == [_sig("a", 2.0), _sig("b", 0.0), _sig("c", 3)]
    assert got[1] == []
    assert got[2] == [_sig("b", -0.0)]
    assert got[3] == [_sig("c", 3.0)] and type(got[3][0][1][0]) is float
    assert got[4] == [_sig("b", 0.0), ("c", True)] and got[4][1][1] is True
    assert got[5] == [("c", 1)] and type(got[5][0][1]) is int
    assert len(got[6]) == 1 and got[6][0][0] == "a" and math.isnan(got[6][0][1][0])
    assert len(got[7]) == 1 and got[7][0][0] == "a" and math.isnan(got[7][0][1][0])
    assert got[8] == [_sig("a", -math.inf), ("b", 0)] and type(got[8][1][1]) is int
    assert got[9] == [("c", 0)]
    assert got[10] == [("c", False)] and got[10][0][1] is False


def test_a_renamed_uniform_is_written_under_its_new_name():
    got = _writes([[("a", 1.0), ("b", 2.0)], [("a", 1.0), ("x", 2.0)], [("a", 1.0), ("x", 2.0)]])
    assert got[1] == [_sig("x", 2.0)] and got[2] == []


@pytest.fixture
def mod(device):
    return pydiff.load_module_from_source("s43_b43", SOURCE, device=device)


def test_generated_calls_follow_zero_signs_nan_and_infinities(device, mod, second_call_generated):
    xs = np.linspace(-1, 1, N).astype(np.float32)
    xs[5] = 0.0
    x = pydiff.tensor(xs, device=device)
    y = pydiff.zeros((N,), device=device)
    values = [1.5, float("1.5"), -0.0, 0.0, 0.0, -0.0, float("nan"), float("nan"), math.inf]
    values += [math.inf, -math.inf, 1e-45, -1e-45, 2.0]
    for a in values * 2:
        mod.b43_scale(a, x, _result=y)
        got = y.numpy()
        with np.errstate(invalid="ignore"):
            want = np.float32(a) * xs
        np.testing.assert_array_equal(got, want)  # (NaN where NaN)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def _numpy_adamw64(p, grads, lrs, wds, b1=0.9, b2=0.999, eps=1e-8):
    m, v = np.zeros_like(p), np.zeros_like(p)
    for t, (g, lr, wd) in enumerate(zip(grads, lrs, wds), 1):
        p = p * (1 - lr * wd)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
    return p


def test_adamw_held_object_follows_changing_hyperparameters(device):
    rng = np.random.default_rng(43)
    shapes = [(8, 8), (8,), (4, 8), (4,), (3,)]  # two four-parameter dispatches
    p0 = [rng.standard_normal(s) for s in shapes]
    params = [pydiff.tensor(a.astype(np.float32), device=device, requires_grad=True) for a in p0]
    opt = optim.AdamW(params, lr=1e-2, weight_decay=0.05)
    lrs = [1e-2, 1e-2, 2e-2, 2e-2, 1e-2, 0.0, 1e-2, 1e-2]
    wds = [0.05, 0.0, 0.0, 0.05, 0.05, 0.05, 0.1, 0.05]
    grads = [[rng.standard_normal(s) for s in shapes] for _ in lrs]
    for step, (lr, wd) in enumerate(zip(lrs, wds)):
        opt.defaults["lr"], opt.defaults["weight_decay"] = lr, wd
        for p, g in zip(params, grads[step]):
            p.grad.copy_from_numpy(g.astype(np.float32))
        opt.step()
    for k, p in enumerate(params):
        gs = [grads[s][k].astype(np.float32).astype(np.float64) for s in range(len(lrs))]
        want = _numpy_adamw64(p0[k].astype(np.float32).astype(np.float64), gs, lrs, wds)
        np.testing.assert_allclose(p.numpy(), want, rtol=2e-5, atol=2e-6)
