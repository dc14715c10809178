"""Every exception and warning pydiff raises, in one place so users can catch them.

try:
    m = pydiff.load_module("broken.slang")
except pydiff.SlangCompileError as exc:
    print(exc.file, exc.line)
"""

from __future__ import annotations

import inspect
import typing
import os
import re
import warnings

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_warned: set = set()
_LOCATION = re.compile(r"-->\s*(?P<file>.+?):(?P<line>\d+):(?P<col>\d+)")


class PydiffError(Exception):
    """Base class of pydiff's own exceptions."""


class TensorTooLargeError(PydiffError, ValueError, MemoryError):
    """A tensor, gradient buffer or call larger than the device can hold or index; the
    message says how much was asked and the limit."""


class OpenFileLimitError(PydiffError, OSError):
    """A buffer could not be allocated because the process is at its open-file limit
    (``RLIMIT_NOFILE``; on lavapipe every device buffer holds a file descriptor). ``errno``
    is ``EMFILE``, as the operating system's own error; the message gives the count and the
    limit and what to do.

    >>> try: kept.append(pydiff.zeros(4))
    ... except pydiff.OpenFileLimitError: pydiff.empty_cache()
    """


class SlangCompileError(PydiffError):
    """A Slang module failed to compile; the message starts with ``file:line``."""

    def __init__(self, message: str, file: str | None = None, line: int | None = None):
        super().__init__(message)
        self.file = file
        self.line = line

    @classmethod
    def from_slang(
        cls,
        text: str,
        display_name: str,
        hashed: bool,
        what: str = "Slang compile error",
        alias: str = "",
    ) -> "SlangCompileError":
        """From Slang's diagnostics ``text``; ``hashed``: the module was compiled from a
        string, which SlangPy names by a 40-digit hash and prepends one line to (``alias``:
        the name pydiff compiled a reloaded file under, likewise)."""
        shifted = re.escape(alias) if alias else r"\b[0-9a-f]{40}" if hashed else ""
        if shifted:
            text = re.sub(
                shifted + r":(\d+)", lambda m: f"{display_name}:{int(m.group(1)) - 1}", text
            )
            text = re.sub(r"(?m)^(\d+)( \|)", lambda m: f"{int(m.group(1)) - 1}{m.group(2)}", text)
        if alias:
            text = text.replace(os.path.splitext(os.path.basename(alias))[0], display_name)
        m = _LOCATION.search(text)
        file, line = (m.group("file"), int(m.group("line"))) if m else (display_name, None)
        where = f"{file}:{line}" if line else file
        details = "\n".join(
            ln for ln in text.splitlines() if ln.strip() and "compilation ceased" not in ln
        )
        return cls(f"{where}: {what}\n{details}", file=file, line=line)


def kernel_compile_error(label: str, file: str, text: str) -> SlangCompileError:
    """A call's kernel failed to compile (Slang reports it only at dispatch, through
    slang-rhi, naming source modules by a hash): the user's file and line, and what to do
    for the known cases."""
    text = text[text.index("RHI messages") :].split("\n", 1)[-1]
    text = "\n".join(
        ln
        for ln in text.splitlines()
        if "file an issue on GitHub" not in ln and not re.search(r"/src/sgl/.* in function", ln)
    )
    if "unrolling failed" in text:
        text += (
            "\nHint: a [ForceUnroll] loop must have a trip count Slang can tell at compile "
            "time (for (int k = 0; k < 4; k++)); drop [ForceUnroll] or bound the loop."
        )
    elif "defaultConstruct" in text and "spirv-emit" in text:
        text += (
            "\nHint: Slang 0.43 cannot build the backward of a loop with [MaxIters(n)] above "
            "about 4094 that loads from a FwdDiffTensor (measured: 3000 builds, 4095 does "
            "not); split it into nested loops of at most 64 iterations each "
            "([MaxIters(64)] for (c ...) { [MaxIters(64)] for (j ...) { k = c * 64 + j; "
            "if (k < n) ... } }), see docs/traps.md."
        )
    elif "internal compiler error" in text:
        text += (
            "\nHint: Slang cannot build the derivative of the expression marked (a float '%' "
            "is one: write a - b * no_diff(trunc(a / b)) instead, see docs/traps.md)."
        )
    what = f"Slang could not compile the kernel of {label}"
    return SlangCompileError.from_slang(text, file, file.startswith("<"), what)


