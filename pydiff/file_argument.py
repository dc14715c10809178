"""A file named on the command line or to ``check_module``: an existing file, relative to
the working directory, never a name looked up on the shader search path (``pydiff check
ops/softmax.slang`` in a folder without it would check pydiff's own copy).

    file = existing_file(args.file, "pydiff check")   # FileNotFoundError / IsADirectoryError
"""

from __future__ import annotations

from pathlib import Path


def existing_file(path: str | Path, where: str) -> Path:
    """``path`` as given when it names an existing file (relative to the working directory);
    otherwise FileNotFoundError ("no such file") or IsADirectoryError, naming ``where``.

    >>> existing_file("pyproject.toml", "pydiff check")
    PosixPath('pyproject.toml')
    """
    p = Path(path)
    if p.is_dir():
        raise IsADirectoryError(
            f"{where}: {str(path)!r} is a directory; give a .slang file (one file per run)"
        )
    if not p.is_file():
        shown = p if p.is_absolute() else Path.cwd() / p
        raise FileNotFoundError(
            f"{where}: no such file: {str(path)!r} (not found at {shown}; the file is read "
            "relative to the working directory, not looked up on the shader search path)"
        )
    return p
