"""pydiff.capture after the optimizer's state, a parameter or a layer changed outside the
captured step (issue 21, 2.2): the replay runs on the current state or refuses, naming what
changed. Never a replay on old buffers that drifts from the eager step."""

import numpy as np
import pytest

import pydiff
from pydiff import CaptureError, nn, ops, optim

RNG = np.random.default_rng(21)
X = RNG.standard_normal((16, 8)).astype(np.float32)
Y = RNG.integers(0, 3, 16).astype(np.int32)

OPTIMIZERS = {
    "adamw": lambda ps: optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
    "adam": lambda ps: optim.Adam(ps, lr=1e-2),
    "sgd-momentum": lambda ps: optim.SGD(ps, lr=0.1, momentum=0.9),
}


def _model(device, make_opt):
    layers = [
        nn.Linear(8, 8, seed=0, activation="relu", device=device),
        nn.Linear(8, 3, seed=1, device=device),
    ]
    opt = make_opt([p for layer in layers for p in layer.parameters()])
    xb, yb = pydiff.tensor(X, device=device), pydiff.tensor(Y, device=device)

    def step():
        opt.zero_grad()
        with pydiff.Tape() as tape:
            loss = ops.cross_entropy(layers[1](layers[0](xb)), yb)
        tape.backward(loss)
        opt.step()
        return loss

    return layers, opt, step


def _weights(layers):
    return [p.numpy().copy() for layer in layers for p in layer.parameters()]


def _load_weights(layers, arrays):
    for p, a in zip([p for layer in layers for p in layer.parameters()], arrays):
        p.copy_from_numpy(a)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_replay_after_load_state_dict_matches_eager(device, name):
    """A checkpoint taken after 2 steps, loaded after 5 more: the replayed steps then equal the
    eager steps from the same checkpoint (moments, step count for bias correction, weights)."""
    layers, opt, step = _model(device, OPTIMIZERS[name])
    step()
    step()
    checkpoint, weights = opt.state_dict(), _weights(layers)
    captured = pydiff.capture(step)
    for _ in range(4):
        captured.replay()
    _load_weights(layers, weights)
    opt.load_state_dict(checkpoint)
    got = [captured.replay().item() for _ in range(3)]
    got_weights = _weights(layers)

    e_layers, e_opt, e_step = _model(device, OPTIMIZERS[name])
    e_step()  # creates the state; weights and state are then overwritten by the checkpoint
    _load_weights(e_layers, weights)
    e_opt.load_state_dict(checkpoint)
    expected = [e_step().item() for _ in range(3)]
    np.testing.assert_array_equal(got, expected)
    for a, b in zip(got_weights, _weights(e_layers)):
        np.testing.assert_array_equal(a, b)
    assert opt.step_count == e_opt.step_count == checkpoint["step"] + 3


def test_load_state_dict_writes_in_place_and_checks_shapes_first(device):
    layers, opt, step = _model(device, OPTIMIZERS["adamw"])
    step()
    before = [dict(s) for s in opt.state]
    sd = opt.state_dict()
    sd["state"][0]["exp_avg"] = np.full(sd["state"][0]["exp_avg"].shape, 0.25, np.float32)
    opt.load_state_dict(sd)
    assert all(opt.state[k][n] is before[k][n] for k in range(len(before)) for n in before[k])
    np.testing.assert_array_equal(opt.state[0]["exp_avg"].numpy(), 0.25)
    bad = opt.state_dict()
    bad["state"][1]["exp_avg_sq"] = np.zeros((2, 2), np.float32)
    bad["step"] = 99
    with pytest.raises(ValueError, match=r"exp_avg_sq.*param 1.*\(2, 2\)"):
        opt.load_state_dict(bad)
    assert opt.step_count == 1  # nothing was loaded


def test_replay_after_loading_a_fresh_state_is_refused(device):
    """A state_dict of an optimizer that never stepped (no moments): the eager step starts the
    moments afresh; the capture cannot, and says so."""
    layers, opt, step = _model(device, OPTIMIZERS["adamw"])
    fresh = opt.state_dict()
    step()
    captured = pydiff.capture(step)
    opt.load_state_dict(fresh)
    with pytest.raises(CaptureError, match=r"AdamW.step: state\[0\]\['exp_avg'\] was removed"):
        captured.replay()


def _replace_weight(layers, opt):
    new = pydiff.tensor(layers[0].weight.numpy(), device=layers[0].weight.device)
    layers[0].weight = new.requires_grad_()


def _replace_param(layers, opt):
    opt.params[0] = pydiff.tensor(opt.params[0].numpy(), device=opt.params[0].device)
    opt.params[0].requires_grad_()


def _replace_grad_buffer(layers, opt):
    opt.params[1].requires_grad_(False)
    opt.params[1].requires_grad_(True)


def _replace_state(layers, opt):
    opt.state[2]["exp_avg"] = pydiff.zeros(opt.params[2].shape, device=opt.params[2].device)


def _change_activation(layers, opt):
    layers[0].activation = None


@pytest.mark.parametrize(
    "change, message",
    [
        (_replace_weight, r"nn.Linear\(8, 8\): weight was replaced"),
        (_replace_param, r"AdamW.step: params\[0\] was replaced"),
        (_replace_grad_buffer, r"AdamW.step: params\[1\].grad was replaced"),
        (_replace_state, r"AdamW.step: state\[2\]\['exp_avg'\] was replaced"),
        (_change_activation, r"nn.Linear\(8, 8\): activation was replaced"),
    ],
    ids=["layer-weight", "optimizer-param", "grad-buffer", "optimizer-state", "activation"],
)
def test_replay_after_a_replaced_tensor_is_refused(device, change, message):
    layers, opt, step = _model(device, OPTIMIZERS["adamw"])
    step()
    captured = pydiff.capture(step)
    captured.replay()
    count = opt.step_count
    change(layers, opt)
    with pytest.raises(CaptureError, match=message):
        captured.replay()
    assert opt.step_count == count  # refused before anything ran
    with pytest.raises(CaptureError, match="capture the step again"):
        captured.replay()
