"""Batches of NumPy arrays for data-parallel training, each rank its share of every global
batch (``pydiff.distributed.ShardedLoader``), and the argument check the distributed module
shares with it.

    loader = ShardedLoader(x_train, y_train, batch_size=32, seed=0)   # rank/world from torch
    for xb, yb in loader: ...
"""

from __future__ import annotations

import operator
import sys
from typing import Any, Iterator

import numpy as np

from .errors import DistributedError


def whole_number(value: Any, what: str, minimum: int = 0) -> int:
    """``value`` as an int of at least ``minimum`` (ints and NumPy integers, not bools,
    floats or strings), else TypeError / ValueError naming ``what``.

    >>> whole_number(3, "ShardedLoader: seed")     # 3
    """
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{what}={value!r} must be an int, not a bool")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{what}={value!r} must be an int, not {type(value).__name__}") from None
    if number < minimum:
        raise ValueError(f"{what}={number} must be >= {minimum}")
    return number


def _rank_and_size() -> tuple[int, int]:
    dist = getattr(sys.modules.get("torch"), "distributed", None)
    if dist is None or not dist.is_initialized():
        raise DistributedError(
            "ShardedLoader: no process group to take rank and world_size from: call "
            "torch.distributed.init_process_group (or pydiff.distributed.init_process_group) "
            "first, or pass rank= and world_size="
        )
    return dist.get_rank(), dist.get_world_size()


class ShardedLoader:
    """Batches of NumPy arrays, each rank its share: epoch ``e`` shuffles the samples with
    ``numpy.random.default_rng((seed, e))`` (the same order on every rank), cuts it into
    global batches of ``batch_size * world_size`` samples (the remainder dropped, so every
    rank has the same number of batches) and gives rank ``r`` the ``r``-th ``batch_size``
    of each. The ranks' batches of one step together are exactly the batch one process
    with ``batch_size * world_size`` and the same seed would take.

    >>> loader = ShardedLoader(x_train, y_train, batch_size=32, seed=0)
    >>> for epoch in range(10):
    ...     loader.set_epoch(epoch)
    ...     for xb, yb in loader: ...
    """

    def __init__(
        self,
        *arrays: np.ndarray,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
    ):
        if not arrays:
            raise ValueError("ShardedLoader: no arrays given")
        self.arrays = [np.asarray(a) for a in arrays]
        for k, a in enumerate(self.arrays):
            if a.ndim == 0:
                raise ValueError(
                    f"ShardedLoader: arrays[{k}] is 0-d (shape ()); each array needs a first "
                    "axis of samples"
                )
        lengths = {len(a) for a in self.arrays}
        if len(lengths) != 1:
            raise ValueError(f"ShardedLoader: arrays of different lengths {sorted(lengths)}")
        if rank is None or world_size is None:
            group_rank, group_size = _rank_and_size()
            rank = group_rank if rank is None else rank
            world_size = group_size if world_size is None else world_size
        self.rank = whole_number(rank, "ShardedLoader: rank")
        self.world_size = whole_number(world_size, "ShardedLoader: world_size", minimum=1)
        if not self.rank < self.world_size:
            raise ValueError(f"ShardedLoader: rank={self.rank} of world_size={self.world_size}")
        self.batch_size = whole_number(batch_size, "ShardedLoader: batch_size", minimum=1)
        self.seed = whole_number(seed, "ShardedLoader: seed")
        self.shuffle, self.epoch = bool(shuffle), 0
        self.samples = lengths.pop()
        if len(self) == 0:
            raise ValueError(
                f"ShardedLoader: {self.samples} samples make no global batch of "
                f"{self.batch_size} x {self.world_size} ranks"
            )

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose order the next iteration takes (set it on every rank alike)."""
        self.epoch = whole_number(epoch, "ShardedLoader.set_epoch: epoch")

    def __len__(self) -> int:
        return self.samples // (self.batch_size * self.world_size)

    def __iter__(self) -> Iterator[tuple[np.ndarray, ...]]:
        if self.shuffle:
            order = np.random.default_rng((self.seed, self.epoch)).permutation(self.samples)
        else:
            order = np.arange(self.samples)
        step = self.batch_size * self.world_size
        for k in range(len(self)):
            first = k * step + self.rank * self.batch_size
            idx = order[first : first + self.batch_size]
            yield tuple(a[idx] for a in self.arrays)
