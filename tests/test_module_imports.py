"""A function a module reaches through a plain `import` is listed by Slang's reflection, but
the kernels a call generates (which import the module) cannot see it: refused by name."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "imp_libb.slang").write_text(
        "[Differentiable] public float fb(float a, float x) { return a * x * x * x; }\n"
    )
    (tmp_path / "imp_libx.slang").write_text("public float fx(float x) { return 3.0 * x; }\n")
    (tmp_path / "imp_part.slang").write_text(
        "implementing imp_modc;\npublic float inpart(float x) { return 2.0 * x; }\n"
    )
    (tmp_path / "imp_modc.slang").write_text(
        "module imp_modc;\n"
        '__include "imp_part";\n'
        "import imp_libb;  // plain: fb is not re-exported\n"
        "__exported import imp_libx;\n"
        "[Differentiable] public float fc(float a, float x) { return fb(a, x) + 2.0; }\n"
    )
    return tmp_path


def test_function_of_a_plain_import_is_refused_by_name(device, folder):
    dev = pydiff.create_device(device.type, include_paths=[str(folder)])
    m = pydiff.load_module("imp_modc.slang", device=dev)
    X = np.array([0.5, 2.0])
    assert not hasattr(m, "fb")
    with pytest.raises(AttributeError, match=r"cannot call 'fb'.*`__exported import imp_libb;`"):
        m.fb(2.0, X, _result="numpy")
    # what the module declares, includes and re-exports is called as before
    np.testing.assert_allclose(m.fc(2.0, X, _result="numpy"), 2.0 * X**3 + 2.0, rtol=1e-6)
    np.testing.assert_allclose(m.inpart(X, _result="numpy"), 2.0 * X, rtol=1e-6)
    np.testing.assert_allclose(m.fx(X, _result="numpy"), 3.0 * X, rtol=1e-6)


def test_plain_import_from_source_module(device, folder):
    dev = pydiff.create_device(device.type, include_paths=[str(folder)])
    src = "import imp_libb;\nfloat g(float x) { return fb(1.0, x); }\n"
    m = pydiff.load_module_from_source("imp_src", src, dev)
    np.testing.assert_allclose(m.g(np.array([2.0]), _result="numpy"), [8.0])
    with pytest.raises(AttributeError, match="cannot call 'fb'"):
        m.fb
    exported = pydiff.load_module_from_source("imp_src2", "__" + "exported " + src, dev)
    np.testing.assert_allclose(exported.fb(1.0, np.array([2.0]), _result="numpy"), [8.0])