class StaleGradientError(PydiffError, RuntimeError):
    """A STRICT-policy backward would add into a gradient that already holds a result."""


class StaleInputError(PydiffError, ValueError, RuntimeError):
    """A backward would differentiate at values written after the call read them (an
    explicit ``.bwds`` or a tape's): a ``ValueError`` and a ``RuntimeError`` alike."""


class ShaderTrapError(PydiffError, RuntimeError):
    """A shader uses a pattern SlangPy 0.43 mis-differentiates or crashes on."""


class BuiltinNameError(PydiffError, TypeError):
    """A module function named as Slang built-ins (``lerp``), whose overloads SlangPy offers
    beside it and cannot tell apart from it: rename the function."""


class DeviceUnavailableError(PydiffError, RuntimeError):
    """No device of the requested type could be opened on this machine."""


class CaptureError(PydiffError, RuntimeError):
    """Something inside ``pydiff.capture`` cannot be recorded for replay."""


class DistributedError(PydiffError, RuntimeError):
    """A collective of ``pydiff.distributed`` failed: no process group, or a peer rank died or
    hung past the process group's timeout (the message names the rank and the collective)."""


class ConvergenceError(PydiffError, RuntimeError):
    """An iterative solve (``pydiff.fixed_point``'s forward or adjoint) did not converge in
    its ``max_iter`` iterations; the message says which solve and its last residual."""


class GradcheckError(PydiffError, AssertionError):
    """gradcheck found a gradient that disagrees with finite differences."""


class GradientOverflowError(PydiffError, OverflowError):
    """A fixed-point gradient's finite contribution or partial sum left its range, or a
    ``Function.backward`` returned finite values beyond the input dtype's range (inf and
    NaN are carried, as IEEE sums give them)."""


class EnvironmentSettingError(PydiffError, ValueError):
    """A ``PYDIFF_*`` environment variable holds a value pydiff does not take (the message
    names the variable and the values it takes).

    >>> os.environ["PYDIFF_FLOAT4_STORES"] = "off"; pydiff.create_device("vulkan")
    EnvironmentSettingError: PYDIFF_FLOAT4_STORES='off': expected one of auto, paired, float4
    """


class ShaderTrapWarning(UserWarning):
    """Raised at load time for shader patterns that will fail in ``.bwds``."""


class TapeReuseWarning(UserWarning):
    """A ``Tape`` that ran a backward and kept its recording (``retain_graph=True``, the
    default) records again: the old records and their tensors stay alive, and grow with
    every step of a loop that reuses it.

    >>> with tape: ...; tape.backward(loss)     # then, next step: with pydiff.Tape() as tape:
    >>> warnings.simplefilter("error", pydiff.TapeReuseWarning)   # make it an error in tests
    """


class CacheWarning(UserWarning):
    """pydiff's persistent compile cache cannot be used (the run goes on without it)."""


class NondeterminismWarning(UserWarning):
    """Deterministic mode is on, but a function's gradients may differ from run to run."""


class GradientFlowWarning(UserWarning):
    """A tensor that wants a gradient passes through something no gradient flows through
    (a ``no_diff`` parameter, a non-differentiable function): its gradient stays unchanged."""


#: The spellings an on/off switch takes (``env_flag``), as every pydiff switch reads them.
ENV_ON, ENV_OFF = ("1", "on", "true", "yes"), ("0", "off", "false", "no")


def env_choice(name: str, choices: tuple[str, ...]) -> str | None:
    """The environment variable ``name``, trimmed and lower-cased; None when unset or empty.
    Any value not in ``choices`` raises ``ValueError`` naming the variable and the choices
    (a typo must not silently fall back to the default it was meant to change).

        env_choice("PYDIFF_FLOAT4_STORES", ("auto", "paired", "float4"))   # 'paired', or None
    """
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value:
        return None
    if value not in choices:
        raise EnvironmentSettingError(
            f"{name}={raw!r}: expected one of {', '.join(choices)} (or unset)"
        )
    return value


