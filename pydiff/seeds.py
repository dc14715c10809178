"""Gradient seeds and directions given from the host: ``tape.backward``'s ``grad=``, a
``jvp`` tangent, a ``vjp`` cotangent, an ``hvp`` direction. They are float values of the
tensor they seed; NumPy would take booleans as 0/1, fail on text with a message naming
nothing, and turn a finite value beyond the float type into inf with only a warning (so
every gradient after it inf). Each is refused here, naming the argument:

    seed_values(np.ones(3), "tape.backward: grad")        # float64 array([1., 1., 1.])
    seed_values(1e39, "tape.backward: grad")              # ValueError: ... beyond the largest
    seed_values([True, False], "jvp: tangents[0]")        # TypeError: ... booleans
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import slangpy as spy

from . import capturing, foreign
from .errors import CaptureError
from .exact_ints import refuse_rounded_ints, refuse_rounded_list

#: The NumPy type whose range a seed of each tensor element type must fit.
_LIMITS = {"float": np.float32, "half": np.float16, "double": np.float64}


def seed_values(value: Any, what: str, scalar_type: str = "float") -> np.ndarray:
    """``value`` (a NumPy array, list or number; tensors read to NumPy first) as float64
    values that a tensor of ``scalar_type`` holds unchanged in range: TypeError naming
    ``what`` for booleans, text, complex numbers or other non-numbers, ValueError for a finite
    value beyond the type's largest (it would become inf there).

    >>> seed_values(np.array([1e39, 1.0]), "vjp: cotangents")   # ValueError: vjp: cotangents
    """
    arr = foreign.as_array(value, what) if not isinstance(value, np.ndarray) else value
    kind = arr.dtype.kind
    if kind == "b":
        raise TypeError(
            f"{what}: got booleans (dtype bool); a gradient seed or direction holds float "
            "values: pass numbers (e.g. np.asarray(v, dtype=float))"
        )
    if kind == "O" and not any(v is None for v in arr.flat):  # Decimals, huge Python ints
        try:
            arr = np.asarray(value, dtype=np.float64)
        except OverflowError:
            raise ValueError(
                f"{what}: {_short(value)} is beyond the largest {scalar_type} and would become "
                "inf: scale it down"
            ) from None
        except (TypeError, ValueError):
            pass
    if arr.dtype.kind not in "fiu":
        name = "complex numbers" if arr.dtype.kind == "c" else f"values of dtype {arr.dtype}"
        raise TypeError(
            f"{what}: got {name} ({_short(value)}); a gradient seed or direction holds float "
            "values: pass a number or a NumPy array of numbers"
        )
    exact = _LIMITS.get(scalar_type, np.float32)  # (ints it would round: refused, s48)
    refuse_rounded_list(value, arr, exact, what)
    if arr.dtype.kind in "iu":
        refuse_rounded_ints(arr, exact, what)
    with np.errstate(invalid="ignore"):  # a signalling NaN comes out quiet: no warning
        wide = np.asarray(arr, dtype=np.float64)
    top = float(np.finfo(_LIMITS.get(scalar_type, np.float32)).max)
    beyond = np.isfinite(wide) & (np.abs(wide) > top)
    if beyond.any():
        raise ValueError(
            f"{what}: {wide[beyond].flat[0].item()!r} is beyond the largest {scalar_type} "
            f"({top:.8g}) and would become inf, and so would every derivative it carries: "
            "scale it down (and what you read back up by the same factor)"
        )
    return wide


def host_seed(value: Any, what: str, scalar_type: str = "float") -> np.ndarray:
    """``seed_values``, with a NumPy array of the tensor's own type (float32 for a ``float``
    output) taken as it is: each of its values fits, and its conversion to float64 and back
    cost a tape step at 2^22 elements ~40 ms of CPU against its kernels' ~10 ms.

    >>> host_seed(np.ones(4, np.float32), "tape.backward: grad").dtype   # float32
    """
    exact = _LIMITS.get(scalar_type)
    if type(value) is np.ndarray and exact is not None and value.dtype == exact:
        return value
    return seed_values(value, what, scalar_type)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def tensor_seed(t: Any) -> np.ndarray:
    """The values of ``t`` (a pydiff.Tensor given as ``tape.backward``'s ``grad=``), read on
    the host. In a capture they are uploaded as recorded, so a replay seeds them again: it
    refuses once ``t`` holds other values (it would seed the capture's, silently), and a
    ``t`` the step itself wrote is refused now: a replay would seed the values it held at
    the capture, not those the replay computes (``grad=y``, a kernel's result, ``h.grad``)."""
    values = t.numpy()
    if (rec := capturing.recording()) is not None:
        if rec.wrote(t.storage):
            raise CaptureError(
                "pydiff.capture: tape.backward: grad is a tensor the captured step wrote "
                "(a result of its calls, or a gradient): a replay would seed the values it "
                "held at the capture, not those the replay computes. Make the seed part of "
                "the loss (backward from sum(y * g)), or compute it before the step"
            )
        ref, kept = weakref.ref(t), values.tobytes()

        def still_same() -> str | None:
            now = ref()
            if now is None or now.numpy().tobytes() == kept:
                return None
            return "tape.backward's grad tensor holds other values than at the capture"

        advice = "A replay seeds the values it held then: pass an array, or capture again."
        capturing.check_on_replay("tape.backward: grad", still_same, advice)
    return values


#: Per device, a buffer holding float 1.0 (four of them: a float4): the default seed of a
#: one-element output, copied on the device instead of uploaded from the host each backward
#: (an upload allocates and fills staging memory: ~9 us a step against ~1 us).
_ONES: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def prepare_one(device: Any) -> None:
    """Create ``device``'s 1.0 buffer for ``copy_one`` if it has none (before a backward
    takes the queue's lock: creating it submits the device's pending work)."""
    if device not in _ONES:
        ones = np.ones(4, np.float32)
        _ONES[device] = device.native.create_buffer(
            size=16, usage=spy.BufferUsage.copy_source, data=ones
        )


def copy_one(upstream: Any, encoder: Any) -> bool:
    """Record ``upstream`` (a one-element tensor's gradient) = 1.0 into ``encoder``, the
    default seed of ``tape.backward`` (call with the queue's lock held, after
    ``prepare_one``); False, nothing done, where it is not a float at the start of its
    buffer or a capture is recording (its seed is a recorded upload, replayed as one)."""
    one = _ONES.get(upstream.device)
    if one is None or upstream.dtype != "float" or not upstream.dense:
        return False
    if capturing.recording() is not None:
        return False
    encoder.copy_buffer(upstream.buffer, 0, one, 0, 4)
    upstream.wrote_from_outside()
    return True


def seed_or_ones(seed: np.ndarray | None, shape: tuple) -> np.ndarray:
    """``seed``, or ones of ``shape`` where it is None (``tape.backward``'s default)."""
    return np.ones(shape) if seed is None else seed


def device_seed(grad: Any, output: Any, entries: list) -> Any:
    """``grad`` (``tape.backward``'s, a pydiff Tensor) where the backward may copy it into
    ``output``'s gradient on the device as it is (``seed_upstream``): on its device, of its
    shape and dtype, both from the start of their buffers, outside a capture (whose replay
    checks the values it seeded: ``tensor_seed``), and neither ``output`` itself (a held-back
    forward may not have written it yet) nor a gradient buffer of a tensor the walked
    ``entries`` read or write (``h.grad``: the backward zeroes those before the seed goes in).
    Else None: its values are read on the host first (``tensor_seed``). A float tensor holds
    only values of its type: ``seed_values`` has nothing to refuse."""
    if capturing.recording() is not None or grad.device is not output.device:
        return None
    if grad.storage is output.storage or (grad.shape, grad.dtype) != (output.shape, output.dtype):
        return None
    if not grad.dense or grad.scalar_type not in _LIMITS:
        return None
    touched = [t for entry in entries for t in entry.writes]
    touched += [r[1] for entry in entries for r in entry.reads]
    for t in touched:
        if grad.storage in t.grad_storages():
            return None
    return grad


def copy_seed(queue: Any, upstream: Any, grad: Any, encoder: Any) -> bool:
    """Record ``upstream`` = ``grad`` (``device_seed``'s) into ``encoder``, or the deferred
    list where there is none (call with the queue's lock held); False, nothing done, where
    ``upstream`` is not dense."""
    if not upstream.dense:
        return False
    dst, src = upstream.buffer, grad.buffer
    nbytes = grad.element_type.buffer_layout.stride * grad.numel
    if encoder is None:
        queue.defer(lambda e: e.copy_buffer(dst, 0, src, 0, nbytes), (dst, src))
    else:
        encoder.copy_buffer(dst, 0, src, 0, nbytes)
    upstream.wrote_from_outside("tape.backward's grad tensor")
    return True


def seed_upstream(
    queue: Any, entries: list, zeroed: Any, seed: Any, upstream: Any, want, grad: Any = None
) -> None:
    """``tape.backward``'s start: the gradients of what the walked calls wrote zeroed (but
    ``zeroed``'s), then the seed (None: ones; ``grad``, ``device_seed``'s, copied on the
    device) into the output's ``upstream``, recorded into the backward's own command list
    when it has one (one submission)."""
    with queue.lock:  # (the batch's encoder fetched and used under it: command_queue)
        encoder = queue.encoder()
        for entry in entries:
            for t in entry.writes:
                if t is not zeroed:
                    t.zero_grad(encoder)
        if grad is not None and copy_seed(queue, upstream, grad, encoder):
            pass
        elif grad is not None:  # (a gradient buffer not dense: the values by the host)
            upstream.copy_from_numpy(grad.numpy())
        elif seed is None and encoder is not None and copy_one(upstream, encoder):
            pass
        elif encoder is None or not upstream.upload(seed_or_ones(seed, want), encoder):
            upstream.copy_from_numpy(seed_or_ones(seed, want))


def fusable_forward(output: Any, entries: list) -> Any:
    """How ``tape.backward`` runs its start: the queue's ``keeping_held`` where the command
    held back is the generated forward that made ``output`` (generated_hold), the only call
    the backward walks, outside a capture (its start then neither reads nor writes what that
    forward does: the backward may fuse it); else a plain call."""
    queue = output.device.queue
    held = queue.held
    fits = len(entries) == 1 and held is not None and held[2] is output.storage
    if fits and getattr(held[3], "fuses_backward", False) and capturing.recording() is None:
        return queue.keeping_held
    return _plain


def _plain(read: Any, key: Any) -> Any:
    return read()


class KeptEnter:
    """A context manager entered through ``keeping`` (``fusable_forward``'s answer):
    ``tape.backward``'s snapshot of the gradients a refusal puts back (grad_restore)."""

    __slots__ = ("keeping", "inner")

    def __init__(self, keeping: Any, inner: Any) -> None:
        self.keeping, self.inner = keeping, inner

    def __enter__(self) -> Any:
        return self.keeping(self.inner.__enter__, None)

    def __exit__(self, *exc: Any) -> Any:
        return self.inner.__exit__(*exc)
