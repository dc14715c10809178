"""fix48b: user traps a breaker met, each against an independent reference (NumPy's own
``astype`` in float64, closed forms), each failing before its fix.

- ``x.astype("double")`` (and ``np.float64``) was refused ("pydiff has no float64 tensors")
  while ``pydiff.tensor(..., dtype="double")`` made one; an explicit ``dtype=np.float64``
  in the constructors made a float32 tensor. ``astype`` now takes every dtype the
  constructors do, an explicit float64 is ``double`` in both, and a tensor that needs a
  gradient on a tape is refused by name (a double tensor cannot carry one).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import pydiff

VALUES = np.array([0.1, -2.5, 3.75, 1e-3, -7.9, 12345.678], np.float32)


@pytest.mark.parametrize("dtype", ["double", np.float64, "float64", np.dtype(np.float64)])
def test_astype_double_matches_numpy(dtype):
    x = pydiff.tensor(VALUES)
    y = x.astype(dtype)
    assert y.dtype == "double"
    got = y.numpy()
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, VALUES.astype(np.float64))  # float32 -> float64: exact


def test_astype_from_double_matches_numpy():
    v = np.array([0.1, -2.5, 1.0 / 3.0, 2049.0, -7.9, 1e-7, 65504.0], np.float64)
    d = pydiff.tensor(v, dtype="double")
    np.testing.assert_array_equal(d.astype("float").numpy(), v.astype(np.float32))
    np.testing.assert_array_equal(d.astype("half").numpy(), v.astype(np.float16))
    np.testing.assert_array_equal(d.astype("int").numpy(), np.trunc(v).astype(np.int32))
    np.testing.assert_array_equal(d.astype("double").numpy(), v)


def test_astype_double_vectors_and_ints():
    v = np.arange(6.0).reshape(2, 3) * 1.25 - 3.0
    got = pydiff.tensor(v, dtype="float3").astype("double3").numpy()
    np.testing.assert_array_equal(got, v.astype(np.float32).astype(np.float64))
    i = pydiff.tensor(np.array([-3, 0, 2**24 + 1], np.int32))  # exact in float64, not float32
    np.testing.assert_array_equal(i.astype("double").numpy(), [-3.0, 0.0, 2.0**24 + 1])


def test_astype_from_double_refuses_what_the_constructor_refuses():
    d = pydiff.tensor([1e39, 1.0], dtype="double")
    with pytest.raises(ValueError, match="Tensor.astype"):
        d.astype("float")  # NumPy gives inf
    with pytest.raises(ValueError, match="Tensor.astype"):
        pydiff.tensor([2.0**31, 0.0], dtype="double").astype("int")  # NumPy wraps


@pytest.mark.parametrize("make", ["tensor", "zeros", "full"])
def test_explicit_float64_dtype_is_double(make):
    f = {
        "tensor": lambda dt: pydiff.tensor([0.1, 2.0**53], dtype=dt),
        "zeros": lambda dt: pydiff.zeros((2,), dtype=dt),
        "full": lambda dt: pydiff.full((2,), 0.1, dtype=dt),
    }[make]
    for dt in (np.float64, "float64"):
        t = f(dt)
        assert t.dtype == "double", (make, dt, t.dtype)
        assert t.numpy().dtype == np.float64
    if make == "tensor":
        np.testing.assert_array_equal(f(np.float64).numpy(), [0.1, 2.0**53])  # not rounded


def test_astype_double_on_tape_with_gradient_is_refused_by_name():
    x = pydiff.tensor(VALUES, requires_grad=True)
    with pydiff.Tape():
        with pytest.raises(TypeError, match=r"astype\('double'\).*cannot carry"):
            x.astype("double")
        y = x.detach().astype("double")  # the values only: allowed
    np.testing.assert_array_equal(y.numpy(), VALUES.astype(np.float64))
    off = x.astype(np.float64)  # off a tape: a copy without a gradient, as astype('float')
    assert off.dtype == "double" and not off.requires_grad


def test_astype_float_half_gradient_still_carried():
    # d/dx sum(2 * half(x)) = 2 wherever half(x) is finite: a central difference of that sum.
    x = pydiff.tensor(np.array([0.5, -1.25, 3.0], np.float32), requires_grad=True)
    with pydiff.Tape() as tape:
        y = (x.astype("half").astype("float") * 2.0).sum()
    tape.backward(y)
    h = 1e-2
    fd = [(2.0 * (np.float16(v + h)) - 2.0 * np.float16(v - h)) / (2 * h) for v in x.numpy()]
    np.testing.assert_allclose(x.grad.numpy(), np.array(fd, np.float64), rtol=0.05)


# - A module function named as a Slang built-in (``lerp``, ``saturate``) failed at its call
#   with SlangPy's raw overload listing and a hint after it; it now raises
#   ``pydiff.BuiltinNameError`` (a TypeError) naming the function, the file and line of its
#   definition and the rename, with SlangPy's report attached.

BUILTIN_SRC = """// a user's helpers
float lerp(float a, float b, float t) { return a + (b - a) * t; }

