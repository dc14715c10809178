"""Session 48 (fix48): leftovers of s47. References: closed-form derivatives, exact integers."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import pydiff

SOURCE = """
import slangpy;
[Differentiable]
float ex(float x) { return exp(x); }
"""


@pytest.fixture
def exps(device):
    return pydiff.load_module_from_source("s48_fix48", SOURCE, device=device)


def _flow_warnings(call) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught if issubclass(w.category, pydiff.GradientFlowWarning)]


@pytest.mark.parametrize("taken", ["native", "bwds"])
def test_handle_of_a_detached_tensor_is_not_warned_of(device, exps, taken):
    # x's handle handed out too (by the user, or by a call given x): the detached tensor's
    # handle shares x's buffer but says no gradient is wanted; it was warned of as x's (s47).
    xs = np.linspace(-1.0, 1.0, 6).astype(np.float32)
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    if taken == "native":
        kept = x.native
    else:
        exps.ex.bwds(x, _result=1.0)
        np.testing.assert_allclose(x.grad.numpy(), np.exp(xs.astype(np.float64)), rtol=1e-5)
    view = pydiff.Tensor(x.detach().native, device)
    np.testing.assert_array_equal(view.numpy(), xs)
    assert _flow_warnings(lambda: exps.ex.bwds(view, _result=1.0)) == []
    # x's own handle, wrapped, is still warned of (a message of its own: another shape, as
    # GradientFlowWarning is once per message and line).
    n = 5 if taken == "native" else 7
    ys = np.linspace(-1.0, 1.0, n).astype(np.float32)
    y = pydiff.tensor(ys, device=device, requires_grad=True)
    kept = y.detach().native  # (a detached handle alive alongside)
    wrapped = pydiff.Tensor(y.native, device)
    got = _flow_warnings(lambda: exps.ex.bwds(wrapped, _result=1.0))
    assert any("handle" in m and f"({n},)" in m for m in got), got
    del kept


IDENTITY = """
import slangpy;
float f(float x) { return x; }
int g(int x) { return x; }
int64_t h(int64_t x) { return x; }
"""

# Lists NumPy rounds on conversion (float64: ints mixed with floats, or past int64), or whose
# int a float cannot hold: each int checked against exact Python integer arithmetic.
ROUNDED = [
    [2**63 + 1, 0],
    [[2**63 + 1], [0]],
    [2**63 + 1, 0.5],
    [2**53 + 1, 0.5],
    [[2**24 + 1, 0.5], [1, 2]],
]


def _inexact(values, dtype) -> bool:
    """Whether some int of the nested list does not survive dtype (Python ints: exact)."""
    flat = [v for row in values for v in (row if isinstance(row, (list, tuple)) else [row])]
    return any(int(np.array(v, dtype=object).astype(dtype)) != v for v in flat if type(v) is int)


@pytest.fixture
def ids(device):
    return pydiff.load_module_from_source("s48_fix48_ids", IDENTITY, device=device)


@pytest.mark.parametrize("values", ROUNDED, ids=str)
def test_a_list_whose_ints_numpy_or_the_dtype_rounds_is_refused(device, ids, values):
    assert _inexact(values, np.float32)  # (the premise: float32 cannot hold them)
    with pytest.raises(ValueError, match=r"parameter 'x'.*integer \d+ has no exact"):
        ids.f(values)
    with pytest.raises(ValueError, match=r"pydiff.tensor: data.*integer \d+ has no exact"):
        pydiff.tensor(values, device=device)
    with pytest.raises(ValueError, match=r"copy_from_numpy.*integer \d+ has no exact"):
        pydiff.tensor(np.zeros(np.shape(values)), device=device).copy_from_numpy(values)
    with pytest.raises(ValueError, match=r"with_tangent: tangent.*integer \d+ has no exact"):
        pydiff.tensor(np.zeros(np.shape(values)), device=device).with_tangent(values)
    x = pydiff.tensor(np.ones(np.shape(values)), device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = x * 2.0
    with pytest.raises(ValueError, match=r"tape.backward: grad.*integer \d+ has no exact"):
        tape.backward(y, values)
    with pytest.raises(ValueError, match=r"jvp: primal 0.*integer \d+ has no exact"):
        pydiff.jvp(lambda v: v * 2.0, (values,), (np.ones(np.shape(values)).tolist(),))
    if _inexact(values, np.float64):  # (NumPy's own float64 rounded it: an int64 too)
        with pytest.raises(ValueError, match=r"parameter 'x'.*NumPy made float64"):
            ids.h(values)


def test_lists_of_exact_ints_still_pass(device, ids):
    assert ids.f([2**63, 0.5], _result="numpy").tolist() == [2.0**63, 0.5]
    assert ids.f([2**64, 0], _result="numpy").tolist() == [2.0**64, 0.0]  # (NumPy: objects)
    assert ids.h([2**53 + 1, 0], _result="numpy").tolist() == [2**53 + 1, 0]  # (int64: exact)
    assert pydiff.tensor([2**24, 0.5], device=device).numpy().tolist() == [2.0**24, 0.5]
    with pytest.raises(ValueError, match=r"18446744073709551617 does not fit int32"):
        ids.g([2**64 + 1, 0])


THREE = """
import slangpy;
[Differentiable]
float f3(float a, float b, float a_fixed_b) { return a * a * b + b * a_fixed_b * a_fixed_b; }
"""


def test_directional_wrappers_whose_kinds_read_alike_are_not_shared(device):
    # dir_wrapper names a wrapper by its fixed parameters: {a_fixed_b} and {a, b} both gave
    # "dir_fixed_a_fixed_b", and the second call reused the first's kernel (another
    # signature: directions for a and b, none for a_fixed_b).
    from pydiff.forward_mode import dir_wrapper

    m = pydiff.load_module_from_source("s48_fix48_three", THREE, device=device)
    one = dir_wrapper(m.f3, (), frozenset({"a_fixed_b"}))
    two = dir_wrapper(m.f3, (), frozenset({"a", "b"}))
    names = [p.name for p in two.params]
    assert names == ["a", "b", "a_fixed_b", "a_fixed_b__v"], names
    assert [p.name for p in one.params] == ["a", "a__v", "b", "b__v", "a_fixed_b"]
    # d/dc (a^2 b + b c^2) along v = 2 b c v (closed form) at a=1.5, b=2, c=3, v=0.5
    got = two(1.5, 2.0, 3.0, 0.5)
    assert got == pytest.approx(2 * 2.0 * 3.0 * 0.5, rel=1e-6)


def test_a_user_function_named_like_a_generated_wrapper_is_refused(device):
    # The wrapper imports the user's module: two f__pydiff_dir overloads, and SlangPy's error
    # listed two identical signatures. hvp of x^3 is 6x (closed form) once renamed.
    src = """
