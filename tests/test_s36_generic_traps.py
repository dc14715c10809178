"""Generic differentiable functions (``f<let M : int>``, ``f<T : ...>``) and the trap checks.

The Slang compiler in SlangPy 0.43.1 never finishes compiling the backward of a generic
function whose ``for`` loop indexes an interface diff tensor (measured: ``gsum<1>.bwds`` hung
in ``specializeModule``, in raw SlangPy too, and so did a non-generic caller of it). pydiff now
refuses it at ``.bwds`` naming the line and the fix, and the rewrites it suggests compile and
give the closed-form gradients. Every trap check also reaches a generic's specialisation
(``m["f<2>"]``): they looked findings up by the name SlangPy gives the call (``f<2>``), so
before this no trap of a generic function was ever refused, and a length-bounded loop past
its ``[MaxIters(n)]`` in one gave wrong gradients silently.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import pydiff
from pydiff import lint

GENERIC_FOR = """import slangpy;
[Differentiable]
float gsum<let M : int>(float a, IDiffTensor<float, 1> x)
{
    float s = 0.0;
    [MaxIters(8)]
    for (int k = 0; k < 4; k++)
        s += a * x[k] * M;
    return s;
}
[Differentiable]
float caller(float a, IDiffTensor<float, 1> x) { return gsum<1>(a, x); }
[Differentiable]
float gsum_while<let M : int>(float a, IDiffTensor<float, 1> x)
{
    float s = 0.0;
    int k = 0;
    [MaxIters(4)]
    while (k < 4) { s += a * x[k] * M; k++; }
    return s;
}
[Differentiable]
float gsum_unrolled<let M : int>(float a, IDiffTensor<float, 1> x)
{
    float s = 0.0;
    [ForceUnroll]
    for (int k = 0; k < 4; k++)
        s += a * x[k] * M;
    return s;
}
[Differentiable]
float gsum_concrete<let M : int>(float a, DiffTensor<float, 1> x)
{
    float s = 0.0;
    for (int k = 0; k < 4; k++)
        s += a * x[k] * M;
    return s;
}
[Differentiable]
float gsum_outside<let M : int>(float a, IDiffTensor<float, 1> x)
{
    float s = 0.0;
    for (int k = 0; k < 4; k++)
        s += a * float(k) * M;
    return s * x[0];
}
"""


def _kinds(source: str) -> dict[str, list[str]]:
    found = lint.scan_source(source, "g.slang")
    return {k: [f.kind for f in v] for k, v in lint.affected_functions(source, found).items()}


def test_lint_finds_the_generic_for_loop_and_its_callers():
    kinds = _kinds(GENERIC_FOR)
    assert kinds == {
        "gsum": ["generic-for-interface-tensor"],
        "caller": ["generic-for-interface-tensor"],
    }
    (finding,) = [f for f in lint.scan_source(GENERIC_FOR, "g.slang") if f.function == "gsum"]
    assert finding.line == 7 and "x[k]" in finding.message and "while" in finding.message


def test_lint_type_generics_and_unattributed_loops_too():
    src = GENERIC_FOR.replace("<let M : int>", "<T : __BuiltinFloatingPointType>").replace(
        "* M", ""
    )
    assert "generic-for-interface-tensor" in _kinds(src).get("gsum", [])
    plain = GENERIC_FOR.replace("float gsum<let M : int>(", "float gsum(").replace("* M", "")
    assert "gsum" not in _kinds(plain)  # not generic: compiles (measured)


def test_trap_map_answers_for_specialisations():
    traps = lint.TrapMap({"gsum": ["finding"]})
    assert traps.get("gsum<1>") == ["finding"] and traps.get("ns::other<2>") is None
    assert traps.get("gsum < 4 >") == ["finding"] and traps.get("missing", []) == []


def _run_child(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    # a child process: were the refusal lost, the Slang compiler would hang the test run
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("name", ["gsum<1>", "gsum<3>", "caller"])
def test_bwds_is_refused_not_hung(name, tmp_path):
    path = tmp_path / "g.slang"
    path.write_text(GENERIC_FOR)
    done = _run_child(
        f"""
        import warnings, numpy as np, pydiff
        warnings.simplefilter("ignore")
        m = pydiff.load_module({str(path)!r})
        f = getattr(m, {name!r})
        a = pydiff.tensor(np.ones(8, np.float32), requires_grad=True)
        x = pydiff.tensor(np.arange(4, dtype=np.float32), requires_grad=True)
        y = f(a, x, _result="tensor")
        try:
            f.bwds(a, x, _result=y.with_grads(ones=True))
        except pydiff.ShaderTrapError as e:
            print("REFUSED", e)
        """
    )
    assert "REFUSED" in done.stdout, done.stderr[-2000:]
    assert "g.slang:7" in done.stdout and "generic function" in done.stdout


@pytest.mark.parametrize("name", ["gsum_while", "gsum_unrolled", "gsum_concrete", "gsum_outside"])
@pytest.mark.parametrize("m_value", [1, 3])
@pytest.mark.filterwarnings("ignore::pydiff.ShaderTrapWarning")
def test_the_rewrites_give_the_closed_form(device, name, m_value):
    mod = pydiff.load_module_from_source("s36_generic_for", GENERIC_FOR, device=device)
    rng = np.random.default_rng(7)
    a = rng.uniform(-2, 2, 8)
    xs = rng.uniform(-2, 2, 4)
    at = pydiff.tensor(a.astype(np.float32), device=device, requires_grad=True)
    x = pydiff.tensor(xs.astype(np.float32), device=device, requires_grad=True)
    f = getattr(mod, f"{name}<{m_value}>")
    y = f(at, x, _result="tensor")
    if name == "gsum_outside":
        want, da, dx = a * 6 * m_value * xs[0], 6 * m_value * xs[0] * np.ones(8), None
        dx = np.array([6 * m_value * a.sum(), 0, 0, 0])
    else:
        want, da, dx = a * m_value * xs.sum(), m_value * xs.sum() * np.ones(8), None
        dx = m_value * a.sum() * np.ones(4)
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-5)
    f.bwds(at, x, _result=y.with_grads(ones=True))
    np.testing.assert_allclose(at.grad.numpy(), da, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(x.grad.numpy(), dx, rtol=1e-5, atol=1e-5)


LENGTH_BOUND = """import slangpy;
[Differentiable]
float gsq<let M : int>(float a, DiffTensor<float, 1> x)
{
    float acc = 0.0;
    int n = x.shape[0];
    [MaxIters(8)]
    for (int k = 0; k < n; k++) acc += a * x[k] * x[k] * M;
    return acc;
}
"""


def test_length_bounded_loop_of_a_generic_is_checked(device):
    """Before: x.grad at 12 inputs came out [..., 9.09, 20, 20, 20] against the closed form
    [..., 9.09, 12.73, 16.36, 20] (Slang kept 8 iterations), silently."""
    mod = pydiff.load_module_from_source("s36_generic_len", LENGTH_BOUND, device=device)
    f = mod["gsq<2>"] if hasattr(mod, "__getitem__") else getattr(mod, "gsq<2>")
    a = np.linspace(0.5, 2.0, 4)
    for k, refused in [(8, False), (12, True)]:
        xs = np.linspace(-1.0, 1.0, k)
        at = pydiff.tensor(a.astype(np.float32), device=device)
        x = pydiff.tensor(xs.astype(np.float32), device=device, requires_grad=True)
        y = f(at, x, _result="tensor")
        np.testing.assert_allclose(y.numpy(), 2 * a * np.sum(xs * xs), rtol=1e-5)
        if refused:
            with pytest.raises(ValueError, match=r"runs 12 times.*MaxIters\(8\)"):
                f.bwds(at, x, _result=y.with_grads(ones=True))
        else:
            f.bwds(at, x, _result=y.with_grads(ones=True))
            np.testing.assert_allclose(x.grad.numpy(), 4 * a.sum() * xs, rtol=1e-5, atol=1e-6)
