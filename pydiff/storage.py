"""Tensor storage: the device memory behind tensors and the bookkeeping every view of it
shares (version counter, last writer, which backward's result it holds); the dtype names
are ``dtype_names``'s.

    native = allocate(device, (4, 3), device.dtype("float"), zero=True)   # a SlangPy tensor
    st = Storage(native.storage)
    st.wrote("m.f (forward call)"); st.version, st.last_writer   # 1, 'm.f (forward call)'
"""

from __future__ import annotations

import itertools
import math
import operator
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import slangpy as spy

from . import capturing, staging
from .buffer_pool import STORAGE_USAGE, allocation_failed, check_size
from .dtype_names import UPLOAD_NUMPY
from .float_storage import FLOAT_WIDTHS, pooled_tensor, refuse_rounded_ints

if TYPE_CHECKING:
    from .device import Device

#: ``Storage.replaced``'s writer for ``Tensor.copy_`` of values with a gradient path.
COPY_FROM_GRAPH = "copy_ of values with a gradient path (copy_ is not recorded on a tape)"
#: ``Storage.last_writer`` of a zeroing (``Tensor.zero_``, ``zero_grad``).
ZEROED = "a host write (zeroing)"
_SERIALS = itertools.count(1)  # Storage.serial (next() on a count is atomic under the GIL)


def upload_numpy_type(native: spy.Tensor, scalar_type: str) -> Any:
    """The NumPy type host values of ``native``'s element are uploaded as: a bool is a 4-byte
    word on Vulkan and D3D12 and one byte on CUDA.

    >>> upload_numpy_type(flags.native, "bool")     # np.uint32 on Vulkan, np.uint8 on CUDA
    """
    if scalar_type == "bool" and int(native.dtype.buffer_layout.stride) == 1:
        return np.uint8
    return UPLOAD_NUMPY.get(scalar_type)


def host_cast(arr: np.ndarray, np_type: Any, where: str, truth: bool = False) -> np.ndarray:
    """``arr`` as ``np_type`` for an upload, refusing what NumPy's cast would change silently:
    complex values (the imaginary part dropped), and, for an integer type, values that are not
    whole numbers (NaN, inf, 2.7) or do not fit (int64 2**32 + 1 wraps to 1 in int32: a label
    that passes its range check as another class); for a float type, overflow and integers it
    cannot hold exactly (2**24 + 1). ``truth``: a bool tensor's words, non-zero (NaN too) is
    true, as NumPy and C convert.
    >>> host_cast(np.array([3, 4]), np.int32, "copy_from_numpy")     # array([3, 4], int32)
    """
    if np_type is None or arr.dtype == np_type:
        return arr
    if arr.dtype.kind == "c":
        raise TypeError(f"{where}: complex values (dtype {arr.dtype}) have no real dtype to go to")
    if arr.dtype.kind in "US":
        raise TypeError(f"{where}: values of dtype {arr.dtype} are text, not numbers")
    if truth:
        return (arr != 0).astype(np_type)
    target = np.dtype(np_type)
    if target.kind in "iu" and arr.size and arr.dtype.kind in "fiub":
        if arr.dtype.kind == "f" and not np.all(np.isfinite(arr) & (arr == np.trunc(arr))):
            bad = arr[~(np.isfinite(arr) & (arr == np.trunc(arr)))].flat[0]
            raise ValueError(
                f"{where}: {float(bad)!r} is not a whole number; the tensor holds {target}"
            )
        info = np.iinfo(target)
        low, high = (arr.min(), arr.max()) if arr.dtype.kind != "b" else (0, 1)
        if float(low) < info.min or float(high) > info.max:  # (float: no float16 overflow)
            wide = "int64" if target.kind == "i" and int(high) < 2**63 else "uint64"
            fits = target.itemsize == 4 and (target.kind == "i" or int(low) >= 0)
            hint = f"; for 64-bit integers pass dtype=np.{wide}" if fits else ""
            raise ValueError(
                f"{where}: values from {low} to {high} do not fit {target} ({info.min}.."
                f"{info.max}){hint}"
            )
    if arr.dtype.kind == "O":  # (Python ints past 64 bits, [2**64 + 1]: refuse_rounded_ints)
        refuse_rounded_ints(arr, target, where)
    if target.kind == "f" and arr.dtype.kind in "fiu" and arr.size:
        with np.errstate(over="ignore"):
            out = arr.astype(np_type, copy=False)
        overflow = np.isinf(out) & np.isfinite(arr)
        if overflow.any():  # (NumPy's cast: inf, a warning; refused, as a call's scalar is)
            raise ValueError(
                f"{where}: {arr[overflow].flat[0].item()!r} is beyond the largest {target} "
                f"({float(np.finfo(target).max):.6g}); it would become inf"
            )
        refuse_rounded_ints(arr, target, where, out)  # (2**24 + 1 -> float32: 2**24)
        return out
    return arr.astype(np_type, copy=False)


