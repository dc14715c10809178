"""Session 41, review: holes left by the session's merged work, each checked against closed
forms or NumPy (never against pydiff's own output)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import pydiff

X = np.array([0.3, -0.7, 1.1])


class _Returns(pydiff.Function):
    ret = None

    @staticmethod
    def forward(ctx, x):
        return x * 2.0

    @staticmethod
    def backward(ctx, g):
        return _Returns.ret()


def test_function_backward_float_tensor_beyond_half_is_refused(device):
    # Before: a float32 gradient tensor of 1e5 (finite) for a half input was added as inf
    # without a word (only float64 gradients were checked). Now refused as float64 ones are,
    # naming the Function and the input, with the gradient unchanged.
    big = np.array([1e5, 1.0, 2.0], np.float32)
    _Returns.ret = lambda: pydiff.tensor(big, device=device)
    x = pydiff.tensor(X, dtype="half", device=device, requires_grad=True)
    x.grad.copy_from_numpy(np.ones(3, np.float16))
    with pydiff.Tape() as tape:
        s = _Returns.apply(x).sum()
    with pytest.raises(OverflowError, match=r"_Returns\.backward\(\) gradient 0 .*half.*100000"):
        tape.backward(s)
    np.testing.assert_array_equal(x.grad.numpy(), np.ones(3, np.float16))
    # in range: added (1 + the returned values, in half)
    ok = np.array([1e4, 1.0, 2.0], np.float32)
    _Returns.ret = lambda: pydiff.tensor(ok, device=device)
    with pydiff.Tape() as tape:
        s = _Returns.apply(x).sum()
    tape.backward(s)
    np.testing.assert_array_equal(x.grad.numpy(), (1.0 + ok).astype(np.float16))


MUL2 = """
[Differentiable] float f(float a, float b) { return a * b; }
[Differentiable] float prod2(float a, float b) { return a * b; }
"""


def test_refused_aliasing_on_a_tape_leaves_earlier_gradients(device):
    # Before: f's layout had run on a tape (b a copy of x.grad), so a tape of the same layout
    # with b = x.grad itself was taken as one that refuses nothing; under RESET f's backward
    # is refused (it would read x.grad after zeroing it) after prod2's entry had reset and
    # added into w.grad: w.grad came out x * 2 = [1, 2, 3, 4] where 9 (unchanged) is right.
    # Now a call reading a gradient buffer of its own arguments is kept and put back.
    m = pydiff.load_module_from_source("s41_review_alias", MUL2, device=device)
    n = 4
    xs = np.linspace(0.5, 2.0, n)

    def run(copy):
        x = pydiff.tensor(xs, device=device, requires_grad=True)
        x.grad.copy_from_numpy(np.full(n, 2.0, np.float32))
        w = pydiff.tensor(np.full(n, 3.0), device=device, requires_grad=True)
        w.grad.copy_from_numpy(np.full(n, 9.0, np.float32))
        with pydiff.zero_policy("reset"):
            with pydiff.Tape() as tape:
                h = m.f(x, x.grad.copy_values() if copy else x.grad, _result="tensor")
                y = m.prod2(w, h, _result="tensor")
            tape.backward(y, grad=np.ones(n, np.float32))
        return x, w

    x, w = run(copy=True)  # d/dx sum(w x b) = w b = 6; d/dw = x b = 2x
    np.testing.assert_allclose(x.grad.numpy(), np.full(n, 6.0), rtol=1e-6)
    np.testing.assert_allclose(w.grad.numpy(), 2.0 * xs, rtol=1e-6)
    with pytest.raises(ValueError, match=r"parameter 'b' reads the gradient buffer of .*'a'"):
        run(copy=False)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    w = pydiff.tensor(np.full(n, 3.0), device=device, requires_grad=True)
    w.grad.copy_from_numpy(np.full(n, 9.0, np.float32))
    x.grad.copy_from_numpy(np.full(n, 2.0, np.float32))
    with pydiff.zero_policy("reset"):
        with pydiff.Tape() as tape:
            h = m.f(x, x.grad, _result="tensor")
            y = m.prod2(w, h, _result="tensor")
        with pytest.raises(ValueError, match=r"reads the gradient buffer"):
            tape.backward(y, grad=np.ones(n, np.float32))
    np.testing.assert_array_equal(w.grad.numpy(), np.full(n, 9.0, np.float32))
    np.testing.assert_array_equal(x.grad.numpy(), np.full(n, 2.0, np.float32))


def test_blocking_follows_block_accumulators(monkeypatch):
    # Before: blocking() was memoized on its arguments, accumulators=None included, so a
    # BLOCK_ACCUMULATORS set after a first call kept the old answer: 16 x 16 x 16 in 8 x 16
    # blocks (128 accumulators) where 32 give 8 x 4 (small blocks: 4 columns, 32 / 4 rows).
    from pydiff import product_kernels

    assert product_kernels.blocking("mm_nn", 16, 16, 16) == (8, 16)
    monkeypatch.setattr(product_kernels, "BLOCK_ACCUMULATORS", 32)
    assert product_kernels.blocking("mm_nn", 16, 16, 16) == (8, 4)


SRC3 = """
[Differentiable] float f(float a, float b) { return a * b; }
[Differentiable] float prod2(float a, float b) { return a * b; }
[Differentiable] float add(float a, float b) { return a + b; }
"""


@pytest.mark.parametrize("policy", ["accumulate", "reset"])
def test_tape_call_reading_a_gradient_a_later_call_adds_into(device, policy):
    # y = w * f(x, x.grad) + x * w, with x.grad = 2 when f read it. Before, ACCUMULATE: the
    # backward of x * w (recorded later, run first) added w = 3 into x.grad, then f's
    # backward read b = 5 there: x.grad came out 20 where 2 + w*2 + w = 11 is right, without
    # a word; RESET: refused part-way (StaleInputError). Now refused before anything is
    # written, naming both calls; recorded in the other order it runs and is right.
    m = pydiff.load_module_from_source("s41_review_order", SRC3, device=device)
    n = 4
    xs = np.linspace(0.5, 2.0, n)

    def run(late):
        x = pydiff.tensor(xs, device=device, requires_grad=True)
        x.grad.copy_from_numpy(np.full(n, 2.0, np.float32))
        w = pydiff.tensor(np.full(n, 3.0), device=device, requires_grad=True)
        w.grad.copy_from_numpy(np.full(n, 1.0, np.float32))
        with pydiff.zero_policy(policy):
            with pydiff.Tape() as tape:
                y2 = None if late else m.prod2(x, w, _result="tensor")
                h = m.f(x, x.grad, _result="tensor")
                y1 = m.prod2(w, h, _result="tensor")
                y2 = m.prod2(x, w, _result="tensor") if late else y2
                y = m.add(y1, y2, _result="tensor")
            tape.backward(y, grad=np.ones(n, np.float32))
        return x, w

    with pytest.raises(ValueError, match=r"parameter 'b' of .*f .*call #1.*gradient buffer"):
        run(late=True)
    if policy == "reset":  # f's own backward would clear x.grad before reading it: refused
        with pytest.raises(ValueError, match=r"RESET zeroing policy clears"):
            run(late=False)
        return
    x, w = run(late=False)  # x * w's backward runs last: f's reads 2 (then adds 6 itself)
    np.testing.assert_allclose(x.grad.numpy(), 2.0 + 3.0 * 2.0 + 3.0, rtol=1e-6)
    np.testing.assert_allclose(w.grad.numpy(), 1.0 + 2.0 * xs + xs, rtol=1e-6)


def test_tape_call_reading_a_result_gradient_is_refused(device):
    # A call reading the gradient buffer of a result on the same tape (zeroed when the
    # backward starts). Before: refused by that call's own stale-input check, when its
    # backward came (the zeroing is a write), after later calls' backwards ran. Now refused
    # before anything is written, naming the call whose result's buffer it is.
    m = pydiff.load_module_from_source("s41_review_result", SRC3, device=device)
    n = 4
    x = pydiff.tensor(np.linspace(0.5, 2.0, n), device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        h = m.prod2(x, x, _result="tensor")
        h.grad.copy_from_numpy(np.full(n, 5.0, np.float32))
        y = m.f(h, h.grad, _result="tensor")
    with pytest.raises(ValueError, match=r"gradient buffer of the result of call #\d+ \(.*prod2\)"):
        tape.backward(y, grad=np.ones(n, np.float32))
    np.testing.assert_array_equal(x.grad.numpy(), np.zeros(n, np.float32))


def test_failed_device_keeps_a_slot_folder_it_did_not_make(tmp_path):
    # Before: a device that failed to open beside another of this process on the same cache
    # removed its shader slot folder (shaders-2) even where an earlier run had made it: the
    # kernels cached there (and another process's database, if open) were deleted. Now only
    # a folder this process made is removed, as for the type folder.
    from pydiff import compile_cache

    first = compile_cache.prepare(tmp_path, "vulkan")  # (this process's first device)
    _, shaders = compile_cache.paths_for(tmp_path, "vulkan")
    earlier = shaders.with_name(f"{shaders.name}-2")
    earlier.mkdir(parents=True)
    (earlier / "kept.txt").write_text("an earlier run's kernels")
    second = compile_cache.prepare(tmp_path, "vulkan")
    assert second is not None and second[1] == str(earlier)
    compile_cache.discard_new(second)  # (its device failed to open)
    assert (earlier / "kept.txt").read_text() == "an earlier run's kernels"
    (earlier / "kept.txt").unlink()
    earlier.rmdir()
    made = compile_cache.prepare(tmp_path, "vulkan")  # the slot is free again, made anew
    assert made is not None and made[1] == str(earlier) and earlier.is_dir()
    compile_cache.discard_new(made)
    assert not earlier.exists() and Path(first[1]).is_dir()
    compile_cache.discard_new(first)