[Differentiable]
float saturate(float x) { return x < 0.0 ? 0.0 : (x > 1.0 ? 1.0 : x); }
float my_mix(float a, float b, float t) { return a + (b - a) * t; }
"""


def test_builtin_named_function_error_names_file_line_and_rename(tmp_path):
    path = tmp_path / "helpers48.slang"
    path.write_text(BUILTIN_SRC)
    m = pydiff.load_module(str(path))
    a = pydiff.tensor([0.0, 2.0])
    with pytest.raises(pydiff.BuiltinNameError) as info:
        m.lerp(a, a, a, _result="tensor")
    msg = str(info.value)
    assert isinstance(info.value, TypeError)  # (as the overload errors before)
    assert f"{path}:2" in msg, msg
    assert "Rename your function" in msg and "my_lerp" in msg, msg
    assert "SlangPy's report:" in msg and "Could not call function 'lerp'" in msg, msg
    x = pydiff.tensor([-0.5, 0.25, 3.0], requires_grad=True)
    with pytest.raises(pydiff.BuiltinNameError, match=rf"{re.escape(str(path))}:5"):
        m.saturate(x, _result="tensor")
    # the same body under another name: a + (b - a) t in closed form
    t = np.array([0.0, 0.5, 1.0], np.float32)
    got = m.my_mix(pydiff.tensor([1.0] * 3), pydiff.tensor([3.0] * 3), pydiff.tensor(t))
    np.testing.assert_allclose(np.asarray(got), 1.0 + 2.0 * t.astype(np.float64), rtol=1e-6)


def test_builtin_named_function_from_source_names_its_line():
    m = pydiff.load_module_from_source("fix48b_builtins", BUILTIN_SRC)
    with pytest.raises(TypeError, match=r"Slang built-in.*<fix48b_builtins>:2\)") as info:
        m.lerp(pydiff.tensor([1.0]), pydiff.tensor([2.0]), pydiff.tensor([0.5]))
    assert "Slang built-in functions" in str(info.value)


def test_own_names_get_no_builtin_error():
    m = pydiff.load_module_from_source("fix48b_own", BUILTIN_SRC)
    with pytest.raises(TypeError) as info:  # an int tensor where every overload takes float
        m.my_mix(pydiff.zeros((2, 2, 2), dtype="int"), 1, 2, 3, _result="tensor")
    assert not isinstance(info.value, pydiff.BuiltinNameError)
    assert "built-in" not in str(info.value)


# - A tape's backward run again (the same recorded calls) copied every gradient buffer it
#   writes each time (31 device copies for 10 calls), to restore them if a call refused
#   part-way: the entries were marked "may refuse" at recording, when their backward had never
#   run. That is now asked again at each backward: once the layouts ran, nothing is kept.

CHAIN_SRC = """
[Differentiable] float sq48(float x) { return x * x; }
[Differentiable] float sn48(float x) { return sin(x); }
"""


def test_second_backward_of_a_tape_keeps_no_gradient_copies(monkeypatch):
    from pydiff import grad_restore

    m = pydiff.load_module_from_source("fix48b_chain", CHAIN_SRC)  # (never ran .bwds)
    xs = np.linspace(-1.0, 1.0, 16).astype(np.float32)
    x = pydiff.tensor(xs, requires_grad=True)
    with pydiff.Tape() as tape:
        h = m.sn48(m.sq48(x, _result="tensor"), _result="tensor")
    kept = []
    keep = grad_restore.GradSnapshot.keep
    monkeypatch.setattr(
        grad_restore.GradSnapshot, "keep", lambda self, g: (kept.append(g), keep(self, g))[1]
    )
    x64 = xs.astype(np.float64)
    want = np.cos(x64**2) * 2.0 * x64  # d/dx sin(x^2)
    tape.backward(h, grad=np.ones(16))
    first = len(kept)
    assert first > 0  # the first backward may refuse part-way: its buffers are kept
    np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-5, atol=1e-6)
    for _ in range(2):
        x.zero_grad()
        tape.backward(h, grad=np.ones(16))
        np.testing.assert_allclose(x.grad.numpy(), want, rtol=1e-5, atol=1e-6)
    assert len(kept) == first, (first, len(kept))
