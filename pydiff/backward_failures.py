"""``.bwds`` of a function Slang cannot differentiate backward (``[ForwardDifferentiable]``
only): refused with the same clear ``TypeError`` every time.

SlangPy 0.43 reflects such a function as differentiable, so its ``.bwds`` reaches Slang's
compiler, which refuses the backward kernel (E41022, "call to non-backward-differentiable
function"); SlangPy then crashes the process (segfault) when the same call is made again.
The first failure becomes a ``TypeError`` saying what to do, kept per function on its
device, and every later ``.bwds`` of the function raises it before SlangPy is called.

    backward_failures.check(fn)                # raises the kept TypeError, if any
    raise backward_failures.kept(fn, exc)      # the TypeError (kept), or exc itself
"""

from __future__ import annotations

from typing import Any

_NOT_BACKWARD = "non-backward-differentiable function"


def _kept(fn: Any) -> dict:
    return fn.module.device.cached("pydiff.backward_failures", dict)


def check(fn: Any) -> None:
    """Raise the ``TypeError`` an earlier ``.bwds`` of ``fn`` kept, if any.

    >>> backward_failures.check(m.shade)       # nothing: shade's .bwds compiled
    """
    refused = _kept(fn).get((fn.module.import_spec, fn.name))
    if refused is not None:
        raise TypeError(str(refused))


def kept(fn: Any, exc: Exception) -> Exception:
    """``exc`` from SlangPy's ``.bwds`` of ``fn``: a ``TypeError`` naming the function when
    Slang found it has no backward derivative (kept for ``check``), else ``exc`` itself.

    >>> raise backward_failures.kept(m.fo, exc)   # fo is [ForwardDifferentiable] only
    """
    text = str(exc)
    if "E41022" not in text or _NOT_BACKWARD not in text:
        return exc
    refused = TypeError(
        f"{fn.label}.bwds: Slang cannot differentiate {fn.name} backward (it is "
        f"[ForwardDifferentiable] only, or calls such a function): mark it [Differentiable] "
        f"in {fn.module.file} to call .bwds, or use forward mode (.fwds)"
    )
    _kept(fn)[(fn.module.import_spec, fn.name)] = refused
    return refused
