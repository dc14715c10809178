"""Issue 15 classes 4 and 11 through imports and macros: the trap scanner reads the files a
module imports (found as Slang finds them) and expands #define macros, so a while loop with
'&&' or a 'break' is refused wherever it is written, naming the file and line where it is.
Gradients of what stays allowed are checked against float64 closed forms / central
differences."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest

import pydiff
from pydiff import lint, lint_sources
from pydiff.lint_macros import preprocess

ROOT = Path(__file__).resolve().parent.parent
_names = itertools.count()

AND_LOOP = (
    "[Differentiable] public float inner_and(float x)\n"
    "{ float y = x; int k = 0;\n"
    "  [MaxIters(20)] while (y < 10.0 && k < 10) { y = y * 1.5 + 0.1; k++; } return y; }\n"
)
BREAK_LOOP = (
    "[Differentiable] public float inner_break(float x)\n"
    "{ float y = 0.5 * x;\n"
    "  [MaxIters(50)] while (y < 100.0) { y = 1.5 * y + x; if (y > 5.0) break; } return y; }\n"
)
CLEAN = "[Differentiable] public float clean(float x) { return x * x * 3.0; }\n"


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _kinds(findings):
    return sorted((Path(f.file).name, f.line, f.function, f.kind) for f in findings)


# --------------------------------------------------------------------------------------------
# imports, found as Slang finds them


def test_trap_in_imported_module_reaches_only_its_callers(tmp_path):
    _write(tmp_path, "helper.slang", "module helper;\n" + AND_LOOP + CLEAN)
    main = _write(
        tmp_path,
        "main.slang",
        "import helper;\n"
        "[Differentiable] float f(float x) { return inner_and(x) * 2.0; }\n"
        "[Differentiable] float g(float x) { return clean(x); }\n"
        "[Differentiable] float h(float x) { return f(x) + 1.0; }\n",
    )
    scan = lint_sources.scan_module(main.read_text(), str(main))
    assert scan.own == []
    assert _kinds(scan.imported) == [("helper.slang", 4, "inner_and", "while-short-circuit")]
    assert str(scan.imported[0]).startswith(f"{tmp_path / 'helper.slang'}:4: in inner_and()")
    assert set(scan.traps) == {"inner_and", "f", "h"}  # g reaches no trap: not refused
    assert scan.traps["h"] == scan.imported


@pytest.mark.parametrize(
    "spec, path",
    [
        ("import nested.deep_mod;", "nested/deep_mod.slang"),
        ("import nested.deep_mod;", "nested/deep-mod.slang"),  # Slang's '_' -> '-' fallback
        ('import "nested/deep_mod.slang";', "nested/deep_mod.slang"),
        ('__include "nested/deep_mod.slang";', "nested/deep_mod.slang"),
    ],
)
def test_nested_imports_and_spellings(tmp_path, spec, path):
    _write(tmp_path, path, BREAK_LOOP)
    _write(
        tmp_path,
        "middle.slang",
        spec + "\n[Differentiable] public float mid(float x)\n{ return inner_break(x) + 1.0; }\n",
    )
    main = "import middle;\n[Differentiable] float f(float x) { return mid(x); }\n"
    scan = lint_sources.scan_module(main, str(tmp_path / "main.slang"))
    assert _kinds(scan.imported) == [(Path(path).name, 3, "inner_break", "while-break")]
    assert [f.kind for f in scan.traps["f"]] == ["while-break"]  # f -> mid -> inner_break


def test_import_found_on_include_paths_only_when_given(tmp_path):
    lib = tmp_path / "lib"
    _write(lib, "libmod.slang", AND_LOOP)
    main = "import libmod;\n[Differentiable] float f(float x) { return inner_and(x); }\n"
    here = str(tmp_path / "src" / "main.slang")
    assert lint_sources.scan_module(main, here).traps == {}  # not found: Slang refuses it
    scan = lint_sources.scan_module(main, here, [str(lib)])
    assert [Path(f.file).name for f in scan.traps["f"]] == ["libmod.slang"]
    assert scan.files == [os.path.realpath(lib / "libmod.slang")]


def test_module_from_source_imports_from_the_working_folder(tmp_path, monkeypatch):
    _write(tmp_path, "cwdmod.slang", BREAK_LOOP)
    monkeypatch.chdir(tmp_path)
    main = "import cwdmod;\n[Differentiable] float f(float x) { return inner_break(x); }\n"
    assert [f.kind for f in lint_sources.scan_module(main, "<m>").traps["f"]] == ["while-break"]


def test_import_cycle_and_missing_files_end(tmp_path):
    _write(tmp_path, "a.slang", "import b;\nimport missing_one;\n" + CLEAN)
    _write(tmp_path, "b.slang", "import a;\n" + BREAK_LOOP)
    main = "import a;\n[Differentiable] float f(float x) { return clean(x); }\n"
    scan = lint_sources.scan_module(main, str(tmp_path / "main.slang"))
    assert [f.kind for f in scan.imported] == ["while-break"]
    assert "f" not in scan.traps


def test_include_carries_macros_and_functions(tmp_path):
    _write(tmp_path, "loops.h", "#define KEEP_GOING(a, b) (a < 10.0 && b < 10)\n" + CLEAN)
    main = (
        '#include "loops.h"\n'
        "[Differentiable] float f(float x)\n"
        "{ float y = x; int k = 0;\n"
        "  [MaxIters(20)] while (KEEP_GOING(y, k)) { y = y * clean(x); k++; }\n"
        "  return y; }\n"
        "[Differentiable] float g(float x) { return clean(x); }\n"
    )
    scan = lint_sources.scan_module(main, str(tmp_path / "main.slang"))
    assert _kinds(scan.own) == [("main.slang", 4, "f", "while-short-circuit")]
    assert set(scan.traps) == {"f"}


def test_scan_is_cached_per_content(tmp_path):
    # from empty: the cache empties itself when full, and the tests before this one in the
    # same process may have filled it to the brim (seen in a whole-suite run)
    lint_sources._cache.clear()
    helper = _write(tmp_path, "cached.slang", CLEAN)
    main = "import cached;\n[Differentiable] float f(float x) { return inner_break(x); }\n"
    here = str(tmp_path / "main.slang")
    assert lint_sources.scan_module(main, here).traps == {}
    first = dict(lint_sources._cache)
    assert lint_sources.scan_module(main, here).traps == {}
    assert dict(lint_sources._cache) == first  # nothing scanned again
    helper.write_text(BREAK_LOOP)  # an edit takes effect
    assert [f.kind for f in lint_sources.scan_module(main, here).traps["f"]] == ["while-break"]


# --------------------------------------------------------------------------------------------
# macros


LOOP = """
{defines}
[Differentiable]
float grow(float a)
{{
    float t = a; int k = 0;
    [MaxIters(20)]
    {loop}
    return t;
}}
"""


@pytest.mark.parametrize(
    "defines, loop, kind",
    [
        (
            "#define COND (t < 100.0 && k < 2)",
            "while (COND) { t = 1.5 * t + a; k++; }",
            "while-short-circuit",
        ),
        (
            "#define BOTH(p, q) p && q",
            "while (BOTH(t < 100.0, k < 2)) { t = 1.5 * t + a; k++; }",
            "while-short-circuit",
        ),
        (
            "#define LOOP_WHILE(c) while (c)",
            "LOOP_WHILE(t < 9.0 || k < 2) { t = t + a; k++; }",
            "while-short-circuit",
        ),
        (
            "#define BRK break",
            "while (t < 100.0) { t = 1.5 * t + a; if (t > 5.3) BRK; }",
            "while-break",
        ),
        (
            "#define STEP(v, s) v = 1.5 * v + s",
            "while (t < 100.0) { STEP(t, a); if (t > 5.3) break; }",
            "while-break",
        ),
        (
            "#define STOP_IF(c) if (c) break",
            "while (t < 100.0) { t = t + a; STOP_IF(t > 5.3); }",
            "while-break",
        ),
        (
            "#define DO_UNTIL do",
            "DO_UNTIL { t = 1.5 * t + a; if (t > 5.3) break; } while (k < 2);",
            "do-while-break",
        ),
        (
            "#define W while\n#define CAT(a, b) a ## b",
            "W (CAT(t, ) < 9.0 && k < 2) { k++; }",
            "while-short-circuit",
        ),
        (
            "#define N 100.0\n#define COND2 t < N && k < 2",
            "while (COND2) { t = 1.5 * t + a; k++; }",
            "while-short-circuit",
        ),
    ],
)
def test_traps_written_through_macros_are_found(defines, loop, kind):
    src = LOOP.format(defines=defines, loop=loop)
    found = lint.scan_source(src, "m.slang")
    line = src.splitlines().index("    " + loop) + 1
    assert [(f.kind, f.line, f.function) for f in found] == [(kind, line, "grow")]


@pytest.mark.parametrize(
    "defines, loop",
    [
        (
            "#define SCALE 1.5\n#define SQ(x) ((x) * (x))",
            "while (t < 100.0) { if (t > 5.3) break; t = SCALE * t + SQ(a); }",
        ),
        ("#define COND (t < 100.0 & k < 2)", "while (COND) { t = 1.5 * t + a; k++; }"),
        ("#define BRK break", "for (; t < 100.0; ) { t = 1.5 * t + a; if (t > 5.3) BRK; }"),
        (
            "#if 0\n#define BRK break\n#else\n#define BRK continue\n#endif",
            "while (k < 4) { k++; if (t > 5.3) BRK; t = 1.5 * t + a; }",
        ),
        (
            "#define FLAG 1\n#if FLAG\n#define C t < 100.0\n"
            "#else\n#define C t < 9.0 && k < 2\n#endif",
            "while (C) { if (t > 5.3) break; t = 1.5 * t + a; }",
        ),
        (
            "#define LOCAL(n) float n = t * 2.0",
            "while (t < 9.0) { LOCAL(u); if (u > 10.6) break; t = 1.5 * t + a; }",
        ),
    ],
)
def test_macros_that_are_not_traps_stay_clean(defines, loop):
    assert lint.scan_source(LOOP.format(defines=defines, loop=loop)) == []


def test_undecided_branch_and_unexpandable_macros_refuse_conservatively():
    undecided = "#ifdef USE_AND\n#define C (t < 9.0 && k < 2)\n#else\n#define C (t < 9.0)\n#endif"
    src = LOOP.format(defines=undecided, loop="while (C) { t = t + a; k++; }")
    assert [f.kind for f in lint.scan_source(src)] == ["macro-unexpanded"]  # either may build
    two = "#ifdef USE_BREAK\n#define B break\n#else\n#define B continue\n#endif"
    src = LOOP.format(defines=two, loop="while (k < 4) { k++; t = t + a; if (t > 5.3) B; }")
    found = lint.scan_source(src, "two.slang")
    assert [f.kind for f in found] == ["macro-unexpanded"]
    assert found[0].line == 12 and "'B'" in found[0].message and found[0].refuses_bwds
    defined = lint.scan_source(
        src.replace("#ifdef USE_BREAK", "#define USE_BREAK\n#ifdef USE_BREAK")
    )
    assert [f.kind for f in defined] == ["while-break"]  # decided: the break is seen
    assert [f.kind for f in lint.scan_source(src, defines={"USE_BREAK": "1"})] == ["while-break"]


def test_preprocessor_keeps_every_line():
    src = (
        "#define LONG(a) \\\n   a * \\\n   2.0\n"
        "float f(float x) { return LONG(\n x); }\n#if 0\nnot compiled\n#endif\nfloat y;"
    )
    out = preprocess(src).text
    assert out.count("\n") == src.count("\n")
    assert out.splitlines()[3].split() == "float f(float x) { return x * 2.0".split()  # line 4
    assert "not compiled" not in out and out.splitlines()[-1] == "float y;"


# --------------------------------------------------------------------------------------------
# no false positives on the project's own shaders through their imports


def test_project_shaders_and_their_imports_scan_clean():
    paths = [str(ROOT / "shaders")]
    checked = 0
    for folder in ("samples", "shaders", "tests/shaders"):
        for path in sorted((ROOT / folder).rglob("*.slang")):
            if path.name == "traps.slang":
                continue
            scan = lint_sources.scan_module(path.read_text(), str(path), paths)
            # (op_silu's forward derivative is not [Differentiable]: its callers' hvp is
            # refused, where it segfaulted the compiler; break47. Since fix49b a file's own
            # such functions are found too: their own hvp cannot build. Both true findings.)
            assert [f for f in scan.own + scan.imported if not f.crashes_hvp] == [], path
            checked += 1
    assert checked > 20


# --------------------------------------------------------------------------------------------
# through pydiff.load_module: refused with the imported file's line, never run


def _fd(f, xs, h=1e-6):
    return np.array([(f(x + h) - f(x - h)) / (2 * h) for x in xs])


def test_load_module_refuses_imported_trap_naming_its_file(device, tmp_path):
    helper = _write(tmp_path, "helper_ld.slang", "module helper_ld;\n" + BREAK_LOOP + CLEAN)
    main = _write(
        tmp_path,
        "main_ld.slang",
        "import helper_ld;\n"
        "[Differentiable] float f(float x) { return inner_break(x); }\n"
        "[Differentiable] float g(float x) { return clean(x) + x; }\n",
    )
    with pytest.warns(pydiff.ShaderTrapWarning, match="helper_ld.slang:4: in inner_break"):
        m = pydiff.load_module(main, device=device)
    x = pydiff.tensor(np.array([1.0, 2.0, 3.0]), device=device, requires_grad=True)
    where = re.escape(f"{os.path.realpath(helper)}:4: in inner_break()")
    with pytest.raises(pydiff.ShaderTrapError, match=where):
        m.f.bwds(x, _result=1.0)
    m.g.bwds(x, _result=1.0)  # reaches no trap: runs, and is right
    np.testing.assert_allclose(x.grad.numpy(), 6.0 * np.array([1.0, 2.0, 3.0]) + 1.0, rtol=1e-6)


def test_load_module_imports_from_device_include_paths(tmp_path):
    lib = tmp_path / "lib"
    _write(lib, "pathmod.slang", AND_LOOP)
    _write(
        tmp_path,
        "main_p.slang",
        "import pathmod;\n[Differentiable] float f(float x) { return inner_and(x); }\n",
    )
    code = f"""
        import warnings, numpy as np, pydiff
        warnings.simplefilter("ignore")
        dev = pydiff.create_device("vulkan", include_paths=[{str(lib)!r}])
        m = pydiff.load_module({str(tmp_path / "main_p.slang")!r}, device=dev)
        x = pydiff.tensor(np.array([1.0, 2.0]), device=dev, requires_grad=True)
        try:
            m.f.bwds(x, _result=1.0)
        except pydiff.ShaderTrapError as e:
            print("REFUSED", "pathmod.slang:3: in inner_and()" in str(e))
    """
    if "vulkan" not in pydiff.available_devices():
        pytest.skip("runs on Vulkan")
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["REFUSED", "True"]


def test_macro_loop_fix_runs_and_matches_finite_differences(device):
    src = (
        "#define STEP(v, s) v = 1.5 * v + s\n#define STOP_IF(c) if (c) break\n"
        "[Differentiable] float grow(float a)\n{ float t = a;\n"
        "  [MaxIters(20)] for (; t < 100.0; ) { STEP(t, a); STOP_IF(t > 5.3); }\n  return t; }\n"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a right loop: no trap warning
        m = pydiff.load_module_from_source(f"macro_fix_{next(_names)}", src, device=device)

    def ref(a):
        t = a
        for _ in range(20):
            t = 1.5 * t + a
            if t > 5.3:
                break
        return t

    xs = np.array([1.0, 2.0, 3.0, 0.7])
    x = pydiff.tensor(xs, device=device, requires_grad=True)
    m.grow.bwds(x, _result=1.0)
    np.testing.assert_allclose(x.grad.numpy(), _fd(ref, xs), rtol=1e-5)
