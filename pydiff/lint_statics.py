"""Thread state in Slang source: mutable ``static`` variables, which a thread keeps from one
call of a function to the next (``static uint seed = 1; float rnd() { seed = hash(seed);
... }``), and SlangPy's call id (``CallShapeInfo::get_call_id()``), which SlangPy's kernels
set per thread and no other kernel provides (a generated kernel's pipeline failed to link:
"unresolved external symbol", a raw RuntimeError out of the call).

SlangPy's kernels run one call element per thread, so every element starts from the
initial value; pydiff's generated elementwise kernels run several elements per thread (eight,
one float4 after another), where each element would see the state the previous one left
(``g = g + 1; return a * x + g`` gave 4, 7, 10, 13 where SlangPy's path gives 4, 6, 8, 10).
Functions of a module declaring such a variable or using the call id (or importing a file
that does) keep SlangPy's path (``generated_helpers.left_to_slangpy``). The scan is
conservative: any ``static`` declaration that is neither ``const``/``let`` nor a function
counts.

    thread_state("static uint seed = 1;\\nstatic const float K = 2.0;")   # ['seed']
"""

from __future__ import annotations

import re

_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\])*\"", re.S)
_STATIC = re.compile(r"\bstatic\b")
_END = re.compile(r"[;=({]")
_NAME = re.compile(r"([A-Za-z_]\w*)\s*(?:\[[^\]]*\]\s*)*$")
_IMMUTABLE = re.compile(r"\b(?:const|let|constexpr)\b")
_SLANGPY = re.compile(r"^\s*(?:implementing|module)\s+slangpy\s*;", re.M)


def thread_state(*texts: str) -> list[str]:
    """The names of the mutable ``static`` variables declared in ``texts`` (Slang source:
    module scope, struct members, function locals), in order, and ``CallShapeInfo`` where
    one uses SlangPy's call id."""
    found: list[str] = []
    for text in texts:
        text = _COMMENTS.sub(" ", text)
        if _SLANGPY.search(text):
            continue  # SlangPy's own files: its call ids, which its kernels set per thread
        for start in _STATIC.finditer(text):
            end = _END.search(text, start.end())
            if end is None or end.group() in "({":
                continue  # a function (or a type), not a variable
            decl = text[start.end() : end.start()]
            if _IMMUTABLE.search(decl) or _IMMUTABLE.search(_line_before(text, start.start())):
                continue
            name = _NAME.search(decl.strip())
            if name is not None and name.group(1) not in found:
                found.append(name.group(1))
        if "CallShapeInfo" not in found and re.search(r"\bCallShapeInfo\b", text):
            found.append("CallShapeInfo")
    return found


_IMPORT = re.compile(r"(?<![\w.])import\s+([A-Za-z_][\w.]*)\s*;")


def imported_names(*texts: str) -> list[str]:
    """The module names ``import name;`` lines of ``texts`` name (``import a.b;``: ``a.b``)."""
    found = [m.group(1) for text in texts for m in _IMPORT.finditer(_COMMENTS.sub(" ", text))]
    return list(dict.fromkeys(found))


def _line_before(text: str, at: int) -> str:
    """The modifiers written before ``static`` in its declaration (``const static``)."""
    begin = max(text.rfind(c, 0, at) for c in ";{}\n")
    return text[begin + 1 : at]
