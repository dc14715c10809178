"""Data-parallel training over torch.distributed: parameters broadcast, gradients all-reduced.

pydiff has no communication layer of its own: the process group is torch's
(``torch.distributed.init_process_group``; gloo on CPUs and lavapipe, NCCL between CUDA
GPUs), launched by ``torchrun``. torch is imported only when a function here is called.

    pydiff.distributed.init_process_group(timeout=60.0)    # or torch's own, under torchrun
    pydiff.distributed.broadcast(params)                     # rank 0's values everywhere
    loader = pydiff.distributed.ShardedLoader(x, y, batch_size=32, seed=0)
    for xb_host, yb_host in loader:                          # this rank's share of each batch
        ...forward, tape.backward(loss)...
        pydiff.distributed.all_reduce_grads(params)          # mean over the ranks
        opt.step()

Gradients travel in one flat buffer per dtype, cut into buckets of ``bucket_bytes``, in the
order the tensors are listed: every rank sends the same buckets, and gloo's sums are
bit-identical on every rank, so every rank steps to bit-identical parameters. On Vulkan
(lavapipe) each bucket makes one host round trip: device copies gather it into one flat
pydiff tensor, one read into NumPy, whose memory a torch CPU tensor shares for the
collective, one upload, device copies back. On CUDA ``cuda_views`` is the hook for NCCL
without a host round trip (see docs/distributed.md). A peer that dies or hangs past the
group's timeout makes the collective raise ``DistributedError`` on the other ranks, never a
silent hang.
"""

from __future__ import annotations

import datetime
import hashlib
import math
import time
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from . import capturing
from .creation import empty
from .errors import DistributedError
from .sharded_loader import ShardedLoader, whole_number
from .tensor import Tensor
from .torch_interop import to_torch

__all__ = [
    "BUCKET_BYTES",
    "OPS",
    "ShardedLoader",
    "all_reduce_grads",
    "broadcast",
    "cuda_views",
    "init_process_group",
    "rank",
    "world_size",
]

#: Default bucket size (bytes), DistributedDataParallel's ``bucket_cap_mb`` of 25 MiB.
BUCKET_BYTES = 25 * 2**20
OPS = ("mean", "sum")
#: NumPy dtypes of values as torch dtypes a collective takes (uint32 travels as int32 bits:
#: broadcast copies bits; gradients are floats).
_WIRE = {"float32": "float32", "float16": "float16", "int32": "int32", "uint32": "int32"}
#: pydiff scalar types that travel, and their NumPy dtypes.
_NUMPY = {"float": np.float32, "half": np.float16, "int": np.int32, "uint": np.uint32}
_SCALAR = {np.dtype(v).name: k for k, v in _NUMPY.items()}
#: The timeout given to ``init_process_group`` here (seconds), for error messages.
_timeout: list[float] = []


def _torch() -> Any:
    try:
        import torch
        import torch.distributed as dist
    except ImportError:
        raise ImportError(
            "pydiff.distributed needs torch (torch.distributed): pip install 'pydiff[torch]'"
        ) from None
    if not dist.is_available():
        raise DistributedError("pydiff.distributed: this torch build has no torch.distributed")
    return torch


def _group(what: str) -> Any:
    """torch.distributed, checked to have a default process group."""
    torch = _torch()
    if not torch.distributed.is_initialized():
        raise DistributedError(
            f"pydiff.distributed.{what}: no process group. Call "
            "torch.distributed.init_process_group(backend='gloo') (or "
            "pydiff.distributed.init_process_group(timeout=...)) in every process first; "
            "torchrun sets the RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT it reads"
        )
    return torch.distributed


