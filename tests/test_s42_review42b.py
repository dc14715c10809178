"""Review of forkguard and fwds1 (review42b): edge cases that were found right, kept as
regression tests. ``.fwds``'s one-call path (forward_pair.direct_pair) against float64
closed forms on strided views, vector-dtype tensors, generics and no_diff parameters; a
forked child's exit status for ``sys.exit("text")`` and ``subprocess`` with ``preexec_fn``
after a device opened."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import pydiff

SRC = """import slangpy;
[Differentiable] float cube(float a) { return a * a * a; }
[Differentiable] float sumsq(float3 a) { return dot(a, a); }
[Differentiable] float3 v3(float3 a) { return a * a; }
[Differentiable] float nod(float a, no_diff float b) { return a * a * b; }
[Differentiable] T gen<T : __BuiltinFloatingPointType>(T a) { return a * a * a; }
"""


@pytest.fixture(scope="module")
def m():
    return pydiff.load_module_from_source("s42_review42b", SRC)


def _vec3(a):
    v = pydiff.empty((a.shape[0],), dtype="float3")
    v.copy_from_numpy(a.astype(np.float32))
    return v


X3 = (np.arange(12, dtype=np.float64).reshape(4, 3) + 1) / 4
X8 = np.asarray(np.linspace(0.1, 2, 8), np.float32).astype(np.float64)
ONES3 = np.ones((4, 3))


def _check(got, value, tangent):
    y, dy = got
    assert type(y) is pydiff.Tensor and y.numpy().shape == dy.numpy().shape == value.shape
    np.testing.assert_allclose(y.numpy(), value, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(dy.numpy(), tangent, rtol=1e-6, atol=1e-6)


def test_strided_view(m):
    x = pydiff.tensor(X8.astype(np.float32))[::2]
    t = pydiff.tensor(np.ones(4, np.float32))
    _check(m.cube.fwds(x.with_tangent(t)), X8[::2] ** 3, 3 * X8[::2] ** 2)


def test_vector_dtype_tensor_at_a_vector_parameter(m):
    got = m.sumsq.fwds(_vec3(X3).with_tangent(_vec3(ONES3)))
    _check(got, (X3**2).sum(1), 2 * X3.sum(1))


def test_float_axes_at_a_vector_parameter(m):
    x = pydiff.tensor(X3.astype(np.float32))
    got = m.v3.fwds(x.with_tangent(pydiff.tensor(ONES3.astype(np.float32))))
    _check(got, X3**2, 2 * X3)


def test_no_diff_and_generic(m):
    x = pydiff.tensor(X8.astype(np.float32)).with_tangent(pydiff.tensor(np.ones(8, np.float32)))
    _check(m.nod.fwds(x, pydiff.tensor(X8.astype(np.float32))), X8**3, 2 * X8 * X8)
    _check(m.gen.fwds(x), X8**3, 3 * X8**2)


def test_vector_dtype_tensor_at_a_scalar_parameter_is_refused(m):
    with pytest.raises(TypeError, match="float3"):
        m.cube.fwds(_vec3(X3).with_tangent(_vec3(ONES3)))


FORK = textwrap.dedent(
    """
    import os, subprocess, sys, time
    import numpy as np, pydiff
    from pydiff import ops
    x = pydiff.tensor(np.array([0.5], np.float32))
    assert abs(float(ops.exp(x).numpy()[0]) - 1.6487212) < 1e-5
    pid = os.fork()
    if pid == 0:
        sys.exit("text status")
    for _ in range(600):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        status = None
    code = None if status is None else os.waitstatus_to_exitcode(status)
    out = subprocess.run([sys.executable, "-c", "print('exec ok')"], preexec_fn=lambda: None,
                         capture_output=True, text=True, timeout=60)
    print("RESULT", code, out.returncode, out.stdout.strip(),
          float(ops.exp(x).numpy()[0]), flush=True)
    """
)


def test_fork_child_text_exit_and_popen_preexec(tmp_path):
    run = subprocess.run(
        [sys.executable, "-c", FORK], capture_output=True, text=True, timeout=240, cwd=tmp_path
    )
    line = [s for s in run.stdout.splitlines() if s.startswith("RESULT")]
    assert line, run.stdout[-2000:] + run.stderr[-2000:]
    _, code, rc, exec1, exec2, value = line[0].split()
    text = f"{exec1} {exec2}"
    assert code == "1" and "text status" in run.stderr  # (as Python's sys.exit(str))
    assert rc == "0" and text == "exec ok"
    assert abs(float(value) - np.exp(0.5)) < 1e-5
