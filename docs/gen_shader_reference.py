"""The shader library reference (docs/shader-library.md), generated from shaders/*.slang.

A MkDocs hook (mkdocs.yml: ``hooks``): when the site is built, the marker line
``<!-- shader-reference -->`` in docs/shader-library.md is replaced by, for every Slang file
under shaders/ (the parts of ``pydiff.slang`` in include order, then the rest), its header
comment (the math) and the signature of every ``public`` function, type and member, and of
every compute entry point. So the page cannot fall behind the shaders;
tests/test_docs.py checks that every public name found by an independent scan is on it.

``python docs/gen_shader_reference.py`` prints the generated part.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHADERS = ROOT / "shaders"
MARKER = "<!-- shader-reference -->"
PAGE = "shader-library.md"


@dataclass
class Decl:
    kind: str  # "function", "method", "struct", "interface", "enum", "field", "entry point"
    name: str
    signature: str  # without attributes
    attrs: list[str] = field(default_factory=list)
    members: list["Decl"] = field(default_factory=list)


@dataclass
class ShaderFile:
    path: Path  # relative to shaders/
    header: str
    decls: list[Decl]
    includes: list[str]


def _strip_comments(src: str) -> str:
    """Comments replaced by spaces (newlines kept); string literals left alone."""
    out, i, n = [], 0, len(src)
    while i < n:
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif src.startswith("/*", i):
            j = src.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", src[i:j]))
            i = j
        elif src[i] == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            out.append(src[i : j + 1])
            i = j + 1
        else:
            out.append(src[i])
            i += 1
    return "".join(out)


def _header(src: str) -> str:
    """The leading block of // comment lines, without the slashes."""
    lines = []
    for line in src.splitlines():
        s = line.strip()
        if not s.startswith("//"):
            break
        lines.append(s[3:] if s.startswith("// ") else s[2:])
    return "\n".join(lines).rstrip()


def _statements(code: str) -> list[tuple[str, str | None]]:
    """Split code at brace depth 0 into (head, body) pairs: `head;` gives body None,
    `head { body }` gives the body text."""
    out, i, start, n = [], 0, 0, len(code)
    paren = 0
    while i < n:
        c = code[i]
        if c in "([":
            paren += 1
        elif c in ")]":
            paren -= 1
        elif c == ";" and paren == 0:
            out.append((code[start:i], None))
            start = i + 1
        elif c == "{" and paren == 0:
            depth, j = 1, i + 1
            while j < n and depth:
                depth += {"{": 1, "}": -1}.get(code[j], 0)
                j += 1
            out.append((code[start:i], code[i + 1 : j - 1]))
            k = j
            while k < n and code[k].isspace():
                k += 1
            start = i = (k + 1) if k < n and code[k] == ";" else j  # `struct S { };`
            continue
        i += 1
    tail = code[start:].strip()
    if tail:
        out.append((tail, None))
    return [(" ".join(h.split()), b) for h, b in out if h.strip()]


def _split_attributes(head: str) -> tuple[list[str], str]:
    """Leading [Attr(...)] groups and the rest."""
    attrs = []
    while head.startswith("["):
        depth = 0
        for j, c in enumerate(head):
            depth += {"[": 1, "]": -1}.get(c, 0)
            if depth == 0:
                break
        attrs.append(head[: j + 1])
        head = head[j + 1 :].lstrip()
    return attrs, head


def function_name(decl: str) -> str | None:
    """The name of a function declared by `decl` (text before its body), or None."""
    angle = 0
    for i, c in enumerate(decl):
        if c == "<":
            angle += 1
        elif c == ">":
            angle -= 1
        elif c == "(" and angle == 0:
            j = i - 1
            while j >= 0 and decl[j].isspace():
                j -= 1
            if j >= 0 and decl[j] == ">":  # generic parameters: skip back to their '<'
                depth = 0
                while j >= 0:
                    depth += {">": 1, "<": -1}.get(decl[j], 0)
                    if depth == 0:
                        break
                    j -= 1
                j -= 1
                while j >= 0 and decl[j].isspace():
                    j -= 1
            m = re.search(r"(\w+)$", decl[: j + 1])
            return m.group(1) if m else None
    return None


def _decl(head: str, body: str | None, member: bool = False) -> Decl | None:
    attrs, rest = _split_attributes(head)
    entry = any(re.match(r"\[\s*shader\s*\(", a) for a in attrs)
    if not (rest.startswith("public ") or entry):
        return None
    m = re.match(r"public\s+(struct|interface|enum)\s+(\w+)", rest)
    if m:
        d = Decl(m.group(1), m.group(2), rest, attrs)
        for mh, mb in _statements(_strip_comments(body or "")):
            md = _decl(mh, mb, member=True)
            if md:
                d.members.append(md)
        return d
    name = function_name(rest)
    if name:
        return Decl(
            "entry point" if entry else ("method" if member else "function"), name, rest, attrs
        )
    m = re.search(r"(\w+)\s*(\[[^\]]*\])?\s*(=.*)?$", rest)
    return Decl("field", m.group(1), rest, attrs) if m else None


