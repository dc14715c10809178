"""The ``pydiff`` command line.

    pydiff check shaders/my_module.slang [--function f ...] [--device vulkan] [--seed 0] [--json]
    pydiff info [--json]
    pydiff cache [info | clear]

Exit status of ``check``: 0 when every check passes (or nothing could be checked), 1 when
any fails or a function could not be run, 2 when the file cannot be read or compiled or the
arguments are wrong. With ``--json`` every outcome prints one JSON object on stdout, usage
errors too (``{"passed": false, "error": ...}``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from typing import Any, Callable, NoReturn, Sequence

from .device_names import TYPES, normalise_type
from .errors import DeviceUnavailableError, EnvironmentSettingError, SlangCompileError
from .file_argument import existing_file
from .modcheck import MAX_POINTS


def _number(
    low: float, *, above: bool = False, whole: bool = False, high: float = math.inf
) -> Callable[[str], float]:
    """An argparse type: a finite number >= low (> low with ``above``) and <= high, so a bad
    step or tolerance stops the command (exit 2) instead of making every check pass, and a
    huge ``--points`` stops it before the arrays are allocated."""

    def parse(text: str) -> float:
        try:
            value = int(text) if whole else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a {'whole ' if whole else ''}number"
            ) from None
        if not math.isfinite(value) or value < low or (above and value == low):
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected a {'whole' if whole else 'finite'} number "
                f"{'>' if above else '>='} {low:g}"
            )
        if value > high:
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected a {'whole' if whole else 'finite'} number <= {high:g}"
            )
        return value

    return parse


def _device_type(text: str) -> str:
    """An argparse type: a device type pydiff knows (``cpu`` passes, refused when it opens,
    saying why), so a misspelt ``--device`` is a usage error naming the flag."""
    try:
        return normalise_type(text)
    except DeviceUnavailableError:
        return text
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: unknown device type; expected one of {', '.join(('auto', *TYPES))}"
        ) from None


def _check(args: argparse.Namespace) -> int:
    from .modcheck import check_module, format_table

    try:  # a path to a file, read first: never a name found on the shader search path
        existing_file(args.file, "pydiff check")
    except OSError as exc:
        print(exc, file=sys.stderr)
        if args.json:
            print(json.dumps(_check_error(str(exc), args.file), indent=2))
        return 2
    progress = None
    if not args.json and sys.stderr.isatty():

        def progress(name: str) -> None:
            print(f"checking {name} ...", file=sys.stderr)

    try:
        results = check_module(
            args.file,
            functions=args.function or None,
            device=args.device,
            seed=args.seed,
            points=args.points,
            eps=args.eps,
            atol=args.atol,
            rtol=args.rtol,
            progress=progress,
        )
    except (FileNotFoundError, SlangCompileError, ValueError, DeviceUnavailableError) as exc:
        print(f"pydiff check: {exc}", file=sys.stderr)
        if args.json:
            print(json.dumps(_check_error(str(exc), args.file), indent=2))
        return 2
    failed = [r for r in results if r.status in ("FAIL", "ERROR")]
    if args.json:
        print(
            json.dumps(
                {
                    "file": args.file,
                    "passed": not failed,
                    "results": [r.as_dict() for r in results],
                },
                indent=2,
                allow_nan=False,  # strict JSON: rows write non-finite errors as strings
            )
        )
    elif not results:
        print(f"{args.file}: no [Differentiable] functions: nothing to check")
    else:
        print(format_table(results))
        counts = {
            s: sum(r.status == s for r in results) for s in ("PASS", "FAIL", "SKIPPED", "ERROR")
        }
        errors = f", {counts['ERROR']} could not run" if counts["ERROR"] else ""
        print(
            f"\n{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIPPED']} "
            f"skipped{errors}"
        )
    return 1 if failed else 0


def _info(args: argparse.Namespace) -> int:
    from .generated import settings
    from .info import collect, format_info

    data = collect()
    data["generated_kernels"] = settings()
    print(json.dumps(data, indent=2) if args.json else format_info(data))
    return 0


def _cache(args: argparse.Namespace) -> int:
    from . import compile_cache
    from .info import format_cache

    compile_cache.max_bytes()  # a bad PYDIFF_CACHE_MAX_MB stops `clear` too, before it removes
    if args.action == "clear":
        removed = compile_cache.clear()
        where = compile_cache.root()
        print(f"pydiff cache: removed {removed / (1 << 20):.1f} MB from {where}")
    else:
        print(format_cache(compile_cache.usage()))
    return 0


def _check_error(message: str, file: str | None = None) -> dict[str, Any]:
    """What ``check --json`` prints when nothing could be checked (exit 2)."""
    return {"file": file, "passed": False, "error": message, "results": []}


def _json_usage_reply(argv: Sequence[str]) -> Callable[[str], dict[str, Any]] | None:
    """The JSON object a usage error prints on stdout when ``--json`` (or an abbreviation
    argparse takes, ``--js``) is among the options; None without it. ``check``'s has the
    shape of its other errors, with ``file`` null: the arguments were not understood."""
    options = list(itertools.takewhile(lambda a: a != "--", argv))
    if not any(a.startswith("--j") and "--json".startswith(a) for a in options):
        return None
    command = next((a for a in options if not a.startswith("-")), None)
    return _check_error if command == "check" else lambda message: {"error": message}


class _Parser(argparse.ArgumentParser):
    """argparse's parser, plus, on a usage error with ``--json`` given, the error as a JSON
    object on stdout: a script reading the JSON gets something to parse, not nothing."""

    def __init__(self, *args: Any, json_reply: Callable[[str], dict] | None = None, **kw: Any):
        super().__init__(*args, **kw)
        self.json_reply = json_reply

    def error(self, message: str) -> NoReturn:
        if self.json_reply is not None:
            print(json.dumps(self.json_reply(message), indent=2), flush=True)
        super().error(message)  # usage and message on stderr, exit status 2


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    reply = _json_usage_reply(argv)
    parser = _Parser(
        prog="pydiff",
        description="pydiff: differentiable Slang shaders from Python",
        json_reply=reply,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "check",
        help="check every [Differentiable] function of a .slang file against finite differences",
        json_reply=reply,
    )
    check.add_argument("file", help="the .slang file")
    check.add_argument(
        "--function",
        action="extend",
        nargs="+",
        metavar="NAME",
        help="check only these functions (--function a b, or repeated)",
    )
    check.add_argument(
        "--device",
        type=_device_type,
        default="auto",
        help="vulkan, cuda, d3d12, metal or auto (default)",
    )
    check.add_argument(
        "--seed", type=_number(0, whole=True), default=0, help="random seed of the sample points"
    )
    check.add_argument(
        "--points",
        type=_number(1, whole=True, high=MAX_POINTS),
        default=16,
        help=f"sample points per function (default 16, at most {MAX_POINTS})",
    )
    check.add_argument(
        "--eps",
        type=_number(0, above=True),
        default=1e-3,
        help="finite-difference step (default 1e-3)",
    )
    check.add_argument("--atol", type=_number(0), default=1e-3)
    check.add_argument("--rtol", type=_number(0), default=1e-2)
    check.add_argument("--json", action="store_true", help="print the results as JSON")
    check.set_defaults(run=_check)
    info = sub.add_parser(
        "info",
        help="versions, devices that open here, features, shader search path",
        json_reply=reply,
    )
    info.add_argument("--json", action="store_true")
    info.set_defaults(run=_info)
    cache = sub.add_parser(
        "cache",
        help="the persistent compile cache: where and how big, or clear it",
        json_reply=reply,
    )
    cache.add_argument("action", choices=["info", "clear"], nargs="?", default="info")
    cache.set_defaults(run=_cache)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except EnvironmentSettingError as exc:  # a mistyped PYDIFF_* switch: say which, no traceback
        print(f"pydiff {args.command}: {exc}", file=sys.stderr)
        if getattr(args, "json", False):  # (check reports its own, with its file)
            print(json.dumps({"error": str(exc)}, indent=2))
        return 2


if __name__ == "__main__":
    sys.exit(main())