class Storage:
    """What every view of one buffer shares.

    Fields (all public, documented here, read and written by the layers above):
      ``buffer``: the SlangPy buffer holding the values (None until known);
      ``version``: how many times the values were written (the tape's overwrite check; a
      replay of ``pydiff.capture`` counts its step's writes again);
      ``last_writer``: a description of the latest write, for error messages;
      ``holds_result_of``: the label of the backward whose result a gradient buffer holds
      (the STRICT zeroing policy), None once zeroed or written otherwise;
      ``checked``: a stamp ``(version, what, ...)`` of the latest validation of the values
      (e.g. label ranges), so they are checked again only after a write;
      ``before``: ``(version, copy)``, the values before the call that read and then
      overwrote them, making ``version`` (kept for that call's ``.bwds``, which
      differentiates at the values read; copy None when none was kept);
      ``read_by_writer``: the parameters at which that call read them (in place, or an
      input it overwrote through another parameter or ``_result``); ``reread``: whether a
      later call of the same function read them again at one of those parameters (then its
      ``.bwds`` cannot tell the two calls apart); ``written_over``: labels of calls that read
      and overwrote the values in place before another call wrote over them (the values
      those calls read are gone: their ``.bwds`` on this storage refuses), cleared by a
      write of all the values from the host; ``producer``: the Tape that recorded the latest
      call writing them (every view of the buffer has it), or None, also once all the values
      were written from outside a call (host, copy, zeroing): a tape's gradient stops there;
      ``replaced``: ``(count, writer)`` of those writes from outside (a tape compares the
      count with the one at its call's record; ``COPY_FROM_GRAPH``: ``copy_`` of values that
      have a gradient path, which no tape records); ``serial``: a number no other storage
      of this process has (what a record names a storage by without holding it);
      ``made_by``: the latest forward call that wrote the values, as
      ``stale_reads.mark_made`` records it (None: none), kept across other writes.

    Gradient buffers are not here: they belong to a ``Tensor`` (two tensors on the same
    storage may carry different gradient buffers, see ``Tensor.with_grads``).
    """

    __slots__ = tuple(
        "buffer holds_result_of version last_writer checked before read_by_writer reread "
        "written_over producer replaced serial made_by __weakref__".split()
    )

    def __init__(self, buffer: Any = None) -> None:
        self.buffer = buffer
        self.holds_result_of: str | None = None
        self.version = 0
        self.last_writer = "nothing"
        self.checked: Any = None
        self.before: tuple[int, Any] | None = None
        self.read_by_writer: tuple[str, ...] = ()
        self.reread = False
        self.written_over: frozenset[str] = frozenset()
        self.producer: Any = None
        self.replaced: tuple[int, str] = (0, "nothing")
        self.serial = next(_SERIALS)
        if (rec := capturing.recording()) is not None:
            rec.record_new(self)  # made by the captured step (its values: the step's)
        self.made_by: tuple | None = None

    def wrote(self, writer: str, everything: bool = False) -> None:
        """Count a write of the values by ``writer`` (``everything``: all of them, from the
        host or a copy, so no earlier call's values survive in part)."""
        if (rec := capturing.recording()) is not None:
            rec.record_write(self)  # each replay writes them again: their version moves on
        if everything:
            self.written_over = frozenset()
            self.producer = None  # no recorded call made these values
            self.replaced = (self.replaced[0] + 1, writer)
        elif self.read_by_writer and self.last_writer != writer:
            self.written_over |= {self.last_writer}
        if writer in self.written_over:  # its newest call's values are tracked again
            self.written_over -= {writer}
        self.version += 1
        self.last_writer = writer
        self.before = None
        self.read_by_writer = ()
        self.reread = False

    def mark_result(self, label: str) -> None:
        """The values are now the result of the backward ``label`` (``holds_result_of``); a
        capture records it, so that each replay marks them again (``replayed``)."""
        self.holds_result_of = label
        if (rec := capturing.recording()) is not None:
            rec.record_write(self)

    def replayed(self, moved: int, mark: str | None, writer: str) -> None:
        """A replay of a captured step wrote the values again: ``moved`` more versions, and the
        mark and last writer the step left, as an eager step does (optimizers step gradients
        marked since ``zero_grad``: unmarked, an eager step after the replay skipped them)."""
        self.holds_result_of = mark
        if moved:
            self.version += moved
            self.last_writer = writer

    def written_since_zeroed(self) -> bool:
        """Whether anything wrote the values since they were allocated or last zeroed
        (``ZEROED``): a write counted by ``wrote`` (a call, the host, a copy) or a backward's
        result (``holds_result_of``: backwards mark the gradient buffers they write). The
        optimizers step only parameters whose gradient buffer says so (torch's ``None``)."""
        if self.holds_result_of is not None:
            return True
        return self.version != 0 and self.last_writer != ZEROED


