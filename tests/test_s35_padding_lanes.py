"""Generated kernels read four elements at a time and run the function on every lane of the
last float4, past the call's end too. Those lanes held stale values (0 in a fresh buffer), so
a function whose loop ends only for the real inputs spun forever: a call of 4097 elements hung
(forward, ``.bwds`` and ``.fwds``). The lanes now repeat the float4's first element.

Each case runs in a child process with a timeout (a hung kernel never returns), at sizes that
leave 1, 2 and 3 lanes of padding, and is checked against the closed form.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

CHILD = r"""
import sys
import numpy as np
import pydiff
from pydiff import generated
device = sys.argv[1]
dev = pydiff.create_device(device)
m = pydiff.load_module_from_source("s35_pad", '''
[Differentiable] float grow(float x)
{
    float t = x;
    [MaxIters(64)] while (t < 10.0) { t = t * 2.0; }
    return t;
}
''', device=dev)
for n in (4097, 4098, 4099):
    x = pydiff.tensor(np.full(n, 3.0, np.float32), device=dev, requires_grad=True)
    y = m.grow(x, _result="tensor")
    assert np.array_equal(y.numpy(), np.full(n, 12.0, np.float32)), (n, y.numpy()[-4:])
    m.grow.bwds(x, _result=y.with_grads(ones=True))
    assert np.array_equal(x.grad.numpy(), np.full(n, 4.0, np.float32)), (n, x.grad.numpy()[-4:])
    v, dv = m.grow.fwds(x.detach().with_tangent(pydiff.ones((n,), device=dev)))
    assert np.array_equal(dv.numpy(), np.full(n, 4.0, np.float32)), (n, dv.numpy()[-4:])
counts = generated.stats()
assert counts.get("forward", 0) >= 3 and counts.get("backward", 0) >= 3, counts
print("ok")
"""


def test_loop_ending_only_for_real_inputs_finishes(device):
    kind = device.type
    try:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, kind], capture_output=True, text=True, timeout=150
        )
    except subprocess.TimeoutExpired:
        pytest.fail("a generated kernel hung on the padding lanes of its last float4")
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
