"""Every legal layout of a model on a box, with its predicted memory per rank (fits or not) and
speed, ranked: those that fit first, fastest first. Legality is decided by the same
`validate` a run goes through, on the box the hardware profile describes."""

from __future__ import annotations

import dataclasses
import math

from meshrun.core.baseline import baseline_config
from meshrun.core.config import ExperimentConfig, ParallelConfig
from meshrun.core.errors import fail
from meshrun.core.hardware import HostFacts
from meshrun.core.layout import Layout
from meshrun.plan import predict
from meshrun.plan.candidate import Candidate, evaluate, host_flops, legal
from meshrun.plan.split import uneven_variant
from meshrun.rank.models import model_shape

# (schedule, stages_per_rank)
SCHEDULE_CHOICES = (("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_grid(world: int, n_layers: int) -> list[dict]:
    """Parallel overrides of every layout of `world` ranks: pp x dp x tp, dp as DDP, FSDP or
    HSDP, each pipeline schedule."""
    grid = []
    for pp in [d for d in _divisors(world) if d <= n_layers]:
        for tp in [d for d in _divisors(world // pp) if d <= 8]:
            dp = world // (pp * tp)
            dps = [(dp, 1), (1, dp)] if dp > 1 else [(1, 1)]
            if dp >= 4:
                dps.append((2, dp // 2))
            schedules = SCHEDULE_CHOICES if pp > 1 else (("1f1b", 1),)
            for (rep, shard), (schedule, stages_per_rank) in (
                (d, s) for d in dps for s in schedules
            ):
                grid.append(dict(pp=pp, tp=tp, dp_replicate=rep, dp_shard=shard,
                                 schedule=schedule, stages_per_rank=stages_per_rank))  # fmt: skip
    return grid


def with_parallel(cfg: ExperimentConfig, world: int, **degrees) -> ExperimentConfig:
    """A layout of the planner's, named as `parallel=auto` (what picks it; `single` for one
    rank): its display name is layout_name's, the overrides that run it layout_overrides'."""
    parallel = ParallelConfig(name="single" if world == 1 else "auto", **degrees)
    launcher = dataclasses.replace(
        cfg.launcher, nproc_per_node=world // cfg.launcher.nnodes, threads_per_rank=None
    )
    # A layout is not illegal for the micro-batch the run happened to ask for: shrink it
    # to what the layout's data-parallel share of the batch allows.
    t = cfg.train
    local = t.global_batch_size // max(1, degrees["dp_replicate"] * degrees["dp_shard"])
    micro = math.gcd(t.micro_batch_size, local) or t.micro_batch_size
    train = dataclasses.replace(t, micro_batch_size=micro)
    return dataclasses.replace(cfg, parallel=parallel, launcher=launcher, train=train)


def search(cfg: ExperimentConfig, world: int, facts: HostFacts) -> list[Candidate]:
    """Ranked candidates; a layout that does not fit is retried with full activation
    checkpointing, and pipelines on mixed boxes get an uneven split as well."""
    candidates = []
    for degrees in layout_grid(world, model_shape(cfg.model).n_layers):
        resolved = legal(with_parallel(cfg, world, **degrees), facts)
        if resolved is None:
            continue
        candidate = evaluate(resolved)
        if not candidate.fits:
            ckpt = dataclasses.replace(resolved.parallel, activation_checkpointing="full")
            retry = evaluate(dataclasses.replace(resolved, parallel=ckpt))
            candidate = retry if retry.fits else candidate
        candidates.append(candidate)
        uneven = uneven_variant(candidate, facts)
        if uneven is not None:
            candidates.append(uneven)
    add_speedups(cfg, candidates, facts)
    return sorted(candidates, key=_rank)


def best_layout(cfg: ExperimentConfig, world: int, facts: HostFacts
                ) -> tuple[ExperimentConfig, str]:  # fmt: skip
    """`parallel=auto`: the fastest predicted layout that fits (the config to validate), and
    why it was chosen, for the console."""
    ranked = [c for c in search(cfg, world, facts) if c.fits]
    if not ranked:
        fail("parallel", "auto", f"no layout of {world} ranks is predicted to fit "
             "(meshrun-plan lists them with their memory)",
             "more devices, a smaller model or a shorter train.seq_len")  # fmt: skip
    best = ranked[0].cfg
    return dataclasses.replace(cfg, parallel=best.parallel, train=best.train), why(ranked)


def why(ranked: list[Candidate]) -> str:
    """The chosen layout (the first), its prediction, and the runner-up it beat."""
    first = ranked[0]
    speed = f"{first.speed.tokens_per_s:,.0f} tokens/s" if first.speed else "speed unknown"
    peak = f"peak {first.peak / 2**30:.2f} of {min(first.capacity) / 2**30:.1f} GiB"
    text = (f"{first.label} ({first.overrides()}): predicted {speed}, {peak} per rank; the "
            f"fastest of the {len(ranked)} layouts that fit")  # fmt: skip
    if len(ranked) > 1 and ranked[1].speed and first.speed:
        lead = first.speed.tokens_per_s / ranked[1].speed.tokens_per_s
        text += f", {lead:.2f}x the next ({ranked[1].label})"
    return text + "; meshrun-plan lists them all"


def _rank(c: Candidate) -> tuple:
    return (not c.fits, -(c.speed.tokens_per_s if c.speed else 0.0), c.peak)


def add_speedups(cfg: ExperimentConfig, candidates: list[Candidate], facts: HostFacts) -> None:
    """Against the single-device twin of each (weak scaling: one device's share of the batch)."""
    for c in candidates:
        twin = legal(baseline_config(c.cfg), facts)
        if twin is None or c.speed is None:
            continue
        single = predict.speed(twin, host_flops(twin))
        if single is not None:
            c.speedup = c.speed.tokens_per_s / single.tokens_per_s


def suggest_micro_batch(c: Candidate, facts: HostFacts) -> int | None:
    """The micro-batch size with the best predicted speed among those that fit (ties: the
    largest, which keeps a device busiest)."""
    t = c.cfg.train
    local = t.global_batch_size // Layout.of(c.cfg.parallel).dp_size
    best: tuple[float, int] | None = None
    for size in [2**i for i in range(int(math.log2(local)) + 1) if local % 2**i == 0]:
        sized = dataclasses.replace(t, micro_batch_size=size)
        trial = legal(dataclasses.replace(c.cfg, train=sized), facts)
        if trial is None:
            continue
        scored = evaluate(trial)
        if scored.fits and scored.speed is not None:
            key = (scored.speed.tokens_per_s, size)
            best = max(best, key) if best else key
    return best[1] if best else None