def has_c_strides(arr: np.ndarray) -> bool:
    """Whether ``arr`` has exactly the strides of a C-ordered array of its shape, size-1 axes
    included (NumPy calls ``a[None]`` contiguous; SlangPy's copy refuses its 0 stride).

    >>> has_c_strides(np.zeros(3, np.float32)[None])
    False
    """
    want, step = [], arr.itemsize
    for d in reversed(arr.shape):
        want.append(step)
        step *= d
    return tuple(reversed(want)) == arr.strides


def layout_element(element: Any) -> Any:
    """What a call plan's layout keys a tensor's element type by: a scalar, vector or matrix
    type by its name (the reflection objects of SlangPy's results and of pydiff's tensors
    differ), any other type by its reflection object.

    >>> layout_element(x.element_type)     # 'float'
    """
    return type_name(element) if type(element).__name__ in _NAMED_TYPES else element


def type_name(element: Any) -> str:
    """``element.full_name`` of a SlangPy reflection type, memoised by the object: Slang's
    reflection builds the name anew at each read (~0.27 us; ~25 reads an MLP training step).
    The memo holds the objects it names, so a key is never a freed type's reused address.

    >>> type_name(x.element_type)     # 'float'
    """
    name = _TYPE_NAMES.get(element)
    if name is None:
        name = element.full_name
        if len(_TYPE_NAMES) >= _TYPE_NAMES_MAX:
            _TYPE_NAMES.clear()  # (types of released modules are not kept alive for long)
        _TYPE_NAMES[element] = name
    return name


_TYPE_NAMES: dict = {}
_TYPE_NAMES_MAX = 256
_NAMED_TYPES = ("ScalarType", "VectorType", "MatrixType")  # SlangPy's reflection classes


def element_shape(native_dtype: Any) -> tuple[int, ...]:
    """Trailing NumPy dimensions one element occupies (float3 -> (3,), float4x4 -> (4, 4))."""
    return tuple(int(s) for s in native_dtype.shape)


