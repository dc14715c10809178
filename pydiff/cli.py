"""The ``pydiff`` command line.

    pydiff check shaders/my_module.slang [--function f ...] [--device vulkan] [--seed 0] [--json]
    pydiff info [--json]
    pydiff cache [info | clear]

Exit status of ``check``: 0 when every check passes (or nothing could be checked), 1 when
any fails or a function could not be run, 2 when the file cannot be read or compiled or the
arguments are wrong.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Callable, Sequence

from .errors import DeviceUnavailableError, EnvironmentSettingError, SlangCompileError


def _number(low: float, *, above: bool = False, whole: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number >= low (> low with ``above``), so a bad step or
    tolerance stops the command (exit 2) instead of making every check pass."""

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
        return value

    return parse


def _check(args: argparse.Namespace) -> int:
    from .modcheck import check_module, format_table

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
            print(
                json.dumps(
                    {"file": args.file, "passed": False, "error": str(exc), "results": []}, indent=2
                )
            )
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pydiff", description="pydiff: differentiable Slang shaders from Python"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "check",
        help="check every [Differentiable] function of a .slang file against finite differences",
    )
    check.add_argument("file", help="the .slang file")
    check.add_argument(
        "--function",
        action="extend",
        nargs="+",
        metavar="NAME",
        help="check only these functions (--function a b, or repeated)",
    )
    check.add_argument("--device", default="auto", help="vulkan, cuda, d3d12 or auto (default)")
    check.add_argument(
        "--seed", type=_number(0, whole=True), default=0, help="random seed of the sample points"
    )
    check.add_argument(
        "--points",
        type=_number(1, whole=True),
        default=16,
        help="sample points per function (default 16)",
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
        "info", help="versions, devices that open here, features, shader search path"
    )
    info.add_argument("--json", action="store_true")
    info.set_defaults(run=_info)
    cache = sub.add_parser(
        "cache", help="the persistent compile cache: where and how big, or clear it"
    )
    cache.add_argument("action", choices=["info", "clear"], nargs="?", default="info")
    cache.set_defaults(run=_cache)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except EnvironmentSettingError as exc:  # a mistyped PYDIFF_* switch: say which, no traceback
        print(f"pydiff {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
