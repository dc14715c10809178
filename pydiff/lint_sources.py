"""The trap scanner over a whole module: its own text and every file it imports, found the way
Slang finds them, so that a trap inside an imported function is refused at the caller's
``.bwds`` with the imported file's path and line (issue 15, classes 4 and 11).

    scan = scan_module(source, "main.slang", search_paths=["shaders"])
    scan.own, scan.imported      # Findings in main.slang / in the files it imports
    scan.traps["f"]              # the findings f's backward would reach

Followed: ``import a.b_c;`` (``a/b_c.slang``, then ``a/b-c.slang``), ``import "x.slang";``,
``__include`` (either form) and ``#include "x"`` (whose macros carry on into the includer),
looked up in the importing file's folder, then ``search_paths`` (the device's include paths,
pydiff's ``shaders/`` first). A name found nowhere is skipped: the Slang compiler would
have refused the module already. Each file's scan is kept per content hash.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from . import lint, lint_calls, lint_custom
from .lint import Finding
from .lint_macros import Defines, Macro, blank_comments_and_strings, preprocess

_IMPORT = re.compile(
    r"(?<![\w.])(?:import|__include)\s+"
    r'(?:"([^"\n]+)"|([A-Za-z_][\w.\-]*))\s*;'
)
_CACHE_SIZE = 256


@dataclass
class ModuleScan:
    """What ``scan_module`` found."""

    own: list[Finding] = field(default_factory=list)
    imported: list[Finding] = field(default_factory=list)
    #: function name -> the refusing findings its backward reaches (see lint.affected_functions)
    traps: dict[str, list[Finding]] = field(default_factory=dict)
    #: every file read besides the module's own, in the order found, and their texts
    #: (preprocessed)
    files: list[str] = field(default_factory=list)
    imported_texts: list[str] = field(default_factory=list)
    #: the module's own text, preprocessed (macros expanded, decidable #if branches dropped)
    own_text: str = ""


@dataclass(frozen=True)
class _FileScan:
    findings: tuple[Finding, ...]
    text: str  # preprocessed
    imports: tuple[str, ...]  # resolved paths of import / __include
    included: tuple[tuple[str, str, tuple], ...]  # (#include path, text, macros before it)


_cache: dict[tuple, _FileScan] = {}


def candidates(name: str, quoted: bool) -> list[str]:
    """File names an import names: ``a.b_c`` -> ``a/b_c.slang``, ``a/b-c.slang``."""
    if quoted:
        return [name]
    base = name.replace(".", "/")
    return list(dict.fromkeys([base + ".slang", base.replace("_", "-") + ".slang"]))


def resolve(name: str, quoted: bool, folder: str, search_paths: tuple[str, ...]) -> str | None:
    """The file an import or include of ``name`` in a file of ``folder`` reads, or None."""
    for d in (folder, *search_paths):
        for c in candidates(name, quoted):
            p = os.path.join(d, c)
            if os.path.isfile(p):
                return os.path.realpath(p)
    return None


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def _scan_file(
    source: str, file: str, folder: str, search_paths: tuple[str, ...], defines: Defines, own: bool
) -> _FileScan:
    digest = hashlib.sha256(source.encode()).hexdigest()
    key = (file, digest, folder, search_paths, tuple(sorted(defines.items())))
    hit = None if own else _cache.get(key)  # the module's own file: lint.scanned_source
    if hit is not None:
        return hit
    included: list[tuple[str, str, tuple]] = []
    active: set[str] = {os.path.realpath(file)}

    def include(name: str, macros: dict[str, Macro]) -> dict[str, Macro] | None:
        path = resolve(name, True, folder, search_paths)
        text = _read(path) if path else None
        if path is None or text is None or path in active:
            return None
        active.add(path)
        try:
            included.append((path, text, tuple(sorted(macros.items()))))
            return preprocess(text, macros, include).macros
        finally:
            active.discard(path)

    pre = preprocess(source, defines, include)
    findings = lint.scan_source(source, file, defines=defines, include=include)
    findings += lint_custom.scan_source(pre.text, file)  # splices joined, macros expanded
    imports = []
    for m in _IMPORT.finditer(pre.text):
        path = resolve(m.group(1) or m.group(2), bool(m.group(1)), folder, search_paths)
        if path is not None:
            imports.append(path)
    result = _FileScan(tuple(findings), pre.text, tuple(dict.fromkeys(imports)), tuple(included))
    if len(_cache) >= _CACHE_SIZE:
        _cache.clear()
    _cache[key] = result
    return result


def scan_module(
    source: str,
    file: str,
    search_paths: tuple[str, ...] | list[str] = (),
    defines: Defines | None = None,
) -> ModuleScan:
    """Scan ``source`` (the module ``file``; "<name>" for one compiled from a string, whose
    imports Slang looks up from the working folder) and every file it imports."""
    paths = tuple(str(p) for p in search_paths)
    defines = dict(defines or {})
    folder = os.getcwd() if file.startswith("<") else os.path.dirname(os.path.abspath(file))
    result = ModuleScan()
    seen = {os.path.realpath(file)}
    texts: list[str] = []
    every: list[tuple[str, str, bool]] = []  # (text, file, own) of each file read
    todo: list[tuple[str, str, str, Defines, bool]] = [(source, file, folder, defines, True)]
    while todo:
        text, name, where, macros, own = todo.pop(0)
        scan = _scan_file(text, name, where, paths, macros, own)
        (result.own if own else result.imported).extend(scan.findings)
        every.append((blank_comments_and_strings(scan.text), name, own))
        if not own:
            texts.append(scan.text)
            result.imported_texts.append(scan.text)
        else:
            result.own_text = scan.text
        for path, inc_text, inc_macros in scan.included:
            if path not in seen:
                seen.add(path)
                result.files.append(path)
                todo.append((inc_text, path, os.path.dirname(path), dict(inc_macros), False))
        for path in scan.imports:
            if path not in seen and (imported := _read(path)) is not None:
                seen.add(path)
                result.files.append(path)
                todo.append((imported, path, os.path.dirname(path), defines, False))
    writers: dict[str, list[lint_calls.Writer]] = {}  # helpers may live in any of the files
    for text, _, _ in every:
        for helper, found in lint_calls.non_differentiable_writers(text).items():
            writers.setdefault(helper, []).extend(found)
    for text, name, own in every:
        (result.own if own else result.imported).extend(lint_calls.scan_source(text, name, writers))
    texts_read = [text for text, _, _ in every]
    for kept in (result.own, result.imported):  # a backward-only function: where called
        kept[:] = [
            f for f in kept
            if f.kind not in (lint.BWD_ONLY_KIND, lint.FWD_NOT_REVERSE_KIND)
            or (f.kind == lint.FWD_NOT_REVERSE_KIND and kept is result.own)  # (its own hvp)
            or lint_custom.called_by_others(texts_read, f.function)  # (hvp: imports' too,
        ]  # fmt: skip  # op_silu's: its callers' hvp segfaulted; module.py warns of own ones)
    findings = result.own + result.imported
    result.traps = lint.affected_functions(source, findings, tuple(texts), defines)
    users = lint_custom.fwd_diff_users([(t, n) for t, n, _ in every], result.traps)
    if users:  # fwd_diff(f) written by hand, f's forward wrong: those functions' values too
        for f in users:
            (result.own if f.file == file else result.imported).append(f)
        findings = result.own + result.imported
        result.traps = lint.affected_functions(source, findings, tuple(texts), defines)
    return result
