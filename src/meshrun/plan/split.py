"""Uneven pipeline splits for mixed boxes: a stage's time is its layers over its devices'
speed, so giving each stage layers in proportion to its (slowest) device's peak FLOP/s
levels the stages; then layers move off any stage whose memory would overflow."""

from __future__ import annotations

import dataclasses

from meshrun.core.config import DeviceSpec, ExperimentConfig
from meshrun.core.errors import ConfigError
from meshrun.core.flops import peak_tflops
from meshrun.core.layout import Layout
from meshrun.core.precision import matmul_precision
from meshrun.models import model_shape
from meshrun.plan.candidate import Candidate, Legal, evaluate
from meshrun.plan.placement import stage_devices

GiB = 2**30


def weakest_devices(cfg: ExperimentConfig) -> list[DeviceSpec]:
    """Per pp rank, the weakest device among its ranks (it paces the stage)."""
    layout = Layout.of(cfg.parallel)
    precision = matmul_precision(cfg)
    return [
        min(
            stage_devices(cfg, layout, pp),
            key=lambda s: (peak_tflops(s, precision) or 0, s.memory_gib),
        )
        for pp in range(layout.pp)
    ]


def proportional(n_layers: int, weights: list[float]) -> list[int]:
    """Largest-remainder split of n_layers by weight, each stage at least one layer."""
    total = sum(weights)
    raw = [n_layers * w / total for w in weights]
    counts = [max(1, int(x)) for x in raw]
    order = sorted(range(len(raw)), key=lambda i: raw[i] - int(raw[i]), reverse=True)
    for i in order[: max(0, n_layers - sum(counts))]:
        counts[i] += 1
    while sum(counts) > n_layers:
        counts[counts.index(max(counts))] -= 1
    return counts


def uneven_variant(candidate: Candidate, legal: Legal) -> Candidate | None:
    """The candidate with a proportional split, or None where all stages run the same device
    kind (an even split is already right) or the layout has no single-stage pipeline."""
    cfg = candidate.cfg
    p = cfg.parallel
    if cfg.hardware.device_type != "cuda" or p.pp == 1 or p.stages_per_rank != 1 or p.pp_layers:
        return None
    devices = weakest_devices(cfg)
    if len({d.name for d in devices}) == 1:
        return None
    rates = [peak_tflops(d, matmul_precision(cfg)) for d in devices]
    weights = [rate or 1.0 for rate in rates]
    n_layers = model_shape(cfg.model).n_layers
    counts = proportional(n_layers, weights)
    trial = None
    for _ in range(n_layers):
        parallel = dataclasses.replace(p, pp_layers=counts)
        try:
            resolved = legal(dataclasses.replace(cfg, parallel=parallel))
        except ConfigError:
            return None
        trial = evaluate(resolved)
        spare = [c - m.peak for c, m in zip(trial.capacity, trial.memory, strict=True)]
        worst, best = spare.index(min(spare)), spare.index(max(spare))
        if spare[worst] >= 0 or counts[worst] == 1 or worst == best:
            break
        counts = [c - (i == worst) + (i == best) for i, c in enumerate(counts)]
    stages = ", ".join(
        f"stage {i} on {d.name} ({rate or 0:g} TFLOP/s, "
        f"{d.memory_gib:g} GiB): {n} layers, {m.peak / GiB:.1f} GiB"
        for i, (d, rate, n, m) in enumerate(zip(devices, rates, counts, trial.memory, strict=True))
    )
    trial.notes.append(
        "uneven split: layers in proportion to each stage's peak FLOP/s so stages take equal "
        f"time, then moved off stages that would not fit; {stages}"
    )
    return trial
