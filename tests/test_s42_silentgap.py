"""Silent gaps of s42 (silentgap): each case against SlangPy's own path (``PYDIFF_GENERATED=0``)
and closed forms. Every test here failed before its fix.

- cross-lane code (wave and quad intrinsics, groupshared) in a function on the generated
  kernels, which map elements to threads otherwise than SlangPy's kernels:
  ``a * x + WaveActiveSum(x)`` gave 12, 16, 18, ... where SlangPy's path gives 38, 40, 42,
  ... (forced, and after 1001 small calls took the planned kernel); side effects (atomics,
  ``printf``) also ran on the spare lanes of the elementwise kernels' last float4;
- ``load_module(path, lint=False)`` scanned only the file's own text for mutable statics, not
  its ``#include``s and imports: 4, 7, 10, ... where 4, 6, 8, ... is right;
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import pydiff
from generated_paths import run_both_paths
from pydiff import generated
from pydiff.lint_lanes import lane_effects

LANES = """
import slangpy;
groupshared float g_shared[64];
float wsum(float a, float x) { return a * x + WaveActiveSum(x); }
float wread(float a, float x) { return a * x + WaveReadLaneAt(x, 0); }
float wpre(float a, float x) { return a * x + WavePrefixSum(x); }
float quad(float a, float x) { return a * x + QuadReadAcrossX(x); }
float helper(float x) { return WaveActiveMax(x); }
float via_call(float a, float x) { return a * x + helper(x); }
[Differentiable] float lanes(float a, float x)
{ return a * x * x + no_diff(float(WaveGetLaneIndex())); }
float3 wv(float3 p, float s) { return p * s + WaveActiveSum(p); }
float plain(float a, float x) { return a * x + 1.0; }
"""


@pytest.fixture
def lanes_module(device):
    return pydiff.load_module_from_source("s42_lanes", LANES, device=device)


def test_cross_lane_functions_keep_slangpy_path(device, forced, lanes_module):
    m = lanes_module
    xs = np.arange(1, 41, dtype=np.float32)
    names = ["wsum", "wread", "wpre", "quad", "via_call", "lanes"]

    def run():
        out = [getattr(m, n)(2.0, pydiff.tensor(xs, device=device)).numpy() for n in names]
        x = pydiff.tensor(xs, device=device, requires_grad=True)
        y = m.lanes(2.0, x)
        m.lanes.bwds(2.0, x, _result=y.with_grads(grad_in=pydiff.ones(40, device=device)))
        _, dy = m.lanes.fwds(
            2.0, pydiff.tensor(xs, device=device).with_tangent(np.ones(40, np.float32))
        )
        p = pydiff.tensor(np.stack([xs] * 3, -1), device=device, dtype="float3")
        return out + [x.grad.numpy(), dy.numpy(), m.wv(p, 2.0).numpy()]

    gen, ref, counts = run_both_paths(forced, run)
    for u, v in zip(gen, ref):
        np.testing.assert_array_equal(u, v)
    np.testing.assert_array_equal(gen[6], 4 * xs)  # d/dx of 2x^2 (+ a lane index, no_diff)
    np.testing.assert_array_equal(gen[7], 4 * xs)
    assert counts["declined: cross-lane: 'WaveActiveSum' in wsum()"] == 1
    assert counts["declined: cross-lane: 'WaveActiveMax' in helper()"] == 1
    assert counts["declined: cross-lane: 'WaveGetLaneIndex' in lanes()"] >= 3
    assert counts["forward: vector"] == 1  # (one element per thread: SlangPy's lanes)
    assert counts.get("forward", 0) == 1 and counts.get("backward", 0) == 0  # (the vector one)
    forced.setenv("PYDIFF_GENERATED", "1")
    generated.reset_stats()
    np.testing.assert_array_equal(
        m.plain(2.0, pydiff.tensor(xs, device=device)).numpy(), 2 * xs + 1
    )
    assert generated.stats().get("forward") == 1  # the module's other functions still run


def test_cross_lane_small_calls_repeated(device, lanes_module):
    # before: the 1002nd call of a layout took the planned generated kernel: 12, 16, 18, ...
    m = lanes_module
    x = pydiff.tensor(np.arange(1, 11, dtype=np.float32), device=device)
    first = m.wsum(2.0, x).numpy()
    y = pydiff.zeros((10,), device=device)
    for _ in range(1100):
        m.wsum(2.0, x, _result=y)
    np.testing.assert_array_equal(y.numpy(), first)


def test_lane_effects_scan():
    src = """
