""".bwds of a forward call whose input was written between the call and .bwds: refused with
ValueError (naming the function, the parameter and the writer) on every path (full, call
plans, generated kernels), not a gradient silently taken at the new values. Against closed
forms in float64 (d(x^2)/dx = 2x), PyTorch's version-counter rule."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import generated

SOURCE = """
[Differentiable] float sq(float x) { return x * x; }
[Differentiable] float twice(float x) { return 2.0 * x; }
[Differentiable] float mulxw(float x, float w) { return x * w; }
[Differentiable] void sq_out(float x, out float y) { y = x * x; }
[Differentiable] void scale_inout(float s, inout float v) { v = v * s; }
"""

SIZES = [16, 1 << 16]


@pytest.fixture(scope="module")
def m(device):
    return pydiff.load_module_from_source("s35_stale", SOURCE, device=device)


def _values(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0.5, 2.0, n).astype(np.float32)


def _fresh(m) -> None:
    for fn in (m.sq, m.twice, m.mulxw, m.sq_out, m.scale_inout):
        fn.plans.clear()
        fn.bwds_plans.clear()


def _round(m, a, y):
    """One legal forward + .bwds of sq at a's current values (plans and kernels warm up)."""
    m.sq(a, _result=y)
    y.grad.fill(1.0)
    m.sq.bwds(a, _result=y)
    a.grad.zero_()


def _writers(m, device, n):
    other = _values(n, 7)
    b = pydiff.tensor(other, device=device)

    def sgd(a):
        a.grad.fill(1.0)
        pydiff.optim.SGD([a], lr=0.5).step()

    return {
        "later call of the same function": (
            lambda a: m.sq(b, _result=a),
            "s35_stale.sq (forward call)",
        ),
        "copy_from_numpy": (lambda a: a.copy_from_numpy(other), "copy_from_numpy"),
        "fill": (lambda a: a.fill(3.0), ""),
        "another function": (
            lambda a: m.twice(b, _result=a),
            "s35_stale.twice (forward call)",
        ),
        "copy_ of an op's result": (lambda a: a.copy_(pydiff.ops.mul(b, b)), ""),
        "optimizer step": (sgd, "SGD.step"),
        "write through a view": (lambda a: a.reshape((n, 1)).fill(-1.0), ""),
        "write through detach": (lambda a: a.detach().copy_from_numpy(other), ""),
    }


WRITERS = [
    "later call of the same function",
    "copy_from_numpy",
    "fill",
    "another function",
    "copy_ of an op's result",
    "optimizer step",
    "write through a view",
    "write through detach",
]


