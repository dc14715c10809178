"""Loading a .slang file again after an edit (a notebook workflow) runs the new text, and the
module names SlangPy and pydiff need for themselves are refused."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import pydiff
from pydiff.errors import ShaderTrapError, SlangCompileError

TRAPPED = """[Differentiable] float g(float a, float x) {
    float t = x;
    [MaxIters(32)] while (t < 100.0) { t = 1.5 * t + a; if (t > 5.0) break; }
    return t;
}
"""
FIXED = TRAPPED.replace("while (t < 100.0)", "for (; t < 100.0; )")


def _stepped(a: float, x: float) -> tuple[float, float, float]:
    """t, dt/da, dt/dx of the loop above, stepped in float64."""
    t, dta, dtx = x, 0.0, 1.0
    while t < 100.0:
        t, dta, dtx = 1.5 * t + a, 1.5 * dta + 1.0, 1.5 * dtx
        if t > 5.0:
            break
    return t, dta, dtx


def test_reload_after_fixing_a_trap_runs_the_fixed_code(device, tmp_path):
    path = tmp_path / "reload_trap.slang"
    path.write_text(TRAPPED)
    A, X = np.array([1.0, 2.0, 3.0]), np.array([0.5, 0.5, 0.5])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = pydiff.load_module(path, device=device)
    a = pydiff.tensor(A, requires_grad=True, device=device)
    x = pydiff.tensor(X, requires_grad=True, device=device)
    with pytest.raises(ShaderTrapError):
        m.g.bwds(a, x, _result=1.0)
    path.write_text(FIXED)
    m2 = pydiff.load_module(path, device=device)
    y = m2.g(a.detach(), x.detach(), _result="numpy")
    m2.g.bwds(a, x, _result=1.0)
    ref = np.array([_stepped(ai, xi) for ai, xi in zip(A, X)])
    np.testing.assert_allclose(y, ref[:, 0], rtol=1e-6)
    np.testing.assert_allclose(a.grad.numpy(), ref[:, 1], rtol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), ref[:, 2], rtol=1e-6)


def test_reload_follows_every_edit(device, tmp_path):
    path = tmp_path / "edited.slang"
    X = np.array([0.5, 2.0])
    bodies = {"a * x": 3.0 * X, "a - x": 3.0 - X, "a + x * x": 3.0 + X * X}
    for body in [*bodies, "a * x"]:  # back to the first text: the first copy again
        path.write_text(f"[Differentiable] float f(float a, float x) {{ return {body}; }}\n")
        m = pydiff.load_module(path, device=device)
        assert m.function_names() == ["f"]
        np.testing.assert_allclose(m.f(3.0, X, _result="numpy"), bodies[body], rtol=1e-6)


def test_reload_compile_error_names_the_file(device, tmp_path):
    path = tmp_path / "broken.slang"
    path.write_text("float f(float x) { return x; }\n")
    pydiff.load_module(path, device=device)
    path.write_text("float f(float x) {\n    return x +* 2.0;\n}\n")
    with pytest.raises(SlangCompileError) as info:
        pydiff.load_module(path, device=device)
    assert f"{path}:2" in str(info.value)
    assert "__pydiff_v" not in str(info.value)


def test_edited_import_is_refused(device, tmp_path):
    lib = tmp_path / "reload_lib.slang"
    lib.write_text("public float h(float x) { return x + 1.0; }\n")
    main = tmp_path / "reload_main.slang"
    main.write_text("import reload_lib;\nfloat f(float x) { return h(x); }\n")
    dev = pydiff.create_device(device.type, include_paths=[str(tmp_path)])
    m = pydiff.load_module(main, device=dev)
    np.testing.assert_allclose(m.f(np.array([1.0]), _result="numpy"), [2.0])
    lib.write_text("public float h(float x) { return x + 5.0; }\n")
    with pytest.raises(RuntimeError, match="reload_lib.slang changed since it was loaded"):
        pydiff.load_module(main, device=dev)
    other = tmp_path / "reload_other.slang"
    other.write_text("import reload_lib;\nfloat k(float x) { return h(x); }\n")
    with pytest.raises(RuntimeError, match="Restart the process"):
        pydiff.load_module(other, device=dev)
    with pytest.raises(RuntimeError, match="reload_lib.slang changed"):
        pydiff.load_module_from_source("uses_lib", "import reload_lib;\n", device=dev)


def test_same_name_other_source_says_what_to_do(device):
    pydiff.load_module_from_source("reload_same", "float f(float x) { return x; }", device)
    with pytest.raises(SlangCompileError, match="another name, or restart the process"):
        pydiff.load_module_from_source("reload_same", "float f(float x) { return -x; }", device)


@pytest.mark.parametrize("name", ["core", "slangpy", "pydiff", "pydiff_written_mask"])
def test_reserved_module_names_are_refused(device, tmp_path, name):
    src = "[Differentiable] float f(float a, float x) { return a * x; }"
    with pytest.raises(ValueError, match=f"a module named '{name}' would shadow"):
        pydiff.load_module_from_source(name, src, device)
    (tmp_path / f"{name}.slang").write_text(src)
    with pytest.raises(ValueError, match="rename it"):
        pydiff.load_module(tmp_path / f"{name}.slang", device=device)
    # nothing was loaded: later kernels still build
    good = pydiff.load_module_from_source(f"after_{name}", src, device)
    np.testing.assert_allclose(good.f(2.0, np.array([1.0, 3.0]), _result="numpy"), [2.0, 6.0])
