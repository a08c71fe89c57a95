"""Token sources and their split over data-parallel ranks.

A global step consumes samples [step * global_batch, (step + 1) * global_batch) of an
index-addressed stream. Data-parallel rank r takes a contiguous slice of that range. Ranks
of one DP group therefore never share a sample, together they cover the global batch, and
TP/PP peers (same dp rank) see the same data. Any layout with the same global batch sees the
same samples per step, which is what makes losses comparable. The training loop cuts a
rank's share into micro-batches (gradient accumulation), or the pipeline schedule does.

Synthetic and text sources are random access; data=hf goes through a DataLoader whose batch
sampler yields each step's index list in turn, from `start_step` (a resumed run) on.

Every source has a held-out stream that shares no sample with training (`build_streams`):
data=hf its last documents, data=text the last `data.heldout_fraction` of the file's bytes
(training reads only the rest, evaluation or not), data=synthetic the samples from
`HELDOUT_FIRST_SAMPLE` on, which training would take 2**40 / global batch steps to reach.
An evaluation reads the same samples of it each time (`HeldoutBatches`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import Sampler

from meshrun.core.config import DataConfig
from meshrun.core.data_files import text_spans
from meshrun.rank.parallel.context_shards import shard_sequence
from meshrun.rank.train.hf_data import HFWindows, hf_streams

_MIX = 0x9E3779B97F4A7C15 & (2**62 - 1)
HELDOUT_FIRST_SAMPLE = 2**40


class SyntheticTokens:
    """Arithmetic progressions mod vocab with a per-sample start and stride: deterministic,
    free to generate on any device, and learnable (the loss falls)."""

    def __init__(self, vocab_size: int, seed: int, first_sample: int = 0) -> None:
        self.vocab_size = vocab_size
        self.seed = seed
        self.first_sample = first_sample  # sample i of this stream is generator index first + i

    def batch(self, samples: range, length: int, device: torch.device) -> torch.Tensor:
        """Generated on `device` directly: no host-to-device copy, no sync."""
        first = self.first_sample
        indices = torch.arange(first + samples.start, first + samples.stop, device=device)
        mixed = (indices * _MIX + self.seed * 7919) % (2**31 - 1)
        start = mixed % self.vocab_size
        stride = 1 + (mixed // self.vocab_size) % min(self.vocab_size - 1, 7)
        positions = torch.arange(length, device=indices.device)
        return (start[:, None] + stride[:, None] * positions[None, :]) % self.vocab_size


class TextBytes:
    """A span of a local text file's bytes (vocabulary 256); sample i is the window at
    i * length into the span, wrapping around: the first len(span) // length samples are
    non-overlapping windows."""

    def __init__(self, tokens: torch.Tensor, span: range) -> None:
        self.tokens = tokens
        self.span = span

    def batch(self, samples: range, length: int, device: torch.device) -> torch.Tensor:
        """Gathered on the host, then copied without waiting for the device."""
        room = len(self.span) - length + 1  # where a window may start
        starts = (torch.arange(samples.start, samples.stop) * length) % room
        windows = self.span.start + starts[:, None] + torch.arange(length)[None, :]
        return self.tokens[windows].long().to(device, non_blocking=True)


Source = SyntheticTokens | TextBytes | HFWindows


def build_streams(
    cfg: DataConfig, data_cache: str | None, vocab_size: int, seed: int, seq_len: int
) -> tuple[Source, Source]:
    """The training stream and the held-out one; no held-out sample is a training sample.
    `data_cache`: data=hf's tokens as the driver prepared them (core/config.Resolved)."""
    if cfg.name == "text":
        tokens = torch.frombuffer(bytearray(Path(str(cfg.path)).read_bytes()), dtype=torch.uint8)
        train, heldout = text_spans(tokens.numel(), cfg.heldout_fraction)
        return TextBytes(tokens, train), TextBytes(tokens, heldout)
    if cfg.name == "hf":
        return hf_streams(cfg, str(data_cache), seq_len, seed)
    heldout = SyntheticTokens(vocab_size, seed, first_sample=HELDOUT_FIRST_SAMPLE)
    return SyntheticTokens(vocab_size, seed), heldout


