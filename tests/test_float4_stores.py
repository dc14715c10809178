"""The two forms of pydiff's float4 stores (pydiff/kernels.py ``float4_out_source``): lavapipe
writes a float4 as two 64-bit words (``RWStructuredBuffer<uint64_t2>``), a GPU as one float4.
Both must write every bit as it was computed (NaN payloads, signalling NaNs, -0, subnormals)
and nothing past the float4s a kernel owns. This file runs in the form the device takes;
``tests/test_float4_loads.py`` runs it again with ``PYDIFF_FLOAT4_STORES=float4``."""

import numpy as np
import pytest

import pydiff
from pydiff import generated
from pydiff import ops, optim
from pydiff.buffer_pool import typed_float4_loads
from pydiff.kernels import float4_chunk, float4_out_source, paired_float4_stores

# Bit patterns a store must keep: quiet NaNs with payloads (both signs), a signalling NaN,
# +-0, +-inf, subnormals, the largest finite floats and ordinary values.
SPECIAL_BITS = np.array(
    [
        0x7FC00001,
        0xFFC12345,
        0x7F800001,
        0x00000000,
        0x80000000,
        0x7F800000,
        0xFF800000,
        0x00000001,
        0x80000001,
        0x007FFFFF,
        0x7F7FFFFF,
        0xFF7FFFFF,
        0x3F800000,
        0xBF800000,
        0x40490FDB,
    ],
    dtype=np.uint32,
)
SENTINEL = np.float32(7.25)


def test_lavapipe_takes_paired_stores_and_the_variable_forces_either(monkeypatch):
    monkeypatch.delenv("PYDIFF_FLOAT4_STORES", raising=False)
    assert paired_float4_stores("llvmpipe (LLVM 15.0.6, 256 bits)")
    assert not paired_float4_stores("NVIDIA H200")
    monkeypatch.setenv("PYDIFF_FLOAT4_STORES", "float4")
    assert not paired_float4_stores("llvmpipe (LLVM 15.0.6, 256 bits)")
    monkeypatch.setenv("PYDIFF_FLOAT4_STORES", "paired")
    assert paired_float4_stores("NVIDIA H200")
    assert "uint64_t2" in float4_out_source(True)
    assert "Float4Out = RWStructuredBuffer<float4>" in float4_out_source(False)