import slangpy;
[Differentiable]
float cube(float x) { return x * x * x; }
[Differentiable]
float cube__pydiff_dir(float x, no_diff float x__v) { return 42.0 * x; }
"""
    m = pydiff.load_module_from_source("s48_fix48_taken", src, device=device)
    with pytest.raises(ValueError, match=r"defines cube__pydiff_dir.*rename it"):
        pydiff.hvp(m.cube, (np.float32(2.0),), (np.float32(1.0),))
    ok = pydiff.load_module_from_source(
        "s48_fix48_free", src.replace("cube__pydiff_dir", "cube_dir"), device=device
    )
    got = pydiff.hvp(ok.cube, (np.float32(2.0),), (np.float32(1.0),))
    assert float(np.asarray(got[0] if isinstance(got, (tuple, list)) else got)) == pytest.approx(
        12.0
    )


FWD_RETURNS_FLOAT = """import slangpy;

float sq_fwd(DifferentialPair<float> x)
{
    return 2.0 * x.p * x.d;
}

[ForwardDerivative(sq_fwd)]
float sq(float x) { return x * x; }
"""

BWD_TAKES_FLOAT = """import slangpy;

void sq_bwd(float x, float dOut)
{
}

[Differentiable]
[BackwardDerivative(sq_bwd)]
float sq(float x) { return x * x; }
"""


@pytest.mark.parametrize(
    "source, want",
    [
        (
            FWD_RETURNS_FLOAT,
            r"sq_fwd \((?P<f>.*):3\), the \[ForwardDerivative\] of sq "
            r"\((?P=f):9\), returns float, not DifferentialPair<float>",
        ),
        (
            BWD_TAKES_FLOAT,
            r"sq_bwd \((?P<f>.*):3\), the \[BackwardDerivative\] of sq "
            r"\((?P=f):9\), takes float at parameter 0, not inout DifferentialPair<float>",
        ),
    ],
    ids=["forward-returns-float", "backward-takes-float"],
)
def test_a_derivative_of_the_wrong_signature_is_named(device, tmp_path, source, want):
    # Slang said only "return type mismatch ... interface requirement" (or a parameter type
    # mismatch at the attribute): pydiff names the derivative, what it derives, both lines.
    path = tmp_path / "wrong_derivative.slang"
    path.write_text(source)
    with pytest.raises(pydiff.SlangCompileError, match=want) as caught:
        pydiff.load_module(path, device=device)
    assert str(path) in str(caught.value) and "error[E" in str(caught.value)  # (Slang's too)
    name = "s48_fix48_fwd" if "Forward" in source else "s48_fix48_bwd"
    with pytest.raises(
        pydiff.SlangCompileError,
        match=want.replace(r"(?P<f>.*)", "<" + name + ">").replace("(?P=f)", "<" + name + ">"),
    ):
        pydiff.load_module_from_source(name, source, device=device)


def test_handles_of_dead_slices_warn_only_while_they_hold_the_slice(device, exps):
    # A temporary slice's handle (break47b's xfail) is warned of; not once the slice's values
    # were overwritten before it died, nor for a detached temporary. (d/dx exp = exp: closed
    # form, for the slice given its own gradient.)
    x = pydiff.tensor(np.linspace(-1.0, 1.0, 10).astype(np.float32), requires_grad=True)
    s = x[2:5]
    handle = s.native
    s.copy_from_numpy(np.zeros(3, np.float32))
    del s
    overwritten = pydiff.Tensor(handle, device)
    assert _flow_warnings(lambda: exps.ex.bwds(overwritten, _result=1.0)) == []
    detached = pydiff.Tensor(x[2:5].detach().native, device)
    assert _flow_warnings(lambda: exps.ex.bwds(detached, _result=1.0)) == []
    temporary = pydiff.Tensor(x[3:6].native, device)
    got = _flow_warnings(lambda: exps.ex.bwds(temporary, _result=1.0))
    assert any("off a tape" in m for m in got), got
    own = pydiff.Tensor(x[3:6].native, device).requires_grad_()
    exps.ex.bwds(own, _result=1.0)
    want = np.exp(np.linspace(-1.0, 1.0, 10)[3:6])
    np.testing.assert_allclose(own.grad.numpy(), want, rtol=1e-5)
