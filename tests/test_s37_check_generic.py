"""`pydiff check --function NAME` naming a generic [Differentiable] function reports it as
skipped (its type arguments cannot be chosen), as checking the whole file does, rather than
an error saying the file has no such function."""

from __future__ import annotations

from pydiff.modcheck import check_module


def test_check_names_a_generic_function(device, tmp_path):
    src = tmp_path / "generic.slang"
    src.write_text(
        "[Differentiable] T gsq<T : __BuiltinFloatingPointType>(T x) { return x * x; }\n"
        "[Differentiable] float h(float x) { return 2.0 * x; }\n"
    )
    results = check_module(str(src), ["gsq", "h"], device=device)
    by_name = {r.function: r for r in results}
    assert set(by_name) == {"gsq", "h"}
    assert by_name["gsq"].status == "SKIPPED" and "generic" in by_name["gsq"].why
    assert by_name["h"].status == "PASS"
    results = check_module(str(src), ["gsq"], device=device)
    assert [(r.function, r.status) for r in results] == [("gsq", "SKIPPED")]
