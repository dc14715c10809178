"""pydiff's pytest plugin (enabled automatically when pydiff is installed) and test helpers.

    def test_my_shader(device):                       # once per backend that opens here
        m = pydiff.load_module("my.slang", device=device)
        x = pydiff.tensor([0.3, 1.2], device=device, requires_grad=True)
        pydiff.testing.assert_gradients_close(m.f, (x,))

Backends: ``--pydiff-device=vulkan,cuda`` or ``PYDIFF_DEVICE_TYPES`` (default: cuda, d3d12,
vulkan); those that do not open here are skipped. A ``device`` fixture of your own (in a
conftest.py) takes precedence over this one.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np
import pytest

_DEFAULT_TYPES = "cuda,d3d12,vulkan"


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("pydiff")
    group.addoption(
        "--pydiff-device",
        default=None,
        metavar="TYPES",
        help="comma-separated device types for the `device` fixture (default: $PYDIFF_DEVICE_TYPES "
        f"or {_DEFAULT_TYPES}); types that do not open here are skipped",
    )


def device_types(config: Any) -> list[str]:
    """The backends the ``device`` fixture runs over, from the option or the environment."""
    raw = (
        config.getoption("--pydiff-device")
        or os.environ.get("PYDIFF_DEVICE_TYPES")
        or _DEFAULT_TYPES
    )
    types = [t.strip().lower() for t in raw.split(",") if t.strip()]
    known = {"cuda", "d3d12", "vulkan", "metal", "cpu"}
    bad = [t for t in types if t not in known]
    if bad:
        raise pytest.UsageError(
            f"--pydiff-device / PYDIFF_DEVICE_TYPES: unknown device type(s) {bad}; "
            f"use {sorted(known - {'cpu', 'metal'})}"
        )
    return types


def pytest_configure(config: Any) -> None:
    device_types(config)  # a misspelt backend is a usage error before collection


def pytest_generate_tests(metafunc: Any) -> None:
    if "device" in metafunc.fixturenames and _uses_our_fixture(metafunc):
        metafunc.parametrize(
            "device", device_types(metafunc.config), indirect=True, scope="session"
        )


def _uses_our_fixture(metafunc: Any) -> bool:
    """True unless a conftest or test module defines its own ``device`` fixture."""
    defs = getattr(metafunc, "_arg2fixturedefs", {}).get("device")
    return bool(defs) and getattr(defs[-1].func, "__module__", None) == __name__


@pytest.fixture(scope="session")
def device(request: Any) -> Any:
    """A pydiff.Device, once per backend that opens here (others are skipped)."""
    import pydiff

    kind = getattr(request, "param", None) or "auto"
    try:
        return pydiff.create_device(kind)
    except pydiff.DeviceUnavailableError as exc:
        pytest.skip(f"{kind} not available here: {str(exc).splitlines()[0][:120]}")


def assert_gradients_close(
    fn: Any,
    inputs: Sequence[Any],
    expected: Sequence[Any] | None = None,
    *,
    grad_output: Any = None,
    eps: float = 1e-3,
    atol: float = 1e-3,
    rtol: float = 1e-2,
) -> None:
    """Assert that ``fn``'s gradients are right.

    Without ``expected``: pydiff.gradcheck against central finite differences (and forward
    mode for module functions). With ``expected`` (one array or None per input): the tape's
    gradients for the upstream ``grad_output`` (default ones) compared within atol/rtol.
    >>> assert_gradients_close(m.f, (x,))
    >>> assert_gradients_close(m.f, (x,), expected=[2 * x.numpy()])
    """
    import pydiff
    from pydiff.gradcheck import as_callable

    if expected is None:
        pydiff.gradcheck(fn, inputs, eps=eps, atol=atol, rtol=rtol)  # raises GradcheckError
        return
    call = as_callable(fn)
    if len(expected) != len(inputs):
        raise ValueError(
            f"assert_gradients_close: {len(inputs)} inputs but {len(expected)} expected gradients"
        )
    leaves = []
    for x in inputs:
        if isinstance(x, pydiff.Tensor) and x.differentiable:
            x = x.detach().requires_grad_(True)
        leaves.append(x)
    with pydiff.Tape(reads_other_tapes=True) as tape:
        out = call(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    seed = np.ones(out.expected_numpy_shape()) if grad_output is None else grad_output
    tape.backward(out, grad=seed)
    for k, (leaf, want) in enumerate(zip(leaves, expected)):
        if want is None:
            continue
        if not isinstance(leaf, pydiff.Tensor):
            raise TypeError(
                f"assert_gradients_close: input {k} is not a pydiff.Tensor; expected gradient "
                "must be None"
            )
        got = leaf.grad.numpy()
        np.testing.assert_allclose(
            got,
            np.asarray(want),
            rtol=rtol,
            atol=atol,
            err_msg=f"gradient of input {k} of {getattr(fn, 'label', fn)}",
        )
