"""Functions of a module named as Slang's built-ins (``lerp``, ``saturate``, ``max``): a module
sees the built-ins of a name it defines as further overloads, which SlangPy lists and then
cannot choose between. Which names are built-in (by reflection of an empty module), their
signatures, the module's definitions of such a name (file and line), and the errors that say
to rename the function.

    >>> is_builtin_name(device, "lerp")      # True
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .errors import BuiltinNameError
from .lint_macros import blank_comments


def _builtin_probe(device: Any) -> Any:
    """An empty module compiled once per device: what its reflection finds is Slang's own."""
    return device.cached(
        "pydiff-builtin-probe",
        lambda: device.native.load_module_from_source("pydiff_builtin_probe", ""),
    )


def is_builtin_name(device: Any, name: str) -> bool:
    """Whether Slang's core module defines a function ``name`` (found by reflection in an
    empty module compiled once per device); False when that cannot be told."""
    try:
        return _builtin_probe(device).layout.find_function_by_name(name) is not None
    except Exception:  # a device without source loading: no hint rather than a wrong one
        return False


def builtin_signatures(device: Any, name: str) -> set[str]:
    """The signatures (as ``str(Signature)`` writes them) of Slang's built-in functions called
    ``name``; empty when there are none or that cannot be told."""
    try:
        found = _builtin_probe(device).layout.find_function_by_name(name)
        if found is None:
            return set()
        overloads = found.overloads if found.is_overloaded else [found]
        return {
            f"{o.return_type.full_name if o.return_type is not None else 'void'} {name}("
            + ", ".join(f"{p.type.full_name} {p.name}" for p in o.parameters)
            + ")"
            for o in overloads
        }
    except Exception:  # no reflection to tell: nothing is called built-in
        return set()


def overload_listing(fns: list) -> str:
    """The overloads of one name, each once, the module's own apart from Slang's built-ins
    (a module sees the built-ins of a name it defines as further overloads)."""
    shown: dict[str, Any] = {}
    for f in fns:
        shown.setdefault(str(f.signature), f)
    builtin = builtin_signatures(fns[0].module.device, fns[0].name)
    own = [repr(f) for s, f in shown.items() if s not in builtin]
    theirs = [s for s in shown if s in builtin]
    text = "overloads:\n  " + "\n  ".join(own) if own else "no overload of the module's own"
    if theirs:
        text += (
            f"\nSlang built-in functions also named '{fns[0].name}' (Slang's, not the module's; "
            "SlangPy offers them as overloads too: rename your function to keep them apart):"
            "\n  " + "\n  ".join(theirs)
        )
    return text


def definition_lines(module: Any, name: str) -> list[int]:
    """The lines of the module's own definitions of ``name`` (a return type, the name, a
    parameter list and a body), comments blanked; none where its text cannot be read.

    >>> definition_lines(m, "lerp")      # [2]
    """
    text = module.source
    if text is None and not module.file.startswith("<"):
        try:
            text = Path(module.file).read_text(errors="replace")
        except OSError:
            return []
    if not text:
        return []
    text = blank_comments(text)
    found = re.finditer(
        rf"[\w>\]]\s+{re.escape(name)}\s*(?:<[^<>;{{}}()]*>\s*)?\([^;{{}}]*\{{", text
    )
    return [text.count("\n", 0, m.start() + 1) + 1 for m in found]


def collision_error(fn: Any, report: str) -> BuiltinNameError | None:
    """The error for a call SlangPy could not resolve when ``fn``'s name is also a Slang
    built-in's (None when it is not): the function, where the module defines it, the rename
    to make, then SlangPy's ``report`` (its head)."""
    module = fn.module
    if not is_builtin_name(module.device, fn.name):
        return None
    lines = definition_lines(module, fn.name)
    where = ", ".join(f"{module.file}:{n}" for n in lines) or module.file
    theirs = sorted(builtin_signatures(module.device, fn.name))
    listed = "".join(f"\n  {s}" for s in theirs[:6]) + ("\n  ..." if len(theirs) > 6 else "")
    return BuiltinNameError(
        f"{fn.label}: SlangPy could not match the arguments to the function: '{fn.name}' is "
        f"also the name of Slang built-in functions (yours is defined at {where}), which "
        f"SlangPy offers as further overloads of yours and cannot tell apart from it:{listed}\n"
        f"Rename your function (a name Slang does not define, such as 'my_{fn.name}') in "
        f"{module.file} and call it by that name.\nSlangPy's report:\n{report}"
    )
