"""Interface tensor parameters marked ``no_diff`` in a module's source.

Reflection cannot tell them apart: SlangPy 0.43 reports ``no_diff`` for every parameter whose
type is not differentiable (an ``int``, any ``IDiffTensor``). Yet their loads still add
gradients into whatever gradient buffer the backward binds, so ``.bwds`` must bind a
throwaway one there (docs/tape.md: a tensor at a ``no_diff`` parameter gets no gradient).

    no_diff_tensors("void f(int i, no_diff IDiffTensor<float, 1> x, ...) {...}")  # {'f': {'x'}}
"""

from __future__ import annotations

import re

# A function definition's name and parameter list (parameters hold no parentheses).
_HEADER = re.compile(r"\b([A-Za-z_]\w*)\s*(?:<[^<>(){};]*>\s*)?\(([^(){};]*)\)\s*(?:->[^{;]*)?\{")
_NO_DIFF_TENSOR = re.compile(
    r"\bno_diff\s+(?:(?:in|const)\s+)*I(?:RW|W)?DiffTensor\s*<[^<>]*>\s+([A-Za-z_]\w*)"
)
_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def no_diff_tensors(source: str) -> dict[str, set[str]]:
    """Per function name, the names of its interface tensor parameters marked ``no_diff``
    (functions of every overload and namespace under their plain name).

    >>> no_diff_tensors("void f(int i, no_diff IDiffTensor<float, 1> x) { }")
    {'f': {'x'}}
    """
    text = _COMMENTS.sub(" ", source)
    found: dict[str, set[str]] = {}
    for header in _HEADER.finditer(text):
        names = set(_NO_DIFF_TENSOR.findall(header.group(2)))
        if names:
            found.setdefault(header.group(1), set()).update(names)
    return found
