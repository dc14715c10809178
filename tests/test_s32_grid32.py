"""`pydiff check` on tensor functions: a backward wrong only past the first 4 elements per
axis FAILs (a second probe at a larger size), and a NaN output leaves out only the entries
it touches instead of SKIPPING every row.

Before: tensors of 4 elements per axis and a 4-per-axis index grid, so a hand-written
backward wrong at index >= 4 (a second tile, the last element of a larger tensor) PASSed;
and one NaN output element made every row SKIPPED (exit 0), so nothing was checked.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from pydiff import cli
from pydiff.modcheck import check_module
from pydiff.tensorcheck_entries import larger_size, sampled_elements

#: x_i^2 by index, its backward hand-written; WRONG_WHERE picks the elements where the
#: backward says 3 x instead of 2 x (a tiled kernel's second tile, the last element).
BY_INDEX = """import slangpy;
[BackwardDerivative(sq_bwd)]
float sq(int i, DiffTensor<float, 1> x) { float v = x.load(i); return v * v; }
void sq_bwd(int i, DiffTensor<float, 1> x, float dOut)
{
    float v = x._primal.load(i);
    x._grad_out.add(i, ((WRONG_WHERE) ? 3.0 : 2.0) * v * dOut);
}
"""

#: sum_j x_j^2 over the whole tensor, no index: the size is the tensor's own.
WHOLE = """import slangpy;
[BackwardDerivative(total_bwd)]
float total(DiffTensor<float, 1> x)
{
    int n = x.shape[0];
    float s = 0.0;
    [MaxIters(1024)]
    for (int j = 0; j < n; j++) { float v = x.load(j); s += v * v; }
    return s;
}
void total_bwd(DiffTensor<float, 1> x, float dOut)
{
    int n = x._primal.shape[0];
    [MaxIters(1024)]
    for (int j = 0; j < n; j++)
    {
        float v = x._primal.load(j);
        x._grad_out.add(j, ((WRONG_WHERE) ? 3.0 : 2.0) * v * dOut);
    }
}
"""

#: a 2-D tensor read by row: w[i, j] * w[i, j] summed over j, the backward wrong at one
#: element only.
ROWS = """import slangpy;
[BackwardDerivative(rows_bwd)]
float rows(int i, DiffTensor<float, 2> w)
{
    int n = w.shape[1];
    float s = 0.0;
    [MaxIters(64)]
    for (int j = 0; j < n; j++) { float v = w.load(int2(i, j)); s += v * v; }
    return s;
}
void rows_bwd(int i, DiffTensor<float, 2> w, float dOut)
{
    int n = w._primal.shape[1];
    [MaxIters(64)]
    for (int j = 0; j < n; j++)
    {
        float v = w._primal.load(int2(i, j));
        w._grad_out.add(int2(i, j), ((WRONG_WHERE) ? 3.0 : 2.0) * v * dOut);
    }
}
"""


def _check(tmp_path, device, name, source, wrong_where="false"):
    path = tmp_path / f"{name}.slang"
    path.write_text(source.replace("WRONG_WHERE", wrong_where))
    return check_module(path, device=device)


def _rows(rows, mode):
    return [r for r in rows if r.mode == mode]


#: the second probe's size: 31 elements for a 1-D tensor, 15 per axis for a 2-D one
#: (pydiff.tensorcheck_entries.LARGER_SIZES)
@pytest.mark.parametrize(
    "source, wrong_where, element, larger",
    [
        (BY_INDEX, "i >= 4", "x[", 31),  # the second tile
        (BY_INDEX, "i == 30", "x[30]", 31),  # the last element of a 31-element tensor
        (BY_INDEX, "i == 14", "x[14]", 31),  # one element inside the larger probe, not last
        (WHOLE, "j >= 4", "x[", 31),  # no index: a loop over the whole tensor
        (ROWS, "i == 14 && j == 14", "w[14, 14]", 15),  # 2-D: the last element only
    ],
)
def test_a_backward_wrong_past_the_first_four_fails(
    tmp_path, device, source, wrong_where, element, larger
):
    rows = _check(tmp_path, device, "s32_past4", source, wrong_where)
    (backward,) = _rows(rows, "backward")
    assert backward.status == "FAIL", rows
    assert f"worst at {element}" in backward.why, backward.why
    assert f"{larger} per axis" in backward.why, backward.why
    # the same source, right everywhere, passes at both sizes (its entries: both probes)
    right = _check(tmp_path, device, "s32_right", source)
    assert all(r.status == "PASS" for r in right), right
    assert _rows(right, "backward")[0].points > 4 ** (2 if source is ROWS else 1)
    if source is not ROWS:  # 1-D: 4, then all 27 past them at 31 (32 sampled at most), x[0]
        assert _rows(right, "backward")[0].points == 4 + 27 + 1
    assert _rows(right, "adjoint")[0].points == 2


def test_the_larger_probe_follows_the_size_rules():
    assert larger_size(4, 1, 1024) == 31 and larger_size(4, 2, 1024) == 15  # 31^2 > 1024
    assert larger_size(4, 3, 1024) == 7  # 15^3 is past 1024 elements a tensor
    assert larger_size(4, 4, 1024) is None  # 7^4 too
    assert larger_size(8, 3, 1024) is None  # nothing above 8 fits a 3-D tensor
    rng = np.random.default_rng(0)
    # the first element (other threads may add into it at the larger size), then the rest
    assert sampled_elements((31,), 4, rng).tolist() == [0, *range(4, 31)]  # 27 <= 32: all
    picked = sampled_elements((15, 15), 4, rng)
    assert len(picked) == 33 and picked[0] == 0 and picked[-1] == 224  # first and last
    i, j = np.unravel_index(picked[1:], (15, 15))
    assert np.all((i >= 4) | (j >= 4))  # else none the first probe perturbed


def test_a_wrong_backward_reported_through_the_cli(tmp_path, capsys, device):
    path = tmp_path / "s32_cli.slang"
    path.write_text(BY_INDEX.replace("WRONG_WHERE", "i >= 4"))
    assert cli.main(["check", str(path), "--json", "--device", device.type]) == 1
    report = json.loads(capsys.readouterr().out)
    (backward,) = [r for r in report["results"] if r["mode"] == "backward"]
    assert backward["status"] == "FAIL" and "31 per axis" in backward["why"], backward  # 1-D


#: log(x) is NaN at the negative half of the inputs; cube is NaN at index 2 only (the
#: square root of -0.25), and so is its backward there, even times an upstream 0.
NAN_OUTPUTS = """import slangpy;
[Differentiable]
void logs(int i, IDiffTensor<float, 1> x, IWDiffTensor<float, 1> y)
{
    float v = x[i];
    y[i] = log(v) + v * v;
}
[BackwardDerivative(cube_bwd)]
float cube(int i, DiffTensor<float, 1> x)
{
    float v = x.load(i);
    float d = float(i) - 2.0;
    return v * v * v * sqrt(d * d - 0.25);
}
void cube_bwd(int i, DiffTensor<float, 1> x, float dOut)
{
    float v = x._primal.load(i);
    float d = float(i) - 2.0;
    x._grad_out.add(i, FACTOR * v * v * sqrt(d * d - 0.25) * dOut);
}
[Differentiable]
float all_nan(int i, IDiffTensor<float, 1> x) { return sqrt(-1.0 - x[i] * x[i]) + x[i]; }
"""


def test_nan_outputs_leave_out_only_their_entries(tmp_path, device):
    rows = _check(tmp_path, device, "s32_nan", NAN_OUTPUTS.replace("FACTOR", "3.0"))
    by = {(r.function, r.mode): r for r in rows}
    for name in ("logs", "cube"):
        for mode in ("backward", "adjoint"):
            r = by[name, mode]
            # cube's NaN thread gives its own element a NaN derivative (NaN times 0): not
            # told from a wrong one, so that row is not passed (SKIPPED, saying why)
            skipped = (name, mode) == ("cube", "backward")
            assert r.status == ("SKIPPED" if skipped else "PASS"), r
            assert "NaN or infinite" in r.why and "left out" in r.why, r.why
            assert ("not passed" in r.why) is skipped, r.why
        assert by[name, "backward"].points > 0
    # NaN at index 2 only: 1 of 4 outputs at the first size, its entry left out there
    assert "1 of 4 at 4 per axis" in by["cube", "backward"].why
    assert by["cube", "backward"].outside_domain >= 1
    # nothing finite left: SKIPPED, as before
    assert {by["all_nan", m].status for m in ("backward", "adjoint")} == {"SKIPPED"}


def test_a_wrong_backward_beside_nan_outputs_fails(tmp_path, device):
    rows = _check(tmp_path, device, "s32_nan_wrong", NAN_OUTPUTS.replace("FACTOR", "2.0"))
    (backward,) = [r for r in rows if r.function == "cube" and r.mode == "backward"]
    assert backward.status == "FAIL", backward
    assert "worst at x[" in backward.why, backward.why
