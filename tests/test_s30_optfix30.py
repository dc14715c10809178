"""Optimizer parameter lists (a changed opt.params, a single tensor), the train_mlp sample's
capture, and arguments refused with errors naming them (nn.Linear, ops.add, pydiff.tensor)."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import pydiff
from pydiff import nn, ops, optim

A0 = np.array([1.0, -2.0, 3.0])


def _param(device, values):
    return pydiff.tensor(np.asarray(values, np.float32), device=device, requires_grad=True)


def _step_with_unit_grads(opt):
    opt.zero_grad()
    for p in opt.params:
        p.grad.fill(1.0)
    opt.step()


def test_sgd_refuses_an_appended_param_before_any_update(device):
    p, q = _param(device, A0), _param(device, A0 * 10)
    opt = optim.SGD([p], lr=0.1, momentum=0.9)
    _step_with_unit_grads(opt)  # p = a0 - 0.1, momentum buffer = 1
    opt.params.append(q)
    with pytest.raises(ValueError, match=r"params\[1\] was added.*new optimizer"):
        _step_with_unit_grads(opt)
    np.testing.assert_allclose(p.numpy(), A0 - 0.1, rtol=1e-6)  # untouched by the refused step
    np.testing.assert_array_equal(q.numpy(), (A0 * 10).astype(np.float32))
    assert opt.param_steps == [1] and opt.step_count == 1
    opt.params.pop()  # the list put back: the next step is the second, as if none was refused
    _step_with_unit_grads(opt)
    # torch's SGD with momentum: buf = 0.9 * 1 + 1 = 1.9; p -= 0.1 * buf
    np.testing.assert_allclose(p.numpy(), A0 - 0.1 - 0.19, rtol=1e-6)


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_adam_refuses_an_appended_param_without_advancing_step_counts(device, name):
    p, q = _param(device, A0), _param(device, A0 * 10)
    opt = getattr(optim, name)([p], lr=0.1, weight_decay=0.0)
    _step_with_unit_grads(opt)
    after_one = p.numpy().copy()
    opt.params.append(q)
    with pytest.raises(ValueError, match=r"params\[1\] was added"):
        _step_with_unit_grads(opt)
    np.testing.assert_array_equal(p.numpy(), after_one)
    assert opt.param_steps == [1]
    opt.params.pop()
    _step_with_unit_grads(opt)
    # Adam with a constant gradient 1: m_hat = v_hat = 1 at every step, so each step moves
    # by lr / (1 + eps) -- only with the bias correction of the right step count.
    np.testing.assert_allclose(p.numpy(), A0 - 2 * 0.1 / (1 + 1e-8), rtol=1e-6)


def test_removed_or_replaced_params_are_named(device):
    p, q, r = _param(device, A0), _param(device, A0), _param(device, A0)
    opt = optim.SGD([p, q], lr=0.1)
    opt.params.pop()
    with pytest.raises(ValueError, match=r"params\[1\] was removed"):
        opt.step()
    with pytest.raises(ValueError, match=r"params\[1\] was removed"):
        opt.state_dict()
    opt.params[:] = [p, r]
    with pytest.raises(ValueError, match=r"params\[1\] was replaced"):
        opt.step()
    opt.params = [p, q]  # the same tensors again: accepted
    _step_with_unit_grads(opt)
    np.testing.assert_allclose(q.numpy(), A0 - 0.1, rtol=1e-6)


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_a_single_tensor_is_not_a_params_list(device, name):
    w = pydiff.tensor(np.ones((3, 2), np.float32), device=device, requires_grad=True)
    with pytest.raises(TypeError, match=r"params must be an iterable of pydiff.Tensor.*\[w\]"):
        getattr(optim, name)(w, lr=0.1)
    with pytest.raises(TypeError, match=r"params must be an iterable.*float"):
        getattr(optim, name)(0.1, lr=0.1)


def test_train_mlp_sample_captures_its_step(device, capsys):
    path = Path(__file__).parent.parent / "samples" / "train_mlp.py"
    spec = importlib.util.spec_from_file_location("train_mlp_s30", path)
    sample = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sample)
    captures = []
    real_capture = pydiff.capture

    def counting_capture(fn):
        captures.append(fn)
        return real_capture(fn)

    pydiff.set_default_device(device)
    sample.pydiff.capture = counting_capture  # (the sample's own reference to pydiff)
    try:
        sample.train(epochs=1, progress=False)
    finally:
        sample.pydiff.capture = real_capture
        pydiff.set_default_device(None)
    out = capsys.readouterr().out
    assert len(captures) == 1 and "not captured" not in out, out


def test_linear_arguments_are_named(device):
    with pytest.raises(TypeError, match="in_features=3.5"):
        nn.Linear(3.5, 3, device=device)
    with pytest.raises(TypeError, match="out_features=True"):
        nn.Linear(4, True, device=device)
    with pytest.raises(TypeError, match="seed='a'"):
        nn.Linear(4, 3, seed="a", device=device)
    with pytest.raises(ValueError, match="seed=-1"):
        nn.Linear(4, 3, seed=-1, device=device)
    assert nn.Linear(np.int64(4), 3, seed=np.int64(0), device=device).weight.shape == (3, 4)


def test_none_and_ragged_arguments_are_named(device):
    x = pydiff.tensor(np.ones((2, 2), np.float32), device=device)
    with pytest.raises(TypeError, match=r"parameter 'b' \(float\): got None"):
        ops.add(x, None)
    with pytest.raises(ValueError, match=r"pydiff.tensor: data: .*rectangular"):
        pydiff.tensor([[1.0], [1.0, 2.0]], device=device)


def test_a_captured_step_refuses_an_appended_param(device):
    x = pydiff.tensor(np.ones((2, 4), np.float32), device=device)
    labels = pydiff.tensor(np.array([0, 1], np.int32), dtype="int", device=device)
    w = pydiff.tensor(np.eye(4, dtype=np.float32), device=device, requires_grad=True)
    q = _param(device, A0)
    opt = optim.SGD([w], lr=0.1)

    def step():
        opt.zero_grad()
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(ops.linear(x, w), labels)
        tape.backward(loss, retain_graph=False)
        opt.step()

    step()
    captured = pydiff.capture(step)
    before = w.numpy().copy()
    opt.params.append(q)
    with pytest.raises(pydiff.CaptureError, match=r"params\[1\] was added"):
        captured.replay()  # (was an IndexError from the replay's check of the state)
    np.testing.assert_array_equal(w.numpy(), before)