def env_flag(name: str, default: bool) -> bool:
    """An on/off switch: ``default`` when unset or empty, else one of ``ENV_ON`` or
    ``ENV_OFF`` (any case); anything else raises ``ValueError`` naming the variable.

        DEFER = env_flag("PYDIFF_DEFER", True)
    """
    value = env_choice(name, ENV_ON + ENV_OFF)
    return default if value is None else value in ENV_ON


def env_int(name: str, default: int, minimum: int = 0) -> int:
    """A whole-number setting (``default`` when unset or empty); anything else, or a number
    below ``minimum``, raises ``ValueError`` naming the variable.

        MIN_ELEMENTS = env_int("PYDIFF_GENERATED_MIN_ELEMENTS", 4096)
    """
    raw = os.environ.get(name, "")
    value = raw.strip().replace("_", "")
    if not value:
        return default
    if not value.isdigit() or int(value) < minimum:
        raise EnvironmentSettingError(
            f"{name}={raw!r}: expected a whole number >= {minimum} (or unset)"
        )
    return int(value)


def warn_once(message: str, category: type[Warning] = GradientFlowWarning) -> None:
    """Warn once per message and call site: the first frame outside pydiff, so a loop that
    repeats one call warns once, and each line of user code that does it is named.

        warn_once("f: parameter 'k' is no_diff; its gradient stays unchanged")
    """
    frame = inspect.currentframe()
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame = frame.f_back
    filename, lineno = (frame.f_code.co_filename, frame.f_lineno) if frame else ("pydiff", 0)
    key = (message, category, filename, lineno)
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn_explicit(message, category, filename, lineno)


class OpDtypeError(TypeError, ValueError):
    """A tensor of a dtype an op does not take: a TypeError, and a ValueError as pydiff.ops
    raised for it before.

    >>> ops.exp(pydiff.tensor(np.ones(3, np.float16)))   # OpDtypeError: exp: x has dtype half

    ``op``, ``argument`` and ``dtype`` name the op, its argument and the dtype refused.
    """

    def __init__(
        self, message: str, op: str | None = None, argument: str | None = None, dtype: str = ""
    ) -> None:
        super().__init__(message)
        self.op, self.argument, self.dtype = op, argument, dtype


_GRID_CONVERSION = re.compile(r"conversion from GridArg<(\d+)> to ([^\n.]+?)\.?\n")


_NUMPY_SHAPE = re.compile(r"numpy array shape dim \d+ does not match the expected shape \(-1 ")


def grid_call_error(label: str, params: list, text: str) -> Exception | None:
    """SlangPy's reports on calls over a grid as errors that name the parameter and say what
    to do: a ``spy.grid`` whose dimensions its index parameter cannot take (a grid of three
    at an ``int2``), a NumPy array at a tensor parameter (SlangPy reads its shape as -1 where
    another argument gives the call's shape, and refuses it); None for other errors.

    >>> grid_call_error("m.f", fn.signature.params, str(exc))  # ValueError: ... 'px' (int2)
    """
    if _NUMPY_SHAPE.search(text):
        tensors = [f"'{p.name}'" for p in params if p.tensor_kind is not None]
        return TypeError(
            f"{label}: SlangPy 0.43 cannot bind a NumPy array given for a tensor parameter "
            f"(of {', '.join(tensors)}) in this call: it takes the array's shape for -1 (the "
            "call's shape comes from another argument, such as a spy.grid). Pass a tensor "
            "instead: pydiff.tensor(array)"
        )
    found = _GRID_CONVERSION.search(text + "\n")
    if found is None:
        return None
    dims, target = found.group(1), found.group(2).strip()
    names = [p.name for p in params if p.type_name.replace(" ", "") == target.replace(" ", "")]
    which = f"parameter '{names[0]}' ({target})" if len(names) == 1 else f"a {target} parameter"
    return ValueError(
        f"{label}: a spy.grid of {dims} dimension(s) was passed to {which}, which it cannot "
        "fill: give the grid as many dimensions as the index has components (int: one, "
        "int2: spy.grid((H, W)), int3: three), or declare the index of the grid's dimensions"
    )


