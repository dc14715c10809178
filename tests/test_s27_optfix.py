"""Optimizers and the all-reduce, against torch.optim and torch's DDP rules:

- hyper-parameters given as 0-d (or one-element) pydiff/torch tensors and NumPy scalars are
  taken, their value read once as a float; NaN, negatives and other sizes are still refused;
- ``load_state_dict`` refuses what this optimizer could not have saved (other counts, keys,
  step counts, part of the buffers) and leaves the optimizer as it was;
- ``zero_grad(set_to_none=False)`` steps a parameter that had a gradient with a zero one,
  as torch does (float64 torch.optim over several steps);
- ``all_reduce_grads`` leaves a gradient no rank wrote unwritten (its parameter skipped, as
  DDP leaves it None), in a group of one and in two gloo ranks.

The two-rank workers are this file run as a script (tests/ranks.py)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import numpy as np
import pytest

import pydiff
from pydiff import distributed as dist
from pydiff import optim

from ranks import free_port, launch_scenario, needs_vulkan, scenario_worker

X0 = np.array([1.0, -2.0, 0.5, 3.0, -1.5], np.float32)


# --- 0-d tensors and NumPy scalars as hyper-parameters ----------------------------------


def test_tensor_and_numpy_scalar_hyper_parameters_are_taken_as_floats(device):
    torch = pytest.importorskip("torch")
    p = pydiff.tensor(X0, device=device, requires_grad=True)
    lr = pydiff.tensor(np.float32(0.25), device=device)  # 0-d, as torch.optim takes
    opt = optim.SGD([p], lr=lr, momentum=np.float64(0.5), weight_decay=np.array(0.1))
    assert opt.defaults == {"lr": 0.25, "momentum": 0.5, "weight_decay": 0.1}
    assert all(type(v) is float for v in opt.defaults.values())
    lr.copy_from_numpy(np.float32(9.0))  # read once, when given: the optimizer keeps 0.25
    assert opt.defaults["lr"] == 0.25
    for value, want in [
        (pydiff.tensor(np.array([0.125], np.float32), device=device), 0.125),  # one element
        (pydiff.tensor(np.array([[0.5]], np.float32), device=device), 0.5),
        (torch.tensor(0.375, dtype=torch.float64), 0.375),
        (torch.tensor([0.0625], requires_grad=True), 0.0625),
        (np.float16(0.5), 0.5),
        (np.array(0.75), 0.75),
        (pydiff.tensor(np.array(2, np.int32), dtype="int", device=device), 2.0),
    ]:
        opt.defaults["lr"] = value
        assert opt.defaults["lr"] == want and type(opt.defaults["lr"]) is float
    adam = optim.Adam(
        [p],
        lr=pydiff.tensor(np.float32(0.5), device=device),
        betas=(pydiff.tensor(np.float32(0.5), device=device), np.float64(0.75)),
        eps=np.array(1e-6),
        weight_decay=torch.tensor(0.0),
    )
    assert adam.defaults == {"lr": 0.5, "betas": (0.5, 0.75), "eps": 1e-6, "weight_decay": 0.0}
    adam.defaults["betas"] = pydiff.tensor(np.array([0.25, 0.5], np.float32), device=device)
    assert adam.defaults["betas"] == (0.25, 0.5)
    adam.defaults["betas"] = torch.tensor([0.5, 0.75])  # torch.optim takes this too
    assert adam.defaults["betas"] == (0.5, 0.75)


def test_tensor_hyper_parameters_step_as_torchs(device):
    """Steps with tensor hyper-parameters are the steps torch takes with tensor ones."""
    torch = pytest.importorskip("torch")
    grads = [np.random.default_rng(k).standard_normal(X0.shape) for k in range(4)]
    p = pydiff.tensor(X0, device=device, requires_grad=True)
    q = pydiff.tensor(X0, device=device, requires_grad=True)
    sgd = optim.SGD([p], lr=pydiff.tensor(np.float32(0.125), device=device), momentum=0.5)
    adam = optim.Adam(
        [q], lr=pydiff.tensor(np.array([0.0625], np.float32), device=device), betas=(0.5, 0.75)
    )
    tp, tq = (torch.tensor(X0.astype(np.float64)) for _ in range(2))
    tsgd = torch.optim.SGD([tp], lr=torch.tensor(0.125, dtype=torch.float64), momentum=0.5)
    tadam = torch.optim.Adam(
        [tq], lr=torch.tensor([0.0625], dtype=torch.float64), betas=(0.5, 0.75)
    )
    for g in grads:
        for t in (p, q):
            t.grad.copy_from_numpy(g.astype(np.float32))
        sgd.step()
        adam.step()
        tp.grad, tq.grad = torch.tensor(g), torch.tensor(g)
        tsgd.step()
        tadam.step()
    np.testing.assert_allclose(p.numpy(), tp.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(q.numpy(), tq.numpy(), rtol=1e-5, atol=1e-6)


def test_bad_tensor_hyper_parameters_are_refused(device):
    p = pydiff.tensor(X0, device=device, requires_grad=True)

    def t(values, dtype="float"):
        return pydiff.tensor(np.array(values), dtype=dtype, device=device)

    cases = [
        ("lr", t(np.float32("nan")), ValueError, "lr=.*finite number >= 0"),
        ("lr", t(np.float32(-0.5)), ValueError, "lr=.*>= 0"),  # torch refuses it too
        ("lr", t([0.1, 0.2]), TypeError, r"lr=.*shape \(2,\).*one element"),
        ("lr", t([[0.1, 0.2]]), TypeError, r"lr=.*shape \(1, 2\)"),
        ("lr", np.array([0.25]), TypeError, r"lr=.*ndarray of shape \(1,\)"),
        ("lr", t([True], "bool"), TypeError, "lr=.*bool values"),
        ("lr", np.array("0.1"), TypeError, "lr=.*<U3 values"),
        ("weight_decay", t(np.float32(-1)), ValueError, "weight_decay="),
        ("eps", t(np.float32("inf")), ValueError, "eps="),
        ("betas", (t(np.float32(1.0)), 0.5), ValueError, r"betas=.*\[0, 1\)"),
        ("betas", t([0.5, 0.6, 0.7]), ValueError, "betas="),
        ("betas", t(np.float32(0.5)), TypeError, "betas="),
    ]
    for key, value, error, match in cases:
        opt = optim.Adam([p], lr=0.1)
        before = dict(opt.defaults)
        with pytest.raises(error, match=rf"Adam.defaults: {match}"):
            opt.defaults[key] = value
        with pytest.raises(error, match=rf"Adam: {match}"):
            optim.Adam([p], **{"lr": 0.1, key: value})
        assert dict(opt.defaults) == before


# --- load_state_dict: what this optimizer could not have saved --------------------------


def _adam(device, n=2, steps=2):
    params = [
        pydiff.tensor(X0[: 3 + k] * (k + 1), device=device, requires_grad=True) for k in range(n)
    ]
    opt = optim.Adam(params, lr=0.1, weight_decay=0.01)
    for _ in range(steps):
        for p in params:
            p.grad.fill(0.5)
        opt.step()
    return params, opt


def _same(a: dict, b: dict) -> bool:
    return (
        a["step"] == b["step"]
        and a["defaults"] == b["defaults"]
        and len(a["state"]) == len(b["state"])
        and all(
            x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x)
            for x, y in zip(a["state"], b["state"])
        )
    )


def _edited(saved, edit):
    out = copy.deepcopy(saved)
    edit(out)
    return out


def test_load_state_dict_refuses_what_this_optimizer_could_not_have_saved(device):
    params, opt = _adam(device)
    saved = opt.state_dict()
    bigger = _adam(device, n=3)[1].state_dict()
    smaller = _adam(device, n=1)[1].state_dict()

    def torch_layout(d):
        d["state"] = {0: d["state"][0], 1: d["state"][1], 5: d["state"][1]}

    def sneaked_in(d):  # what the loader used to read past: a change then a bad buffer
        d["defaults"]["lr"] = 0.5
        d["step"] = 7
        d["state"][1]["exp_avg"] = np.ones(4, np.complex64)

    cases = [
        (bigger, r"state\['state'\] has 3 per-parameter entries.*Adam here has 2"),
        (smaller, r"state\['state'\] has 1 per-parameter entries.*Adam here has 2"),
        (_edited(saved, torch_layout), r"keyed by \[0, 1, 5\] \(\[5\]: no index of its 2"),
        (_edited(saved, lambda d: d.update(param_steps=[2, 2])), "'param_steps', which Adam"),
        (_edited(saved, lambda d: d.update(param_groups=[])), "'param_groups', which Adam"),
        (
            _edited(saved, lambda d: d["state"][1].update(step=3)),
            r"state\[1\]\['step'\]=3, more than the optimizer's 'step'=2",
        ),
        (
            _edited(saved, lambda d: d["state"][0].pop("exp_avg_sq")),
            r"state\[0\] holds 'exp_avg' without 'exp_avg_sq'",
        ),
        (
            _edited(saved, lambda d: d["state"].__setitem__(1, {"step": 2})),
            r"state\[1\] has 'step'=2 but no state buffers",
        ),
        (
            _edited(saved, lambda d: d["state"][1].update(exp_avg_sq=-np.ones(4, np.float32))),
            r"state\[1\]\['exp_avg_sq'\] has negative values",
        ),
        (_edited(saved, sneaked_in), r"state\[1\]\['exp_avg'\] holds complex64 values"),
        (
            _edited(saved, lambda d: d["state"][0].update(exp_avg=np.array(list("abc")))),
            r"state\[0\]\['exp_avg'\] holds <U1 values",
        ),
        (
            _edited(saved, lambda d: d["state"][0].update(exp_avg=[[1.0], [2.0, 3.0]])),
            r"state\[0\]\['exp_avg'\] holds object values",
        ),
    ]
    for bad, match in cases:
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(bad)
        assert _same(opt.state_dict(), saved), match  # a refused load changes nothing
        assert opt.param_steps == [2, 2] and opt.step_count == 2


def test_load_state_dict_takes_other_float_arrays_and_lists(device):
    params, opt = _adam(device)
    saved = opt.state_dict()
    as64 = copy.deepcopy(saved)
    as64["state"][0]["exp_avg"] = saved["state"][0]["exp_avg"].astype(np.float64) * 2
    as64["state"][1]["exp_avg_sq"] = (saved["state"][1]["exp_avg_sq"] * 3).tolist()
    opt.load_state_dict(as64)
    got = opt.state_dict()["state"]
    np.testing.assert_array_equal(got[0]["exp_avg"], saved["state"][0]["exp_avg"] * 2)
    np.testing.assert_array_equal(got[1]["exp_avg_sq"], saved["state"][1]["exp_avg_sq"] * 3)
    fresh = _adam(device, steps=0)[1].state_dict()  # before any step: no buffers, step 0
    opt.load_state_dict(fresh)
    assert opt.state == [{}, {}] and opt.param_steps == [0, 0]


# --- zero_grad(set_to_none=False): torch's steps with zero gradients --------------------

SHAPES = [(3, 4), (5,), (2,), (3,)]
OPTIMIZERS = {
    "SGD": dict(lr=0.05, momentum=0.9, weight_decay=0.05),
    "Adam": dict(lr=0.02, weight_decay=0.05),
    "AdamW": dict(lr=0.02, weight_decay=0.1),
}


def _plan(step):
    """(set_to_none, the parameters with a gradient this step): 0 always; 1 at steps 0 and 3
    (a zero gradient at the others, but None after the set_to_none=True of step 6); 2 from
    step 4 on at even steps (None before); 3 never."""
    used = [True, step in (0, 3), step >= 4 and step % 2 == 0, False]
    return step == 6, used


def _gradients(steps):
    rng = np.random.default_rng(27)
    return [[rng.standard_normal(s) for s in SHAPES] for _ in range(steps)]


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_zero_grad_set_to_none_false_steps_as_torch(device, kind):
    torch = pytest.importorskip("torch")
    steps, kw = 10, OPTIMIZERS[kind]
    grads = _gradients(steps)
    starts = [
        np.random.default_rng(k).standard_normal(s).astype(np.float32) for k, s in enumerate(SHAPES)
    ]
    params = [pydiff.tensor(x, device=device, requires_grad=True) for x in starts]
    tparams = [torch.tensor(x.astype(np.float64), requires_grad=True) for x in starts]
    opt = getattr(optim, kind)(params, **kw)
    topt = getattr(torch.optim, kind)(tparams, **kw)
    for step in range(steps):
        to_none, used = _plan(step)
        opt.zero_grad(set_to_none=to_none)
        topt.zero_grad(set_to_none=to_none)
        for p, tp, g, u in zip(params, tparams, grads[step], used):
            if u:  # (a backward into a zeroed buffer: the gradient itself)
                p.grad.copy_from_numpy(g.astype(np.float32))
                tp.grad = torch.tensor(g) if tp.grad is None else tp.grad + torch.tensor(g)
        opt.step()
        topt.step()
    for k, (p, tp) in enumerate(zip(params, tparams)):
        np.testing.assert_allclose(
            p.numpy(), tp.detach().numpy(), rtol=2e-5, atol=2e-5, err_msg=f"param {k}"
        )
    np.testing.assert_array_equal(params[3].numpy(), starts[3])  # never a gradient
    if kind != "SGD":  # (torch's SGD keeps no step count)
        tsteps = [int(topt.state[tp]["step"]) if tp in topt.state else 0 for tp in tparams]
        assert opt.param_steps == tsteps
    # param 1 was stepped with zero gradients (steps 1, 2, 4, 5), so it moved past its two
    # real updates: what set_to_none=False means.
    assert opt.param_steps[1] == 6


def test_zero_grad_set_to_none_refuses_non_bools(device):
    p = pydiff.tensor(X0, device=device, requires_grad=True)
    opt = optim.SGD([p], lr=0.1)
    with pytest.raises(TypeError, match="SGD.zero_grad: set_to_none='no'"):
        opt.zero_grad(set_to_none="no")
    opt.zero_grad(set_to_none=np.bool_(True))


# --- all_reduce_grads: a gradient no rank wrote stays unwritten --------------------------


@pytest.fixture
def group_of_one():
    pytest.importorskip("torch")
    dist.init_process_group(
        "gloo", timeout=30.0, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    yield
    import torch

    torch.distributed.destroy_process_group()


def test_all_reduce_leaves_a_gradient_no_rank_wrote_unwritten(device, group_of_one):
    used = pydiff.tensor(X0, device=device, requires_grad=True)
    unused = pydiff.tensor(X0[:3], device=device, requires_grad=True)
    opt = optim.SGD([used, unused], lr=0.5, momentum=0.9, weight_decay=0.5)
    opt.zero_grad()
    used.grad.fill(1.0)
    assert dist.all_reduce_grads([used, unused]) == 4 * X0.size  # only the written travels
    assert used.grad.storage.written_since_zeroed()
    assert not unused.grad.storage.written_since_zeroed()
    opt.step()
    np.testing.assert_array_equal(unused.numpy(), X0[:3])  # skipped: no weight decay
    np.testing.assert_allclose(used.numpy(), X0 - 0.5 * (1.0 + 0.5 * X0), rtol=1e-6)
    assert opt.param_steps == [1, 0]
    assert dist.all_reduce_grads([unused]) == 0


def _scenario_unused(me, world):
    """Parameter 0 used on every rank, 1 on rank 0 only, 2 on none: three SGD and AdamW
    steps with the gradients all-reduced before each."""
    out = {}
    for kind, kw in (("SGD", OPTIMIZERS["SGD"]), ("AdamW", OPTIMIZERS["AdamW"])):
        params = [
            pydiff.tensor(np.full(s, 1.0, np.float32), requires_grad=True) for s in SHAPES[:3]
        ]
        opt = getattr(optim, kind)(params, **kw)
        for step in range(3):
            opt.zero_grad()
            for k, p in enumerate(params):
                if k == 0 or (k == 1 and me == 0):
                    p.grad.copy_from_numpy(_rank_gradient(me, k, step).astype(np.float32))
            dist.all_reduce_grads(params)
            opt.step()
        out[kind] = {"params": [p.numpy().tolist() for p in params], "steps": opt.param_steps}
    return out


def _rank_gradient(rank, k, step):
    return np.random.default_rng((rank, k, step)).standard_normal(SHAPES[k])


@needs_vulkan
def test_two_ranks_skip_a_parameter_no_rank_used_as_ddp(tmp_path):
    torch = pytest.importorskip("torch")
    results = launch_scenario(__file__, "unused", tmp_path, {"B19_TIMEOUT": "60"}, wait=180)
    for code, log, res in results:
        assert code == 0 and res is not None, log
    for kind in ("SGD", "AdamW"):
        # DDP's rule: the mean over both ranks (a rank that did not use it adds zeros); a
        # parameter no rank used keeps .grad None and is skipped.
        tparams = [torch.ones(s, dtype=torch.float64) for s in SHAPES[:3]]
        topt = getattr(torch.optim, kind)(tparams, **OPTIMIZERS[kind])
        for step in range(3):
            topt.zero_grad()
            tparams[0].grad = torch.tensor(sum(_rank_gradient(r, 0, step) for r in range(2)) / 2)
            tparams[1].grad = torch.tensor(_rank_gradient(0, 1, step) / 2)
            topt.step()
        for me, (_, _, res) in enumerate(results):
            for k, tp in enumerate(tparams):
                got = np.array(res[kind]["params"][k])
                np.testing.assert_allclose(
                    got, tp.numpy(), rtol=2e-5, atol=2e-5, err_msg=f"{kind} rank {me} param {k}"
                )
            assert res[kind]["steps"] == [3, 3, 0]
        assert results[0][2] == results[1][2]  # the same on both ranks
        np.testing.assert_array_equal(np.array(results[0][2][kind]["params"][2]), 1.0)


if __name__ == "__main__":
    scenario_worker(globals(), sys.argv[1], Path(sys.argv[2]))
