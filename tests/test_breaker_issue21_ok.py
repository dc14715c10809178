# ruff: noqa: E402, E501, E731, E741  (the breaker's cases, kept as written)
"""Things breaker 21 tried that worked (pass on main). Condensed versions of scratch scripts e*.py."""

import numpy as np
import pytest
import pydiff
from pydiff import ops

torch = pytest.importorskip("torch")
F = torch.nn.functional

EDGE = [
    0.0,
    -0.0,
    1e-30,
    -1e-30,
    1e-6,
    -1e-6,
    2e-38,
    0.5,
    -0.5,
    1.0,
    -1.0,
    0.9999999,
    1.0000001,
    3.0,
    -3.0,
    9.0,
    20.0,
    88.7,
    89.0,
    -100.0,
    -91.0,
    1e4,
    -1e4,
    1e10,
    -1e10,
    3e38,
    -3e38,
    3.4028235e38,
    np.inf,
    -np.inf,
    np.nan,
    4e-4,
    0.1,
    0.09999,
]


def _close(g, r):
    if np.isnan(r):
        return np.isnan(g)
    with np.errstate(over="ignore"):
        r32 = np.float32(r)
    if np.isinf(r32):
        return g == r32
    return np.isfinite(g) and abs(g - r) <= 1e-5 * abs(r) + 1.2e-38


TOPS = dict(
    exp=torch.exp,
    log=torch.log,
    sqrt=torch.sqrt,
    sin=torch.sin,
    cos=torch.cos,
    sigmoid=torch.sigmoid,
    relu=torch.relu,
    silu=F.silu,
    neg=torch.neg,
)


@pytest.mark.parametrize("name", sorted(TOPS))
def test_elementwise_edges_value_and_grad(name):
    x32 = np.array(EDGE, np.float32)
    x = pydiff.tensor(x32.copy(), requires_grad=True)
    with pydiff.Tape() as tape:
        y = getattr(ops, name)(x)
        loss = ops.sum(y)
    tape.backward(loss)
    xt = torch.tensor(x32.astype(np.float64), requires_grad=True)
    yt = TOPS[name](xt)
    yt.sum().backward()
    for g, r in zip(y.numpy(), yt.detach().numpy()):
        assert _close(g, r)
    for g, r in zip(x.grad.numpy(), xt.grad.numpy()):
        assert _close(g, r)


def test_dtype_errors_name_op_argument_dtype():
    x = pydiff.tensor(np.ones((2, 4), np.float32))
    with pytest.raises(TypeError, match="softmax: logits has dtype half"):
        ops.softmax(x.astype("half"))
    with pytest.raises(TypeError, match="linear: bias has dtype int"):
        ops.linear(
            x,
            pydiff.tensor(np.ones((3, 4), np.float32)),
            pydiff.tensor(np.ones(3, np.float32)).astype("int"),
        )


def test_view_of_result_on_tape_carries_gradient():
    a = np.arange(6, dtype=np.float32) + 1
    x = pydiff.tensor(a.copy(), requires_grad=True)
    with pydiff.Tape() as tape:
        y = ops.mul(x, x)
        loss = ops.sum(ops.sin(y.reshape(3, 2)))
    tape.backward(loss)
    np.testing.assert_allclose(x.grad.numpy(), np.cos(a.astype(np.float64) ** 2) * 2 * a, rtol=1e-5)


def test_gradcheck_inout_python_composition():
    m = pydiff.load_module_from_source(
        "b21ok_inout", "[Differentiable] void sq_inout(inout float v) { v = v * v; }"
    )

    def f(x):
        m.sq_inout(x)
        m.sq_inout(x)
        return x

    assert pydiff.gradcheck(f, (pydiff.tensor([0.5, -0.3, 0.9, 1.5], requires_grad=True),))
