"""Optimizer hyper-parameters and state dicts (breaker C, F4, F7, F9): ``opt.defaults`` takes
``betas`` as the constructor and torch do (eagerly and at a captured step's replay), refuses
unknown keys, and checks every value as the constructor does, by torch.optim's rules;
``load_state_dict`` says what is wrong with a dict that is not this optimizer's."""

import pickle

import numpy as np
import pytest

import pydiff
from pydiff import ops, optim

X0 = np.linspace(-1, 1, 5).astype(np.float32)


def _adam_steps(device, kind, change, steps=6):
    a = pydiff.tensor(X0, device=device, requires_grad=True)
    opt = getattr(optim, kind)([a], lr=0.1)
    for step in range(steps):
        change(step, opt)
        opt.zero_grad()
        with pydiff.Tape() as tape:
            loss = ops.sum(ops.mul(a, a))
        tape.backward(loss)
        opt.step()
    return a.numpy()


def _torch_adam(kind, betas_at, steps=6):
    torch = pytest.importorskip("torch")
    a = torch.tensor(X0.astype(np.float64), requires_grad=True)
    opt = getattr(torch.optim, kind)([a], lr=0.1)
    for step in range(steps):
        if step in betas_at:
            opt.param_groups[0]["betas"] = betas_at[step]
        opt.zero_grad()
        (a * a).sum().backward()
        opt.step()
    return a.detach().numpy()


@pytest.mark.parametrize("kind", ["Adam", "AdamW"])
def test_betas_set_through_defaults_apply(device, kind):
    def change(step, opt):
        if step == 3:
            opt.defaults["betas"] = (0.5, 0.6)

    got = _adam_steps(device, kind, change)
    np.testing.assert_allclose(got, _torch_adam(kind, {3: (0.5, 0.6)}), rtol=1e-5, atol=1e-6)
    assert not np.allclose(got, _torch_adam(kind, {}), rtol=1e-3)  # the change shows


def test_betas_set_between_replays_apply(device):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    X = rng.standard_normal((8, 4)).astype(np.float32)
    G = rng.standard_normal((8, 4)).astype(np.float32)
    W0 = rng.standard_normal((4, 4)).astype(np.float32)
    x = pydiff.tensor(X, device=device)
    w = pydiff.tensor(W0, device=device, requires_grad=True)
    opt = optim.AdamW([w], lr=0.05)

    def step():
        opt.zero_grad()
        with pydiff.Tape() as tape:
            y = ops.linear(x, w)
        tape.backward(y, grad=G)
        opt.step()

    step()
    captured = pydiff.capture(step)
    schedule = [(0.5, 0.6), (0.8, 0.9), (0.95, 0.99)]
    for betas in schedule:
        opt.defaults["betas"] = betas
        captured.replay()
    tw = torch.tensor(W0.astype(np.float64), requires_grad=True)
    topt = torch.optim.AdamW([tw], lr=0.05)
    dw = torch.tensor(G.astype(np.float64).T @ X)
    for betas in [(0.9, 0.999), (0.9, 0.999)] + schedule:
        topt.param_groups[0]["betas"] = betas
        tw.grad = dw.clone()
        topt.step()
    np.testing.assert_allclose(w.numpy(), tw.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_defaults_keys_are_fixed(device):
    p = pydiff.tensor(X0, device=device, requires_grad=True)
    opt = optim.AdamW([p], lr=0.1)
    assert opt.defaults == {"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    with pytest.raises(KeyError, match=r"AdamW.defaults has no key 'lrr'.*lr, betas, eps"):
        opt.defaults["lrr"] = 5.0
    with pytest.raises(KeyError, match=r"'beta1'.*betas=\(beta1, beta2\)"):
        opt.defaults["beta1"] = 0.5
    with pytest.raises(KeyError, match="SGD.defaults has no key 'betas'"):
        optim.SGD([p], lr=0.1).defaults.update(betas=(0.5, 0.5))
    with pytest.raises(TypeError, match="keys are fixed"):
        del opt.defaults["lr"]
    with pytest.raises(ValueError, match="lr"):  # all or nothing: eps is not set either
        opt.defaults.update({"eps": 1e-3, "lr": -1.0})
    assert opt.defaults["eps"] == 1e-8
    opt.defaults.update(lr=np.float32(0.5), weight_decay=0)  # NumPy numbers and ints: floats
    assert type(opt.defaults["lr"]) is float and type(opt.defaults["weight_decay"]) is float
    opt.defaults["lr"] = np.array(0.25)  # a 0-d array (or torch tensor, as torch.optim takes)
    assert opt.defaults["lr"] == 0.25 and type(opt.defaults["lr"]) is float
    for bad in (np.array([0.25]), np.array(True), np.array(1 + 0j)):
        with pytest.raises(TypeError, match="AdamW.defaults: lr="):
            opt.defaults["lr"] = bad
    assert pickle.loads(pickle.dumps(opt.defaults)) == dict(opt.defaults)
    with pytest.raises(KeyError, match="expected the keys lr, betas, eps, weight_decay"):
        opt.defaults = {"lr": 0.1}  # a new dict: checked as a whole
    with pytest.raises(ValueError, match="AdamW: eps=-1"):
        opt.defaults = {**opt.defaults, "eps": -1}
    opt.defaults = {**opt.defaults, "betas": [0.5, 0.6]}
    assert opt.defaults["betas"] == (0.5, 0.6)
    with pytest.raises(KeyError, match="lrr"):  # still the checked dict
        opt.defaults["lrr"] = 0.0


BAD = [
    ("lr", float("nan"), ValueError),
    ("lr", float("inf"), ValueError),
    ("lr", -5.0, ValueError),
    ("lr", "0.1", TypeError),
    ("lr", None, TypeError),
    ("lr", [0.1], TypeError),
    ("lr", True, TypeError),
    ("weight_decay", -0.1, ValueError),
    ("weight_decay", float("nan"), ValueError),
]
BAD_SGD = BAD + [("momentum", float("nan"), ValueError), ("momentum", -0.5, ValueError)]
BAD_ADAM = BAD + [
    ("eps", float("nan"), ValueError),
    ("eps", -1e-8, ValueError),
    ("betas", (1.0, 0.9), ValueError),
    ("betas", (0.9, float("nan")), ValueError),
    ("betas", (0.9,), ValueError),
    ("betas", 0.9, TypeError),
    ("betas", ("0.9", 0.99), TypeError),
]
CASES = [("SGD", *c) for c in BAD_SGD] + [(k, *c) for k in ("Adam", "AdamW") for c in BAD_ADAM]


@pytest.mark.parametrize(
    "kind, key, value, error", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]!r}" for c in CASES]
)
def test_bad_hyper_parameters_are_refused_when_set(device, kind, key, value, error):
    """The constructor and ``defaults[key] = value`` refuse alike, naming the optimizer and
    the key; the optimizer still steps with its old value."""
    p = pydiff.tensor(X0, device=device, requires_grad=True)
    kw = {"lr": 0.1, key: value}
    with pytest.raises(error, match=rf"{kind}: {key}="):
        getattr(optim, kind)([p], **kw)
    opt = getattr(optim, kind)([p], lr=0.1)
    before = dict(opt.defaults)
    with pytest.raises(error, match=rf"{kind}.defaults: {key}="):
        opt.defaults[key] = value
    assert dict(opt.defaults) == before
    p.grad.fill(1.0)
    opt.step()
    assert np.all(np.isfinite(p.numpy()))


