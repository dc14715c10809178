"""The gradient buffers of a ``Tensor`` (``grad_in``, ``grad_out``) and of its views.

A view (``x.reshape(...)``) has no gradient buffers of its own: it shows its base's, viewed
in its shape (the same memory, so the view's gradient *is* the base's), re-read whenever the
base's buffers change (``requires_grad_``, a tape giving a result buffers after the view
was made). So a backward through a view adds into ``x.grad``; nothing is dropped.

    x = pydiff.tensor(np.ones(6), requires_grad=True)
    v = x.reshape((2, 3))          # v.grad is x.grad viewed as (2, 3)
"""

from __future__ import annotations

from operator import attrgetter
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .storage import allocate, type_name

if TYPE_CHECKING:
    from typing_extensions import Self


# Per element type (SlangPy's reflection objects, compared by identity; the memo holds them,
# so a key is never a freed type's reused address): ``differentiable``, and ``grad_dtype``
# per backend. What they read of a type never changes; the refusals are not memoised.
_DIFFERENTIABLE: dict = {}
_DERIVATIVES: dict = {}
_MEMO_MAX = 256


class GradBuffers:
    """The gradient half of ``Tensor`` (a mixin: ``Tensor`` sets ``_native``, ``_device``,
    ``_shape``, ``_grad_in``, ``_grad_out``, ``_base``, ``_viewed`` and ``_bound``)."""

    _native: Any
    _device: Any
    _shape: tuple[int, ...]
    _grad_in: Any
    _grad_out: Any
    _base: Any
    _viewed: tuple
    _bound: Any
    _zero_policy: Any  # (tensor.py's zero_policy property: a tensor with a base reads its base's)
    _element: Any  # SlangPy's reflection of the element type (fixed, as the native is)
    _zero_pending: bool  # zero_later: the buffers are owed, made zeroed when first needed

    base = property(  # (a C getter, no Python frame: the tape reads it for every tensor)
        attrgetter("_base"),
        doc="The tensor this one is a view of (``reshape``), or shares the gradients of "
        "(``share_grads``): its gradient buffers and zeroing policy are this one's.",
    )

    @property
    def requires_grad(self) -> bool:
        if self._base is not None:
            self._sync_view()
        return self._grad_out is not None or self._grad_in is not None or self._zero_pending

    @property
    def grad(self) -> "Self | None":
        """The gradient buffer a backward adds into (``grad_out``), as in SlangPy."""
        if self._base is not None:
            self._sync_view()
        elif self._zero_pending:
            self._settle()
        return self._grad_out

    @property
    def grad_in(self) -> "Self | None":
        if self._base is not None:
            self._sync_view()
        elif self._zero_pending:
            self._settle()
        return self._grad_in

    @property
    def grad_out(self) -> "Self | None":
        if self._base is not None:
            self._sync_view()
        elif self._zero_pending:
            self._settle()
        return self._grad_out

    def grad_flags(self) -> tuple[bool, bool]:
        """Whether it has ``grad_in`` and ``grad_out`` (a view: its base's, synced by the
        caller), owed ones (``zero_later``: one shared buffer, made when bound) included:
        ``Tensor.layout``'s, which call plans key on."""
        owed = self._zero_pending
        return (owed or self._grad_in is not None, owed or self._grad_out is not None)

    def grad_storages(self) -> tuple:
        """The storages of ``(grad_in, grad_out)`` (None where absent) without zeroing a
        buffer attached with ``zero_later`` (``grad_in`` would, as a read): what a check of
        which buffers alias which compares, before the backward zeroes them in its batch."""
        if self._base is not None:
            self._sync_view()
        gi, go = self._grad_in, self._grad_out
        return (None if gi is None else gi.storage, None if go is None else go.storage)

    @property
    def geometry(self) -> tuple[int, tuple[int, ...], tuple[int, ...], bool]:
        """The values' view as (offset, strides, shape, contiguous), in elements: no flush and
        no handle handed out, unlike ``native`` (``view_overlap``'s checks, on every call);
        read from SlangPy once per tensor (its view never changes)."""
        geometry = self.__dict__.get("_geometry")
        if geometry is None:
            n = self._native
            geometry = (n.offset, tuple(n.strides), tuple(n.shape), n.is_contiguous())
            self.__dict__["_geometry"] = geometry
        return geometry

    def _settle(self) -> None:
        """Make the zeroed gradient buffer ``requires_grad_(zero_later=True)`` owes, now:
        something is about to read or bind it (the backward writing or reading it, a user's
        ``.grad``). Zeroed in order with the pending work (``zero_grad``), as the backward's
        own zeroing of its results' buffers would have been."""
        self._zero_pending = False
        if self._grad_in is None and self._grad_out is None:
            self._grad_in = self._grad_out = self.new_grad_buffer(zero=False)
            self._bound = None
        self.zero_grad()

    def make_owed(self) -> bool:
        """Make the gradient buffer ``zero_later`` left owed, its zeroing still owed (the next
        ``zero_grad`` or read does it); whether its zeroing is owed now. ``tape.backward``
        makes its results' before its batch opens, where the pool hands out free buffers
        (inside a batch each is a new one, ~2x the host time), then zeroes them."""
        if self._zero_pending and self._grad_in is None and self._grad_out is None:
            self._grad_in = self._grad_out = self.new_grad_buffer(zero=False)
            self._bound = None
        return self._zero_pending

    def _sync_view(self) -> None:
        """A view's gradient buffers: its base's current ones, viewed in its shape."""
        base = self._base
        if base is None:
            return
        gi, go = base.grad_in, base.grad_out
        if gi is self._viewed[0] and go is self._viewed[1]:
            return
        self._grad_in = None if gi is None else view_of(gi, self._shape, "grad_in")
        self._grad_out = self._grad_in if go is gi else view_of(go, self._shape, "grad_out")
        self._viewed = (gi, go)
        self._bound = None

    @property
    def differentiable(self) -> bool:
        """Whether the element type has a derivative (SlangPy's reflection, read once per
        type: ~0.3 us, a few reads per op)."""
        element = self._element
        known = _DIFFERENTIABLE.get(element)
        if known is None:
            known = bool(getattr(element, "differentiable", False))
            if len(_DIFFERENTIABLE) >= _MEMO_MAX:
                _DIFFERENTIABLE.clear()
            _DIFFERENTIABLE[element] = known
        return known

    @property
    def grad_dtype(self) -> Any:
        """SlangPy's reflection of the gradient's element type (TypeError if there is none);
        found once per element type and backend (each gradient buffer made asks: ~1 us)."""
        key = (self._element, self._device.type)
        derivative = _DERIVATIVES.get(key)
        if derivative is None:
            derivative = self._derivative()
            if len(_DERIVATIVES) >= _MEMO_MAX:
                _DERIVATIVES.clear()
            _DERIVATIVES[key] = derivative
        return derivative

    def _derivative(self) -> Any:
        derivative = getattr(self._element, "derivative", None)
        if derivative is None or not self.differentiable:
            raise TypeError(
                f"a tensor of dtype {self.dtype!r} cannot have gradients (no derivative type); "
                "use a floating-point dtype such as 'float', 'half' or 'float3'"
            )
        if str(self.dtype).startswith("double"):
            # SlangPy's RWDiffTensor needs atomic adds of its element type; Slang has none for
            # double, so the call would fail binding the tensor with a raw SlangPy error.
            raise TypeError(
                f"a tensor of dtype {self.dtype!r} cannot have gradients: pydiff's gradients "
                "are float or half (Slang has no double atomics to add them with). Use "
                "dtype='float' for tensors with gradients (a function may still compute in "
                "double inside), or .fwds with a tangent, which works for double"
            )
        if self._device.type == "cuda" and self.dtype == "half3":
            raise TypeError(
                "gradients of 'half3' tensors on CUDA are refused: SlangPy accumulated them "
                "wrong on an H200 (half, half2 and float3 are right); use 'float3', or "
                "'half' with a last axis of 3"
            )
        return derivative

    def new_grad_buffer(self, zero: bool = True) -> "Self":
        """A new tensor shaped for this tensor's gradient (zeroed unless ``zero=False``)."""
        dtype = self.grad_dtype
        native = allocate(self._device, self._shape or (1,), dtype, zero)  # (0-d: Tensor's form)
        # A float one is pooled, so float4-ready by construction (storage.allocate): no reads
        # of its layout from SlangPy (float4_layout, ~1 us; 3 a training step).
        float4 = type_name(dtype) == "float"
        return type(self)(native, self._device, shape=self._shape, float4=float4)

    def check_grad(self, grad: Any, name: str) -> "Self":
        if not isinstance(grad, GradBuffers):
            raise TypeError(f"{name}: expected a pydiff.Tensor, got {type(grad).__name__}")
        if grad.device != self.device:
            raise ValueError(f"{name}: on device {grad.device!r}, primal on {self.device!r}")
        if grad.shape != self.shape:
            raise ValueError(
                f"{name}: gradient shape {grad.shape} does not match the primal's shape "
                f"{self.shape}"
            )
        want = self.grad_dtype.full_name
        if grad.element_type.full_name != want:
            raise ValueError(
                f"{name}: gradient dtype {grad.dtype!r} does not match the primal's "
                f"derivative type {want!r}"
            )
        return grad

    def with_grads(
        self,
        grad_in: "Self | None" = None,
        grad_out: "Self | None" = None,
        zero: bool = True,
        *,
        ones: bool = False,
    ) -> "Self":
        """A tensor on the same storage with gradient buffers attached.

        With no buffers given, one new buffer serves as grad_in and grad_out. Buffers you
        pass are validated (shape, dtype, device) and kept as they are: ``zero`` applies
        only to buffers pydiff allocates (SlangPy also clears yours, losing an upstream
        gradient). ``ones=True`` fills a new shared buffer with ones, the usual upstream
        gradient of an output.

        >>> y = module.f(x, _result="tensor").with_grads(ones=True)
        >>> module.f.bwds(x, _result=y)
        """
        self._sync_view()
        if grad_in is not None:
            self.check_grad(grad_in, "grad_in")
        if grad_out is not None:
            self.check_grad(grad_out, "grad_out")
        if grad_in is None and grad_out is None:
            grad_in = grad_out = self.new_grad_buffer(zero and not ones)
            if ones:
                grad_in.fill(1.0)
        else:
            grad_in = grad_in if grad_in is not None else self.new_grad_buffer(zero)
            grad_out = grad_out if grad_out is not None else self.new_grad_buffer(zero)
        return type(self)(
            self._native if self._shape else self._native.view(()),
            self._device,
            grad_in,
            grad_out,
            storage=self.storage,
            zero_policy=self.zero_policy,
        )

    def share_grads(self, other: "Self") -> None:
        """Route this tensor's gradients to ``other``'s from now on, as a view's go to its
        base (e.g. the tape's copy of an in-place argument's values before the call): it
        follows ``other``'s current gradient buffers (also ones lent or attached later) and
        its zeroing policy (``zero_policy`` reads and sets ``other``'s). A copy of either
        taken now would let a backward add into a buffer ``other`` no longer uses, or under
        a policy ``other`` no longer has.

        >>> before = x.copy_values(); before.share_grads(x)   # before.grad is x.grad
        """
        if other.shape != self._shape:
            raise ValueError(
                f"share_grads: this tensor's shape {self._shape} is not the shape "
                f"{other.shape} of the tensor whose gradient buffers it would share"
            )
        self._base = other.base if other.base is not None else other
        self._grad_in = self._grad_out = None  # (read from the base when next used)
        self._viewed, self._bound = (None, None), None
        self._zero_pending = False
        self._zero_policy = None  # (a tensor with a base has none of its own)

    def lend_grads(self) -> Callable[[], None]:
        """Give this tensor (a view: its base) a fresh zeroed gradient buffer until the
        returned function is called, which puts its own back as they were: a backward in
        between leaves its ``.grad`` untouched (a transform's, through a closure's tensor).

        >>> give_back = w.lend_grads(); tape.backward(y); give_back()
        """
        if self._base is not None:
            return self._base.lend_grads()
        own = (self._grad_in, self._grad_out, self._zero_pending)
        self._grad_in = self._grad_out = self.new_grad_buffer()
        self._zero_pending, self._bound = False, None

        def give_back() -> None:
            self._grad_in, self._grad_out, self._zero_pending = own
            self._bound = None

        return give_back

    def requires_grad_(self, flag: bool = True, *, zero_later: bool = False) -> "Self":
        """Attach (or drop) a zeroed shared gradient buffer in place; returns self (a view:
        its base's, which it shares). ``zero_later``: the buffer is made (zeroed, in order
        with the pending work) only when first read or bound: a recorded call's results
        (``requires_grad`` is True at once; ``zero_grad`` leaves it owed). A backward that
        never reaches a result makes none (a new pooled buffer is ~10 us of host time), and
        a separate zeroing submission (~50 us on lavapipe) is never needed.

        >>> y.requires_grad_(True, zero_later=True)   # y.grad reads zeros, as always
        """
        if self._base is not None:
            self._base.requires_grad_(flag, zero_later=zero_later)
            self._sync_view()
            return self
        if flag and not self.requires_grad:
            if zero_later:  # (made by _settle when first needed)
                self._zero_pending = True
            else:
                self._grad_in = self._grad_out = self.new_grad_buffer()
        elif not flag:
            self._grad_in = self._grad_out = None
            self._zero_pending = False
        self._bound = None
        return self

    def zero_grad(self, encoder: Any = None) -> "Self":
        """Zero the gradient buffers (grad_in and grad_out) in order with the commands of
        ``encoder``, else of this context's batch or the device's deferred list (see
        ``Tensor.zero_``); returns self. A buffer still owed (``zero_later``) stays owed: it
        is zeroed when made."""
        if self._zero_pending and self._grad_in is None and self._grad_out is None:
            return self
        self._zero_pending = False  # (zeroed here: not again when first read)
        grad_in, grad_out = self.grad_in, self.grad_out
        if grad_in is not None:
            grad_in.zero_(encoder)
        if grad_out is not None and grad_out is not grad_in:
            grad_out.zero_(encoder)
        return self


def view_of(grad: Any, shape: Sequence[int], what: str) -> Any:
    """``grad`` (a gradient buffer) viewed in ``shape``: what a view of its primal shares
    (``grad`` itself in its own shape)."""
    if grad.shape == tuple(shape):
        return grad
    if not grad.native.is_contiguous():
        raise ValueError(
            f"reshape: the tensor's {what} buffer is not contiguous, so a view cannot share "
            "it; give the tensor contiguous gradient buffers, or reshape t.detach()"
        )
    return type(grad)(grad.native.view(tuple(shape)), grad.device, storage=grad.storage)
