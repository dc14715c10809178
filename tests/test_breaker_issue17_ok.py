# ruff: noqa: E402, E501, E731, E741  (the breaker's cases, kept as written)
"""Breaker 17: things tried that WORKED (these pass on the current code)."""

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import pydiff
from pydiff import ops
import torch.nn.functional as F

SRC = """
[Differentiable] float poly(float a, float b, float c, float x) { return a * x * x + b * x + c; }
[Differentiable] float f2(float x, float y) { return sin(x) * exp(0.3*y) + x*x*y; }
[Differentiable] half hsq(half x) { return x * x; }
int ilabel(int i) { return i * 2; }
"""


@pytest.fixture(scope="module")
def m():
    return pydiff.load_module_from_source("b17ok", SRC)


@pytest.mark.parametrize("dt", [torch.float32, torch.float16, torch.int32, torch.uint32])
def test_from_torch_exact_dtypes_roundtrip(dt):
    t = torch.tensor([0, 1, 7, 100], dtype=dt)
    back = pydiff.to_torch(pydiff.from_torch(t))
    assert back.dtype == dt and torch.equal(back.cpu(), t)


@pytest.mark.parametrize(
    "dt",
    [
        torch.float64,
        torch.int64,
        torch.complex64,
        torch.bfloat16,
        torch.bool,
        torch.int8,
        torch.int16,
        torch.uint8,
    ],
)
def test_from_torch_refuses_naming_dtype(dt):
    with pytest.raises(TypeError, match=str(dt)):
        pydiff.from_torch(torch.zeros(2, dtype=dt))


def test_from_torch_narrowing_when_asked():
    assert pydiff.from_torch(
        torch.tensor([1.5], dtype=torch.float64), dtype="float"
    ).numpy().tolist() == [1.5]
    assert pydiff.from_torch(torch.tensor([-5]), dtype="int").numpy().tolist() == [-5]
    with pytest.raises(ValueError, match="do not fit"):
        pydiff.from_torch(torch.tensor([2**40]), dtype="int")


def test_from_torch_noncontiguous():
    a = torch.arange(24.0).reshape(2, 3, 4)
    for v in [
        a.transpose(0, 2),
        a[:, ::2, 1::2],
        a.flip(1),
        torch.tensor([1.0, 2.0]).expand(3, 2),
        torch.arange(10.0)[3:7],
        a.unsqueeze(0).to(memory_format=torch.channels_last),
    ]:
        np.testing.assert_array_equal(pydiff.from_torch(v).numpy(), v.numpy())


def test_from_to_torch_are_copies():
    src = torch.ones(3)
    p = pydiff.from_torch(src)
    src.fill_(7)
    assert p.numpy().tolist() == [1, 1, 1]


def test_shader_call_grads_vs_analytic_float64(m):
    x = torch.tensor([0.3, -1.2, 2.0], requires_grad=True)
    y = torch.tensor([0.5, 0.1, -0.7], requires_grad=True)
    g = torch.tensor([0.7, -1.3, 2.1])
    m.f2(x, y).backward(g)
    X, Y, G = x.detach().double(), y.detach().double(), g.double()
    torch.testing.assert_close(
        x.grad.double(), G * (torch.cos(X) * torch.exp(0.3 * Y) + 2 * X * Y), rtol=1e-5, atol=1e-6
    )
    torch.testing.assert_close(
        y.grad.double(), G * (torch.sin(X) * 0.3 * torch.exp(0.3 * Y) + X * X), rtol=1e-5, atol=1e-6
    )


def test_shader_call_broadcast_and_0d_and_half(m):
    a = torch.tensor(2.0, requires_grad=True)
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    m.poly(a, 8.0, -1.0, x).sum().backward()
    assert a.grad.shape == () and a.grad.item() == 5.0
    h = torch.tensor([1.5, 2.0], dtype=torch.float16, requires_grad=True)
    m.hsq(h).sum().backward()
    assert torch.equal(h.grad, torch.tensor([3.0, 4.0], dtype=torch.float16))
    assert m.ilabel(torch.tensor([1, 2])).tolist() == [2, 4]


def test_no_grad_and_keyword_refusal(m):
    with torch.no_grad():
        y = m.poly(1.0, 0.0, 0.0, torch.ones(2, requires_grad=True))
    assert y.grad_fn is None
    with pytest.raises(ValueError, match="'x'"):
        m.poly(a=1.0, b=0.0, c=0.0, x=torch.ones(2, requires_grad=True))


def test_multiple_outputs_partially_used():
    both = pydiff.torch_function(lambda a, b: (ops.mul(a, b), ops.sum(a)))
    a, b = torch.ones(2, requires_grad=True), torch.tensor([3.0, 4.0], requires_grad=True)
    p, t = both(a, b)
    t.sum().backward()
    assert a.grad.tolist() == [1, 1] and b.grad.tolist() == [0, 0]