def _bits(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    pool = np.concatenate(
        [SPECIAL_BITS, rng.standard_normal(64).astype(np.float32).view(np.uint32)]
    )
    return rng.permutation(np.resize(pool, n)).astype(np.uint32)


def _dispatch(device, entry: str, count: int, **bindings) -> None:
    kernels = device.kernels
    kernel = kernels.get("ops/elementwise.slang", entry, CHUNK=kernels.chunk)
    kernels.dispatch(kernel, -(-count // kernels.chunk), count=count, **bindings)


@pytest.mark.parametrize("n", [1, 3, 4, 5, 17, 64, 4099])
def test_copy4_keeps_every_bit_and_stops_at_its_float4s(device, n):
    bits = _bits(n, seed=n)
    x = pydiff.tensor(bits.view(np.float32), device=device)
    # the output is longer: past x's whole float4s it must keep what it held
    out = pydiff.tensor(np.full(n + 9, SENTINEL, np.float32), device=device)
    count = -(-n // 4)
    _dispatch(device, "copy4", count, x=x.buffer, y=out.buffer)
    got = out.numpy()
    np.testing.assert_array_equal(got[:n].view(np.uint32), bits)
    # x's padding (whatever its buffer held) fills the rest of its last float4; past that,
    # nothing is written
    np.testing.assert_array_equal(got[4 * count :], np.full(n + 9 - 4 * count, SENTINEL))


@pytest.mark.parametrize("n", [5, 4099])
def test_relu4_and_its_backward_keep_nan_payloads_and_signed_zeros(device, n):
    bits = _bits(n, seed=100 + n)
    values = bits.view(np.float32)
    x = pydiff.tensor(values, device=device)
    y = pydiff.zeros((n,), device=device)
    count = -(-n // 4)
    _dispatch(device, "relu4", count, x=x.buffer, y=y.buffer)
    # relu keeps x where x > 0 or x is NaN (payload and all), else writes +0
    keep = ~(values <= 0)
    expected = np.where(keep, bits, np.uint32(0))
    np.testing.assert_array_equal(y.numpy().view(np.uint32), expected)

    g = pydiff.tensor(np.linspace(-2, 2, n, dtype=np.float32), device=device)
    dx0 = np.where(np.arange(n) % 2 == 0, -0.0, 1.5).astype(np.float32)
    dx = pydiff.tensor(dx0, device=device)
    _dispatch(device, "relu_bwd_acc4", count, x=x.buffer, g=g.buffer, dx=dx.buffer, dx_in=dx.buffer)
    contribution = np.where(values <= 0, np.float32(0), g.numpy())
    expected_dx = dx0 + contribution  # float32 adds, as the kernel's (-0 + 0 = +0)
    np.testing.assert_array_equal(dx.numpy().view(np.uint32), expected_dx.view(np.uint32))


def test_generated_forward_and_backward_store_every_bit(device):
    module = pydiff.load_module_from_source(
        "float4_store_identity",
        "import slangpy;\n[Differentiable] float ident(float x) { return x; }\n",
        device=device,
    )
    n = 4099
    bits = _bits(n, seed=7)
    x = pydiff.tensor(bits.view(np.float32), requires_grad=True, device=device)
    y = generated.forward(module.ident, [x], None)
    assert y is not None, generated.stats()
    np.testing.assert_array_equal(y.numpy().view(np.uint32), bits)
    # the gradient is added into what the buffer holds: -0 there, so -0 + u is u's bits. A
    # NaN's payload is the adder's: lavapipe keeps it (quietened, as NumPy's float32 add on
    # the same CPU), a GPU returns its canonical NaN: NaNs are compared as NaNs.
    x.grad_out.copy_from_numpy(np.full(n, -0.0, np.float32))
    upstream = pydiff.tensor(bits.view(np.float32), device=device)
    assert generated.backward(module.ident, [x], upstream, {0: x.grad_out})
    with np.errstate(invalid="ignore"):
        expected = (np.float32(-0.0) + bits.view(np.float32)).view(np.uint32)
    got = x.grad_out.numpy()
    nan = np.isnan(bits.view(np.float32))
    assert nan.any() and np.isnan(got[nan]).all()
    if "llvmpipe" in device.adapter_name:
        np.testing.assert_array_equal(got.view(np.uint32), expected)
    else:
        np.testing.assert_array_equal(got.view(np.uint32)[~nan], expected[~nan])


@pytest.mark.parametrize(
    "name, value",
    [
        ("PYDIFF_FLOAT4_STORES", "0"),
        ("PYDIFF_FLOAT4_STORES", "float"),
        ("PYDIFF_FLOAT4_STORES", "garbage"),
        ("PYDIFF_FLOAT4_LOADS", "structure"),
        ("PYDIFF_FLOAT4_CHUNK", "abc"),
        ("PYDIFF_FLOAT4_CHUNK", "0"),
    ],
)
def test_a_mistyped_override_is_refused_naming_the_variable(monkeypatch, name, value):
    """A typo must not silently leave the default it was meant to change (the breaker set
    PYDIFF_FLOAT4_STORES=0 and got the paired stores it meant to turn off)."""
    monkeypatch.setenv(name, value)
    check = {
        "PYDIFF_FLOAT4_STORES": lambda: paired_float4_stores("llvmpipe (LLVM 15.0.6, 256 bits)"),
        "PYDIFF_FLOAT4_LOADS": lambda: typed_float4_loads("vulkan"),
        "PYDIFF_FLOAT4_CHUNK": lambda: float4_chunk("llvmpipe (LLVM 15.0.6, 256 bits)"),
    }[name]
    with pytest.raises(ValueError, match=f"{name}={value!r}: expected"):
        check()


def test_accepted_spellings_of_the_overrides(monkeypatch):
    llvmpipe = "llvmpipe (LLVM 15.0.6, 256 bits)"
    for value, paired in ((" Paired ", True), ("FLOAT4", False), ("auto", True), ("", True)):
        monkeypatch.setenv("PYDIFF_FLOAT4_STORES", value)
        assert paired_float4_stores(llvmpipe) is paired
    for value, typed in (("typed", True), ("Structured", False), ("auto", True)):
        monkeypatch.setenv("PYDIFF_FLOAT4_LOADS", value)
        assert typed_float4_loads("vulkan") is typed
        assert not typed_float4_loads("cuda")
    monkeypatch.setenv("PYDIFF_FLOAT4_CHUNK", " 2 ")
    assert float4_chunk(llvmpipe) == 2


def test_neighbouring_small_tensors_are_never_written(device):
    """Many small tensors alive at once (the pool packs them into neighbouring buffers):
    relu, dropout, a tape backward and AdamW/SGD steps over some leave the others, and
    their gradients, exactly as they were (the breaker's case, smaller)."""
    rng = np.random.default_rng(0)
    sizes = [int(s) for s in rng.integers(1, 10, 48)]
    before = [
        pydiff.tensor(np.full(s, 1234.5 + i, np.float32), device=device, requires_grad=True)
        for i, s in enumerate(sizes)
    ]
    work = [
        pydiff.tensor(rng.standard_normal(s).astype(np.float32), device=device, requires_grad=True)
        for s in sizes
    ]
    after = [
        pydiff.tensor(np.full(s, -77.25 - i, np.float32), device=device)
        for i, s in enumerate(sizes)
    ]
    adam = optim.AdamW(work, lr=0.1, weight_decay=0.1)
    sgd = optim.SGD(work, lr=0.1, momentum=0.9)
    for step in range(2):
        adam.zero_grad()
        with pydiff.Tape() as tape:
            total = None
            for w in work:
                s = ops.sum(ops.dropout(ops.relu(w), 0.25, seed=step))
                total = s if total is None else ops.add(total, s)
        tape.backward(total)
        adam.step()
        sgd.step()
    for i, (a, b) in enumerate(zip(before, after)):
        np.testing.assert_array_equal(a.numpy(), np.float32(1234.5 + i))
        np.testing.assert_array_equal(b.numpy(), np.float32(-77.25 - i))
        np.testing.assert_array_equal(a.grad.numpy(), 0.0)


def test_a_signalling_nan_in_a_seed_or_tangent_gives_no_numpy_warning(device):
    """NumPy's float64 cast of a signalling NaN set the invalid flag: a RuntimeWarning from
    pydiff's own line (the breaker's case). The NaN arrives quiet, as IEEE arithmetic makes it."""
    import warnings

    m = pydiff.load_module_from_source(
        "snan_seed", "[Differentiable] float sq(float x) { return x * x; }\n", device=device
    )
    x = pydiff.tensor([1.0, 2.0], device=device, requires_grad=True)
    seed = np.array([0x7F800001, 0x3F800000], np.uint32).view(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pydiff.Tape() as tape:
            y = m.sq(x, _result="tensor")
        tape.backward(y, grad=seed)
        pydiff.tensor([1.0, 2.0], device=device).with_tangent(seed)
    got = x.grad.numpy()
    assert np.isnan(got[0]) and got[1] == np.float32(4.0)  # d(x^2)/dx * 1 at x = 2
