"""A struct with an interface tensor field (ITensor, IDiffTensor, ...) makes SlangPy 0.43
segfault building any call that passes it, the forward call included (issue 15, class 11).
pydiff refuses such calls with file:line and the fix; concrete tensor fields work. Each case
runs in a subprocess, so a crash fails the test instead of killing the run."""

import subprocess
import sys
import textwrap

import pytest

import pydiff

TEMPLATE = textwrap.dedent(
    """
    import warnings, numpy as np, slangpy as spy, pydiff
    warnings.simplefilter("ignore")
    src = '''
    import slangpy;
    struct Layer {{ {field} w; float k; }}
    {attr} float lay(int i, Layer l) {{ return l.w[i] * l.k; }}
    '''
    m = pydiff.load_module_from_source("struct_fields", src, device=pydiff.create_device("vulkan"))
    w = pydiff.tensor([1.0, 2.0, 3.0], requires_grad=True)
    try:
        y = m.lay(spy.grid((3,)), {{"w": w, "k": 2.0}}, _result="tensor")
        print("values", *y.numpy())
    except pydiff.ShaderTrapError as exc:
        print("refused", ":4:" in str(exc), "concrete type" in str(exc))
    """
)


def _run(field, attr):
    code = TEMPLATE.format(field=field, attr=attr)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"the process died ({out.returncode}): {out.stderr[-1500:]}"
    return out.stdout.split()


@pytest.mark.slow
@pytest.mark.parametrize(
    "field,attr",
    [
        ("IDiffTensor<float, 1>", "[Differentiable]"),
        ("IDiffTensor<float, 1>", ""),
        ("ITensor<float, 1>", "[Differentiable]"),
    ],
)
def test_interface_tensor_fields_are_refused(field, attr):
    if "vulkan" not in pydiff.available_devices():
        pytest.skip("runs on Vulkan")
    assert _run(field, attr) == ["refused", "True", "True"]


@pytest.mark.slow
@pytest.mark.parametrize("field", ["DiffTensor<float, 1>", "Tensor<float, 1>"])
def test_concrete_tensor_fields_work(field):
    if "vulkan" not in pydiff.available_devices():
        pytest.skip("runs on Vulkan")
    assert [float(v) for v in _run(field, "[Differentiable]")[1:]] == [2.0, 4.0, 6.0]
