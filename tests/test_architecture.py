"""The package's shape matches docs/architecture.md: every module is on the page, every import
points up the page's table (no cycle), no module is over 450 lines, and no module reaches into
another object's private names. Read from the source with ``ast``; no device needed."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "pydiff"
MAX_LINES = 450


def _documented_order() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    return re.findall(r"^\| \d [a-z ]+ \| `(\w+)` \|", text, flags=re.M)


def _imports(path: Path) -> set[str]:
    """Sibling modules a module imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else [a.name for a in node.names]
            found.update(n.split(".")[0] for n in names if n)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pydiff."):
            found.add(node.module.split(".")[1])
    return found


def _private_reaches(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (
            node.level == 1 or (node.module or "").startswith("pydiff")
        ):
            out += [
                a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")
            ]
        elif (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                out.append(f"line {node.lineno}: .{node.attr}")
    return out


def test_every_module_is_documented_once():
    order = _documented_order()
    modules = sorted(p.stem for p in PKG.glob("*.py"))
    assert len(order) == len(set(order)), "a module is listed twice in docs/architecture.md"
    assert sorted(order) == modules, (
        f"docs/architecture.md lists {sorted(set(order) - set(modules))} that do not exist and "
        f"misses {sorted(set(modules) - set(order))}"
    )


def test_imports_point_up_the_table():
    order = _documented_order()
    rank = {m: i for i, m in enumerate(order)}
    wrong = []
    for m in order:
        for dep in _imports(PKG / f"{m}.py"):
            if dep in rank and dep != m and rank[dep] > rank[m]:
                wrong.append(f"{m} imports {dep}, which docs/architecture.md places above it")
    assert not wrong, "\n".join(wrong)


def test_modules_fit_one_sitting():
    long = {p.stem: n for p in PKG.glob("*.py") if (n := p.read_text().count("\n")) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


# Private names of other libraries pydiff must write, each with its reason (not pydiff's own).
ALLOWED: dict[str, set[str]] = {}


def test_no_private_reach_through():
    found = {}
    for p in PKG.glob("*.py"):
        reaches = [
            r for r in _private_reaches(p) if r.split(": ")[-1] not in ALLOWED.get(p.stem, ())
        ]
        if reaches:
            found[p.stem] = reaches
    assert not found, f"private names reached from outside their object: {found}"


def test_the_checker_sees_a_cycle_and_a_reach(tmp_path):
    """The checks above can fail: an upward import and a private reach are both caught."""
    (tmp_path / "low.py").write_text("from .high import thing\nx = obj._secret\n")
    assert "high" in _imports(tmp_path / "low.py")
    assert _private_reaches(tmp_path / "low.py") == ["line 2: ._secret"]
