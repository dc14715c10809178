"""The docs site (docs/, mkdocs.yml): runnable examples run, the shader reference is complete.

Runnable blocks: a ```python fence preceded by the line ``<!-- runnable -->`` in docs/*.md
(invisible on the rendered site and on GitHub). The blocks of one page run in order, in one
fresh namespace shared by that page only (like a notebook: a later block may use names an
earlier one defined), in this process, with the repository root as the working directory
and pydiff's default device. A failure points at the page and line of the Markdown source.
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


def runnable_blocks(page: Path) -> list[tuple[int, str]]:
    """(first line of the code, code) of every block marked runnable on ``page``."""
    text = page.read_text()
    blocks = []
    for m in re.finditer(rf"^{re.escape(MARKER)}[ \t]*\n", text, re.M):
        fence = _FENCE.match(text, m.end())
        if not fence or fence.group(2).strip() not in ("python", "py"):
            line = text.count("\n", 0, m.start()) + 1
            raise AssertionError(
                f"{page.name}:{line}: {MARKER} must be followed directly by a ```python block"
            )
        first_line = text.count("\n", 0, fence.start(3)) + 1
        blocks.append((first_line, fence.group(3)))
    return blocks


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
    monkeypatch.chdir(ROOT)
    namespace: dict = {"__name__": f"docs.{page.stem}"}
    for first_line, code in runnable_blocks(page):
        # Leading newlines make tracebacks show the line numbers of the Markdown file.
        source = "\n" * (first_line - 1) + code
        exec(compile(source, str(page.relative_to(ROOT)), "exec"), namespace)


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
