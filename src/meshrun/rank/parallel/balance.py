"""parallel.pp_layers=auto: the pipeline's layers split by measured cost.

A pipeline runs at the pace of its slowest stage, and the ends are not layers: the first
stage also embeds, the last also runs the final norm, the head and the loss (with a large
vocabulary, several blocks' worth). So every rank times, at the run's micro-batch shape and
precision, the forward and backward of one block, of the embedding and of the norm, head and
loss, each cut from the meta model as a stage of its own and materialised alone (no rank
ever holds the whole model). The ranks gather their timings; ranks on the same kind of
device share the median of theirs (the probes of two equal CPUs another process disturbed
once split 4 layers [3, 1]), a stage costs what its slowest kind of device measured (a mixed
box's stages differ), and `balanced_layer_counts` picks the split whose slowest stage is
fastest. Once per run, before the pipeline is cut, on every rank alike, so all cut the same
split. A block's cost stands for every block's: the decoders meshrun builds repeat one block.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from meshrun.core.config import ExperimentConfig
from meshrun.core.layout import Layout, rank_coords
from meshrun.core.rank_report import StageSplit
from meshrun.core.stages import balanced_layer_counts, stage_costs
from meshrun.models import build_model, model_shape
from meshrun.models.loss import loss_method
from meshrun.rank.device import autocast, synchronize
from meshrun.rank.parallel.compose import materialise
from meshrun.rank.parallel.loss import apply_chunked_loss, micro_batch_loss
from meshrun.rank.parallel.pipeline import cut_stage

# Timed rounds after one warm-up round (allocations, kernel selection); the median is kept.
PROBE_ROUNDS = 5


def balance_stages(
    cfg: ExperimentConfig,
    layout: Layout,
    rank: int,
    device: torch.device,
    autocast_dtype: torch.dtype | None,
) -> StageSplit:
    """Probe this rank's parts, gather every rank's, split (the same on every rank)."""
    probed = probe_parts(cfg, device, autocast_dtype)
    _release(device)  # the probe's tensors, gone before the run's memory is measured
    gathered: list[tuple[str, tuple[float, float, float]]] = [
        ("", (0.0,) * 3)
    ] * dist.get_world_size()
    dist.all_gather_object(gathered, (device_kind(device), probed))
    # Ranks on the same kind of device share one figure, the median of their probes: a
    # probe another process slowed must not move layers between equal devices.
    by_kind: dict[str, list[tuple[float, float, float]]] = {}
    for kind, costs in gathered:
        by_kind.setdefault(kind, []).append(costs)
    pooled = {
        kind: [statistics.median(c) for c in zip(*runs, strict=True)]
        for kind, runs in by_kind.items()
    }
    # [embedding, block, head] per pipeline rank: the slowest kind among its ranks
    per_pp = [[0.0, 0.0, 0.0] for _ in range(layout.pp)]
    for other, (kind, _) in enumerate(gathered):
        slowest = per_pp[rank_coords(layout, other)["pp"]]
        slowest[:] = [max(a, b) for a, b in zip(slowest, pooled[kind], strict=True)]
    n_stages = layout.pp * cfg.parallel.stages_per_rank
    block = [per_pp[stage % layout.pp][1] for stage in range(n_stages)]
    first, last = per_pp[0][0], per_pp[(n_stages - 1) % layout.pp][2]
    counts = balanced_layer_counts(model_shape(cfg.model).n_layers, block, first, last)
    return StageSplit(counts, stage_costs(counts, block, first, last), max(block))


def device_kind(device: torch.device) -> str:
    """What makes two ranks' devices alike: the GPU's name, or the CPU."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def probe_parts(
    cfg: ExperimentConfig, device: torch.device, autocast_dtype: torch.dtype | None
) -> tuple[float, float, float]:
    """Seconds of one micro-batch's forward and backward through the embedding, one block,
    and the norm, head and loss, on this rank's device (the median of PROBE_ROUNDS)."""
    t = cfg.train
    meta = build_model(cfg.model, t.seq_len, "meta")
    n = len(meta.layers)
    # each a stage of its own: stage 0 of [0, n], stage 1 of [0, 1, n-1], stage 1 of [n, 0]
    parts = [
        cut_stage(meta, 0, [0, n]),
        cut_stage(meta, 1, [0, 1, n - 1]),
        cut_stage(meta, 1, [n, 0]),
    ]
    method = loss_method(cfg)[0]
    if method == "chunked":
        apply_chunked_loss(parts[2])
    for part in parts:
        materialise(part, device, t.seed, None)
    embedding, block, head = parts
    vocab = model_shape(cfg.model).vocab_size
    tokens = torch.randint(vocab, (t.micro_batch_size, t.seq_len), device=device)
    with autocast(device, autocast_dtype):
        hidden = embedding(tokens).detach()
    grad = torch.randn_like(hidden)

    def embed() -> None:
        embedding(tokens).backward(grad)

    def one_block() -> None:
        block(hidden.requires_grad_()).backward(grad)

    def head_and_loss() -> None:
        micro_batch_loss(head, hidden.requires_grad_(), tokens, method).backward()

    passes = (embed, one_block, head_and_loss)
    seconds: list[list[float]] = [[] for _ in passes]
    for round_ in range(PROBE_ROUNDS + 1):
        for fn, times in zip(passes, seconds, strict=True):  # interleaved: drift hits all
            elapsed = _timed(fn, device, autocast_dtype)
            if round_:
                times.append(elapsed)
    return tuple(statistics.median(times) for times in seconds)  # type: ignore[return-value]


def _timed(fn: Callable[[], None], device: torch.device, dtype: torch.dtype | None) -> float:
    synchronize(device)
    started = time.perf_counter()
    with autocast(device, dtype):
        fn()
    synchronize(device)
    return time.perf_counter() - started


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
