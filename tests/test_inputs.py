"""Host values for shader parameters (issue 15, class 12), tensors on two devices (class 13)
and sizes beyond the device's limits (class 14).

Class 12: NumPy arrays of other dtypes and layouts, lists, 0-d arrays and numbers passed to a
parameter are converted as NumPy converts them, for the forward call, ``.bwds`` and ``.fwds``,
checked against NumPy in float64; conversions that would change a value are refused with an
error naming the parameter. Class 13: every op, the forward call and gradient buffers refuse
tensors of another device, naming both devices. Class 14: sizes over the limits are refused
before anything is allocated, saying how much was asked and the limit.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

import pydiff
from conftest import SHADERS
from pydiff import ops, optim
from pydiff.buffer_pool import MAX_ELEMENTS
from pydiff.errors import TensorTooLargeError

RTOL = 2e-6  # float32 results against float64 NumPy

BASE = np.array([0.5, -1.25, 2.0, 3.5, -0.75, 1.0])
HOST_FORMS = {
    "float64": lambda: BASE.copy(),
    "float32": lambda: BASE.astype(np.float32),
    "strided": lambda: np.repeat(BASE, 2)[::2],
    "reversed": lambda: BASE[::-1].copy()[::-1],
    "fortran 2-D": lambda: np.asfortranarray(BASE.reshape(2, 3)),
    "transposed": lambda: BASE.reshape(3, 2).T,
    "list": lambda: BASE.tolist(),
    "int64": lambda: np.array([1, -2, 3, 7, 0, 5], dtype=np.int64),
    "int32 strided": lambda: np.arange(12, dtype=np.int32)[::2],
    "size-1 axis": lambda: BASE[None, :],
}


def _f64(value):
    return np.asarray(value, dtype=np.float64)


@pytest.fixture
def m(device, load):
    return load("inputs", device)


@pytest.mark.parametrize("form", list(HOST_FORMS))
def test_forward_converts_host_arrays(m, form):
    a = HOST_FORMS[form]()
    x = 3.0
    got = m.affine(a, x, _result="numpy")
    want = _f64(a) * x + 1.0
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=RTOL)
    got = m.affine(2.5, a, _result="numpy")  # the differentiable parameter too
    np.testing.assert_allclose(got, 2.5 * _f64(a) + 1.0, rtol=RTOL)


@pytest.mark.parametrize("form", ["float64", "strided", "reversed", "fortran 2-D", "int64", "list"])
def test_bwds_converts_host_arrays(device, m, form):
    a = HOST_FORMS[form]()
    shape = _f64(a).shape
    x = pydiff.tensor(np.full(shape, 0.25), device=device, requires_grad=True)
    seed = np.linspace(0.5, 2.0, int(np.prod(shape))).reshape(shape)
    y = pydiff.tensor(seed, device=device).with_grads(ones=False)
    y.grad_in.copy_from_numpy(seed.astype(np.float32))
    m.affine.bwds(a, x, _result=y)
    np.testing.assert_allclose(x.grad.numpy(), _f64(a) * seed, rtol=RTOL)  # d/dx = a


@pytest.mark.parametrize("form", ["float64", "strided", "reversed", "int64"])
def test_fwds_converts_host_arrays(device, m, form):
    a = HOST_FORMS[form]()
    xs = np.linspace(-1.0, 1.0, a.size)
    u = np.linspace(0.3, 0.9, a.size)
    x = pydiff.tensor(xs, device=device).with_tangent(u)
    y, dy = m.affine.fwds(a, x)
    np.testing.assert_allclose(y.numpy(), _f64(a) * xs + 1.0, rtol=RTOL, atol=1e-7)
    np.testing.assert_allclose(dy.numpy(), _f64(a) * u, rtol=RTOL)


@pytest.mark.parametrize(
    "value", [2, np.float64(2.5), np.int64(-3), np.array(1.75), np.array(4, dtype=np.int16)]
)
def test_numbers_and_0d_arrays_for_a_float(device, m, value):
    x = pydiff.tensor(BASE, device=device, requires_grad=True)
    got = m.affine(value, x, _result="numpy")
    np.testing.assert_allclose(got, float(value) * BASE + 1.0, rtol=RTOL)
    m.affine.bwds(value, x, _result=pydiff.tensor(got, device=device).with_grads(ones=True))
    np.testing.assert_allclose(x.grad.numpy(), np.full(6, float(value)), rtol=RTOL)


def test_vector_parameter_from_float64_views(m):
    v = np.arange(12, dtype=np.float64).reshape(4, 3) / 7.0
    for arr in (v, v[::-1], np.asfortranarray(v), np.repeat(v, 2, axis=0)[::2]):
        np.testing.assert_allclose(
            m.norm2(arr, _result="numpy"), (_f64(arr) ** 2).sum(-1), rtol=RTOL
        )


def test_int_parameters(m):
    x = np.array([1.5, -2.0, 0.25])
    for k in (np.array([3, -1, 4], dtype=np.int64), np.array([3.0, -1.0, 4.0]), [3, -1, 4]):
        np.testing.assert_allclose(m.times_k(k, x, _result="numpy"), _f64(k) * x, rtol=RTOL)
    np.testing.assert_allclose(m.times_k(2.0, x, _result="numpy"), 2 * x, rtol=RTOL)
    ku = np.array([0, 7, 2**31 + 5], dtype=np.int64)  # beyond int32, inside uint32
    np.testing.assert_allclose(
        m.times_u(ku, np.ones(3), _result="numpy"), ku.astype(np.float64), rtol=RTOL
    )


@pytest.mark.parametrize(
    "k, match",
    [
        (np.array([1.0, 2.5, 3.0]), r"element \(1,\) = 2\.5 is not an integer"),
        (np.array([1, 2**40, 3]), r"element \(1,\) = 1099511627776 is not an integer in the range"),
        (1.5, "got the float 1.5, which an integer parameter would truncate"),
        (2**40, "outside the range of int"),
        (np.array([True, False, True]), "dtype bool"),
        (np.array([1 + 2j, 0, 0]), "dtype complex128"),
    ],
)
def test_int_parameter_refuses_lossy_values(m, k, match):
    with pytest.raises((ValueError, TypeError), match=r"inputs\.times_k: parameter 'k' \(int\)"):
        m.times_k(k, np.ones(3), _result="numpy")
    with pytest.raises((ValueError, TypeError), match=match):
        m.times_k(k, np.ones(3), _result="numpy")


def test_negative_to_uint_refused(m):
    with pytest.raises(ValueError, match=r"parameter 'k' \(uint\).*element \(0,\) = -1"):
        m.times_u(np.array([-1, 2]), np.ones(2), _result="numpy")


def test_bool_parameter(device, m):
    mask = np.array([True, False, True, False])
    x = np.array([1.5, 2.0, -3.0, 0.5])
    got = m.pick(mask[::1], x, _result="numpy")
    np.testing.assert_allclose(got, np.where(mask, x * x, -x), rtol=RTOL)
    got = m.pick(np.repeat(mask, 2)[::2], x, _result="numpy")  # a strided bool view
    np.testing.assert_allclose(got, np.where(mask, x * x, -x), rtol=RTOL)
    t = pydiff.tensor(mask, device=device)  # bool tensors: 4-byte words on the device
    np.testing.assert_array_equal(t.numpy(), mask)
    np.testing.assert_allclose(m.pick(t, x, _result="numpy"), np.where(mask, x * x, -x))
    with pytest.raises(TypeError, match=r"parameter 'x' \(float\): a NumPy array of dtype bool"):
        m.pick(mask, mask, _result="numpy")
    with pytest.raises(TypeError, match=r"parameter 'm' \(bool\).*dtype float64"):
        m.pick(x, x, _result="numpy")


@pytest.mark.parametrize("value", [np.array([1.0, 1e39]), 1e39, 10**40, -(10**400)])
def test_float32_overflow_refused(m, value):
    with pytest.raises(ValueError, match=r"parameter 'a' \(float\).*largest float.*inf"):
        m.affine(value, np.ones(2), _result="numpy")


def test_inf_and_nan_pass_through(m):
    a = np.array([np.inf, -np.inf, np.nan, 1.0])
    got = m.affine(a, np.full(4, 2.0), _result="numpy")
    np.testing.assert_array_equal(got, a * 2.0 + 1.0)


def test_written_parameter_refuses_a_converted_copy(m):
    y = np.zeros(3)  # float64: a float32 copy would receive the output, not y
    with pytest.raises(TypeError, match=r"parameter 'y' \(float\).*written by the call"):
        m.triple_out(np.ones(3), y)


# ---- class 13: two devices ----


@pytest.fixture
def other(device):
    dev = pydiff.create_device(device.type, include_paths=[str(SHADERS)])
    assert dev != device and repr(dev) != repr(device)
    return dev


def _pair(device, other, shape, seed=0):
    rng = np.random.default_rng(seed)
    return (
        pydiff.tensor(rng.standard_normal(shape), device=device, requires_grad=True),
        pydiff.tensor(rng.standard_normal(shape), device=other, requires_grad=True),
    )


TWO_DEVICE_OPS = {  # a, b: (3, 3) on two devices; v: (3,) on b's
    "matmul": lambda a, b, v: ops.matmul(a, b),
    "matmul swapped": lambda a, b, v: ops.matmul(b, a),
    "linear": lambda a, b, v: ops.linear(a, b),
    "linear bias": lambda a, b, v: ops.linear(a, a, v),
    "attention": lambda a, b, v: ops.attention(a, a, b),
    "add": lambda a, b, v: ops.add(a, b),
    "mul": lambda a, b, v: ops.mul(a, b),
    "div": lambda a, b, v: ops.div(a, b),
    "swiglu": lambda a, b, v: ops.swiglu(a, b),
    "broadcast add": lambda a, b, v: ops.add(a, v),
    "mse_loss": lambda a, b, v: ops.mse_loss(a, b),
    "rms_norm": lambda a, b, v: ops.rms_norm(a, v),
    "layer_norm": lambda a, b, v: ops.layer_norm(a, None, v),
}


@pytest.mark.parametrize("name", list(TWO_DEVICE_OPS))
def test_ops_refuse_two_devices(device, other, name):
    a, b = _pair(device, other, (3, 3))
    v = pydiff.tensor(np.ones(3), device=other, requires_grad=True)
    with pytest.raises(ValueError, match="on one device") as info:
        TWO_DEVICE_OPS[name](a, b, v)
    msg = str(info.value)
    assert repr(device) in msg and repr(other) in msg, msg


def test_cross_entropy_labels_on_another_device(device, other):
    logits = pydiff.tensor(np.zeros((2, 3)), device=device, requires_grad=True)
    labels = pydiff.tensor(np.array([0, 2], dtype=np.int32), device=other)
    with pytest.raises(ValueError, match=r"cross_entropy: logits is on .* but labels is on"):
        ops.cross_entropy(logits, labels)


def test_layer_from_another_device(device, other):
    layer = pydiff.nn.Linear(3, 2, device=other, seed=0)
    x = pydiff.tensor(np.ones((4, 3)), device=device)
    with pytest.raises(ValueError, match=r"linear: x is on <pydiff.Device #\d+ .* but weight"):
        layer(x)


def test_shader_call_names_both_devices(device, other, load):
    m = load("inputs", device)
    x = pydiff.tensor(np.ones(2), device=other)
    with pytest.raises(ValueError, match="parameter 'x' is on device") as info:
        m.affine(1.0, x, _result="tensor")
    assert repr(other) in str(info.value) and repr(device) in str(info.value)
    y = pydiff.tensor(np.ones(2), device=device)
    with pytest.raises(ValueError, match="grad_out: on device") as info:
        y.with_grads(grad_out=pydiff.zeros((2,), device=other))
    assert repr(other) in str(info.value) and repr(device) in str(info.value)


def test_optimizer_over_two_devices_matches_rule(device, other):
    # Parameters may live on several devices (one batch per device): each follows AdamW.
    p0 = np.array([0.5, -1.0, 2.0, 0.25])
    grads = [np.array([0.1, -0.2, 0.3, 0.05]) * (k + 1) for k in range(5)]
    ps = [pydiff.tensor(p0, device=d, requires_grad=True) for d in (device, other)]
    opt = optim.AdamW(ps, lr=0.01, weight_decay=0.1)
    for g in grads:
        for p in ps:
            p.grad.copy_from_numpy(g.astype(np.float32))
        opt.step()
    want, mom, vel = p0.copy(), 0.0, 0.0
    for t, g in enumerate(grads, start=1):
        want = want * (1 - 0.01 * 0.1)
        mom = 0.9 * mom + 0.1 * g
        vel = 0.999 * vel + 0.001 * g * g
        want = want - 0.01 * (mom / (1 - 0.9**t)) / (np.sqrt(vel / (1 - 0.999**t)) + 1e-8)
    for p in ps:
        np.testing.assert_allclose(p.numpy(), want, rtol=1e-5, atol=1e-6)


# ---- class 14: sizes beyond the limits ----


@pytest.mark.parametrize(
    "make, what",
    [
        (lambda d: pydiff.zeros((2**34,), device=d), r"pydiff\.zeros\(dtype='float'\)"),
        (lambda d: pydiff.empty((2**17, 2**17), device=d), r"pydiff\.empty"),
        (lambda d: pydiff.ones((2**31,), dtype="half", device=d), r"pydiff\.ones\(dtype='half'\)"),
        (lambda d: pydiff.zeros((2**20, 2**12), dtype="float3", device=d), "float3"),
    ],
)
def test_creation_too_large(device, make, what):
    with pytest.raises(TensorTooLargeError, match=what) as info:
        make(device)
    msg = str(info.value)
    assert "elements" in msg and f"{MAX_ELEMENTS:,}" in msg and "bytes" in msg
    assert isinstance(info.value, MemoryError) and isinstance(info.value, ValueError)


def test_creation_size_message_numbers(device):
    with pytest.raises(TensorTooLargeError) as info:
        pydiff.zeros((2**34,), device=device)
    msg = str(info.value)
    assert f"{2**34:,} elements" in msg and f"{4 * 2**34:,} bytes" in msg and "64.0 GiB" in msg


def test_vulkan_buffer_byte_limit(device):
    if device.type != "vulkan":
        pytest.skip("Vulkan's 4 GiB storage-buffer limit")
    # 2**29 float4s: fewer elements than SlangPy's limit, more bytes than Vulkan binds.
    with pytest.raises(TensorTooLargeError, match=f"{2**32 - 1:,} bytes per buffer"):
        pydiff.empty((2**28,), dtype="float4", device=device)


def test_call_shape_too_large(device, m):
    a = pydiff.zeros((2**17, 1), device=device, requires_grad=True)
    x = pydiff.zeros((1, 2**17), device=device, requires_grad=True)
    for call in (
        lambda: m.affine(a, x, _result="tensor"),
        lambda: m.affine.fwds(a, x.with_tangent(np.zeros((1, 2**17)))),
        lambda: m.affine(a, np.zeros((1, 2**17), np.float32), _result="tensor"),
    ):
        with pytest.raises(TensorTooLargeError, match=r"inputs\.affine.*the call of shape") as e:
            call()
        assert f"(131072, 131072) is {2**34:,} elements" in str(e.value)
    ok = m.affine(a, pydiff.ones((1, 2), device=device), _result="tensor")  # 2**18: fine
    assert ok.shape == (2**17, 2)


def test_gradient_buffer_too_large_refused_before_allocating(device, m):
    a = pydiff.zeros((2**16, 1), device=device)
    x = pydiff.zeros((1, 2**15), device=device, requires_grad=True)
    with pytest.raises(TensorTooLargeError, match=r"(65536, 32768)"):
        m.affine.bwds(a, x, _result=1.0)


def test_overloads_of_different_types_are_left_to_slangpy(device):
    src = """
    float pick2(int k) { return float(k) + 0.5; }
    float pick2(float x) { return x * 10.0; }
    float twice(float x) { return 2.0 * x; }
    float twice(float x, float y) { return 2.0 * x + y; }
    """
    m = pydiff.load_module_from_source("inputs_overloads", src, device=device)
    # Overloads told apart by their count: the chosen one's types convert the value.
    v = np.array([0.25, -3.0])
    np.testing.assert_allclose(m.twice(v, _result="numpy"), 2.0 * v, rtol=RTOL)
    np.testing.assert_allclose(m.twice(v, v[::-1], _result="numpy"), 2 * v + v[::-1], rtol=RTOL)
    # Different element types: pydiff does not choose one by converting; exact dtypes work.
    np.testing.assert_allclose(
        m.pick2(np.array([1, 2], np.int32), _result="numpy"), [1.5, 2.5], rtol=RTOL
    )
    np.testing.assert_allclose(
        m.pick2(np.array([1.0, 2.0], np.float32), _result="numpy"), [10.0, 20.0], rtol=RTOL
    )


def test_refused_allocation_says_how_much(device):
    from pydiff import buffer_pool

    class RefusingDevice:  # a device out of memory: create_buffer fails as SlangPy's does
        def create_buffer(self, **kwargs):
            raise RuntimeError("createBuffer(...) failed with error: -2147467259 (SLANG_FAIL)")

    pool = buffer_pool.BufferPool(RefusingDevice(), device.queue)
    with pytest.raises(TensorTooLargeError, match=r"a buffer of 16\.0 KiB \(16,384 bytes\)"):
        pool.float4_buffer(1024)


def test_slangpy_allocation_failure_is_translated(device, m):
    from pydiff.arguments import resolve_error

    exc = RuntimeError("m_device->rhi_device()->createBuffer(rhi_desc) failed (SLANG_FAIL)")
    out = resolve_error(m.affine, exc)
    assert isinstance(out, TensorTooLargeError)
    assert str(out).startswith("inputs.affine: the device could not allocate a buffer")


# ---- class 12: host values checked against each parameter's type ----

TYPES_SOURCE = """
[Differentiable] float affine(float a, float x) { return a * x + 1.0; }
[Differentiable] float times_k(int k, float x) { return float(k) * x; }
[Differentiable] float pick(bool m, float x) { return m ? x * x : -x; }
[Differentiable] float weigh3(float3 v, float s) { return s * (v.x + 10.0 * v.y + 100.0 * v.z); }
[Differentiable] float msum(float2x2 m) { return m[0][0] + 10.0 * m[0][1] + 100.0 * m[1][0]
                                               + 1000.0 * m[1][1]; }
