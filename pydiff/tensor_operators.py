"""The operators and NumPy-like methods of ``Tensor`` (``x + y``, ``x[1:3]``, ``x.T``,
``x.sum()``): each runs what ``pydiff.tensor_api`` provides through ``tensor_methods``, so
they are differentiable and recorded on the active tape like the ops they call.

    y = (x * 2.0 + 1.0)[1:3].sum()      # ops.mul, ops.add, a slice, ops.sum
    z = w.T @ x                         # a transposed copy, ops.matmul
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from . import foreign, temporary_copies, tensor_methods

# Operands of the arithmetic operators; anything else gives Python's TypeError.
_OPERANDS = (numbers.Real, np.ndarray, np.generic, list, tuple)


def _operand(other: Any, symbol: str) -> bool:
    """Whether the operator ``symbol`` takes ``other``; a TypeError naming the framework for
    another framework's tensor (Python's own message would read "'Tensor' and 'Tensor'")."""
    if isinstance(other, _OPERANDS) or isinstance(other, TensorOperators):
        return True
    name = foreign.framework(other)
    if name is not None:
        raise TypeError(
            f"unsupported operand types for {symbol}: pydiff.Tensor and {name}.Tensor: pydiff's "
            f"operators do not take {name} tensors; {foreign.advice(other)}"
        )
    return False


def _comparison(symbol: str, other: Any) -> str:
    what = "a pydiff.Tensor" if isinstance(other, TensorOperators) else type(other).__name__
    return (
        f"pydiff.Tensor {symbol} {what}: tensors do not compare with {symbol} (neither by value "
        f"nor by identity); compare their values: x.numpy() {symbol} v (elementwise, as NumPy), "
        f"float(x) {symbol} v for one element, or `x is y` for the same tensor"
    )


def copy_refusal(dst: Any, src: Any) -> Exception:
    """The error of ``dst.copy_(src)`` for a ``src`` that is not a tensor of ``dst``'s shape and
    dtype (host values go through ``copy_from_numpy``).

    >>> raise copy_refusal(x, np.ones(3))    # TypeError: ... use x.copy_from_numpy(values)
    """
    if not hasattr(src, "native"):
        return TypeError(
            f"copy_: the source is a {type(src).__name__}, not a pydiff Tensor; copy host "
            "values with dst.copy_from_numpy(values)"
        )
    return ValueError(f"copy_: {src!r} does not match {dst!r}")


class TensorOperators:
    """Mixed into ``Tensor``: operators, indexing and math methods."""

    __array_ufunc__ = None  # NumPy defers to the operators below: `array + x` stays a Tensor

    def __array_function__(self, func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
        """``np.dot(x, y)``, ``np.sum(x)``, ...: see ``pydiff.numpy_functions`` (refused where
        a NumPy copy of the values would lose the gradient)."""
        return tensor_methods.call("array_function", func, args, kwargs)

    def __getitem__(self, key: Any) -> Any:
        return tensor_methods.call("getitem", self, key)

    def __setitem__(self, key: Any, value: Any) -> None:
        """``x[key] = value``: the elements ``x[key]`` selects written in place (the keys of
        ``x[key]``; a number, NumPy array or tensor broadcast as NumPy): see
        ``pydiff.tensor_setitem``."""
        temporary_copies.refuse(self, "__setitem__")  # (x[1:3][0] = v: a copy nothing holds)
        tensor_methods.call("setitem", self, key, value)

    def __add__(self, other: Any) -> Any:
        if not _operand(other, "+"):
            return NotImplemented
        return tensor_methods.call("add", self, other)

    def __radd__(self, other: Any) -> Any:
        if not _operand(other, "+"):
            return NotImplemented
        return tensor_methods.call("add", other, self)

    def __sub__(self, other: Any) -> Any:
        if not _operand(other, "-"):
            return NotImplemented
        return tensor_methods.call("sub", self, other)

    def __rsub__(self, other: Any) -> Any:
        if not _operand(other, "-"):
            return NotImplemented
        return tensor_methods.call("sub", other, self)

    def __mul__(self, other: Any) -> Any:
        if not _operand(other, "*"):
            return NotImplemented
        return tensor_methods.call("mul", self, other)

    def __rmul__(self, other: Any) -> Any:
        if not _operand(other, "*"):
            return NotImplemented
        return tensor_methods.call("mul", other, self)

    def __truediv__(self, other: Any) -> Any:
        if not _operand(other, "/"):
            return NotImplemented
        return tensor_methods.call("div", self, other)

    def __rtruediv__(self, other: Any) -> Any:
        if not _operand(other, "/"):
            return NotImplemented
        return tensor_methods.call("div", other, self)

    def __pow__(self, exponent: Any) -> Any:
        if not isinstance(exponent, _OPERANDS):
            _operand(exponent, "**")  # another framework's tensor: refused by name
        return tensor_methods.call("pow", self, exponent)

    def __matmul__(self, other: Any) -> Any:
        if not _operand(other, "@"):
            return NotImplemented
        return tensor_methods.call("matmul", self, other)

    def __rmatmul__(self, other: Any) -> Any:
        if not _operand(other, "@"):
            return NotImplemented
        return tensor_methods.call("matmul", other, self)

    def __neg__(self) -> Any:
        return tensor_methods.call("neg", self)

    def __pos__(self) -> Any:
        return self

    def sum(
        self, axis: Any = None, keepdims: bool = False, dtype: Any = None, out: Any = None
    ) -> Any:
        """``pydiff.ops.sum(self, axis, keepdims)``; ``axis`` may be a tuple. (``dtype`` and
        ``out`` exist for ``np.sum(x)``: only None.)"""
        _numpy_extras("sum", dtype, out)
        return tensor_methods.call("sum", self, axis, keepdims)

    def mean(
        self, axis: Any = None, keepdims: bool = False, dtype: Any = None, out: Any = None
    ) -> Any:
        """``pydiff.ops.mean(self, axis, keepdims)``; ``axis`` may be a tuple."""
        _numpy_extras("mean", dtype, out)
        return tensor_methods.call("mean", self, axis, keepdims)

    # --- Python conversions of the values (they read the tensor back) ------------------
    def __len__(self) -> int:
        if not self.shape:  # type: ignore[attr-defined]
            raise TypeError("len() of a 0-d tensor (shape ()), as NumPy")
        return self.shape[0]  # type: ignore[attr-defined]

    def __iter__(self) -> Any:
        """The rows, as copies (``self[i]``): in-place writes to them are refused, since they
        would never reach this tensor (NumPy's and PyTorch's rows are views)."""
        n = len(self)  # TypeError for a 0-d tensor, as NumPy
        return _rows(self, range(n))

    def __reversed__(self) -> Any:
        """``reversed(x)``: the rows last first, marked as ``__iter__``'s (without it Python
        indexed ``x[i]`` itself, and writes to those rows went unseen)."""
        return _rows(self, range(len(self) - 1, -1, -1))

    # `row += v` on a row iteration gave: refused (NumPy writes its view, the tensor's row);
    # any other tensor: NotImplemented, so Python computes `row + v` and rebinds the name.
    def __iadd__(self, other: Any) -> Any:
        return temporary_copies.refuse_row(self, "row += value") or NotImplemented

    def __isub__(self, other: Any) -> Any:
        return temporary_copies.refuse_row(self, "row -= value") or NotImplemented

    def __imul__(self, other: Any) -> Any:
        return temporary_copies.refuse_row(self, "row *= value") or NotImplemented

    def __itruediv__(self, other: Any) -> Any:
        return temporary_copies.refuse_row(self, "row /= value") or NotImplemented

    def __ipow__(self, other: Any) -> Any:
        return temporary_copies.refuse_row(self, "row **= value") or NotImplemented

    def __imatmul__(self, other: Any) -> Any:
        return temporary_copies.refuse_row(self, "row @= value") or NotImplemented

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """The values as a NumPy array: always a copy read back from the device (NumPy 2's
        ``np.asarray(x, copy=False)`` raises ValueError, as for any array it cannot view).
        Refused (TypeError) where the copy would lose a derivative: see
        ``numpy_functions.refuse_lost_conversion`` (``np.sum([x, y])`` on a tape)."""
        tensor_methods.call("refuse_lost_conversion", self)
        if copy is False:
            raise ValueError(
                "np.asarray(x, copy=False) / np.array(x, copy=False): a pydiff.Tensor's values "
                "live in a device buffer and cannot be viewed without a copy; use np.asarray(x) "
                "or x.numpy() (a copy: writes to it do not reach the tensor; x.copy_from_numpy "
                "writes values back)"
            )
        arr = self.numpy()  # type: ignore[attr-defined]
        return arr if dtype is None else arr.astype(dtype)

    def item(self) -> float:
        arr = self.numpy()  # type: ignore[attr-defined]
        if arr.size != 1:
            raise ValueError(
                f"item() needs a tensor with one element, this one has shape {self.shape}"  # type: ignore[attr-defined]
            )
        return arr.reshape(()).item()

    def __bool__(self) -> bool:
        values = self.numpy()  # type: ignore[attr-defined]
        if values.size != 1:
            raise ValueError(
                f"the truth value of a tensor of shape {self.shape} is ambiguous (as in NumPy): "  # type: ignore[attr-defined]
                "use (x != 0).any()-style reductions on the values (np.asarray(x))"
            )
        return bool(values.reshape(-1)[0])

    def __float__(self) -> float:
        return float(self.item())  # type: ignore[attr-defined]

    def __int__(self) -> int:
        return int(self.item())  # type: ignore[attr-defined]

    def __format__(self, spec: str) -> str:
        if not spec:
            return repr(self)
        return format(self.item(), spec)  # type: ignore[attr-defined]

    # `x == v` refused rather than by identity (a silent False in `if loss == 0:`) or by
    # value (pydiff keeps tensors in lists and dicts by identity): hashing stays by identity.
    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        raise TypeError(_comparison("==", other))

    def __ne__(self, other: object) -> bool:
        raise TypeError(_comparison("!=", other))

    def __contains__(self, value: Any) -> bool:
        return bool(np.any(self.numpy() == value))  # type: ignore[attr-defined]

    def fill(self, value: float) -> Any:
        """Set every component to ``value``; returns self (``copy_from_numpy`` of them)."""
        temporary_copies.refuse(self, "fill")  # (x[1:3].fill(0): a copy nothing holds)
        arr = np.full(self.expected_numpy_shape(), value)  # type: ignore[attr-defined]
        return self.copy_from_numpy(arr, caller="Tensor.fill")  # type: ignore[attr-defined]

    def exp(self) -> Any:
        return tensor_methods.call("exp", self)

    def log(self) -> Any:
        return tensor_methods.call("log", self)

    def tanh(self) -> Any:
        return tensor_methods.call("tanh", self)

    def sqrt(self) -> Any:
        return tensor_methods.call("sqrt", self)

    def sin(self) -> Any:
        return tensor_methods.call("sin", self)

    def cos(self) -> Any:
        return tensor_methods.call("cos", self)

    def sigmoid(self) -> Any:
        return tensor_methods.call("sigmoid", self)

    def relu(self) -> Any:
        return tensor_methods.call("relu", self)

    def clone(self) -> Any:
        """A copy in new storage. On an active tape, a tensor that requires grad is copied by
        a recorded op, so gradients reach it through the copy (as ``torch.clone``);
        ``copy_values`` never records.

        >>> y = x.clone()
        """
        return tensor_methods.call("clone", self)

    def transpose(self, *axes: int) -> Any:
        """The axes reversed (or permuted as ``axes``), a copy recorded on the tape."""
        return tensor_methods.call("transpose", self, axes)

    @property
    def T(self) -> Any:  # noqa: N802 (NumPy's name)
        return tensor_methods.call("transpose", self, ())

    def astype(self, dtype: Any) -> Any:
        """A copy converted to ``dtype`` (float <-> half carry gradients)."""
        return tensor_methods.call("astype", self, dtype)

    def to(self, device: Any) -> Any:
        """The tensor on ``device`` (a ``pydiff.Device`` or a type name): itself if it is there
        already, else a copy through the host. On a tape a float tensor's copy is recorded: the
        gradient goes back to this tensor on its own device (a model split over two devices
        trains as on one). ``pydiff.tensor(x.numpy(), device=d)`` copies the values only.

        >>> h = layer1(x).to(dev2)
        """
        return tensor_methods.call("to", self, device)

    def __deepcopy__(self, memo: dict) -> Any:
        """``copy.deepcopy(x)`` (of a layer, an optimizer, a dict holding tensors): a copy on
        the same device, ``requires_grad`` kept, a fresh gradient (``tensor_pickle``)."""
        return tensor_methods.call("deepcopy", self, memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """``pickle``: the values, dtype and ``requires_grad``; loads on the default device."""
        return tensor_methods.call("reduce", self)

    def __copy__(self) -> Any:
        """``copy.copy(x)``: another Tensor object on the same storage and gradient buffers
        (as before ``__reduce_ex__`` existed; torch's ``copy.copy`` shares storage too).
        Gradient buffers still owed (``zero_later``) are made first: each copy would make its
        own, and a backward would add into one that the other's producer never reads."""
        _ = self.grad_in  # (owed: made and zeroed now; else just read)
        other = type(self).__new__(type(self))
        other.__dict__.update(self.__dict__)
        return other

    def __dlpack__(self, *, stream: Any = None, **kwargs: Any) -> Any:
        """DLPack export (``torch.from_dlpack(x)``, ``np.from_dlpack(x)``): on a CUDA device
        this tensor's own buffer (zero-copy; needs torch), elsewhere a host copy."""
        return tensor_methods.call("__dlpack__", self, stream=stream, **kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return tensor_methods.call("__dlpack_device__", self)


def _rows(x: Any, indices: range) -> Any:
    for i in indices:
        row = x[i]
        temporary_copies.mark_row(row, i, x.shape)
        yield row


def _numpy_extras(name: str, dtype: Any, out: Any) -> None:
    if dtype is not None or out is not None:
        raise TypeError(f"Tensor.{name}: dtype= and out= are not supported (only None)")