def build_dataset(
    cfg: DataConfig, data_cache: str | None, vocab_size: int, seed: int, seq_len: int
) -> Source:
    """The training stream."""
    return build_streams(cfg, data_cache, vocab_size, seed, seq_len)[0]


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
    (data=hf) serves consecutive steps from `start_step`, prefetching. `offset`: batches
    skipped so far (train.guard's rollbacks): step s trains on batch s + offset."""

    def __init__(
        self,
        dataset: Source,
        global_batch: int,
        seq_len: int,
        dp_rank: int,
        dp_size: int,
        device: torch.device,
        start_step: int = 0,
        cp: tuple[int, int] = (0, 1),
        offset: int = 0,
    ) -> None:
        self.dataset = dataset
        self.offset = offset
        self.cp = cp
        self.global_batch = global_batch
        self.seq_len = seq_len
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.device = device
        self.waits: list[float] = []
        self._loader = None
        self.seek(start_step)

    def batch_index(self, step: int) -> int:
        """Which batch of the data step `step` trains on."""
        return step + self.offset

    def seek(self, step: int) -> None:
        """The next batch asked for is step `step`'s (at the current offset)."""
        self.next_batch = self.batch_index(step)
        if isinstance(self.dataset, HFWindows):
            sampler = StepSampler(
                self.dataset, self.global_batch, self.dp_rank, self.dp_size, self.next_batch
            )
            self._loader = iter(self.dataset.loader(sampler, self.device))

    def for_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        started = time.perf_counter()
        batch = self.batch_index(step)
        if self._loader is None:
            samples = dp_sample_range(batch, self.global_batch, self.dp_rank, self.dp_size)
            tokens = self.dataset.batch(samples, self.seq_len + 1, self.device)
        else:
            assert batch == self.next_batch, (
                f"batch {batch} asked, the loader is at {self.next_batch}"
            )
            self.next_batch += 1
            tokens = next(self._loader).to(self.device, non_blocking=True)
        self.waits.append(time.perf_counter() - started)
        return inputs_and_targets(tokens, *self.cp)

    def again(self, step: int) -> None:
        """Step `step` is trained again (a torchft replica failed during it): its batch is
        asked for once more, and waited for once in its record."""
        self.waits.pop()
        self.seek(step)

    def drain_waits(self) -> list[float]:
        waits, self.waits = self.waits, []
        return waits


def inputs_and_targets(
    tokens: torch.Tensor, cp_rank: int = 0, cp: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of seq_len + 1 tokens as (inputs, next tokens), context-parallel rank
    `cp_rank`'s part of each when `cp` > 1. Contiguous: pipeline stages check the strides of
    what they receive (torch < 2.13)."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if cp > 1:
        inputs, targets = shard_sequence(inputs, cp_rank, cp), shard_sequence(targets, cp_rank, cp)
    return inputs.contiguous(), targets.contiguous()


class HeldoutBatches:
    """The evaluation set: samples [0, n_batches x global_batch) of the held-out stream, the
    same each evaluation. Batch k is cut over DP ranks as training's step k is (contiguous
    slices), so every layout evaluates the same tokens. Read at random access (data=hf
    too): an evaluation is rare, and a loader's prefetching would hold its batches between."""

    def __init__(
        self,
        dataset: Source,
        n_batches: int,
        global_batch: int,
        seq_len: int,
        dp_rank: int,
        dp_size: int,
        device: torch.device,
        cp: tuple[int, int] = (0, 1),
    ) -> None:
        self.dataset = dataset
        self.cp = cp
        self.n_batches = n_batches
        self.global_batch = global_batch
        self.seq_len = seq_len
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.device = device

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for k in range(self.n_batches):
            samples = dp_sample_range(k, self.global_batch, self.dp_rank, self.dp_size)
            tokens = self.dataset.batch(samples, self.seq_len + 1, self.device)
            yield inputs_and_targets(tokens, *self.cp)