def dims(shape: Any) -> tuple[int, ...]:
    """A shape (SlangPy's ``Shape`` or a sequence of ints) as a tuple of ints. SlangPy's
    through ``as_tuple``: iterating it element by element costs ~3 us a shape.

    >>> dims(t.native.shape)        # (256, 64)
    """
    if type(shape) is tuple:
        return shape if all(type(d) is int for d in shape) else tuple(int(d) for d in shape)
    as_tuple = getattr(shape, "as_tuple", None)
    return as_tuple() if as_tuple is not None else tuple(int(d) for d in shape)


def shape_tuple(shape: Any) -> tuple[int, ...]:
    """A shape argument as a tuple of positive ints (an int is a 1-D shape; ``()`` is 0-d, one
    element): Python or NumPy integers only (2.5 or 2.0 is refused, not truncated; a bool is
    refused too)."""
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    try:
        dims = list(shape)
    except TypeError:
        raise TypeError(f"shape={shape!r}: expected an int or a sequence of ints") from None
    try:
        if any(isinstance(d, (bool, np.bool_)) for d in dims):
            raise TypeError
        out = tuple(operator.index(d) for d in dims)
    except TypeError:
        bad = next(d for d in dims if isinstance(d, (bool, np.bool_)) or not _is_index(d))
        raise TypeError(
            f"shape={shape!r}: dimension {bad!r} is not an integer; pass ints "
            "(round them yourself if you mean to)"
        ) from None
    if any(s <= 0 for s in out):
        raise ValueError(f"shape={shape!r}: every dimension must be a positive integer")
    return out


def _is_index(d: Any) -> bool:
    try:
        operator.index(d)
    except TypeError:
        return False
    return True


def float4_layout(native: spy.Tensor, typed_loads: bool = True) -> bool:
    """A contiguous float tensor at the start of a buffer of float4s, readable as float4s by
    pydiff's fast kernels on every backend (through typed loads, it needs the rgba32_float
    format as well)."""
    desc = native.storage.desc
    return (
        type_name(native.dtype) == "float"
        and native.offset == 0
        and native.is_contiguous()
        and desc.struct_size == 16
        and (desc.format == spy.Format.rgba32_float or not typed_loads)
    )


def bool_words(dev: "Device", native: spy.Tensor) -> spy.Tensor:
    """A bool view as a view of its words (4 bytes; 1 on CUDA), which SlangPy reads and
    writes as 1-byte bools (a strided write's read-back moved bytes); another view as it is.
    Called before the queue's lock: dev.dtype may take the device's, which is held around
    work that takes the queue's (a memo's make() creating tensors)."""
    if native.dtype.full_name != "bool":
        return native
    word = dev.dtype("uint" if int(native.dtype.buffer_layout.stride) == 4 else "uint8_t")
    return spy.Tensor(native.storage, word, list(native.shape), list(native.strides), native.offset)


def read_back(dev: "Device", native: spy.Tensor) -> np.ndarray:
    """The values of ``native`` as a NumPy array, reading only the bytes its view spans.

    SlangPy's ``to_numpy`` reads a view from its offset to the end of the storage (16 elements
    at the start of a 64 MB buffer: ~110 ms): a view spanning less than half its buffer is first
    copied on the device into a buffer of its own; a small one, ``staging.read_small``.
    >>> read_back(dev, big.native.view((16,)))     # copies 64 bytes, not the whole buffer"""
    if native.dtype.full_name == "bool":  # words that SlangPy misreads: bool_words
        return read_back(dev, bool_words(dev, native)) != 0
    with dev.queue.lock:
        dev.queue.enter()
        if (values := staging.read_small(dev.queue, native)) is not None:
            return values  # (the copy submitted with the pending work: one submission)
        dev.queue.flush()  # (again, under the lock: what another thread recorded since goes too)
        return _read_back(dev, native)


