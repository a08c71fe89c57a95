"""data=hf in a rank: the driver's tokenized cache (core/data_files.py) memory-mapped, each
split cut into non-overlapping windows of seq_len + 1 tokens, visited in a seeded per-epoch
order, read through a DataLoader. Ranks only read: the cache is written once, before any rank
starts.
"""

from __future__ import annotations

import multiprocessing

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from meshrun.core.config import DataConfig
from meshrun.core.data_files import TokenCache, n_windows


class WindowOrder:
    """Global sample i -> window: epoch e = i // n, window perm_e[i % n], perm_e a permutation
    seeded by (seed, e) (the identity without shuffle): the same sample is the same window in
    every layout, and each epoch visits every window once."""

    def __init__(self, n_windows: int, seed: int, shuffle: bool) -> None:
        self.n_windows = n_windows
        self.seed = seed
        self.shuffle = shuffle
        self._epoch: tuple[int, torch.Tensor] | None = None

    def windows(self, samples: range) -> list[int]:
        n = self.n_windows
        if not self.shuffle:
            return [i % n for i in samples]
        return [int(self._permutation(i // n)[i % n]) for i in samples]

    def _permutation(self, epoch: int) -> torch.Tensor:
        """The current epoch's, drawn once (steps go forward, an epoch is many steps)."""
        if self._epoch is None or self._epoch[0] != epoch:
            generator = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**63)
            self._epoch = (epoch, torch.randperm(self.n_windows, generator=generator))
        return self._epoch[1]


class HFWindows(Dataset):
    """One split's non-overlapping windows of `length` tokens: a map-style Dataset by window
    (for the DataLoader), and `batch` by global sample (through `order`), the interface of
    the other token sources."""

    def __init__(
        self, cache: TokenCache, span: range, length: int, order: WindowOrder, cfg: DataConfig
    ) -> None:
        self.cache = cache
        self.span = span
        self.length = length
        self.order = order
        self.cfg = cfg

    def __len__(self) -> int:
        return self.order.n_windows

    def __getitem__(self, window: int) -> torch.Tensor:
        start = self.span.start + window * self.length
        return torch.from_numpy(self.cache.tokens[start : start + self.length].astype(np.int64))

    def batch(self, samples: range, length: int, device: torch.device) -> torch.Tensor:
        """Random access, gathered on the host (the held-out stream's evaluation reads)."""
        assert length == self.length, f"windows are {self.length} tokens, not {length}"
        rows = torch.stack([self[w] for w in self.order.windows(samples)])
        return rows.to(device, non_blocking=True)

    def loader(self, batches: Sampler[list[int]], device: torch.device) -> DataLoader:
        """A DataLoader yielding one tensor of windows per index list of `batches`. Workers
        are forked: a rank started by a forkserver would otherwise start a server of its own
        for them, importing torch again (14 s before the first batch on a busy 2-core box)."""
        workers = self.cfg.num_workers
        forked = workers > 0 and "fork" in multiprocessing.get_all_start_methods()
        return DataLoader(
            self,
            batch_sampler=batches,
            num_workers=workers,
            pin_memory=self.cfg.pin_memory and device.type == "cuda",
            prefetch_factor=self.cfg.prefetch_factor if workers else None,
            persistent_workers=workers > 0,
            multiprocessing_context="fork" if forked else None,
        )


def hf_streams(
    cfg: DataConfig, data_cache: str, seq_len: int, seed: int
) -> tuple[HFWindows, HFWindows]:
    """The training stream (shuffled per `cfg.shuffle`) and the held-out one (in order) of
    the cache the driver prepared (`data_cache`), in windows of seq_len + 1 tokens."""
    cache = TokenCache(data_cache)
    length = seq_len + 1
    train, heldout = cache.spans(cfg.heldout_fraction)

    def stream(span: range, shuffle: bool) -> HFWindows:
        return HFWindows(
            cache, span, length, WindowOrder(n_windows(span, length), seed, shuffle), cfg
        )

    return stream(train, cfg.shuffle), stream(heldout, False)