def _stepped(device, kind, **kw):
    p = pydiff.tensor(X0, device=device, requires_grad=True)
    opt = getattr(optim, kind)([p], **kw)
    p.grad.fill(1.0)
    opt.step()
    return p, opt


def test_load_state_dict_says_what_is_wrong(device):
    torch = pytest.importorskip("torch")
    p, adamw = _stepped(device, "AdamW", lr=0.1, weight_decay=0.3)
    with pytest.raises(
        ValueError,
        match=r"not a state dict of pydiff's AdamW: it lacks 'defaults', 'step', 'state'",
    ):
        adamw.load_state_dict({})
    with pytest.raises(ValueError, match=r"lacks 'defaults', 'state'"):
        adamw.load_state_dict({"step": 1})
    with pytest.raises(TypeError, match="expected a dict"):
        adamw.load_state_dict([1])
    theirs = torch.optim.AdamW([torch.nn.Parameter(torch.ones(5))]).state_dict()
    with pytest.raises(ValueError, match="torch.optim's: it has 'param_groups'"):
        adamw.load_state_dict(theirs)
    saved = adamw.state_dict()
    assert saved["optimizer"] == "AdamW"
    q, sgd = _stepped(device, "SGD", lr=0.001, momentum=0.9)
    before = (dict(sgd.defaults), sgd.step_count, sgd.state[0]["momentum_buffer"].numpy())
    with pytest.raises(ValueError, match="saved by AdamW, not SGD"):
        sgd.load_state_dict(saved)
    with pytest.raises(ValueError, match="saved by AdamW, not Adam"):
        _stepped(device, "Adam")[1].load_state_dict(saved)
    unnamed = dict(saved)
    del unnamed["optimizer"]  # a state dict of older pydiff: its keys still tell
    with pytest.raises(
        ValueError, match=r"hyper-parameters \(lr, betas, eps, weight_decay\) are not SGD's"
    ):
        sgd.load_state_dict(unnamed)
    bad = sgd.state_dict()
    bad["state"][0]["exp_avg"] = np.zeros(5, np.float32)
    with pytest.raises(ValueError, match="state\\[0\\] holds 'exp_avg', which SGD has not"):
        sgd.load_state_dict(bad)
    bad = sgd.state_dict()
    bad["defaults"]["lr"] = float("nan")
    with pytest.raises(ValueError, match="lr=nan"):
        sgd.load_state_dict(bad)
    bad = sgd.state_dict()
    bad["step"] = 1.5
    with pytest.raises(ValueError, match="step=1.5 is not a step count"):
        sgd.load_state_dict(bad)
    after = (dict(sgd.defaults), sgd.step_count, sgd.state[0]["momentum_buffer"].numpy())
    assert after[:2] == before[:2]  # nothing was loaded
    np.testing.assert_array_equal(after[2], before[2])


def test_state_dict_of_older_pydiff_loads(device):
    """beta1/beta2 (older pydiff's keys) load as betas; no class name, no per-parameter
    counts: each parameter takes the optimizer's."""
    p, opt = _stepped(device, "Adam", lr=0.1)
    old = opt.state_dict()
    del old["optimizer"]
    old["defaults"]["beta1"], old["defaults"]["beta2"] = old["defaults"].pop("betas")
    old["defaults"]["beta1"] = 0.5
    old["step"] = 3
    del old["state"][0]["step"]
    opt.load_state_dict(old)
    assert opt.defaults["betas"] == (0.5, 0.999)
    assert opt.param_steps == [3]