#define SUM(v) WaveActiveSum(v)
groupshared float tile[4][4];
RWStructuredBuffer<uint> counter;
float a(float x) { return SUM(x); }
float b(float x) { tile[0][0] = x; GroupMemoryBarrierWithGroupSync(); return tile[1][0]; }
float c(float x) { uint old; InterlockedAdd(counter[0], 1, old); return x; }
float d(float x) { printf("%f", x); return x; }
float e(float x) { return c(x) + a(x); }
float f(float x) { return x; }   // WaveActiveSum in a comment
void g_bwd(inout DifferentialPair<float> x, float dy) { counter.InterlockedAdd(0, 1); }
[BackwardDerivative(g_bwd)] float g(float x) { return x; }
"""
    from pydiff.lint_macros import preprocess

    found = lane_effects(preprocess(src).text)
    assert found["a"] == ("cross-lane", "'WaveActiveSum' in a()")
    assert found["b"][0] == "cross-lane"
    assert found["c"] == ("side effect", "'InterlockedAdd' in c()")
    assert found["d"] == ("side effect", "'printf' in d()")
    assert found["e"] == ("cross-lane", "'WaveActiveSum' in a()")  # the worse of two
    assert found["g"][0] == "side effect"
    assert "f" not in found
    assert lane_effects("implementing slangpy;\nvoid h() { InterlockedAdd(x[0], 1); }") == {}


STATE_INCLUDE = "static float g_inc = 3.0;\n"
STATE_IMPORT = """module s42_stmod;
public static float g_mod = 3.0;
public float bump() { g_mod = g_mod + 1.0; return g_mod; }
"""
USES_INCLUDE = """import slangpy;
#include "s42_stinc.slang"
[Differentiable] float h(float a, float x) { g_inc = g_inc + 1.0; return a * x + g_inc; }
"""
USES_IMPORT = """import slangpy;
import s42_stmod;
[Differentiable] float h(float a, float x) { float g = no_diff bump(); return a * x + g; }
"""


@pytest.mark.parametrize("which", ["include", "import"])
def test_unlinted_file_imports_statics(device, forced, tmp_path, which):
    # before: lint=False scanned only the file's own text: 4, 7, 10, ... on the generated path
    (tmp_path / "s42_stinc.slang").write_text(STATE_INCLUDE)
    (tmp_path / "s42_stmod.slang").write_text(STATE_IMPORT)
    path = tmp_path / f"s42_uses_{which}.slang"
    path.write_text(USES_INCLUDE if which == "include" else USES_IMPORT)
    m = pydiff.load_module(str(path), device=device, lint=False)
    xs = np.arange(10, dtype=np.float32)
    gen, ref, counts = run_both_paths(
        forced, lambda: [m.h(2.0, pydiff.tensor(xs, device=device)).numpy()]
    )
    np.testing.assert_array_equal(gen[0], 2 * xs + 4)
    np.testing.assert_array_equal(gen[0], ref[0])
    name = "g_inc" if which == "include" else "g_mod"
    assert counts[f"declined: thread state in the module: '{name}'"] == 1


# --------------------------------------------------------------------------------------------
# writes through a SlangPy handle of a pydiff tensor: counted, or refused

SQUARE = "[Differentiable] float sq(float x) { return x * x; }"
X4 = np.array([1.0, 2.0, 3.0, 4.0], np.float32)


def _recorded(device):
    m = pydiff.load_module_from_source("s42_square", SQUARE, device=device)
    x = pydiff.tensor(X4, device=device, requires_grad=True)
    with pydiff.Tape() as tape:
        y = m.sq(x)
    return m, x, y, tape


def test_view_of_a_native_handle_counts_its_writes(device):
    # before: Tensor(x.native.view(...), device) had a storage of its own, so writing through
    # it left x's version as the tape saw it: x.grad came out 18 everywhere (2 * 9) where
    # 2x = 2, 4, 6, 8 is right for the values read
    m, x, y, tape = _recorded(device)
    v = pydiff.Tensor(x.native.view(shape=(4,), strides=(1,)), x.device)
    assert v.storage is x.storage
    v.copy_from_numpy(np.full(4, 9.0, np.float32))
    with pytest.raises(pydiff.StaleInputError, match="overwritten"):
        tape.backward(y, grad=np.ones(4, np.float32))
    m2, x2, y2, tape2 = _recorded(device)
    w = pydiff.Tensor(x2.native.view(shape=(4,), strides=(1,)), x2.device)
    m2.sq(pydiff.tensor(np.full(4, 3.0, np.float32), device=device), _result=w)
    with pytest.raises(pydiff.StaleInputError, match="overwritten"):
        tape2.backward(y2, grad=np.ones(4, np.float32))


def test_native_handle_as_result_is_refused(device):
    # before: m.f(z, _result=x.native) wrote x uncounted: tape.backward gave 18 everywhere
    m, x, y, tape = _recorded(device)
    with pytest.raises(ValueError, match="raw SlangPy tensor on the buffer of a pydiff tensor"):
        m.sq(pydiff.tensor(np.full(4, 3.0, np.float32), device=device), _result=x.native)
    tape.backward(y, grad=np.ones(4, np.float32))
    np.testing.assert_array_equal(x.grad.numpy(), 2 * X4)
    # a SlangPy tensor of the user's own (no pydiff tensor's buffer) is still taken
    import slangpy as spy

    own = spy.Tensor.zeros(device.native, (4,), "float")
    m.sq(pydiff.tensor(X4, device=device), _result=own)
    np.testing.assert_array_equal(own.to_numpy(), X4 * X4)


def test_host_strided_copy_keeps_the_strict_mark(device):
    # before: w.grad.copy_(strided view of x.grad) by the host dropped the mark that x.grad
    # holds a backward's result (a device copy_ keeps it), so STRICT let a backward add onto
    # the copied gradient: 4 where a fresh backward gives 2 (or a refusal, as contiguous)
    m = pydiff.load_module_from_source(
        "s42_double", "[Differentiable] float f(float x) { return 2.0 * x; }", device=device
    )
    results = []
    for strided in (False, True):
        x = pydiff.tensor(np.zeros((2, 2), np.float32), device=device, requires_grad=True)
        w = pydiff.tensor(np.zeros((2, 2), np.float32), device=device, requires_grad=True)
        seed = pydiff.zeros((2, 2), device=device).with_grads(ones=True)
        m.f.bwds(x, _result=seed)
        g = x.grad
        if strided:
            g = pydiff.Tensor(
                g.native.view(shape=(2, 2), strides=(1, 2)), g.device, storage=g.storage
            )
            assert not g.native.is_contiguous()
        w.grad.copy_(g)
        with pydiff.zero_policy("strict"):
            with pytest.raises(pydiff.StaleGradientError, match="still holds the result"):
                m.f.bwds(w, _result=pydiff.zeros((2, 2), device=device).with_grads(ones=True))
        results.append(w.grad.numpy())
    np.testing.assert_array_equal(results[0], np.full((2, 2), 2.0, np.float32))
    np.testing.assert_array_equal(results[1], np.full((2, 2), 2.0, np.float32))


# --------------------------------------------------------------------------------------------
# a store outside the tensor: named by its real index, and refused below the first element too

OUTSIDE = r"""
import slangpy;
[Differentiable] void swapped(int2 idx, IDiffTensor<float, 2> x, IWDiffTensor<float, 2> y)
{ y[int2(idx.y, idx.x)] = x[int2(idx.x, idx.y)] * 2.0; }
[Differentiable] void before(int idx, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)
{ y[idx - 2] = x[idx] * 2.0; }
[Differentiable] void past(int idx, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)
{ y[idx + 3] = x[idx] * 2.0; }
"""


@pytest.mark.parametrize(
    "name, shape, where",
    [
        # before: "flat index 4294967294" for both (the stores at 6 and 7 landed on the
        # mask's own race words), and the store at -2 was not refused at all: x.grad came
        # out [0, 0, 2, 2, 2, 2], a gradient of a forward that wrote outside y
        ("swapped", (2, 3), r"flat index 6, where 0 to 5 are inside: index \(2, 0\)"),
        ("before", (6,), r"flat index -2, where 0 to 5 are inside\)"),
        ("past", (6,), r"flat index 6, where 0 to 5 are inside\)"),
    ],
)
def test_store_outside_the_tensor_names_its_index(device, name, shape, where):
    import slangpy as spy

    m = pydiff.load_module_from_source("s42_outside", OUTSIDE, device=device)
    x = pydiff.tensor(np.arange(6, dtype=np.float32).reshape(shape), device=device)
    x.requires_grad_(True)
    y = pydiff.zeros(shape, device=device, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (pydiff's index-order hint)
        with pydiff.Tape() as tape:
            getattr(m, name)(spy.grid(shape), x, y)
        with pytest.raises(ValueError, match=rf"index outside the tensor \(row-major {where}"):
            tape.backward(y, grad=np.ones(shape))


def test_static_through_an_undecided_macro_branch(device):
    # before: the scan read only the preprocessed text, which takes one of the definitions a
    # branch it cannot decide (__TARGET_CUDA__: the target's) gives; on CUDA `K` is `static`
    src = """import slangpy;