WIDTH = 92


def _wrap(signature: str, indent: str) -> list[str]:
    """One parameter per line when the signature is wider than WIDTH."""
    if len(indent + signature) <= WIDTH:
        return [indent + signature]
    open_at = signature.index("(", len(signature.split("(")[0]))
    params, depth, cur = [], 0, ""
    for c in signature[open_at + 1 : signature.rindex(")")]:
        depth += {"(": 1, "<": 1, "[": 1, ")": -1, ">": -1, "]": -1}.get(c, 0)
        if c == "," and depth == 0:
            params.append(cur.strip())
            cur = ""
        else:
            cur += c
    params.append(cur.strip())
    lines = [indent + signature[: open_at + 1]]
    lines += [f"{indent}    {p}," for p in params]
    lines[-1] = lines[-1][:-1] + signature[signature.rindex(")") :]
    return lines


def format_decl(d: Decl, indent: str = "") -> list[str]:
    """The declaration as Slang lines: attributes, then the wrapped signature, then `;`."""
    one_line = " ".join(d.attrs + [d.signature])
    if len(indent + one_line) <= WIDTH:
        return [indent + one_line + ";"]
    lines = [indent + " ".join(d.attrs)] if d.attrs else []
    lines += _wrap(d.signature, indent)
    lines[-1] += ";"
    return lines


def parse(path: Path) -> ShaderFile:
    src = path.read_text()
    code = re.sub(r"(?m)^[ \t]*#.*$", "", _strip_comments(src))  # preprocessor lines
    decls, includes = [], []
    for head, body in _statements(code):
        if head.startswith("__include"):
            includes.append(head.split(None, 1)[1].strip().strip('"'))
            continue
        d = _decl(head, body)
        if d:
            decls.append(d)
    return ShaderFile(path.relative_to(SHADERS), _header(src), decls, includes)


def shader_files() -> list[ShaderFile]:
    """pydiff.slang, its parts in include order, then every other .slang under shaders/."""
    main = parse(SHADERS / "pydiff.slang")
    order = [main] + [parse(SHADERS / inc) for inc in main.includes if (SHADERS / inc).exists()]
    seen = {f.path.as_posix() for f in order}
    for p in sorted(SHADERS.rglob("*.slang")):
        if p.relative_to(SHADERS).as_posix() not in seen:
            order.append(parse(p))
    return order


def _anchor(rel: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", rel.lower()).strip("-")


def render() -> str:
    files = shader_files()
    main, parts = files[0], files[1:]
    included = set(main.includes)
    out = [
        "## `pydiff.slang` {#pydiff-slang}",
        "",
        "```text",
        main.header,
        "```",
        "",
        "Parts, in include order: "
        + ", ".join(
            f"[`{f.path.as_posix()}`](#{_anchor(f.path.as_posix())})"
            for f in parts
            if f.path.as_posix() in included
        )
        + ".",
        "",
    ]
    index: list[tuple[str, str, str]] = []
    for f in parts:
        rel = f.path.as_posix()
        out += [f"## `{rel}` {{#{_anchor(rel)}}}", ""]
        if rel not in included:
            out += [
                "*Not part of `import pydiff;`: loaded by pydiff on its own "
                "(compute entry points dispatched directly).*",
                "",
            ]
        if f.header:
            out += ["```text", f.header, "```", ""]
        if not f.decls:
            out += ["No public declarations.", ""]
            continue
        out += ["```slang"]
        for d in f.decls:
            index.append((d.name, d.kind, rel))
            if d.kind in ("struct", "interface", "enum"):
                out += [" ".join(d.attrs + [d.signature]), "{"]
                for m in d.members:
                    out += format_decl(m, "    ")
                out.append("}")
            else:
                out += format_decl(d)
            out.append("")
        out[-1] = "```"
        out.append("")
    out += ["## Index", "", "| name | kind | file |", "|---|---|---|"]
    for name, kind, rel in sorted(index, key=lambda t: (t[0].lower(), t[2])):
        out.append(f"| `{name}` | {kind} | [`{rel}`](#{_anchor(rel)}) |")
    out.append("")
    return "\n".join(out)


# -- MkDocs hook ----------------------------------------------------------------------------


def on_config(config):
    # `mkdocs serve` rebuilds when a shader changes.
    watch = config.get("watch")
    if watch is not None and str(SHADERS) not in map(str, watch):
        watch.append(str(SHADERS))
    return config


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE}: the marker {MARKER} is missing")
    return markdown.replace(MARKER, render())


if __name__ == "__main__":
    print(render())
