"""pydiff.call_uniforms: the uniform sizes pydiff computes for SlangPy calls against the sizes
Slang's reflection gives for the linked programs, and no program past Vulkan's push
constants (breaker 18: a 4-D backward of 276 bytes refused by slang-rhi, then rebuilt)."""

import numpy as np
import pytest
import slangpy as spy
from slangpy.core import calldata

import pydiff
from pydiff import call_uniforms, ops


def test_sizes_match_the_linked_programs_and_stay_within_the_budget(device, monkeypatch, tmp_path):
    if device.type != "vulkan":
        pytest.skip("push constants are Vulkan's")
    monkeypatch.setenv("PYDIFF_GENERATED", "0")  # SlangPy's calls, under --pydiff-generated too
    dev = pydiff.create_device("vulkan", include_paths=[str(tmp_path)], cache_dir=False)
    modelled: list[int] = []
    pairs: list[tuple[int, int]] = []  # (pydiff's size, the linked program's), per build
    failed: list[str] = []
    estimate, link = calldata.estimate_entrypoint_arguments_size, spy.SlangSession.link_program

    def recording_estimate(call, dims):
        modelled.append(call_uniforms.uniform_size(call, dims))
        return estimate(call, dims)

    def recording_link(self, *args):
        try:
            program = link(self, *args)
        except RuntimeError as exc:
            failed.append(str(exc))
            raise
        if not modelled:  # one of pydiff's own kernels (their sizes are uniforms too)
            return program
        ep = program.layout.entry_points[0]
        real = sum(ep.parameters[i].type_layout.size for i in range(len(ep.parameters)))
        if real:  # entry-point uniforms (0: a ParameterBlock)
            pairs.append((modelled[-1], real))
        modelled.clear()  # each SlangPy call's estimate pairs with its own link only
        return program

    monkeypatch.setattr(calldata, "estimate_entrypoint_arguments_size", recording_estimate)
    monkeypatch.setattr(spy.SlangSession, "link_program", recording_link)
    rng = np.random.default_rng(0)
    for shape in [(5,), (2, 3), (2, 2, 3), (1, 2, 3, 2), (1, 1, 2, 3, 2)]:
        a = pydiff.tensor(rng.standard_normal(shape).astype(np.float32), device=dev)
        b = pydiff.tensor(rng.standard_normal(shape).astype(np.float32), device=dev)
        a.requires_grad_(True)
        b.requires_grad_(True)
        with pydiff.Tape() as tape:
            y = ops.sum(ops.tanh(a * b) ** 2 + ops.softmax(a, axis=0))
        tape.backward(y)
        want = 2 * np.tanh(a.numpy() * b.numpy()) / np.cosh(a.numpy() * b.numpy()) ** 2
        np.testing.assert_allclose(b.grad.numpy(), want * a.numpy(), rtol=1e-4, atol=1e-6)
    assert not failed, failed
    assert len(pairs) >= 10
    for ours, real in pairs:
        assert ours == real, pairs
        assert real <= call_uniforms.PUSH_CONSTANT_BUDGET
