"""Token sources and their split over data-parallel ranks.

A global step consumes samples [step * global_batch, (step + 1) * global_batch) of an
index-addressed stream. Data-parallel rank r takes a contiguous slice of that range. Ranks
of one DP group therefore never share a sample, together they cover the global batch, and
TP/PP peers (same dp rank) see the same data. Any layout with the same global batch sees the
same samples per step, which is what makes losses comparable. The training loop cuts a
rank's share into micro-batches (gradient accumulation), or the pipeline schedule does.

Synthetic and text sources are random access; data=hf goes through a DataLoader whose batch
sampler yields each step's index list in turn, from `start_step` (a resumed run) on.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import Sampler

from meshrun.core.config import DataConfig
from meshrun.rank.train.hf_data import HFWindows, hf_streams

_MIX = 0x9E3779B97F4A7C15 & (2**62 - 1)


class SyntheticTokens:
    """Arithmetic progressions mod vocab with a per-sample start and stride: deterministic,
    free to generate on any device, and learnable (the loss falls)."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.vocab_size = vocab_size
        self.seed = seed

    def batch(self, samples: range, length: int, device: torch.device) -> torch.Tensor:
        """Generated on `device` directly: no host-to-device copy, no sync."""
        indices = torch.arange(samples.start, samples.stop, device=device)
        mixed = (indices * _MIX + self.seed * 7919) % (2**31 - 1)
        start = mixed % self.vocab_size
        stride = 1 + (mixed // self.vocab_size) % min(self.vocab_size - 1, 7)
        positions = torch.arange(length, device=indices.device)
        return (start[:, None] + stride[:, None] * positions[None, :]) % self.vocab_size


class TextBytes:
    """A local text file as bytes (vocabulary 256); sample i is the window at i * length."""

    def __init__(self, path: str) -> None:
        self.tokens = torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8)

    def batch(self, samples: range, length: int, device: torch.device) -> torch.Tensor:
        """Gathered on the host, then copied without waiting for the device."""
        span = self.tokens.numel() - length
        starts = (torch.arange(samples.start, samples.stop) * length) % span
        windows = starts[:, None] + torch.arange(length)[None, :]
        return self.tokens[windows].long().to(device, non_blocking=True)


Source = SyntheticTokens | TextBytes | HFWindows


def build_dataset(cfg: DataConfig, vocab_size: int, seed: int, seq_len: int) -> Source:
    """The training stream; data=hf's held-out stream is `hf_streams(...)[1]`."""
    if cfg.name == "text":
        return TextBytes(str(cfg.path))
    if cfg.name == "hf":
        return hf_streams(cfg, seq_len, seed)[0]
    return SyntheticTokens(vocab_size, seed)


def dp_sample_range(step: int, global_batch: int, dp_rank: int, dp_size: int) -> range:
    """Sample indices a data-parallel rank trains on at `step`."""
    per_rank = global_batch // dp_size
    first = step * global_batch + dp_rank * per_rank
    return range(first, first + per_rank)


class StepSampler(Sampler[list[int]]):
    """A DataLoader's batch sampler: the windows of one DP rank's samples, step after step
    from `start_step` on, without end (the loop stops asking)."""

    def __init__(
        self, windows: HFWindows, global_batch: int, dp_rank: int, dp_size: int, start_step: int
    ) -> None:
        self.windows = windows
        self.global_batch = global_batch
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.start_step = start_step

    def __iter__(self) -> Iterator[list[int]]:
        for step in itertools.count(self.start_step):
            samples = dp_sample_range(step, self.global_batch, self.dp_rank, self.dp_size)
            yield self.windows.order.windows(samples)


class LocalBatches:
    """One rank's share of each step's global batch, as (inputs, targets). `waits`: the host
    seconds each step waited for its batch, until `drain_waits`. A loader-backed source
    (data=hf) serves consecutive steps from `start_step`, prefetching."""

    def __init__(
        self,
        dataset: Source,
        global_batch: int,
        seq_len: int,
        dp_rank: int,
        dp_size: int,
        device: torch.device,
        start_step: int = 0,
    ) -> None:
        self.dataset = dataset
        self.global_batch = global_batch
        self.seq_len = seq_len
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.device = device
        self.next_step = start_step
        self.waits: list[float] = []
        self._loader = None
        if isinstance(dataset, HFWindows):
            sampler = StepSampler(dataset, global_batch, dp_rank, dp_size, start_step)
            self._loader = iter(dataset.loader(sampler, device))

    def for_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        started = time.perf_counter()
        if self._loader is None:
            samples = dp_sample_range(step, self.global_batch, self.dp_rank, self.dp_size)
            tokens = self.dataset.batch(samples, self.seq_len + 1, self.device)
        else:
            assert step == self.next_step, f"step {step} asked, the loader is at {self.next_step}"
            self.next_step += 1
            tokens = next(self._loader).to(self.device, non_blocking=True)
        self.waits.append(time.perf_counter() - started)
        # Contiguous: pipeline stages check the strides of what they receive (torch < 2.13).
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def drain_waits(self) -> list[float]:
        waits, self.waits = self.waits, []
        return waits
