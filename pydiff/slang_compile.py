"""Slang source compiled into a device's session, and SlangPy's compile errors made readable:
the file and line of the user's text (SlangPy names source modules by a hash, or pydiff by a
fresh alias for a reloaded file, and prepends a line), as a ``SlangCompileError``.

    native = load_source(dev.native, "sq", "[Differentiable] float sq(float x) { return x*x; }")
    raise compile_error(exc, "shaders/model.slang", None)
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import slangpy as spy

from . import kernel_sources
from .errors import SlangCompileError


def compile_error(
    exc: Exception, display_name: str, hashed_name: str | None, alias: str = "", source: str = ""
) -> SlangCompileError:
    """SlangPy's compile error as a ``SlangCompileError`` naming ``display_name`` and the line
    (``alias``: the fresh name a reloaded file was compiled under); a user derivative of the
    wrong signature (``source``: the module's text) is said in pydiff's words first."""
    error = SlangCompileError.from_slang(str(exc), display_name, bool(hashed_name), alias=alias)
    what = derivative_mismatch(str(error), source, display_name)
    if what is None:
        return error
    return SlangCompileError.from_slang(
        str(exc), display_name, bool(hashed_name), what=what, alias=alias
    )


_RETURN = re.compile(
    r"--> (?P<file>[^\n]+?):(?P<line>\d+):\d+\n(?:.*\n){0,3}?.*member '(?P<fn>\w+)' "
    r"return type '(?P<got>[^']+)' does not match interface requirement return type "
    r"'(?P<want>[^']+)'"
)
_PARAM = re.compile(
    r"--> (?P<file>[^\n]+?):(?P<line>\d+):\d+\n(?:.*\n){0,3}?.*invalid custom derivative\. "
    r"parameter type mismatch at position (?P<pos>\d+)\. expected '(?P<want>[^']+)', got "
    r"'(?P<got>[^']+)'"
)
_PRIMAL = (  # (the attribute naming the derivative, further attributes, the function it derives)
    r"\[(?P<kind>Forward|Backward)Derivative\(\s*{}\s*\)\]\s*(?:\[[^\]]*\]\s*)*"
    r"[\w<>:, ]+?\s(?P<primal>\w+)\s*\("
)
_SHAPES = {
    "Forward": "returns DifferentialPair<R> (return diffPair(value, derivative)) and takes "
    "DifferentialPair<T> for each differentiable parameter T",
    "Backward": "returns void and takes inout DifferentialPair<T> for each differentiable "
    "parameter T, then the upstream gradient (R dOut) of the result",
}


def derivative_mismatch(text: str, source: str, display_name: str) -> str | None:
    """pydiff's headline for Slang's diagnostic ``text`` of a user ``[ForwardDerivative(g)]``
    or ``[BackwardDerivative(g)]`` whose ``g`` has the wrong signature (a forward derivative
    returning ``float``, not ``DifferentialPair<float>``: "E38106 return type mismatch"; a
    parameter of the wrong type: E31149), naming g, the function it derives, files and lines;
    None for other errors. ``source``: the text of ``display_name`` (else read from the file
    the diagnostic names)."""
    m = _RETURN.search(text) or _PARAM.search(text)
    if m is None:
        return None
    file, line = m.group("file"), int(m.group("line"))
    if file != display_name or not source:
        try:
            source = Path(file).read_text()
        except OSError:
            return None
    if "fn" in m.groupdict():
        found = re.search(_PRIMAL.format(re.escape(m.group("fn"))), source)
    else:  # (E31149 points at the attribute: its line names the derivative)
        lines = source.splitlines()
        attr = re.search(
            r"(Forward|Backward)Derivative\(\s*(\w+)",
            lines[line - 1] if 0 < line <= len(lines) else "",
        )
        found = attr and re.search(_PRIMAL.format(re.escape(attr.group(2))), source)
    if not found:
        return None
    name = m.group("fn") if "fn" in m.groupdict() else attr.group(2)
    kind, primal = found.group("kind"), found.group("primal")
    at = source.count("\n", 0, found.start("primal")) + 1
    defined = re.search(rf"(?m)^[ \t]*(?!return\b)[\w<>:, ]+\s{re.escape(name)}\s*\(", source)
    line = source.count("\n", 0, defined.start()) + 1 if defined else line  # (E31149: the use)
    wrong = (
        f"returns {m.group('got')}, not {m.group('want')}"
        if "fn" in m.groupdict()
        else f"takes {m.group('got')} at parameter {m.group('pos')}, not {m.group('want')}"
    )
    return (
        f"{name} ({file}:{line}), the [{kind}Derivative] of {primal} ({file}:{at}), {wrong}: "
        f"a {kind.lower()} derivative {_SHAPES[kind]} (docs/custom-derivatives.md). Slang says"
    )


#: Sources that failed to compile, by (device, name, source digest): the Slang session keeps
#: a module that failed, and loading the same name again returns it, half-built (a second
#: pydiff.hvp of a function whose wrapper failed crashed the interpreter).
_FAILED_SOURCES: dict[tuple[int, str, str], tuple[str, str | None, int | None]] = {}


def load_source(native_device: Any, name: str, source: str, link: list) -> Any:
    """SlangPy's module compiled from ``source`` under ``name``; a ``SlangCompileError``
    naming ``<name>`` and the line, again on every retry of a source that failed."""
    failed_key = (id(native_device), name, hashlib.sha1(source.encode()).hexdigest())
    if failed_key in _FAILED_SOURCES:  # SlangPy would hand back the broken module: a segfault
        message, file, line = _FAILED_SOURCES[failed_key]
        raise SlangCompileError(message, file=file, line=line)
    try:
        return kernel_sources.spy_module(native_device, name, source, link=link)
    except spy.SlangCompileError as exc:
        if "already loaded with different source" in str(exc):
            raise SlangCompileError(
                f"<{name}>: a module named {name!r} was already loaded in this process with "
                "different source; SlangPy cannot reload a module: give this version another "
                "name, or restart the process",
                file=f"<{name}>",
                line=None,
            ) from None
        error = compile_error(exc, f"<{name}>", name, source=source)
        _FAILED_SOURCES[failed_key] = (str(error), error.file, error.line)
        raise error from None