def test_threads(m):
    res = {}

    def worker(i):
        a = torch.tensor([float(i), 1.0], requires_grad=True)
        m.f2(a, torch.tensor([1.0, 1.0])).sum().backward()
        res[i] = a.grad.clone()

    ths = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    [t.start() for t in ths]
    [t.join(60) for t in ths]
    for i in range(4):
        a = torch.tensor([float(i), 1.0])
        torch.testing.assert_close(res[i], torch.cos(a) * np.exp(0.3) + 2 * a, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "name,fp,ft,shapes",
    [
        ("linear bias", ops.linear, F.linear, [(6, 5), (3, 5), (3,)]),
        ("matmul", ops.matmul, torch.matmul, [(5, 8), (8, 4)]),
        ("softmax", ops.softmax, lambda x: torch.softmax(x, -1), [(3, 5)]),
        (
            "layer_norm",
            ops.layer_norm,
            lambda x, w, b: F.layer_norm(x, (5,), w, b),
            [(4, 5), (5,), (5,)],
        ),
        (
            "attention",
            ops.attention,
            lambda q, k, v: torch.softmax(q @ k.T / 2.0, -1) @ v,
            [(3, 4), (5, 4), (5, 2)],
        ),
        ("mul bcast", ops.mul, torch.mul, [(2, 1, 4), (3, 1)]),
    ],
)
def test_ops_with_torch_vs_torch_float64(name, fp, ft, shapes):
    torch.manual_seed(0)
    ts = [torch.randn(*s, requires_grad=True) for s in shapes]
    out = fp(*ts)
    g = torch.randn(out.shape)
    (out * g).sum().backward()
    td = [t.detach().double().requires_grad_() for t in ts]
    (ft(*td) * g.double()).sum().backward()
    for t, d in zip(ts, td):
        torch.testing.assert_close(t.grad.double(), d.grad, rtol=1e-3, atol=1e-4)


def test_indexing_every_key_vs_numpy():
    A = np.arange(24.0, dtype=np.float32).reshape(2, 3, 4)
    x = pydiff.tensor(A)
    for k in [
        0,
        -1,
        (1, 2),
        (-1, -1, -1),
        slice(None, None, -1),
        slice(3, 0, -2),
        (Ellipsis, 1),
        (0, Ellipsis, 2),
        (1, slice(1, None), slice(None, None, 3)),
        slice(-100, 100),
        np.int64(1),
    ]:
        np.testing.assert_array_equal(x[k].numpy(), np.atleast_1d(A[k]))
    for k in [[0, 1], None, True, 1.0]:
        with pytest.raises(TypeError):
            x[k]
    with pytest.raises(IndexError):
        x[0:0]


def test_operators_broadcast_grads_vs_torch():
    rng = np.random.default_rng(1)
    A, B, C = (rng.uniform(0.5, 2, s).astype(np.float32) for s in [(3, 4), (4,), (3, 1)])
    a, b, c = (pydiff.tensor(v, requires_grad=True) for v in (A, B, C))
    with pydiff.Tape() as tape:
        l = (((a + b) * c / (2.0 - b)) ** -2 + (a @ b) @ (a @ b) + 3.0 / c).mean() + a.T[
            ::-1, 1:
        ].sum()
    tape.backward(l)
    ta, tb, tc = (torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in (A, B, C))
    tl = (
        ((ta + tb) * tc / (2.0 - tb)) ** -2 + (ta @ tb) @ (ta @ tb) + 3.0 / tc
    ).mean() + ta.T.flip(0)[:, 1:].sum()
    tl.backward()
    np.testing.assert_allclose(l.item(), tl.item(), rtol=1e-5)
    for p, t in [(a, ta), (b, tb), (c, tc)]:
        np.testing.assert_allclose(p.grad.numpy(), t.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_creation():
    np.testing.assert_array_equal(pydiff.arange(5, 0, -1).numpy(), np.arange(5, 0, -1))
    np.testing.assert_allclose(pydiff.arange(0, 1, 0.1).numpy(), np.arange(0, 1, 0.1), rtol=1e-6)
    np.testing.assert_array_equal(
        pydiff.randn(2, 3, seed=0).numpy(),
        np.random.Generator(np.random.Philox(0)).standard_normal((2, 3), dtype=np.float32),
    )
    assert not np.array_equal(pydiff.rand(4).numpy(), pydiff.rand(4).numpy())
    with pytest.raises(ValueError, match="seed"):
        pydiff.rand(2, seed=-1)


def test_grad_forms_and_errors():
    sq = lambda x: ops.sum(ops.mul(x, x))
    assert pydiff.grad(lambda x: ops.mul(x, x))(3) == 6.0
    np.testing.assert_array_equal(pydiff.grad(sq)([1.0, -3.0]), [2.0, -6.0])
    x = pydiff.tensor([1.0, 2.0], requires_grad=True)
    assert isinstance(pydiff.grad(sq)(x), pydiff.Tensor) and x.grad.numpy().tolist() == [0, 0]
    with pytest.raises(ValueError, match="argnums"):
        pydiff.grad(lambda a, b: ops.sum(ops.mul(a, b)), argnums=(0, -2))(np.ones(2), np.ones(2))
    with pytest.raises(ValueError, match="one-element"):
        pydiff.grad(lambda a: ops.mul(a, a))(np.ones(2))
    np.testing.assert_array_equal(pydiff.grad(lambda a: a[1])(np.array([2.0, 3.0])), [0.0, 1.0])


def test_torch_function_memory_short_loop():
    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024

    f = pydiff.torch_function(lambda x, w: ops.mean(ops.tanh(ops.linear(x, w))))
    w = torch.nn.Parameter(torch.randn(16, 8) * 0.5)
    X = torch.randn(32, 8)
    for _ in range(100):
        f(X, w).backward()
    r0 = rss()
    for _ in range(300):
        f(X, w).backward()
    assert rss() - r0 < 20  # MiB; 2000 steps measured: +4 MiB, flat after warm-up
