"""Generic differentiable functions (``f<let N : int>(...)``, ``f<T : IFloat>(...)``) with a
``for`` loop that indexes an interface diff tensor (``IDiffTensor``, ``IRWDiffTensor``, ...):
the Slang compiler in SlangPy 0.43.1 never finishes compiling their backward (it loops in
``specializeModule``; the process hangs at ``.bwds``), also when a non-generic function calls
one. Measured: the same loop as ``[MaxIters(n)] while (...)``, ``[ForceUnroll] for``, with a
concrete ``DiffTensor`` parameter, or in a non-generic function compiles; the forward and
``.fwds`` compile either way. docs/traps.md.

    hit = generic_for_access(body, accesses(body, tensors, types))
    hit  # (offset of the loop, "a 'for' loop reading 'x[k]' in a generic function ...")
"""

from __future__ import annotations

import re

from .lint_flow import statement_end
from .lint_index import Access, show

KIND = "generic-for-interface-tensor"
_FOR = re.compile(r"\bfor\s*\(")
# the attributes just before a loop: `[ForceUnroll] [MaxIters(4)]` (in either order)
_ATTRIBUTES = re.compile(r"(?:\[[^\[\]]*\]\s*)*$")


def _force_unrolled(body: str, loop: int) -> bool:
    attributes = _ATTRIBUTES.search(body[max(0, loop - 200) : loop])
    return attributes is not None and re.search(r"\bForceUnroll\b", attributes.group()) is not None


def generic_for_access(body: str, indexed: list[Access]) -> tuple[int, str] | None:
    """(offset of the loop, why and the fix) for the first ``for`` loop of a generic function's
    ``body`` (not ``[ForceUnroll]``) inside which one of the ``indexed`` accesses is."""
    for m in _FOR.finditer(body):
        if _force_unrolled(body, m.start()):
            continue
        end = statement_end(body, m.start())
        inside = next((a for a in indexed if m.start() <= a.offset < end), None)
        if inside is not None:
            return m.start(), (
                f"a 'for' loop using '{show(inside)}' (an interface diff tensor) in a generic "
                "function: SlangPy 0.43 bwds of it never finishes compiling (the Slang compiler "
                "loops; the process hangs), and so does the backward of any function calling "
                "it; write the loop as '[MaxIters(n)] while (k < n) { ...; k++; }', mark it "
                f"[ForceUnroll] if its count is a constant, declare '{inside.tensor}' as a "
                "concrete DiffTensor/WDiffTensor/RWDiffTensor, or make the function non-generic"
            )
    return None
