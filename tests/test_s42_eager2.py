"""The eager training step's host shortcuts (twenty-second session, second helper), each
against an independent reference:

- a uniform that changed since a bound object's last dispatch is written through its field's
  cursor, found once per object and name (``cursor[name] = value`` looked the name up in
  Slang's reflection at every write): AdamW's changing step size and bias correction, and
  hyper-parameters changed between steps, must reach the kernel every step;
- Slang type names are memoised by reflection object (``storage.type_name``): distinct types
  must keep distinct names.
"""

import numpy as np

import pydiff
from pydiff import optim
from pydiff.storage import type_name

B1, B2, EPS = 0.9, 0.999, 1e-8


def _adamw64(p, grads, lrs, wds):
    """AdamW's rule in float64, one gradient, learning rate and weight decay per step."""
    p, m, v = p.astype(np.float64), 0.0, 0.0
    for t, (g, lr, wd) in enumerate(zip(grads, lrs, wds), start=1):
        g = g.astype(np.float64)
        p = p * (1 - lr * wd)
        m = B1 * m + (1 - B1) * g
        v = B2 * v + (1 - B2) * g**2
        p = p - lr * (m / (1 - B1**t)) / (np.sqrt(v / (1 - B2**t)) + EPS)
    return p


def test_changed_uniforms_reach_the_kernel_every_step(device):
    rng = np.random.default_rng(7)
    shapes = [(16, 8), (8,), (3, 8)]
    p0 = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    steps = 6
    grads = [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(steps)]
    # the learning rate changes at steps 2 and 4 (step_size changes anyway: bias correction),
    # the weight decay at step 3 (a uniform that stays fixed for two steps, then changes)
    lrs = [1e-2, 1e-2, 3e-2, 3e-2, 5e-3, 5e-3]
    wds = [0.01, 0.01, 0.01, 0.2, 0.2, 0.2]
    params = [pydiff.tensor(a, device=device, requires_grad=True) for a in p0]
    opt = optim.AdamW(params, lr=lrs[0], betas=(B1, B2), eps=EPS, weight_decay=wds[0])
    for step in range(steps):
        opt.defaults.update(lr=lrs[step], weight_decay=wds[step])
        for p, g in zip(params, grads[step]):
            p.grad.copy_from_numpy(g)
        opt.step()
    for k, p in enumerate(params):
        want = _adamw64(p0[k], [gs[k] for gs in grads], lrs, wds)
        np.testing.assert_allclose(p.numpy(), want, rtol=2e-5, atol=2e-6)
    # the changed uniforms went through the object's field cursors (found once per name)
    entries = [held[1] for held in opt._held.values() if held]
    assert entries and all(len(e) == 5 for e in entries)
    assert any("step_size" in e[4] and "bias2_sqrt" in e[4] for e in entries)


def test_type_names_stay_apart(device):
    names = ["float", "int", "float3", "uint", "float2", "half"]
    types = [device.dtype(n) for n in names]
    want = [t.full_name for t in types]  # Slang's own (vector<float,3> for float3)
    assert len(set(want)) == len(names)
    for _ in range(2):  # the second round from the memo
        assert [type_name(t) for t in types] == want
    for dtype, arr in [
        ("float", np.zeros((2, 3), np.float32)),
        ("int", np.zeros(4, np.int32)),
        ("float3", np.zeros((5, 3), np.float32)),
    ]:
        t = pydiff.tensor(arr, device=device) if dtype != "float3" else None
        if t is None:
            t = pydiff.zeros((5,), dtype="float3", device=device)
        assert t.dtype == dtype
