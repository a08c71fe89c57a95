"""Gradient accumulation over micro-batches: the data-parallel replicas synced on the last."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Sync the gradients over the data-parallel replicas on the last micro-batch only.

    DDP skips its all-reduce (no_sync). FSDP2 still reduce-scatters every micro-batch over
    its shards (skipping that would accumulate unsharded gradients, a full-size copy per
    rank, which is the memory FSDP exists to save), but its all-reduce across replicas (HSDP,
    or replication beside TP/PP) waits for the last: the sharded sum it accumulates meanwhile
    is the size of the sharded gradient the layout holds anyway. A module without replicas
    has no all-reduce to skip."""
    if not enabled and isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
        return
    if not enabled and isinstance(model, FSDPModule):
        model.set_requires_all_reduce(False)
        try:
            yield
        finally:
            model.set_requires_all_reduce(True)
        return
    yield