def init_process_group(backend: str | None = None, timeout: float = 300.0, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group`` with a timeout in seconds (torch's default is
    30 minutes): a collective waiting longer than ``timeout`` for a peer raises
    ``DistributedError``, as does a rank that never joins. ``backend`` defaults to gloo;
    pass ``"nccl"`` between CUDA GPUs. Other keywords go to torch (``init_method``, ``rank``,
    ``world_size``); under torchrun the environment gives them.

    >>> pydiff.distributed.init_process_group(timeout=60.0)
    """
    torch = _torch()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"init_process_group: timeout={timeout!r} must be a number of seconds")
    if not 0 < timeout < math.inf:
        raise ValueError(f"init_process_group: timeout={timeout} must be > 0 seconds, finite")
    try:
        torch.distributed.init_process_group(
            backend or "gloo", timeout=datetime.timedelta(seconds=timeout), **kwargs
        )
    except RuntimeError as exc:  # DistStoreError: a rank never joined within the timeout
        raise DistributedError(
            f"pydiff.distributed.init_process_group: the process group did not form within "
            f"{timeout:g} s (a rank that never started, or a wrong MASTER_ADDR/MASTER_PORT): "
            f"{exc}"
        ) from exc
    _timeout[:] = [float(timeout)]


def rank() -> int:
    """This process's rank in the default process group (0 .. world_size() - 1)."""
    return _group("rank").get_rank()


def world_size() -> int:
    """The number of processes in the default process group."""
    return _group("world_size").get_world_size()


def _run(what: str, dist: Any, collective: Callable[[], Any]) -> None:
    """Run a collective; a failure (a peer gone, or the timeout passed) as DistributedError."""
    me, n = dist.get_rank(), dist.get_world_size()
    start = time.monotonic()
    try:
        collective()
    except RuntimeError as exc:  # gloo: DistBackendError "Connection closed", "Timed out"
        limit = f"{_timeout[0]:g} s" if _timeout else "the one given to init_process_group"
        raise DistributedError(
            f"pydiff.distributed.{what} failed on rank {me} of {n} after "
            f"{time.monotonic() - start:.1f} s: a peer rank exited or hung past the process "
            f"group's timeout ({limit}; set it with init_process_group(timeout=...)). The "
            f"group cannot be used again: end this process. torch said: {exc}"
        ) from exc


def _buckets(sizes: Sequence[tuple[str, int]], bucket_bytes: int) -> list[list[int]]:
    """Indices of the (dtype, bytes) ``sizes`` grouped into buckets: one dtype per bucket, in
    list order (dtypes in order of first appearance), a new bucket when the next one would
    pass ``bucket_bytes`` (one larger than that is a bucket of its own)."""
    by_dtype: dict[str, list[int]] = {}
    for k, (dtype, _) in enumerate(sizes):
        by_dtype.setdefault(dtype, []).append(k)
    out: list[list[int]] = []
    for members in by_dtype.values():
        current: list[int] = []
        size = 0
        for k in members:
            nbytes = sizes[k][1]
            if current and size + nbytes > bucket_bytes:
                out.append(current)
                current, size = [], 0
            current.append(k)
            size += nbytes
        out.append(current)
    return out


def _layout(t: Tensor) -> tuple[str, int]:
    """(NumPy dtype name, bytes) of the values of ``t``, without reading them."""
    np_type = _NUMPY.get(t.scalar_type)
    if np_type is None:
        raise TypeError(
            f"pydiff.distributed: a tensor of dtype {t.dtype!r} cannot travel (scalar types: "
            f"{', '.join(_NUMPY)})"
        )
    count = math.prod(t.expected_numpy_shape())
    return np.dtype(np_type).name, count * np.dtype(np_type).itemsize


def _one_buffer(tensors: Sequence[Tensor]) -> bool:
    """Whether ``tensors`` can be gathered into one flat tensor on the device (one device,
    contiguous values, more than one tensor)."""
    return (
        len(tensors) > 1
        and len({id(t.device) for t in tensors}) == 1
        and all(t.native.is_contiguous() for t in tensors)
    )


def _copies(tensors: Sequence[Tensor], flat: Tensor, into_flat: bool) -> None:
    """Device copies between each of ``tensors`` and its span of ``flat``, one submission."""
    dev = flat.device.native
    with flat.device.queue.lock:  # recording and submitting: exclusive (command_queue)
        encoder = dev.create_command_encoder()
        at = flat.native.offset * int(flat.native.dtype.buffer_layout.stride)
        for t in tensors:
            n = t.native
            stride = int(n.dtype.buffer_layout.stride)
            nbytes = n.element_count * stride
            if into_flat:
                encoder.copy_buffer(flat.native.storage, at, n.storage, n.offset * stride, nbytes)
            else:
                encoder.copy_buffer(n.storage, n.offset * stride, flat.native.storage, at, nbytes)
            at += nbytes
        dev.submit_command_buffer(encoder.finish())


def _read_bucket(tensors: Sequence[Tensor], dtype: np.dtype) -> np.ndarray:
    """The values of ``tensors`` one after the other: copied into one flat tensor on the
    device, then one read to the host."""
    if not _one_buffer(tensors):
        return np.concatenate([t.numpy().ravel() for t in tensors]).astype(dtype, copy=False)
    count = sum(math.prod(t.expected_numpy_shape()) for t in tensors)
    flat = empty((count,), dtype=_SCALAR[dtype.name], device=tensors[0].device)
    _copies(tensors, flat, into_flat=True)
    return flat.numpy().ravel()


def _write_bucket(tensors: Sequence[Tensor], values: np.ndarray) -> None:
    """Overwrite ``tensors`` with ``values`` (one after the other): one upload, then device
    copies; each tensor counts a write, as a host write does."""
    if not _one_buffer(tensors):
        offset = 0
        for t in tensors:
            shape = t.expected_numpy_shape()
            n = math.prod(shape)
            t.copy_from_numpy(values[offset : offset + n].reshape(shape))
            offset += n
        return
    flat = empty((values.size,), dtype=_SCALAR[values.dtype.name], device=tensors[0].device)
    flat.copy_from_numpy(values)
    _copies(tensors, flat, into_flat=False)
    for t in tensors:
        t.storage.holds_result_of = None
        t.storage.wrote("pydiff.distributed", everything=True)


def cuda_views(tensors: Sequence[Tensor]) -> list | None:
    """The CUDA path's hook: torch CUDA tensors sharing the memory of ``tensors`` (through
    ``pydiff.to_torch``), or None where to_torch gives host copies (Vulkan; CUDA until
    to_torch exchanges through DLPack, the interop issue's zero-copy path). With views, a
    bucket is one ``torch.cat`` on the GPU, the NCCL collective, and copies back into the
    views: no host round trip."""
    if not tensors or any(t.device.type != "cuda" for t in tensors):
        return None
    views = [to_torch(t) for t in tensors]
    return views if all(v.is_cuda for v in views) else None


def _exchange(
    torch: Any,
    tensors: list[Tensor],
    bucket_bytes: int,
    collective: Callable[[Any], None],
    divisor: int = 1,
) -> int:
    """Run ``collective`` on flat buffers holding the values of ``tensors`` (in place), bucket
    by bucket, divide the results by ``divisor`` and write them back; returns the bytes sent.
    (The division is NumPy's on the host: torch's CPU kernels would start its thread pool,
    whose spinning threads slow the other ranks on a machine of few CPUs.)"""
    views = cuda_views(tensors)
    if views is not None:
        return _exchange_cuda(torch, tensors, views, bucket_bytes, collective, divisor)
    sizes = [_layout(t) for t in tensors]
    sent = 0
    for bucket in _buckets(sizes, bucket_bytes):
        members = [tensors[k] for k in bucket]
        dtype = np.dtype(sizes[bucket[0]][0])
        values = _read_bucket(members, dtype)
        if divisor != 1:  # before the sum, as DDP: a mean whose sum overflows stays finite
            np.divide(values, divisor, out=values)
        buf = torch.from_numpy(values.view(_WIRE[dtype.name]))  # the bucket's one host copy
        collective(buf)
        result = buf.numpy().view(dtype)
        sent += result.nbytes
        _write_bucket(members, result)
    return sent


def _exchange_cuda(
    torch: Any,
    tensors: list[Tensor],
    views: list,
    bucket_bytes: int,
    collective: Callable[[Any], None],
    divisor: int,
) -> int:
    for dev in {id(t.device): t.device for t in tensors}.values():
        dev.wait()  # pydiff's kernels that wrote the values have finished before torch reads
    sent = 0
    sizes = [(str(v.dtype), v.numel() * v.element_size()) for v in views]
    for bucket in _buckets(sizes, bucket_bytes):
        flat = torch.cat([views[k].reshape(-1) for k in bucket])
        if divisor != 1:  # before the sum, as on the host path
            flat.div_(divisor)
        collective(flat)
        sent += flat.numel() * flat.element_size()
        offset = 0
        for k in bucket:
            n = views[k].numel()
            views[k].copy_(flat[offset : offset + n].view_as(views[k]))
            offset += n
    torch.cuda.synchronize()  # the copies land before pydiff's own queue reads the buffers
    for t in tensors:
        t.storage.holds_result_of = None
        t.storage.wrote("pydiff.distributed", everything=True)
    return sent


def _tensors(tensors: Iterable[Tensor] | Tensor, what: str) -> list[Tensor]:
    out = [tensors] if isinstance(tensors, Tensor) else list(tensors)
    for k, t in enumerate(out):
        if not isinstance(t, Tensor):
            raise TypeError(f"{what}: tensors[{k}] is a {type(t).__name__}, not a pydiff.Tensor")
    if not out:
        raise ValueError(f"{what}: no tensors given")
    return out


def _agree(dist: Any, what: str, tensors: list[Tensor], *settings: Any) -> None:
    """Check that every rank calls ``what`` with the same tensor layouts (dtypes and shapes,
    in order) and settings, by one small all-reduce of a hash: a mismatch would pair
    unrelated buckets (silently wrong, or gloo aborting the process on a size mismatch)."""
    layout = [(t.dtype, tuple(t.shape)) for t in tensors]
    digest = hashlib.sha256(repr((what, layout, settings)).encode()).digest()
    mine = int.from_bytes(digest[:7], "little")  # 56 bits: its negation fits int64 too
    if _max_over_ranks(dist, what, [mine, -mine]) != [mine, -mine]:
        raise DistributedError(
            f"pydiff.distributed.{what}: the ranks called it with different tensors or "
            f"settings (this rank {dist.get_rank()}: {len(layout)} tensors {layout[:4]}"
            f"{' ...' if len(layout) > 4 else ''}, settings {settings}); every rank must list "
            "the same tensors (dtypes, shapes) in the same order, with the same op, src and "
            "bucket_bytes"
        )


def _max_over_ranks(dist: Any, what: str, values: list[int]) -> list[int]:
    """The element-wise maximum of ``values`` (int64s, as many on every rank) over the ranks."""
    torch = _torch()
    where = "cuda" if dist.get_backend() == "nccl" else "cpu"
    probe = torch.tensor(values, dtype=torch.int64, device=where)
    _run(what, dist, lambda: dist.all_reduce(probe, op=dist.ReduceOp.MAX))
    return probe.tolist()


def _bucket_bytes(value: Any, what: str) -> int:
    return whole_number(value, f"{what}: bucket_bytes", minimum=1)


def broadcast(
    tensors: Iterable[Tensor] | Tensor,
    src: int = 0,
    bucket_bytes: int = BUCKET_BYTES,
    check_layout: bool = True,
) -> int:
    """Overwrite the values of ``tensors`` on every rank with rank ``src``'s (before training:
    every rank starts from the same parameters). Bucketed like ``all_reduce_grads``; returns
    the bytes sent. Every rank must list the same tensors (shapes, dtypes) in the same order.

    >>> pydiff.distributed.broadcast([p for layer in layers for p in layer.parameters()])
    """
    tensors = _tensors(tensors, "broadcast")
    bucket_bytes = _bucket_bytes(bucket_bytes, "broadcast")
    src = whole_number(src, "broadcast: src")
    capturing.refuse("pydiff.distributed.broadcast (a collective across processes)")
    dist = _group("broadcast")
    if not 0 <= src < dist.get_world_size():
        raise ValueError(f"broadcast: src={src} is not a rank (world size {dist.get_world_size()})")
    if check_layout:
        _agree(dist, "broadcast", tensors, src, bucket_bytes)

    def collective(buf: Any) -> None:
        _run("broadcast", dist, lambda: dist.broadcast(buf, src=src))

    return _exchange(_torch(), tensors, bucket_bytes, collective)


def all_reduce_grads(
    tensors: Iterable[Tensor] | Tensor,
    op: str = "mean",
    bucket_bytes: int = BUCKET_BYTES,
    check_layout: bool = True,
) -> int:
    """Reduce the gradients (``.grad``) of ``tensors`` across the ranks, in place: their sum,
    or their mean (``op="mean"``: each rank divides by the world size before the sum, as DDP
    does, so a mean whose sum would overflow stays finite; the same on every rank).
    With each rank's loss a mean over an equal share of the batch, the mean is the gradient
    of the whole batch's mean loss. Returns the bytes all-reduced (per rank). A gradient
    that no rank wrote since it was zeroed (its parameter unused on every rank) is left
    as it is, zeros counting as no gradient, so the optimizer skips it as torch's DDP
    leaves its ``.grad`` None; one written on some rank counts as written on every rank.

    One flat buffer per dtype, in buckets of at most ``bucket_bytes`` (25 MiB), in the
    listed order: one collective per bucket, never one per tensor. Every rank must list the
    same tensors in the same order: each call checks that first (one small all-reduce;
    ``check_layout=False`` skips it, the caller then guaranteeing it). Not inside
    ``pydiff.capture``: capture the forward and
    backward apart from the optimizer step and call this between the replays.

    >>> pydiff.distributed.all_reduce_grads(params)           # then opt.step()
    """
    if op not in OPS:
        raise ValueError(f"all_reduce_grads: op={op!r}; expected one of {OPS}")
    tensors = _tensors(tensors, "all_reduce_grads")
    bucket_bytes = _bucket_bytes(bucket_bytes, "all_reduce_grads")
    grads = []
    for k, t in enumerate(tensors):
        if not t.requires_grad or t.grad is None:
            raise ValueError(
                f"all_reduce_grads: tensors[{k}] has no gradient (requires_grad=False); list "
                "the parameters whose gradients the ranks share"
            )
        grads.append(t.grad)
    capturing.refuse(
        "pydiff.distributed.all_reduce_grads (a collective across processes; capture the "
        "forward and backward, and the optimizer step, as two steps and all-reduce between "
        "their replays: docs/distributed.md)"
    )
    dist = _group("all_reduce_grads")
    n = dist.get_world_size()
    if check_layout:
        _agree(dist, "all_reduce_grads", grads, op, bucket_bytes)

    # A gradient no rank wrote since it was zeroed is zeros everywhere and stays "no
    # gradient" (the optimizers skip its parameter, as torch's DDP leaves an unused
    # parameter's .grad None): one small all-reduce of the flags, then only the others.
    mine = [int(g.storage.written_since_zeroed()) for g in grads]
    written = _max_over_ranks(dist, "all_reduce_grads", mine)
    grads = [g for g, flag in zip(grads, written) if flag]
    if not grads:
        return 0

    def collective(buf: Any) -> None:
        _run("all_reduce_grads", dist, lambda: dist.all_reduce(buf, op=dist.ReduceOp.SUM))

    sent = _exchange(_torch(), grads, bucket_bytes, collective, n if op == "mean" else 1)
    for g in grads:  # a backward's result still (STRICT refuses adding to it: zero_grad first)
        g.storage.mark_result(f"pydiff.distributed.all_reduce_grads ({op} over {n} ranks)")
    return sent
