"""Breaking the held generated forward fused with the tape's backward (generated_hold):
each case run with the hold on and with HOLD_FORWARD off, bits equal, and the values
against float64 closed forms."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest

import pydiff
from pydiff import generated, generated_hold

SOURCE = """
import slangpy;
[Differentiable] float bk_poly(float a, float b, float x) { return a * x * x + b * x + sin(x); }
"""

_n = iter(range(10**6))


@pytest.fixture(autouse=True)
def _hold_forward_on(monkeypatch):
    """The fused path (generated_hold.HOLD_FORWARD, on by default): on for these tests."""
    monkeypatch.setattr(generated_hold, "HOLD_FORWARD", True)


def _module(device):
    return pydiff.load_module_from_source(f"break49c_{next(_n)}", SOURCE, device=device)


def _closed(x, g, a=1.5):
    x64, g64 = x.astype(np.float64), g.astype(np.float64)
    return a * x64**2 - 0.5 * x64 + np.sin(x64), g64 * (2 * a * x64 - 0.5 + np.cos(x64))


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.uniform(-2, 2, n).astype(np.float32), rng.uniform(-1, 1, n).astype(np.float32)


def _outcome(fn):
    """The arrays ``fn`` returns, or its exception's type and message then the arrays of
    ``fn.after`` (what is read after the error)."""
    try:
        return [np.asarray(o) for o in fn()]
    except Exception as e:  # noqa: BLE001
        return [type(e).__name__, re.sub(r"break49c_(nd)?\d+", "M", str(e))] + [
            np.asarray(o) for o in fn.after()
        ]


def _both(device, monkeypatch, run):
    monkeypatch.setattr(generated, "MIN_ELEMENTS", 1)
    outs, stats = [], []
    for hold in (True, False):
        monkeypatch.setattr(generated_hold, "HOLD_FORWARD", hold)
        generated.reset_stats()
        outs.append(_outcome(run(_module(device))))
        stats.append(generated.stats())
    assert len(outs[0]) == len(outs[1]), outs
    for a, b in zip(*outs):
        if isinstance(a, str):
            assert a == b
        else:
            np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    return stats[0], outs[0]


X, G = _data(3000, 11)


def _case(device, between, grad=None):
    def run(m):
        st = {}

        def go():
            xt = pydiff.tensor(X, device=device, requires_grad=True)
            st["x"] = xt
            with pydiff.Tape() as tape:
                y = m.bk_poly(1.5, -0.5, xt)
            st["y"] = y
            extra = between(m, y, xt, tape)
            tape.backward(y, grad=G if grad is None else grad(y, xt))
            return [y.numpy(), xt.grad.numpy(), *(extra or [])]

        go.after = lambda: [st["y"].numpy()]
        return go

    return run


def test_probe_plain(device, monkeypatch):
    stats, outs = _both(device, monkeypatch, _case(device, lambda m, y, x, t: None))
    assert stats.get("forward+backward fused") == 1, stats
    wy, wg = _closed(X, G)
    np.testing.assert_allclose(outs[0], wy, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outs[1], wg, rtol=1e-5, atol=1e-5)


def _thread_read(m, y, x, t):
    box = []
    th = threading.Thread(target=lambda: box.append(y.numpy().copy()))
    th.start()
    th.join(60)
    return box


def _raise_between(m, y, x, t):
    try:
        m.bk_poly(1.5, -0.5, pydiff.tensor(np.zeros((2, 3), np.float32), device=x.device)[0:1])
    except Exception:  # noqa: BLE001
        pass
    try:
        raise RuntimeError("user")
    except RuntimeError:
        pass


def _second_tape(m, y, x, t):
    with pydiff.Tape() as t2:
        y2 = m.bk_poly(1.5, -0.5, x)
    t2.backward(y2, grad=G)
    return [y2.numpy()]


def _bwds(m, y, x, t):
    xs = pydiff.tensor(X, device=x.device, requires_grad=True)
    ys = pydiff.tensor(np.zeros_like(X), device=x.device)
    m.bk_poly(1.5, -0.5, xs, _result=ys)
    return [ys.numpy()]


BETWEEN = {
    "x_fill": lambda m, y, x, t: [x.copy_from_numpy(np.full_like(X, 0.25)).numpy()],
    "x_setitem": lambda m, y, x, t: x.__setitem__(Ellipsis, 0.5),
    "x_zero": lambda m, y, x, t: x.zero_(),
    "x_by_call": lambda m, y, x, t: m.bk_poly(0.0, 0.0, x, _result=x),
    "y_fill": lambda m, y, x, t: y.copy_from_numpy(np.full_like(X, 3.0)),
    "y_zero": lambda m, y, x, t: y.zero_(),
    "thread_read": _thread_read,
    "raise": _raise_between,
    "second_tape": _second_tape,
    "wait": lambda m, y, x, t: x.device.wait(),
    "flush": lambda m, y, x, t: x.device.flush(),
    "bwds": _bwds,
    "del_x_ref": lambda m, y, x, t: None,
}


@pytest.mark.parametrize("case", sorted(BETWEEN))
def test_probe_between(device, monkeypatch, case):
    stats, outs = _both(device, monkeypatch, _case(device, BETWEEN[case]))
    print(case, stats, [o if isinstance(o, str) else o.shape for o in outs])
    if not isinstance(outs[0], str):
        wy, _ = _closed(X, G)
        np.testing.assert_allclose(outs[0], wy, rtol=1e-5, atol=1e-5)


GRADS = {
    "grad_is_x": lambda y, x: x,
    "grad_is_y": lambda y, x: y,
    "grad_wrong_shape": lambda y, x: np.ones(7, np.float32),
    "grad_tensor": lambda y, x: pydiff.tensor(G, device=x.device),
}


@pytest.mark.parametrize("case", sorted(GRADS))
def test_probe_grads(device, monkeypatch, case):
    stats, outs = _both(device, monkeypatch, _case(device, lambda m, y, x, t: None, GRADS[case]))
    print(case, stats, [o if isinstance(o, str) else o.shape for o in outs])
    wy, _ = _closed(X, G)
    arr = [o for o in outs if not isinstance(o, str)]
    np.testing.assert_allclose(arr[0], wy, rtol=1e-5, atol=1e-5)


def _tensor(device, v, rg=False):
    return pydiff.tensor(np.asarray(v, np.float32), device=device, requires_grad=rg)


def _variant(device, name):
    def run(m):
        st = {}

        def go():
            dev = device
            xt = _tensor(dev, X, True)
            a = 1.5
            g = G
            extra = []
            if name == "prefill":
                with pydiff.Tape() as t0:
                    y0 = m.bk_poly(1.5, -0.5, xt)
                t0.backward(y0, grad=G)
            if name == "x_twice":
                with pydiff.Tape() as tape:
                    y = m.bk_poly(xt, -0.5, xt)
            elif name == "scalar_tensor":
                a = _tensor(dev, [1.5], True)
                with pydiff.Tape() as tape:
                    y = m.bk_poly(a, -0.5, xt)
                extra = [a]
            elif name == "scalar_tensor_nograd":
                a = _tensor(dev, [1.5], False)
                with pydiff.Tape() as tape:
                    y = m.bk_poly(a, -0.5, xt)
            elif name == "x_nograd":
                xt = _tensor(dev, X, False)
                a = _tensor(dev, np.full(X.shape, 1.5), True)
                with pydiff.Tape() as tape:
                    y = m.bk_poly(a, -0.5, xt)
                extra = [a]
            elif name == "int_args":
                with pydiff.Tape() as tape:
                    y = m.bk_poly(2, -1, xt)
            elif name == "two_calls":
                with pydiff.Tape() as tape:
                    y1 = m.bk_poly(1.5, -0.5, xt)
                    y = m.bk_poly(1.5, -0.5, xt)
                tape.backward(y1, grad=G)
                st["y1"] = y1
                extra = [y1]
            elif name == "earlier_y":
                with pydiff.Tape() as tape:
                    y = m.bk_poly(1.5, -0.5, xt)
                    y2 = m.bk_poly(0.5, 0.5, xt)
                extra = [y2]
            elif name == "nested":
                with pydiff.Tape() as outer:
                    with pydiff.Tape() as tape:
                        y = m.bk_poly(1.5, -0.5, xt)
                st["outer"] = outer
            elif name == "two_tapes":
                with pydiff.Tape() as tape:
                    y = m.bk_poly(1.5, -0.5, xt)
                with pydiff.Tape() as t2:
                    y2 = m.bk_poly(1.5, -0.5, xt)
                extra = [y2]
            elif name == "size1":
                xt = _tensor(dev, X[:1], True)
                g = G[:1]
                with pydiff.Tape() as tape:
                    y = m.bk_poly(1.5, -0.5, xt)
            elif name == "size0":
                xt = _tensor(dev, X[:0], True)
                g = G[:0]
                with pydiff.Tape() as tape:
                    y = m.bk_poly(1.5, -0.5, xt)
            elif name == "ones":
                g = None
                with pydiff.Tape() as tape:
                    y = m.bk_poly(1.5, -0.5, xt)
            elif name == "del_y":
                with pydiff.Tape() as tape:
                    y = m.bk_poly(1.5, -0.5, xt)
                tape.backward(y, grad=G)
                return [xt.grad.numpy()]
            else:
                with pydiff.Tape() as tape:
                    y = m.bk_poly(1.5, -0.5, xt)
            st["y"] = y
            if name == "policy_reset":
                with pydiff.zero_policy("reset"):
                    tape.backward(y, grad=g)
            elif name == "policy_strict":
                with pydiff.zero_policy("strict"):
                    tape.backward(y, grad=g)
            else:
                tape.backward(y, grad=g)
            if name == "nested":
                st["outer"].backward(y, grad=G)
            if name == "earlier_y":
                tape.backward(y2, grad=G)
            if name == "two_tapes":
                t2.backward(y2, grad=G)
            out = [y.numpy(), xt.grad.numpy() if xt.grad is not None else np.zeros(1)]
            return out + [(e.grad if e.requires_grad else e).numpy() for e in extra]

        go.after = lambda: [st["y"].numpy()] if "y" in st else []
        return go

    return run


VARIANTS = [
    "prefill",
    "x_twice",
    "scalar_tensor",
    "scalar_tensor_nograd",
    "x_nograd",
    "int_args",
    "two_calls",
    "earlier_y",
    "nested",
    "two_tapes",
    "size1",
    "size0",
    "ones",
    "del_y",
    "policy_reset",
    "policy_strict",
]


@pytest.mark.parametrize("name", VARIANTS)
def test_probe_variants(device, monkeypatch, name):
    stats, outs = _both(device, monkeypatch, _variant(device, name))
    print(name, stats, [o if isinstance(o, str) else o.shape for o in outs])


SOURCE2 = """
import slangpy;
[Differentiable]
float bk_nd(no_diff float a, float b, float x) { return a * x * x + b * x + sin(x); }
"""


def _more(device, name):
    def run(m):
        st = {}

        def go():
            xt = _tensor(device, X, True)
            if name == "vjp":
                y, (ga, gb, gx) = pydiff.vjp(m.bk_poly, (1.5, -0.5, xt), G)
                return [y.numpy(), np.asarray(gx.numpy()), np.asarray(gb, np.float32)]
            if name == "jvp":
                with pydiff.Tape() as tape:
                    y, dy = pydiff.jvp(m.bk_poly, (1.5, -0.5, xt), (None, None, G))
                tape.backward(y, grad=G)
                return [y.numpy(), dy.numpy(), xt.grad.numpy()]
            if name == "function":

                class F(pydiff.Function):
                    @staticmethod
                    def forward(ctx, x):
                        ctx.save_for_backward(x)
                        return m.bk_poly(1.5, -0.5, x)

                    @staticmethod
                    def backward(ctx, gy):
                        (x,) = ctx.saved_tensors
                        xv = x.numpy().astype(np.float64)
                        return pydiff.tensor(
                            (gy.numpy() * (3.0 * xv - 0.5 + np.cos(xv))).astype(np.float32),
                            device=device,
                        )

                with pydiff.Tape() as tape:
                    y = F.apply(xt)
                st["y"] = y
                tape.backward(y, grad=G)
                return [y.numpy(), xt.grad.numpy()]
            if name == "capture":
                ys = []

                def step():
                    with pydiff.Tape() as tape:
                        y = m.bk_poly(1.5, -0.5, xt)
                    tape.backward(y, grad=G)
                    ys.append(y)
                    return y

                step()
                cap = pydiff.capture(step)
                cap.replay()
                return [ys[-1].numpy(), xt.grad.numpy(), cap.result.numpy()]
            if name == "strict_prefilled":
                xt.grad_out.copy_from_numpy(np.full_like(X, 2.0))
                with pydiff.Tape() as tape:
                    y = m.bk_poly(1.5, -0.5, xt)
                st["y"] = y
                with pydiff.zero_policy("strict"):
                    tape.backward(y, grad=G)
                return [y.numpy(), xt.grad.numpy()]
            if name == "prefilled":
                xt.grad_out.copy_from_numpy(np.full_like(X, 2.0))
                with pydiff.Tape() as tape:
                    y = m.bk_poly(1.5, -0.5, xt)
                tape.backward(y, grad=G)
                return [y.numpy(), xt.grad.numpy()]
            if name in ("no_diff", "no_diff_error"):
                m2 = pydiff.load_module_from_source(
                    f"break49c_nd{next(_n)}", SOURCE2, device=device
                )
                a = _tensor(device, np.full(X.shape, 1.5), True)
                with pydiff.Tape() as tape:
                    y = m2.bk_nd(a, -0.5, xt)
                st["y"] = y
                import warnings

                with warnings.catch_warnings():
                    warnings.simplefilter("error" if name == "no_diff_error" else "ignore")
                    tape.backward(y, grad=G)
                return [y.numpy(), xt.grad.numpy()]
            raise AssertionError(name)

        go.after = lambda: [st["y"].numpy()] if "y" in st else []
        return go

    return run


@pytest.mark.parametrize(
    "name",
    [
        "vjp",
        "jvp",
        "function",
        "capture",
        "strict_prefilled",
        "prefilled",
        "no_diff",
        "no_diff_error",
    ],
)
def test_probe_more(device, monkeypatch, name):
    stats, outs = _both(device, monkeypatch, _more(device, name))
    print(name, stats, [o if isinstance(o, str) else o.shape for o in outs])
    if not isinstance(outs[0], str):
        wy, wg = _closed(X, G)
        np.testing.assert_allclose(outs[0], wy, rtol=1e-5, atol=1e-5)


def test_read_of_result_from_warning_hook_during_fused_backward(device, monkeypatch):
    """A warning the backward issues (a no_diff parameter given a tensor that requires a
    gradient) reaches a user's ``warnings.showwarning``, which reads the result: it must see
    the forward's values (the held forward recorded first), as with the hold off."""
    import warnings

    def run(m):
        def go():
            m2 = pydiff.load_module_from_source(f"break49c_nd{next(_n)}", SOURCE2, device=device)
            xt = _tensor(device, X, True)
            a = _tensor(device, np.full(X.shape, 1.5), True)
            with pydiff.Tape() as tape:
                y = m2.bk_nd(a, -0.5, xt)
            seen = []
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = lambda *a, **k: seen.append(y.numpy().copy())
                tape.backward(y, grad=G)
            assert len(seen) == 1
            return [seen[0], y.numpy(), xt.grad.numpy()]

        return go

    stats, outs = _both(device, monkeypatch, run)
    wy, wg = _closed(X, G)
    np.testing.assert_allclose(outs[0], wy, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outs[1], wy, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(outs[2], wg, rtol=1e-5, atol=1e-5)


def test_no_fusion_while_another_python_thread_lives(device, monkeypatch):
    """Between the held forward's claim and the fused dispatch another thread's read of y
    would find nothing held or recorded (stale values): with another Python thread alive the
    backward takes the two kernels, with the same values (float64 closed form)."""
    monkeypatch.setattr(generated, "MIN_ELEMENTS", 1)
    m = pydiff.load_module_from_source(
        "break49c_threads",
        "[Differentiable] float tq(float a, float x) { return a * x * x + sin(x); }",
        device=device,
    )
    rng = np.random.default_rng(7)
    x = rng.standard_normal(3000).astype(np.float32)
    g = rng.standard_normal(3000).astype(np.float32)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        xt = pydiff.tensor(x, device=device, requires_grad=True)
        generated.reset_stats()
        with pydiff.Tape() as tape:
            y = m.tq(1.5, xt)
        tape.backward(y, grad=g)
        assert "forward+backward fused" not in generated.stats(), generated.stats()
    finally:
        stop.set()
        other.join()
    x64, g64 = x.astype(np.float64), g.astype(np.float64)
    np.testing.assert_allclose(y.numpy(), 1.5 * x64**2 + np.sin(x64), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        xt.grad.numpy(), g64 * (3.0 * x64 + np.cos(x64)), rtol=1e-5, atol=1e-5
    )