float isum(int3 k) { return float(k.x + 10 * k.y + 100 * k.z); }
"""
W3 = np.array([1.0, 10.0, 100.0])


@pytest.fixture(scope="module")
def t(device):
    return pydiff.load_module_from_source("inputs_types", TYPES_SOURCE, device=device)


@pytest.mark.parametrize("value", [1, 0, 1.0, np.int32(1), np.float32(0.0), 2])
def test_number_for_a_bool_parameter_refused(t, value):
    with pytest.raises(TypeError, match=r"inputs_types\.pick: parameter 'm' \(bool\)"):
        t.pick(value, 2.0)
    with pytest.raises(TypeError, match=r"parameter 'm' \(bool\)"):
        t.pick.bwds(value, pydiff.tensor([2.0], requires_grad=True, device=t.device), 1.0)


@pytest.mark.parametrize("value", [True, False, np.bool_(True), np.array(False), [True, False]])
def test_bools_for_a_bool_parameter(t, value):
    x = np.array([1.5, -2.0]) if isinstance(value, list) else 1.5
    mask = np.asarray(value)
    got = t.pick(value, x, _result="numpy")
    np.testing.assert_allclose(got, np.where(mask, np.square(x), -np.asarray(x)), rtol=RTOL)


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda t: t.affine(True, 1.0), "'a' (float)"),
        (lambda t: t.affine(1.0, np.bool_(False)), "'x' (float)"),
        (lambda t: t.times_k(True, 1.0), "'k' (int)"),
        (lambda t: t.weigh3(True, 1.0), "'v' (vector<float,3>)"),
        (lambda t: t.weigh3([True, False, True], 1.0), "'v' (vector<float,3>)"),
        (lambda t: t.isum(False), "'k' (vector<int,3>)"),
    ],
)
def test_bool_for_a_number_parameter_refused(t, call, name):
    with pytest.raises(TypeError, match="parameter " + re.escape(name)) as info:
        call(t)
    assert "bool" in str(info.value)


def test_number_for_a_vector_fills_every_component(device, t):
    assert t.weigh3(2.0, 1.0) == pytest.approx(2.0 * W3.sum())
    assert t.weigh3(3, 0.5) == pytest.approx(1.5 * W3.sum())  # an int for a float3
    assert t.isum(2) == 222.0
    x = pydiff.tensor([1.0, -2.0], device=device, requires_grad=True)
    y = pydiff.zeros((2,), device=device).with_grads(ones=True)
    t.weigh3.bwds(2.0, x, _result=y)  # d/ds = v . W3
    np.testing.assert_allclose(x.grad.numpy(), [2.0 * W3.sum()] * 2, rtol=RTOL)
    with pytest.raises(ValueError, match=r"parameter 'k' \(vector<int,3>\).*truncate"):
        t.isum(2.5)


@pytest.mark.parametrize("value", [2.0, 1, np.float64(0.5)])
def test_number_for_a_matrix_refused(t, value):
    with pytest.raises(TypeError, match=r"parameter 'm' \(matrix<float,2,2>\).*float2x2"):
        t.msum(value)


@pytest.mark.parametrize(
    "value",
    [
        np.ones((2, 4)),
        np.ones((2, 2)),
        np.ones(4),
        np.ones((3, 1)),
        [1.0, 2.0],
        [[1.0, 2.0, 3.0, 4.0]],
        [1.0, 2.0, 3.0, 4.0],
    ],
)
def test_wrong_vector_width_names_the_parameter(t, value):
    with pytest.raises(ValueError, match=r"inputs_types\.weigh3: parameter 'v'") as info:
        t.weigh3(value, 2.0, _result="numpy")
    assert "float3" in str(info.value) and str(np.asarray(value).shape) in str(info.value)


@pytest.mark.parametrize(
    "shape, dtype",
    [((2, 4), "float"), ((2, 2), "float"), ((4,), "float"), ((2,), "float2"), ((2,), "float4")],
)
def test_tensor_of_wrong_vector_width_names_the_parameter(device, t, shape, dtype):
    v = pydiff.zeros(shape, dtype=dtype, device=device, requires_grad=True)
    for call in (
        lambda: t.weigh3(v, 2.0, _result="numpy"),
        lambda: t.weigh3.bwds(v, 2.0, _result=1.0),
    ):
        with pytest.raises(ValueError, match=r"parameter 'v' \(float3\)"):
            call()
    np.testing.assert_array_equal(v.grad.numpy(), np.zeros_like(v.grad.numpy()))


@pytest.mark.parametrize(
    "value",
    [
        np.ones((2, 4)),
        np.ones((3, 2, 3)),
        np.ones(4),
        [[1.0, 2.0, 3.0]],
        [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]],
    ],
)
def test_wrong_matrix_axes_name_the_parameter(t, value):
    with pytest.raises(ValueError, match=r"parameter 'm' \(matrix<float,2,2>\)"):
        t.msum(value, _result="numpy")


def test_vectors_and_matrices_from_lists_and_arrays(device, t):
    v = np.array([[1.0, 2.0, 3.0], [-0.5, 0.25, 4.0]])
    np.testing.assert_allclose(t.weigh3(v, 2.0, _result="numpy"), 2.0 * v @ W3, rtol=RTOL)
    np.testing.assert_allclose(t.weigh3(v.tolist(), 2.0, _result="numpy"), 2.0 * v @ W3, rtol=RTOL)
    assert t.weigh3([1.0, 2.0, 3.0], 1.0) == pytest.approx(321.0)
    vt = pydiff.tensor(v, device=device)  # a float tensor with a last axis of 3
    np.testing.assert_allclose(t.weigh3(vt, 2.0, _result="numpy"), 2.0 * v @ W3, rtol=RTOL)
    mats = np.arange(12.0).reshape(3, 2, 2)
    ref = mats[:, 0, 0] + 10 * mats[:, 0, 1] + 100 * mats[:, 1, 0] + 1000 * mats[:, 1, 1]
    np.testing.assert_allclose(t.msum(mats, _result="numpy"), ref, rtol=RTOL)
    np.testing.assert_allclose(t.msum(mats.tolist(), _result="numpy"), ref, rtol=RTOL)
    assert float(t.msum([[1.0, 2.0], [3.0, 4.0]], _result="numpy")) == 4321.0


# ---- class 14: shapes of creation functions, broadcast results over the byte limit ----


@pytest.mark.parametrize(
    "shape", [(2.5,), 2.5, (2.0,), (3, 1.5), (True,), (np.float64(2.0),), ("2",), None]
)
def test_non_integer_shapes_refused(device, shape):
    for make in (pydiff.empty, pydiff.zeros, pydiff.ones):
        with pytest.raises(TypeError, match=r"shape=.*(not an integer|sequence of ints)"):
            make(shape, device=device)
    with pytest.raises(TypeError, match="shape="):
        pydiff.zeros((6,), device=device).reshape(shape)


@pytest.mark.parametrize(
    "shape, want",
    [
        (np.int64(3), (3,)),
        ((np.int32(2), 3), (2, 3)),
        ([np.uint8(4)], (4,)),
        (np.array([2, 2]), (2, 2)),
    ],
)
def test_numpy_integer_shapes_accepted(device, shape, want):
    assert pydiff.zeros(shape, device=device).shape == want
    np.testing.assert_array_equal(pydiff.ones(shape, device=device).numpy(), np.ones(want))


def test_broadcast_result_over_the_byte_limit(device):
    if device.type != "vulkan":
        pytest.skip("Vulkan's 4 GiB storage-buffer limit")
    m = pydiff.load_module_from_source(
        "inputs_bytes",
        "float times(float a, float b) { return a * b; }\n"
        "float4 times4(float a, float b) { return float4(a * b); }\n",
        device=device,
    )
    a, b = pydiff.zeros((2**15, 1), device=device), pydiff.zeros((1, 2**15), device=device)
    for result in ("tensor", "numpy"):  # 2**30 floats: one byte more than a buffer holds
        with pytest.raises(TensorTooLargeError) as info:
            m.times(a, b, _result=result)
        msg = str(info.value)
        assert f"{2**32:,} bytes" in msg and f"{2**32 - 1:,} bytes per buffer" in msg, msg
    a, b = pydiff.zeros((2**14, 1), device=device), pydiff.zeros((1, 2**14), device=device)
    with pytest.raises(TensorTooLargeError, match=r"inputs_bytes\.times4.*16 bytes each"):
        m.times4(a, b, _result="tensor")  # 2**28 float4s: 4 GiB
    with pytest.raises(TensorTooLargeError, match=r"\(16384, 16384\)"):
        m.times4(a, np.zeros((1, 2**14), np.float32), _result="tensor")  # a host argument
    ok = m.times(
        pydiff.zeros((2**13, 1), device=device),
        pydiff.zeros((1, 4), device=device),
        _result="tensor",
    )
    assert ok.shape == (2**13, 4)


def test_one_vector_as_a_list_is_converted_or_refused(t):
    assert t.isum([1.0, 2.0, 3.0]) == 321.0  # floats that are integers, for an int3
    assert t.weigh3([1, 2, 3], 1.0) == pytest.approx(321.0)  # ints for a float3
    with pytest.raises(ValueError, match=r"parameter 'k' \(vector<int,3>\).*1\.5"):
        t.isum([1.5, 2.0, 3.0])  # SlangPy: std::bad_cast
    with pytest.raises(ValueError, match=r"parameter 'k' \(vector<int,3>\).*2147483648"):
        t.isum([1, 2**31, 3])