_SHAPE_MISMATCH = re.compile(
    r"Shape mismatch for (\S+) between value \(([^)]*)\) and call \(([^)]*)\)"
)


def shape_mismatch_error(label: str, text: str) -> Exception | None:
    """SlangPy's "Shape mismatch for x between value (3) and call (4)" (followed by its table
    of every argument) as one sentence naming the argument, both shapes and what to do; None
    for other errors.

    >>> shape_mismatch_error("m.f", str(exc))   # ValueError: m.f: parameter 'y' does not ...
    """
    found = _SHAPE_MISMATCH.search(text)
    if found is None:
        return None
    name, value, call = found.groups()
    sizes = f"one of its axes has size {value} where the call's has {call}"
    if name == "_result":
        return ValueError(
            f"{label}: _result does not fit the call's shape ({sizes}): pass a _result of the "
            "shape the arguments broadcast to (followed by the result type's element axes, "
            "if any), or none"
        )
    return ValueError(
        f"{label}: parameter '{name}' does not broadcast with the other arguments ({sizes}; "
        "from the last axis, each size must equal the call's or be 1). Pass arguments whose "
        "shapes broadcast to one call shape"
    )


def known_call_error(label: str, params: list, text: str) -> Exception | None:
    """The SlangPy call errors pydiff words itself (``grid_call_error``,
    ``shape_mismatch_error``); None for others.

    >>> known_call_error("m.f", fn.signature.params, str(exc))   # ValueError or None
    """
    return grid_call_error(label, params, text) or shape_mismatch_error(label, text)


#: The names a forward call's ``_result`` takes (SlangPy's ``return_type``).
RESULT_NAMES = ("tensor", "numpy", "texture")


def check_result_value(label: str, result: object) -> str | None:
    """The name a string ``_result`` gives (``check_result_name``), None for any other value
    a call may take; a ``TypeError`` naming ``_result`` for values SlangPy cannot write into
    and reported only as its own internal errors (a list, tuple, dict, bytes, complex, bool,
    a class other than NumPy's and SlangPy's: ``_result=pydiff.Tensor``).

        check_result_value("m.f", [0.0, 0.0])   # TypeError: ... _result=[0.0, 0.0] (list)
    """
    if type(result) is str:
        return check_result_name(label, result)
    refused = (list, tuple, dict, set, bytes, bytearray, complex, bool)
    bad = isinstance(result, refused)
    if isinstance(result, type):  # (np.ndarray, spy.Tensor: SlangPy's return types)
        bad = result.__module__.split(".")[0] not in ("numpy", "slangpy")
    if bad:
        shown = repr(result) if len(repr(result)) <= 40 else repr(result)[:37] + "..."
        raise TypeError(
            f"{label}: _result={shown} ({type(result).__name__}) is nothing a call writes "
            "into: pass _result='tensor' (a new pydiff tensor), 'numpy' (an array), or a "
            "pydiff tensor or C-contiguous NumPy array of the call's shape"
        )
    return None


def check_result_name(label: str, result: str) -> str:
    """``result`` if it is a name ``_result`` takes, else a ``ValueError`` naming ``_result``
    and the closest name (SlangPy's own said only "Unknown return type").

        check_result_name("m.f", "tensr")   # ValueError: ... did you mean 'tensor'?
    """
    if result in RESULT_NAMES:
        return result
    import difflib

    close = difflib.get_close_matches(result.lower(), RESULT_NAMES, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"{label}: _result={result!r} is not a result kind: use _result='tensor' (a new "
        f"pydiff tensor), 'numpy' (an array), or a tensor to write into{hint}"
    )


def taken_wrapper_name(module: "typing.Any", name: str, label: str) -> str:
    """``name``, a generated wrapper's (``f__pydiff_dir``), unless the user's ``module``
    defines it already: a ValueError then (the wrapper, which imports the module, made an
    ambiguous overload, and SlangPy's error listed two identical signatures; s48)."""
    if module.native.layout.find_function_by_name(name) is not None:
        raise ValueError(
            f"{module.file} defines {name}, the name pydiff gives its generated wrapper of "
            f"{label}: rename it (names holding '__pydiff_' are pydiff's)"
        )
    return name
