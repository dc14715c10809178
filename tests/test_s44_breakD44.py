"""breakD44: pydiff with torch (inference-mode data) and torch.distributed (STRICT after an
all-reduce). References are closed forms and NumPy float64."""

from __future__ import annotations

import numpy as np
import pytest

import pydiff
from pydiff import ops

torch = pytest.importorskip("torch")
from ranks import free_port  # noqa: E402

SRC = "[Differentiable] float f(float a, float b) { return a * a * b; }"


def test_data_made_under_inference_mode_is_taken_as_torch_takes_it(device):
    # torch.sin(d) of an inference tensor d works outside inference_mode; pydiff's calls
    # saved every torch input for backward, which torch refuses for inference tensors.
    m = pydiff.load_module_from_source("bd44_inference", SRC)
    with torch.inference_mode():
        d = torch.tensor([1.0, 2.0, 3.0])
    np.testing.assert_allclose(ops.mul(d, d).numpy(), [1.0, 4.0, 9.0])
    np.testing.assert_allclose(m.f(d, d).numpy(), [1.0, 8.0, 27.0])
    # beside a pydiff parameter (torch's own d * w refuses here; pydiff copied d's values)
    w = pydiff.tensor([3.0, 4.0, 5.0], device=device, requires_grad=True)
    y = m.f(w, d)
    y.sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), 2 * np.array([3.0, 4.0, 5.0]) * [1, 2, 3])
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        y.sum().backward()  # still refused without retain_graph, as for torch's functions
    # beside a torch tensor that requires grad
    a = torch.tensor([1.0, -2.0, 0.5], requires_grad=True)
    m.f(a, d).sum().backward()
    torch.testing.assert_close(a.grad, 2 * a.detach() * d.clone())


@pytest.fixture
def group_of_one():
    dist = pytest.importorskip("torch.distributed")
    pydiff.distributed.init_process_group(
        "gloo", timeout=30.0, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


def test_strict_refuses_a_backward_onto_an_all_reduced_gradient(device, group_of_one):
    # all_reduce_grads wrote the mean back as a host write, which dropped STRICT's mark: a
    # second backward without zero_grad silently added onto the averaged gradient.
    x = np.array([1.0, 4.0], np.float32)
    w = pydiff.tensor([2.0, 3.0], device=device, requires_grad=True)
    w.zero_policy = pydiff.ZeroPolicy.STRICT

    def backward():
        with pydiff.Tape() as tape:
            loss = ops.sum(ops.mul(w, pydiff.tensor(x, device=device)))
        tape.backward(loss)

    backward()
    pydiff.distributed.all_reduce_grads([w])
    np.testing.assert_array_equal(w.grad.numpy(), x)
    with pytest.raises(pydiff.StaleGradientError, match="all_reduce_grads"):
        backward()
    np.testing.assert_array_equal(w.grad.numpy(), x)  # refused: left as it was
    w.zero_grad()
    backward()
    np.testing.assert_array_equal(w.grad.numpy(), x)


def test_torch_tensors_go_to_the_device_of_the_module_or_of_the_pydiff_arguments(device):
    # A second device (another include path): torch tensors in its module's calls, its ops
    # and its .bwds were converted onto the default device and refused as "on another device".
    other = pydiff.create_device(
        device.type, include_paths=[str(__import__("pathlib").Path(__file__).parent / "shaders")]
    )
    assert other is not pydiff.default_device()
    m = pydiff.load_module_from_source("bd44_other_device", SRC, device=other)
    a = torch.tensor([1.0, -2.0, 0.5], requires_grad=True)
    w = pydiff.tensor([3.0, 4.0, 5.0], device=other, requires_grad=True)
    m.f(a, w).sum().backward()  # d(a^2 w)/da = 2 a w, d/dw = a^2
    torch.testing.assert_close(a.grad, 2 * a.detach() * torch.tensor([3.0, 4.0, 5.0]))
    np.testing.assert_allclose(w.grad.numpy(), [1.0, 4.0, 0.25])
    v = pydiff.tensor([2.0, 3.0, 4.0], device=other, requires_grad=True)
    ops.mul(torch.tensor([1.0, 2.0, 3.0]), v).sum().backward()
    np.testing.assert_allclose(v.grad.numpy(), [1.0, 2.0, 3.0])
    x = pydiff.tensor([3.0, 4.0], device=other, requires_grad=True)
    m.f.bwds(
        x, torch.tensor([3.0, 5.0]), _result=pydiff.zeros((2,), device=other).with_grads(ones=True)
    )
    np.testing.assert_allclose(x.grad.numpy(), [18.0, 40.0])


@pytest.mark.parametrize("policy", ["reset", "strict"])
def test_a_reentrant_checkpoint_shares_its_outer_pass_zeroing(device, policy):
    # torch.utils.checkpoint(use_reentrant=True) recomputes its forward inside the outer
    # pass's backward and runs a nested pass of its own: RESET zeroed the pydiff parameter's
    # gradient again there (keeping one use's share only: off by 3.8), STRICT refused it.
    from torch.utils.checkpoint import checkpoint

    gen = torch.Generator().manual_seed(0)
    x64 = torch.randn(5, 3, dtype=torch.float64, generator=gen)
    w64 = torch.randn(4, 3, dtype=torch.float64, generator=gen)
    w = pydiff.tensor(w64.float().numpy(), device=device, requires_grad=True)
    w.zero_policy = policy
    x = x64.float().requires_grad_()
    y = checkpoint(lambda a: ops.tanh(ops.linear(a, w)), x, use_reentrant=True)
    y2 = ops.tanh(ops.linear(x, w))  # a second use of w, outside the checkpoint
    (torch.tanh(y) ** 2 + y2).sum().backward()
    xr, wr = x64.clone().requires_grad_(), w64.clone().requires_grad_()
    (torch.tanh(torch.tanh(xr @ wr.T)) ** 2 + torch.tanh(xr @ wr.T)).sum().backward()
    np.testing.assert_allclose(w.grad.numpy(), wr.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), xr.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_a_parameter_torch_function_returns_itself_gets_its_gradient(device):
    # torch_function(lambda t: (f(t, w), w)): the output that is w itself (a learned scale,
    # a log-variance handed to a torch loss) lost its gradient without a word (0, and the
    # product's share only).
    w = pydiff.tensor([1.0, 2.0], device=device, requires_grad=True)
    f = pydiff.torch_function(lambda t: (ops.mul(t, w), w, w.reshape((2, 1))))
    t = torch.tensor([5.0, 7.0], requires_grad=True)
    prod, same, column = f(t)
    c = torch.tensor([3.0, 4.0])
    (prod.sum() + (same * c).sum() + (column[:, 0] * c * 2).sum()).backward()
    np.testing.assert_allclose(w.grad.numpy(), [5.0 + 9.0, 7.0 + 12.0])  # t + 3 c
    torch.testing.assert_close(t.grad, torch.tensor([1.0, 2.0]))