def _read_back(dev: "Device", native: spy.Tensor) -> np.ndarray:
    if (values := staging.read(dev.queue, native, lambda v: _read_back(dev, v))) is not None:
        return values  # (a large view, or negative strides: pydiff.staging)
    shape, strides = list(native.shape), list(native.strides)
    if not shape or min(shape) <= 0:
        return native.to_numpy()
    stride = int(native.dtype.buffer_layout.stride)
    span = 1 + sum((d - 1) * s for d, s in zip(shape, strides))
    if min(strides) < 0 or 2 * span * stride >= native.storage.size:
        return native.to_numpy()
    temp = dev.native.create_buffer(size=span * stride, usage=STORAGE_USAGE)
    encoder = dev.native.create_command_encoder()
    encoder.copy_buffer(temp, 0, native.storage, native.offset * stride, span * stride)
    dev.native.submit_command_buffer(encoder.finish())
    return spy.Tensor(temp, native.dtype, shape, strides, 0).to_numpy()


def allocate(
    dev: "Device", shape: Sequence[int], dtype: Any, zero: bool = False, what: str = ""
) -> spy.Tensor:
    """A SlangPy tensor for new values of ``shape`` and ``dtype`` (a name or reflection).

    Float and float-vector (float2/3/4) tensors live in a buffer of float4s (padded to whole
    float4s, reused from ``dev.pool``: float_storage) on every backend: SlangPy binds it as
    usual and pydiff's fast kernels read float ones as float4s (on Vulkan through typed loads,
    about 3x cheaper on lavapipe). ``what`` names the tensor in a size error (default: "a
    <dtype> tensor"). Shape ``()`` gives a 0-d view of one element.
    """
    if len(shape) == 0:
        return allocate(dev, (1,), dtype, zero, what).view(())
    name = dtype if isinstance(dtype, str) else type_name(dtype)
    width = FLOAT_WIDTHS.get(name)
    if width is None:
        shape = dims(shape)
        refl = dev.dtype(name) if isinstance(dtype, str) else dtype
        check_size(what or f"a {name} tensor", dev.type, shape, int(refl.buffer_layout.stride))
        return _allocate_plain(dev, shape, dtype, name, zero, capturing.recording())
    refl = dev.dtype(name) if isinstance(dtype, str) else dtype
    what = what or ("a float tensor" if width == 1 else f"a float{width} tensor")
    return pooled_tensor(
        dev, shape if type(shape) is tuple else dims(shape), refl, width, zero, what
    )


def _allocate_plain(
    dev: "Device", shape: tuple, dtype: Any, name: str, zero: bool, rec: Any
) -> spy.Tensor:
    make = spy.Tensor.zeros if zero and rec is None else spy.Tensor.empty
    refl = dev.dtype(name) if isinstance(dtype, str) else dtype
    stride = int(refl.buffer_layout.stride)
    count = math.prod(shape)
    padded = count
    if shape and (count * stride) % 4:
        # SlangPy's clear() zeroes whole 4-byte words and leaves the last element of,
        # e.g., an odd number of halves: pad the storage to whole words.
        while (padded * stride) % 4:
            padded += 1
    try:
        native = make(dev.native, (padded,), dtype).view(shape) if padded != count else None
        if native is None:
            native = make(dev.native, shape, dtype)
    except RuntimeError as exc:  # the device's own limit or out of memory: say how much
        raise allocation_failed(padded * stride, exc) from None
    dev.queue.allocated(padded * stride)
    if zero and rec is not None:
        native.clear()
        rec.record_clear(dev.queue, native)
    return native


def shape_with_inferred_axis(shape: Any, numel: int) -> tuple[int, ...]:
    """``shape`` with one -1 replaced by what the other sizes leave (NumPy's rule)."""
    if not isinstance(shape, (tuple, list)) or not all(
        isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in shape
    ):
        return shape_tuple(shape)  # refuses what is not a shape, naming it
    shape = tuple(shape)
    if sum(1 for n in shape if n == -1) > 1:
        raise ValueError(f"reshape: only one axis may be -1, got {shape}")
    if -1 in shape:
        known = math.prod(n for n in shape if n != -1)
        if known == 0 or numel % known:
            raise ValueError(f"reshape: cannot view {numel} elements as shape {shape}")
        shape = tuple(numel // known if n == -1 else n for n in shape)
    return shape_tuple(shape)
