"""The docs site (docs/, mkdocs.yml): runnable examples run, the shader reference is complete.

Every ```python fence in docs/*.md runs: each is preceded by the line ``<!-- runnable -->``
(invisible on the rendered site and on GitHub). Hidden code, an HTML comment
``<!-- hidden-python`` ... ``-->``, runs between them: the set-up a fragment needs (a module,
its tensors) and the checks of what it claims (``# x.grad = 2x``) against NumPy. The blocks of
one page run in order, in one fresh namespace shared by that page only (like a notebook),
in this process, with the repository root as the working directory and pydiff's default
device; ``page_slang(k)`` there is the page's k-th ```slang block. A failure points at the
page and line of the Markdown source.

Every ```slang fence is either a copy of a sample (first line ``// samples/<file>``, the rest
found in that file) or is loaded by the page's code through ``page_slang`` and passes
``pydiff check``; so does every shader in samples/.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SHADERS = ROOT / "shaders"
MARKER = "<!-- runnable -->"
_FENCE = re.compile(r"^(`{3,}|~{3,})([^\n]*)\n(.*?)^\1[ \t]*$", re.M | re.S)


_HIDDEN = re.compile(r"^<!-- hidden-python[ \t]*\n(.*?)^-->[ \t]*$", re.M | re.S)


def runnable_blocks(page: Path) -> list[tuple[int, str]]:
    """(first line of the code, code) of every block marked runnable and every hidden block
    on ``page``, in the page's order."""
    text = page.read_text()
    blocks = []
    for m in re.finditer(rf"^{re.escape(MARKER)}[ \t]*\n", text, re.M):
        fence = _FENCE.match(text, m.end())
        if not fence or fence.group(2).strip() not in ("python", "py"):
            line = text.count("\n", 0, m.start()) + 1
            raise AssertionError(
                f"{page.name}:{line}: {MARKER} must be followed directly by a ```python block"
            )
        blocks.append((fence.start(3), fence.group(3)))
    blocks += [(m.start(1), m.group(1)) for m in _HIDDEN.finditer(text)]
    return [(text.count("\n", 0, start) + 1, code) for start, code in sorted(blocks)]


def fenced_blocks(page: Path, language: str) -> list[tuple[int, str]]:
    """(line of the fence, code) of every ```<language> block on ``page``."""
    text = page.read_text()
    return [
        (text.count("\n", 0, m.start()) + 1, m.group(3))
        for m in _FENCE.finditer(text)
        if m.group(2).strip() == language
    ]


PAGES = sorted(p for p in DOCS.glob("*.md") if MARKER in p.read_text())


def test_runnable_examples_exist_on_the_main_pages():
    names = {p.name for p in PAGES}
    for page in (
        "index.md",
        "getting-started.md",
        "tensors-and-gradients.md",
        "tape.md",
        "functions.md",
        "custom-derivatives.md",
        "forward-mode.md",
        "ops-and-optimizers.md",
        "shader-library.md",
    ):
        assert page in names, f"docs/{page} has no runnable example"
    for page in PAGES:
        assert runnable_blocks(page)  # also checks every marker is followed by a python block


@pytest.mark.parametrize("page", PAGES, ids=[p.stem for p in PAGES])
def test_runnable_blocks(page: Path, monkeypatch):
    import pydiff

    monkeypatch.chdir(ROOT)
    slang = [code for _, code in fenced_blocks(page, "slang")]
    namespace: dict = {"__name__": f"docs.{page.stem}", "page_slang": slang.__getitem__}
    device = pydiff.default_device()
    try:
        for first_line, code in runnable_blocks(page):
            # Leading newlines make tracebacks show the line numbers of the Markdown file.
            source = "\n" * (first_line - 1) + code
            exec(compile(source, str(page.relative_to(ROOT)), "exec"), namespace)
    finally:  # process-wide settings a page shows how to change
        pydiff.set_default_device(device)
        pydiff.set_deterministic(False)
        pydiff.set_zero_policy("accumulate")


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda p: p.stem)
def test_every_python_example_runs(page: Path):
    text = page.read_text()
    for m in _FENCE.finditer(text):
        if m.group(2).strip() in ("python", "py"):
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            line = text.count("\n", 0, m.start()) + 1
            assert before.strip() == MARKER, (
                f"docs/{page.name}:{line}: a ```python example without {MARKER} above it: make "
                "it run (hidden set-up and checks in <!-- hidden-python ... --> blocks)"
            )


SLANG_EXAMPLES = [
    (page, k, line, code)
    for page in sorted(DOCS.glob("*.md"))
    for k, (line, code) in enumerate(fenced_blocks(page, "slang"))
]


