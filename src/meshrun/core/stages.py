"""A pipeline's stages: which layers each holds (even, explicit or balanced by measured
cost), which stages a pipeline rank runs, and the bubble its schedule leaves in theory; all
from a resolved config, with no torch, so the rules, the planner and the record share them
with the ranks that cut the model."""

from __future__ import annotations

import dataclasses

from meshrun.core.choices import Schedule
from meshrun.core.config import ExperimentConfig, unpredicted

# Schedules that run several stages on each pipeline rank (parallel.stages_per_rank > 1).
MULTI_STAGE_SCHEDULES = (Schedule["interleaved_1f1b"], Schedule["interleaved_zb"])
# parallel.pp_layers: the split chosen by measured cost on the ranks (rank/parallel/balance.py)
PP_AUTO = "auto"


def stage_layer_counts(n_layers: int, n_stages: int, explicit: list[int] | None) -> list[int]:
    """Layers per stage: `explicit` as given, else as even as possible (earlier stages, which
    also hold the embedding, get no more than later ones)."""
    if explicit:
        return list(explicit)
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if stage >= n_stages - extra else 0) for stage in range(n_stages)]


def balanced_layer_counts(
    n_layers: int, block: list[float], first: float, last: float
) -> list[int]:
    """The split of `n_layers` over len(block) stages, each at least one layer, whose slowest
    stage is the fastest: stage s costs counts[s] * block[s], plus `first` on stage 0 (the
    embedding) and `last` on the last stage (norm, head, loss). Of equally slow splits, the
    one with fewer layers on earlier stages (as the even split). O(stages x layers^2)."""
    n_stages = len(block)
    # best[k]: (slowest stage, counts) of the stages so far holding k layers
    best: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
    for stage in range(n_stages):
        extra = (first if stage == 0 else 0.0) + (last if stage == n_stages - 1 else 0.0)
        left = n_stages - stage - 1  # stages after this one, a layer each at least
        nxt: dict[int, tuple[float, tuple[int, ...]]] = {}
        for held, (slowest, counts) in best.items():
            for c in range(1, n_layers - held - left + 1):
                option = (max(slowest, c * block[stage] + extra), (*counts, c))
                if held + c not in nxt or option < nxt[held + c]:
                    nxt[held + c] = option
        best = nxt
    return list(best[n_layers][1])


def stage_costs(counts: list[int], block: list[float], first: float, last: float) -> list[float]:
    """Each stage's cost under `balanced_layer_counts`'s model."""
    n = len(counts)
    return [
        c * b + (first if s == 0 else 0.0) + (last if s == n - 1 else 0.0)
        for s, (c, b) in enumerate(zip(counts, block, strict=True))
    ]


def with_layers(cfg: ExperimentConfig, counts: list[int]) -> ExperimentConfig:
    """`cfg` with an explicit split: what `parallel.pp_layers=auto` chose, to run it again."""
    parallel = dataclasses.replace(cfg.parallel, pp_layers=counts)
    return dataclasses.replace(unpredicted(cfg), parallel=parallel)


def local_stage_ids(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    return [pp_rank + i * pp for i in range(stages_per_rank)]


def theoretical_bubble(pp: int, n_microbatches: int, stages_per_rank: int) -> float:
    """Idle fraction of a step: (p-1)/(m+p-1), or (p-1)/(v*m+p-1) interleaved (v stages a rank)."""
    return (pp - 1) / (stages_per_rank * n_microbatches + pp - 1)
