"""Differentiable tensors: a SlangPy tensor plus the gradient buffers pydiff manages for it.

x = pydiff.tensor([1.0, 2.0, 3.0], requires_grad=True)   # grads zeroed on allocation
y = module.polynomial(2.0, 8.0, -1.0, x, _result="tensor")
module.polynomial.bwds(2.0, 8.0, -1.0, x, _result=y.with_grads(ones=True)); x.grad.numpy()
"""

from __future__ import annotations

import math
from operator import attrgetter
from typing import Any, Callable

import numpy as np
import slangpy as spy

from . import capturing, forward_trace, temporary_copies, tensor_methods
from .device import Device
from .grad_buffers import GradBuffers, view_of
from .policy import ZeroPolicy
from .seeds import seed_values
from .storage import ZEROED, Storage, allocate, dims, float4_layout, layout_element
from .storage import shape_with_inferred_axis, type_name
from .handles import handed_out, owner
from .tensor_operators import TensorOperators
from .tensor_transfers import TensorTransfers


class Tensor(GradBuffers, TensorOperators, TensorTransfers):
    """A tensor on a device with optional gradient buffers ``grad_in`` and ``grad_out``.

    ``grad_in`` holds the upstream gradient a backward reads for values the call wrote;
    ``grad_out`` receives gradients a backward adds for values the call read. By default one
    zeroed buffer serves as both, and ``.grad`` is ``grad_out`` (as in SlangPy).

    Public fields for the layers above: ``native`` (the SlangPy tensor of the values), ``device``,
    ``storage`` (what every view of the buffer shares), ``producer`` (the Tape that wrote it).

    A 0-d tensor (shape ``()``: ``x.sum()``, ``x[1]``) keeps a ``(1,)`` view as ``native`` (a
    SlangPy call given a 0-d tensor returns a number); a call of 0-d tensors gives a 0-d one.

    A view (``reshape``) has no gradient buffers of its own: its gradients are its base's,
    viewed in its shape (the same memory), so a backward through the view adds into the
    base's gradient, and gradient buffers given to either later are seen by both.

    >>> x = pydiff.tensor(np.arange(4.0), requires_grad=True)
    >>> x.shape, x.dtype, x.grad.numpy()
    ((4,), 'float', array([0., 0., 0., 0.], dtype=float32))
    """

    __array_priority__ = 1000

    def __init__(
        self,
        native: spy.Tensor,
        device: Device,
        grad_in: "Tensor | None" = None,
        grad_out: "Tensor | None" = None,
        *,
        storage: Storage | None = None,
        zero_policy: ZeroPolicy | str | None = None,
        base: "Tensor | None" = None,
        shape: tuple | None = None,  # (the caller's: a new pooled tensor's; (1,)-shaped for ())
        float4: bool | None = None,  # (the allocator's: float4_layout's answer, None: unknown)
        detached: bool = False,  # (detach(): ``native`` hands out a handle of its own)
    ):
        self._shape = dims(native.shape) if shape is None else shape
        if not self._shape and shape is None:  # 0-d: kept as a (1,) view, as SlangPy takes it
            native = native.view((1,))
        self._native = native
        self._device = device
        self._element = native.dtype  # SlangPy's element type (a native stays fixed)
        self._layout_el = layout_element(self._element)  # (fixed, as the native is)
        self._grad_in = grad_in
        self._grad_out = grad_out
        self.storage = storage or owner(buf := native.storage, self, native) or Storage(buf)
        self._zero_policy = None if zero_policy is None else ZeroPolicy.parse(zero_policy)
        self._float4: bool | None = float4  # float4_ready, found once (the layout is fixed)
        self._base = base  # a view: the tensor whose gradients it shares (see grad_buffers)
        if detached:
            self._handle = False  # detach(): its own handle, made once (``native``)

    # Set per instance when they change (class defaults: fewer stores, a step makes 7 tensors)
    _bound: spy.Tensor | None = None
    _upstream: tuple = (None, None)  # (bind()'s tensor, bind_upstream's) cached
    _dtype: str | None = None  # the element type's name, found once
    _zero_pending = False  # gradient buffers owed (zero_later): made when needed
    _viewed: tuple = (None, None)  # the base's buffers its own grads view
    _tangent: "Tensor | None" = None  # forward mode: d(self) along the chosen direction
    _handle: Any = None  # (False: detach()'s own, made at the first ``native``)

    # --- description -------------------------------------------------------------------
    shape = property(attrgetter("_shape"), doc="The shape: a tuple of ints, () for 0-d.")

    @property
    def dtype(self) -> str:
        """Slang element type name: 'float', 'float3', 'half', 'int', ..."""
        if self._dtype is None:  # read from SlangPy once (~1 us; every op checks it)
            t = self._element
            vector = type(t).__name__ == "VectorType"
            self._dtype = f"{type_name(t.element_type)}{t.num_elements}" if vector else type_name(t)
        return self._dtype

    @property
    def element_type(self) -> Any:
        """SlangPy's element type (``x.element_type.full_name``): no flush, unlike ``native``."""
        return self._element

    @property
    def scalar_type(self) -> str:
        """The Slang scalar type of the elements ('float' for float3, 'half', 'int', ...)."""
        t = self._element
        while hasattr(t, "element_type") and t.element_type is not None and t.element_type != t:
            t = t.element_type
        return t.full_name

    device = property(attrgetter("_device"), doc="The pydiff Device holding the values.")

    @property
    def native(self) -> spy.Tensor:
        """The SlangPy tensor of the values (no gradient buffers), pending work submitted first
        (a Function ``backward``'s batch too); a handle kept over later calls is not: retake it."""
        if (queue := self._device.queue).deferred or queue.open_batches or queue.pending:
            queue.flush()
        if (handle := self._handle) is False:  # (detach(): its own, not its source's: handles.py)
            handle = self._handle = (n := self._native).view(n.shape, n.strides, n.offset)
        return handed_out(self.storage, self._native if handle is None else handle, self)

    def native_view(self) -> spy.Tensor:
        """``native`` in this tensor's shape (0-d too): to make a Tensor of the same values.

        >>> pydiff.Tensor(x.native_view(), x.device)        # x's shape, () included
        """
        return self.native if self._shape else self.native.view(())

    @property
    def buffer(self) -> spy.Buffer:
        """The buffer holding the values, for commands recorded in order with the device's
        pending work (pydiff's kernels): no flush, unlike ``native``.

        >>> device.kernels.dispatch(kernel, n, x=t.buffer)
        """
        return self._native.storage

    @property
    def numel(self) -> int:
        return math.prod(self._shape)

    @property
    def float4(self) -> bool:
        """A contiguous float tensor at the start of a buffer of float4s (see float4_ready):
        read from SlangPy once per tensor, as its values' layout never changes."""
        if self._float4 is None:
            self._float4 = float4_layout(self._native, self._device.typed_loads)
        return self._float4

    @property
    def dense(self) -> bool:
        """The values are contiguous from the start of their buffer (no flush, unlike ``native``).

        >>> labels.dense        # True for pydiff.tensor(array)
        """
        return (n := self._native).offset == 0 and n.is_contiguous()

    @property
    def layout(self) -> tuple:
        """(shape, ``storage.layout_element`` of the element type, has grad_in, has grad_out):
        what a call plan of this tensor's argument depends on (see call_plan).

        >>> x.layout      # ((4,), 'float', True, True)
        """
        if self._base is not None:
            self._sync_view()
        return (self._shape, self._layout_el) + self.grad_flags()

    @property
    def zero_policy(self) -> ZeroPolicy | None:
        """The policy of this tensor's gradient buffers (None: the global/context one); a view
        reads and sets its base's: ``x.reshape((6,)).zero_policy = "strict"`` sets x's."""
        return self._zero_policy if self._base is None else self._base.zero_policy

    @zero_policy.setter
    def zero_policy(self, value: ZeroPolicy | str | None) -> None:
        if self._base is not None:
            self._base.zero_policy = value
        else:
            self._zero_policy = None if value is None else ZeroPolicy.parse(value)

    @property
    def producer(self) -> Any:
        """The Tape that recorded the call writing these values (every view shares it)."""
        return self.storage.producer

    @producer.setter
    def producer(self, tape: Any) -> None:
        self.storage.producer = tape

    def __repr__(self) -> str:
        self._sync_view()
        shared = ", grad=shared" if self._grad_in is self._grad_out else ", grad=separate"
        grads = "" if self._grad_out is None and not self._zero_pending else shared
        return (
            f"pydiff.Tensor({tensor_methods.call('values_text', self)}, shape={self.shape}, "
            f"dtype={self.dtype}, device={self._device.type}{grads})"
        )

    @property
    def tangent(self) -> "Tensor | None":
        """The tangent ``.fwds`` reads (and fills for outputs), or None; a reshape view without
        its own follows its base's current one (``m.f.fwds(x.with_tangent(u))``)."""
        own, base = self._tangent, self._base
        if own is not None or base is None or base.tangent is None:
            return own
        return base.tangent.reshape(self.shape)

    def with_tangent(self, tangent: Any) -> "Tensor":
        """Attach a tangent (a pydiff.Tensor or host data of the same shape); returns self.

        >>> x = pydiff.tensor([1.0, 2.0]).with_tangent([1.0, 0.0])
        """
        if tangent is None:
            self._tangent = None
            return self
        if isinstance(tangent, Tensor):
            if tangent.device != self.device:
                raise ValueError(
                    f"tangent is on device {tangent.device!r}, the tensor on {self.device!r}"
                )
            if tangent.shape != self.shape or tangent.dtype != self.dtype:
                raise ValueError(
                    f"tangent has shape {tangent.shape} and dtype {tangent.dtype}; the tensor "
                    f"has shape {self.shape} and dtype {self.dtype}"
                )
            self._tangent = tangent
            return self
        arr = seed_values(tangent, "with_tangent: tangent", self.scalar_type)
        want = self.expected_numpy_shape()
        if arr.shape != want:
            raise ValueError(
                f"tangent has shape {arr.shape}; the tensor's values have shape {want}"
            )
        native = allocate(self._device, self._shape, self._element)
        self._tangent = Tensor(native, self._device).copy_from_numpy(arr)
        return self

    def detach(self) -> "Tensor":
        """The same values (same storage) without gradient buffers."""
        native = self._native if self._shape else self._native.view(())  # (no flush)
        return Tensor(native, self._device, storage=self.storage, detached=True)

    def zero_(self, encoder: Any = None, *, batch: bool = True) -> "Tensor":
        """Zero the values in order with the commands of ``encoder``, of this context's batch
        (not if ``batch`` is False: new storage), or else of the deferred list; returns self."""
        temporary_copies.refuse(self, "zero_")
        queue = self._device.queue
        native = self._native
        with queue.lock:  # (the batch's encoder fetched and used under it: command_queue)
            if encoder is None and batch:
                encoder = queue.encoder()
            if encoder is None:
                queue.defer(native.clear, (native.storage,))
            else:
                native.clear(encoder)
        if (rec := capturing.recording()) is not None:
            rec.record_clear(self._device.queue, self._native)
        (storage := self.storage).holds_result_of = None
        storage.wrote(ZEROED, everything=True)
        return self if forward_trace.active() is None else forward_trace.replaced(self)

    def reshape(self, *shape: Any) -> "Tensor":
        """A view of the same contiguous storage with another shape, sharing this tensor's
        gradient buffers (viewed in the new shape: a gradient through the view lands in
        ``x.grad``). ``x.detach().reshape(...)`` is a view without gradients.

        >>> flat = x.reshape((x.numel,))       # or x.reshape(x.numel), x.reshape(2, -1)
        >>> s = x.sum().reshape(1)             # a 0-d tensor as (1,); x[0:1].reshape(()) back
        """
        if len(shape) == 1 and not isinstance(shape[0], (int, np.integer)):
            shape = shape[0]  # reshape((2, 3)); anything else is refused by shape_tuple
        shape = shape_with_inferred_axis(shape, self.numel)
        if math.prod(shape) != self.numel:
            raise ValueError(f"reshape: cannot view {self.numel} elements as shape {shape}")
        if not self._native.is_contiguous():
            raise ValueError("reshape: the tensor is not contiguous; clone() it first")
        base = self._base if self._base is not None else self
        for g, what in ((base.grad_in, "grad_in"), (base.grad_out, "grad_out")):
            if g is not None:
                view_of(g, shape, what)  # refused now if it cannot be viewed
        native = self._native.view(shape)  # () -> a 0-d view, kept as (1,) with shape ()
        view = Tensor(native, self._device, storage=self.storage, base=base)
        return forward_trace.derived(self, view, lambda t: t.reshape(shape))  # its tangent too

    def copy_values(self) -> "Tensor":
        """``before = x.copy_values()``: new storage, never recorded, no gradient path (``clone``
        has one); values ``copy_`` took from a gradient path stay marked (refused there)."""
        copy = Tensor(allocate(self._device, self._shape, self._element), self._device)
        marked = tensor_methods.call("copied_from", self) is not None  # (copy_'s mark: kept)
        if copy.copy_(self) is copy and not marked:  # else a constant on purpose
            copy.storage.last_writer = "a snapshot (copy_values)"
        return forward_trace.view_of(self, copy, lambda t: t.copy_values())

    def backward(self, grad: Any = None, *, retain_graph: bool = True) -> None:
        """Backpropagate through the tape that recorded the call producing this tensor
        (``retain_graph``: as for ``Tape.backward``).

        >>> with pydiff.Tape():
        ...     loss = m.loss(x, _result="tensor")
        >>> loss.backward()
        """
        if self.producer is None:  # (what made it, said by pydiff.unrecorded)
            raise RuntimeError(tensor_methods.call("not_recorded", "backward()", self))
        self.producer.backward(self, grad, retain_graph=retain_graph)

    # --- binding to SlangPy calls ----------------------------------------------------------
    def bind(self, with_grads: bool = True, flush: bool = True) -> spy.Tensor:
        """The SlangPy tensor to pass to a call: the primal plus its gradient buffers when
        attached (and ``with_grads``); ``flush=False``: for a call deferred after pending work.

        >>> m.native.f(x.bind(), _result="tensor")        # raw SlangPy, with x's gradients
        """
        if self._base is not None:
            self._sync_view()
        elif self._zero_pending and with_grads:
            self._settle()
        queue = self._device.queue
        if queue.cuda:  # a thread's first use of a CUDA device (cuda_context)
            queue.enter()
        if flush and (queue.deferred or queue.open_batches):  # a SlangPy call reads it: flush
            queue.flush_deferred()
        if not with_grads or (self._grad_out is None and self._grad_in is None):
            return self._native
        if self._bound is None:  # (the gradients' own SlangPy tensors: flushed above if asked)
            gi = self._grad_in.bind(False, False) if self._grad_in is not None else None
            go = self._grad_out.bind(False, False) if self._grad_out is not None else None
            self._bound = self._native.with_grads(grad_in=gi, grad_out=go, zero=False)
        return self._bound

    def bind_upstream(self, sink: Callable[[], spy.Tensor], flush: bool = True) -> spy.Tensor:
        """This tensor's gradient buffers on the values of ``sink()`` (a buffer of its shape
        that a backward kernel may write forward values into): how ``.bwds`` passes a result
        whose upstream gradient it reads. Kept while the gradient buffers stay the same.

        >>> fn.native_bwds(x.bind(), _result=y.bind_upstream(lambda: sink))
        """
        bound = self.bind(True, flush)  # a new object whenever the gradient buffers change
        if self._upstream[0] is not bound:
            gi, go = self._grad_in, self._grad_out
            gi = gi.bind(False, False) if gi is not None else None
            go = go.bind(False, False) if go is not None else None
            self._upstream = (bound, sink().with_grads(grad_in=gi, grad_out=go, zero=False))
        return self._upstream[1]


def float4_ready(*tensors: Tensor) -> bool:
    """All tensors are contiguous float tensors at the start of a buffer of float4s: pydiff's
    fast kernels can read them as float4s (on every backend).

    >>> if float4_ready(x, w, y): ...      # take the fast path
    """
    for t in tensors:
        if not t.float4:
            return False
    return True