@pytest.mark.parametrize(
    "page, k, line, code",
    SLANG_EXAMPLES,
    ids=[f"{p.stem}:{line}" for p, _, line, _ in SLANG_EXAMPLES],
)
def test_every_slang_example_is_checked(page: Path, k: int, line: int, code: str, tmp_path):
    from pydiff.modcheck import check_module

    first, _, rest = code.partition("\n")
    copied = re.fullmatch(r"//\s*(samples/[\w./-]+\.slang)\s*", first)
    if copied:  # a copy of a sample (checked below, with the samples)
        squash = lambda t: re.sub(r"\s+", " ", t).strip()  # noqa: E731
        assert squash(rest) in squash((ROOT / copied.group(1)).read_text()), (
            f"docs/{page.name}:{line}: the example differs from {copied.group(1)}"
        )
        return
    hidden = "\n".join(c for _, c in runnable_blocks(page))
    assert f"page_slang({k})" in hidden, (
        f"docs/{page.name}:{line}: no runnable code on the page loads this example "
        f"(page_slang({k}) in a hidden-python block)"
    )
    path = tmp_path / f"{page.stem}_{line}.slang"
    path.write_text(code)
    bad = [r for r in check_module(path) if r.status in ("FAIL", "ERROR")]
    assert not bad, f"docs/{page.name}:{line}: pydiff check failed: {bad}"


@pytest.mark.parametrize("path", sorted((ROOT / "samples").glob("*.slang")), ids=lambda p: p.name)
def test_every_sample_shader_passes_pydiff_check(path: Path):
    from pydiff.modcheck import check_module

    results = check_module(path)
    assert results, f"{path.name}: no [Differentiable] function checked"
    bad = [r for r in results if r.status in ("FAIL", "ERROR")]
    assert not bad, f"samples/{path.name}: pydiff check failed: {bad}"


# -- the shader library reference -----------------------------------------------------------


def _generator():
    spec = importlib.util.spec_from_file_location(
        "gen_shader_reference", DOCS / "gen_shader_reference.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _rendered_page() -> str:
    """docs/shader-library.md as the MkDocs hook turns it into the page."""
    gen = _generator()
    page = SimpleNamespace(file=SimpleNamespace(src_uri=gen.PAGE))
    return gen.on_page_markdown((DOCS / gen.PAGE).read_text(), page, None, None)


def _public_names(src: str) -> set[str]:
    """Public functions, types and members, and compute entry points, by a plain regex scan
    (independent of the generator's parser)."""
    src = re.sub(r"/\*.*?\*/", " ", src, flags=re.S)
    src = re.sub(r"//[^\n]*", " ", src)
    names = set(re.findall(r"\bpublic\s+(?:struct|interface|enum)\s+(\w+)", src))
    names |= set(
        re.findall(
            r"\bpublic\s+(?!(?:struct|interface|enum)\b)[^;{}()=]*?\b(\w+)\s*(?:<[^<>();{}]*>)?\s*\(",
            src,
        )
    )
    names |= set(re.findall(r"\bpublic\s+[^;{}()=]*?\b(\w+)\s*(?:\[[^\]]*\])?\s*;", src))
    names |= set(
        re.findall(r"\[\s*shader\s*\([^)]*\)\s*\]\s*(?:\[[^\]]*\]\s*)*\w+\s+(\w+)\s*\(", src)
    )
    return names


def test_shader_reference_lists_every_public_slang_function():
    page = _rendered_page()
    assert "<!-- shader-reference -->" not in page
    files = sorted(SHADERS.rglob("*.slang"))
    assert files
    missing = []
    for path in files:
        rel = path.relative_to(SHADERS).as_posix()
        head = f"## `{rel}`"
        assert head in page, f"docs/shader-library.md has no section for shaders/{rel}"
        section = page.split(head, 1)[1].split("\n## ", 1)[0]
        code = "\n".join(re.findall(r"```slang\n(.*?)```", section, re.S))
        for name in sorted(_public_names(path.read_text())):
            if not re.search(rf"\b{re.escape(name)}\b", code):
                missing.append(f"shaders/{rel}: {name}")
    assert not missing, "missing from docs/shader-library.md: " + ", ".join(missing)


def test_shader_reference_scan_sees_the_library():
    """Guards the scan above against matching nothing."""
    names = _public_names((SHADERS / "ops" / "elementwise.slang").read_text())
    assert {"op_add", "op_relu", "op_swiglu"} <= names and "op_relu_bwd" not in names
    names = _public_names((SHADERS / "forward_tensor.slang").read_text())
    assert {"FwdDiffTensor", "RWFwdDiffTensor", "fdt_load_fwd", "load", "store", "primal"} <= names
    assert {"mm_nt", "mm_nn", "mm_tn"} <= _public_names(
        (SHADERS / "ops" / "matmul.slang").read_text()
    )


def test_shader_reference_hook_is_configured():
    config = (ROOT / "mkdocs.yml").read_text()
    assert "docs/gen_shader_reference.py" in config and "shader-library.md" in config