@pytest.mark.parametrize("path", ["full", "plans", "forced generated"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("writer", WRITERS)
def test_input_written_after_the_call_is_refused(device, m, forced, path, n, writer):
    if path != "forced generated":
        forced.setattr(generated, "MIN_ELEMENTS", 4096)  # (the fixture's default size)
    _fresh(m)
    a = pydiff.tensor(_values(n), requires_grad=True, device=device)
    y = pydiff.zeros((n,), device=device).with_grads()
    if path != "full":
        for _ in range(3):
            _round(m, a, y)
    generated.reset_stats()
    write, writer_label = _writers(m, device, n)[writer]
    read = a.numpy().astype(np.float64)
    m.sq(a, _result=y)  # reads a
    write(a)  # a is written after the call, before its .bwds
    grad_before = a.grad.numpy().copy()
    y.grad.fill(1.0)
    with pytest.raises(ValueError, match=r"parameter 'x'") as err:
        m.sq.bwds(a, _result=y)
    message = str(err.value)
    assert "s35_stale.sq.bwds" in message and a.storage.last_writer in message
    assert writer_label in message and "pydiff.Tape" in message
    np.testing.assert_array_equal(a.grad.numpy(), grad_before)  # nothing written
    if path == "plans":
        assert m.sq.plans and m.sq.bwds_plans
    if path == "forced generated" or n >= 4096:
        assert generated.stats().get("forward", 0) > 0
    # what the message says: rerun the forward call, then .bwds differentiates there
    now = a.numpy().astype(np.float64)
    a.grad.zero_()
    m.sq(a, _result=y)
    m.sq.bwds(a, _result=y)
    np.testing.assert_allclose(a.grad.numpy(), 2 * now, rtol=1e-6)
    # or a copy of the values read, passed to .bwds
    kept = pydiff.tensor(read.astype(np.float32), device=device).with_grads()
    m.sq.bwds(kept, _result=y)
    np.testing.assert_allclose(kept.grad.numpy(), 2 * read, rtol=1e-6)


@pytest.mark.parametrize("n", SIZES)
def test_result_made_by_plan_or_kernel_is_checked(device, m, forced, n):
    """_result='tensor' (a new result, returned by a plan or a generated kernel)."""
    _fresh(m)
    a = pydiff.tensor(_values(n), requires_grad=True, device=device)
    for k in range(4):  # the full path first, then the plan (a generated kernel: forced)
        y = m.sq(a).with_grads()
        a.fill(float(k + 1))
        y.grad.fill(1.0)
        with pytest.raises(ValueError, match=r"sq\.bwds: parameter 'x'.*a host write"):
            m.sq.bwds(a, _result=y)
    assert m.sq.plans and generated.stats().get("forward", 0) > 0


def test_the_repro(device, m):
    a = pydiff.tensor(np.array([1, 2, 3], np.float32), requires_grad=True, device=device)
    b = pydiff.tensor(np.array([10, 20, 30], np.float32), device=device)
    y = m.sq(a).with_grads()
    m.sq(b, _result=a)
    y.grad.fill(1.0)
    with pytest.raises(ValueError, match="s35_stale.sq.bwds: parameter 'x'"):
        m.sq.bwds(a, _result=y)
    np.testing.assert_array_equal(a.grad.numpy(), 0.0)


def test_second_input_and_written_parameters(device, m):
    """Another read parameter (w), an out parameter's tensor, an inout call's other input."""
    x = pydiff.tensor(_values(16), requires_grad=True, device=device)
    w = pydiff.tensor(_values(16, 1), requires_grad=True, device=device)
    y = m.mulxw(x, w).with_grads()
    w.fill(5.0)
    y.grad.fill(1.0)
    with pytest.raises(ValueError, match=r"mulxw\.bwds: parameter 'w'"):
        m.mulxw.bwds(x, w, _result=y)
    o = pydiff.zeros((16,), device=device).with_grads()
    m.sq_out(x, o)
    x.fill(2.0)
    o.grad.fill(1.0)
    with pytest.raises(ValueError, match=r"sq_out\.bwds: parameter 'x'.*parameter 'y'"):
        m.sq_out.bwds(x, o)
    s = pydiff.tensor(_values(16, 2), requires_grad=True, device=device)
    v = pydiff.tensor(_values(16, 3), requires_grad=True, device=device)
    m.scale_inout(s, v)
    s.fill(4.0)
    v.grad.fill(1.0)
    with pytest.raises(ValueError, match=r"scale_inout\.bwds: parameter 's'"):
        m.scale_inout.bwds(s, v)


# --------------------------------------------------------------------------------------------
# what stays allowed


@pytest.mark.parametrize("n", SIZES)
def test_optimizer_loop_rerunning_the_forward_call(device, m, n):
    """y = f(x); step; f(x, _result=y); f.bwds(x, _result=y): the forward re-made y."""
    _fresh(m)
    x0 = _values(n)
    x = pydiff.tensor(x0, requires_grad=True, device=device)
    y = m.sq(x).with_grads()
    opt = pydiff.optim.SGD([x], lr=0.1)
    want = x0.astype(np.float64)
    for _ in range(5):
        m.sq(x, _result=y)
        y.grad.fill(1.0)
        opt.zero_grad()
        m.sq.bwds(x, _result=y)
        np.testing.assert_allclose(x.grad.numpy(), 2 * want, rtol=1e-5)
        opt.step()
        want = want - 0.1 * 2 * want
    np.testing.assert_allclose(x.numpy(), want, rtol=1e-5)


def test_bwds_twice_and_other_tensors(device, m):
    a0 = _values(16)
    a = pydiff.tensor(a0, requires_grad=True, device=device)
    y = m.sq(a).with_grads()
    y.grad.fill(1.0)
    m.sq.bwds(a, _result=y)
    m.sq.bwds(a, _result=y)  # .bwds writes no values: the second one is the same call's
    np.testing.assert_allclose(a.grad.numpy(), 4 * a0.astype(np.float64), rtol=1e-6)
    # another tensor than the one the call read: the caller's choice
    c0 = _values(16, 5)
    c = pydiff.tensor(c0, requires_grad=True, device=device)
    a.fill(9.0)
    m.sq.bwds(c, _result=y)
    np.testing.assert_allclose(c.grad.numpy(), 2 * c0.astype(np.float64), rtol=1e-6)
    # another function's .bwds given y: not the call that made it
    m.twice.bwds(a, _result=y)
    np.testing.assert_allclose(a.grad.numpy(), 4 * a0.astype(np.float64) + 2, rtol=1e-6)


def test_in_place_call_with_a_kept_copy(device, m):
    """A later in-place call of the same function keeps the values it read: when they are
    those the first call read, .bwds uses them (as before); when not, refused."""
    x0 = _values(16)
    x = pydiff.tensor(x0, requires_grad=True, device=device)
    y = m.sq(x).with_grads()
    m.sq(x, _result=x)  # reads x (the same values), keeps a copy, overwrites it
    y.grad.fill(1.0)
    m.sq.bwds(x, _result=y)
    np.testing.assert_allclose(x.grad.numpy(), 2 * x0.astype(np.float64), rtol=1e-6)
    z = pydiff.tensor(x0, requires_grad=True, device=device)
    y = m.sq(z).with_grads()
    z.fill(5.0)
    m.sq(z, _result=z)  # its copy holds 5s, not what the call that made y read
    y.grad.fill(1.0)
    with pytest.raises(ValueError, match=r"sq\.bwds: parameter 'x'"):
        m.sq.bwds(z, _result=y)


def test_tape_keeps_working(device, m):
    a0 = _values(16)
    a = pydiff.tensor(a0, requires_grad=True, device=device)
    with pydiff.Tape() as tape:
        y = m.sq(a)
    tape.backward(y, grad=np.ones(16, np.float32))
    np.testing.assert_allclose(a.grad.numpy(), 2 * a0.astype(np.float64), rtol=1e-6)
    # in place on a tape: the tape's own copies, then its own version check
    s = pydiff.tensor(np.full(16, 3.0, np.float32), requires_grad=True, device=device)
    v = pydiff.tensor(a0, requires_grad=True, device=device)
    with pydiff.Tape() as tape:
        m.scale_inout(s, v)
        m.scale_inout(s, v)
        loss = pydiff.ops.sum(v)
    tape.backward(loss)
    np.testing.assert_allclose(v.grad.numpy(), 9.0, rtol=1e-6)
    np.testing.assert_allclose(s.grad.numpy(), 2 * 3.0 * a0.astype(np.float64), rtol=1e-5)
    with pydiff.Tape() as tape:
        y = m.sq(a)
    a.fill(1.0)
    with pytest.raises(RuntimeError, match="overwritten"):
        tape.backward(y, grad=np.ones(16, np.float32))


def test_gradcheck_still_works(device, m):
    x = pydiff.tensor(_values(8), requires_grad=True, device=device)
    assert pydiff.gradcheck(m.sq, (x,))
    w = pydiff.tensor(_values(8, 1), requires_grad=True, device=device)
    assert pydiff.gradcheck(m.mulxw, (x, w))


def test_tensor_in_a_struct_field(device):
    m = pydiff.load_module_from_source(
        "s35_struct",
        """
        struct P : IDifferentiable { float a; float b; };
        [Differentiable] float ps(P p, float x) { return p.a * x * x + p.b; }
        """,
        device=device,
    )
    a0, x0 = _values(8), _values(8, 1)
    a = pydiff.tensor(a0, requires_grad=True, device=device)
    x = pydiff.tensor(x0, requires_grad=True, device=device)
    y = m.ps({"a": a, "b": 1.0}, x).with_grads()
    y.grad.fill(1.0)
    m.ps.bwds({"a": a, "b": 1.0}, x, _result=y)
    a64, x64 = a0.astype(np.float64), x0.astype(np.float64)
    np.testing.assert_allclose(x.grad.numpy(), 2 * a64 * x64, rtol=1e-6)
    a.fill(2.0)
    with pytest.raises(ValueError, match=r"ps\.bwds: parameter 'p\.a'.*field p\.a"):
        m.ps.bwds({"a": a, "b": 1.0}, x, _result=y)
    np.testing.assert_allclose(x.grad.numpy(), 2 * a64 * x64, rtol=1e-6)  # unchanged


INOUT = """
[Differentiable] void s35_sqio(inout float y) { y = y * y; }
[Differentiable] void s35_scale_inout(float s, inout float v) { v = v * s; }
"""


@pytest.mark.parametrize("grads", ["requires_grad", "with_grads", "none"])
def test_inout_written_since_the_call_is_refused_unless_restored(device, grads):
    """break35: an in-place call, then a host write of its tensor: .bwds differentiated at the
    new values (2 * 3 for every element, not 2 * [1, 2, 3, 4]), silently. Refused now; a
    write that puts back exactly the values the call read (SlangPy's idiom) is allowed where
    pydiff kept a copy to compare with (the tensor had gradient buffers at the call)."""
    m = pydiff.load_module_from_source("s35_stale_inout", INOUT, device=device)
    xs = np.arange(1, 5, dtype=np.float32)
    v = pydiff.tensor(xs, device=device, requires_grad=grads == "requires_grad")
    v = v.with_grads() if grads == "with_grads" else v
    m.s35_sqio(v)
    np.testing.assert_allclose(v.numpy(), xs.astype(np.float64) ** 2)
    v.fill(3.0)
    v = v if v.grad is not None else v.with_grads()
    v.grad.fill(1.0)
    with pytest.raises(ValueError, match=r"parameter 'y' .*wrote it since"):
        m.s35_sqio.bwds(v)
    v.copy_from_numpy(xs)  # the values the call read, put back
    if grads == "none":  # (no copy kept at the call: nothing to compare with)
        with pytest.raises(ValueError, match=r"parameter 'y' .*wrote it since"):
            m.s35_sqio.bwds(v)
        return
    m.s35_sqio.bwds(v)
    np.testing.assert_allclose(v.grad.numpy(), 2.0 * xs)
    s = pydiff.tensor(np.full(4, 2.0, np.float32), device=device, requires_grad=True)
    w = pydiff.tensor(xs, device=device, requires_grad=True)
    m.s35_scale_inout(s, w)
    w.fill(10.0)
    w.grad.fill(1.0)
    with pytest.raises(ValueError, match=r"parameter 'v' .*wrote it since"):
        m.s35_scale_inout.bwds(s, w)
    assert not np.any(s.grad.numpy())