#ifdef __TARGET_CUDA__
#define K static
#else
#define K
#endif
K float g = 1.0;
[Differentiable] float h(float a, float x) { return a * x + g; }
"""
    m = pydiff.load_module_from_source("s42_undecided", src, device=device)
    assert m.thread_state == ["g"]


def test_imported_module_loaded_from_source(device, forced):
    # before: `import s42_helper;` of a module loaded from source (no file for the scan to
    # read) hid its static and its wave intrinsic: 4, 7, 10, ... and 8, 12, 14, ... on the
    # generated path where SlangPy's path gives 4, 6, 8, ... and 28, 30, 32, ...
    pydiff.load_module_from_source(
        "s42_helper",
        "module s42_helper;\npublic static float g_mod = 3.0;\n"
        "public float bump() { g_mod = g_mod + 1.0; return g_mod; }\n"
        "public float wsum(float x) { return WaveActiveSum(x); }\n",
        device=device,
    )
    m = pydiff.load_module_from_source(
        "s42_helper_user",
        "import s42_helper;\n"
        "[Differentiable] float h(float a, float x)\n"
        "{ float g = no_diff bump(); return a * x + g; }\n"
        "float w(float a, float x) { return a * x + wsum(x); }\n",
        device=device,
    )
    assert m.thread_state == ["g_mod"]
    assert m.lane_effects["w"] == ("cross-lane", "'WaveActiveSum' in wsum()")
    xs = np.arange(10, dtype=np.float32)

    def run():
        return [
            m.h(2.0, pydiff.tensor(xs, device=device)).numpy(),
            m.w(2.0, pydiff.tensor(xs, device=device)).numpy(),
        ]

    gen, ref, counts = run_both_paths(forced, run)
    np.testing.assert_array_equal(gen[0], 2 * xs + 4)
    np.testing.assert_array_equal(gen[1], ref[1])
    assert counts["declined: thread state in the module: 'g_mod'"] == 2
