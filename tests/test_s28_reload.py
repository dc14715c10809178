"""load_module of an unchanged file returns the module already loaded (each new one held
about 1 MB: a loop reloading a file grew without bound, found by the issue-16 breaker);
an edited file still gets its new text, and the old text its old module."""

from __future__ import annotations

import numpy as np

import pydiff

_SOURCE = "[Differentiable] float f(float x) {{ return {k} * x * x; }}\n"


def _check(module, k, device):
    x = pydiff.tensor(np.array([1.0, -2.0, 3.0], np.float32), device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = module.f(x, _result="tensor")
    tape.backward(y, grad=np.ones(3))
    xs = np.array([1.0, -2.0, 3.0])
    np.testing.assert_allclose(y.numpy(), k * xs**2, rtol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), 2.0 * k * xs, rtol=1e-6)


def test_reloading_an_unchanged_file_gives_the_same_module_and_edits_still_load(device, tmp_path):
    path = tmp_path / "s28_reload_sq.slang"
    path.write_text(_SOURCE.format(k=3.0))
    first = pydiff.load_module(str(path), device)
    assert pydiff.load_module(str(path), device) is first
    _check(first, 3.0, device)
    path.write_text(_SOURCE.format(k=5.0))
    edited = pydiff.load_module(str(path), device)
    assert edited is not first
    _check(edited, 5.0, device)
    assert pydiff.load_module(str(path), device) is edited  # the edit, loaded again
    path.write_text(_SOURCE.format(k=3.0))
    assert pydiff.load_module(str(path), device) is first  # the first text: its module
    _check(first, 3.0, device)
    assert pydiff.load_module(str(path), device, lint=False) is not first  # its own options
