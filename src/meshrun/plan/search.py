"""Every legal layout of a model on a box, with its predicted memory per rank (fits or not) and
speed, ranked: those that fit first, fastest first. Legality is decided by the same
`validate` a run goes through, on the box the hardware profile describes."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from meshrun.config import ExperimentConfig, HardwareConfig, ParallelConfig
from meshrun.errors import ConfigError, fail
from meshrun.hardware import CudaDevice, HostFacts
from meshrun.mesh import Layout
from meshrun.metrics.flops import device_for_rank
from meshrun.plan.memory import MemoryPrediction, predict_memory
from meshrun.plan.probe import host_matmul_flops
from meshrun.plan.speed import SpeedPrediction, predict_speed
from meshrun.validate import validate

GiB = 2**30
SCHEDULE_CHOICES = (("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2))


@dataclass
class Candidate:
    cfg: ExperimentConfig
    memory: list[MemoryPrediction]
    capacity: list[int]
    speed: SpeedPrediction | None
    speedup: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return all(m.peak <= c for m, c in zip(self.memory, self.capacity, strict=True))

    @property
    def peak(self) -> int:
        return max(m.peak for m in self.memory)

    @property
    def label(self) -> str:
        p = self.cfg.parallel
        parts = [Layout.of(p).describe()]
        if p.pp > 1:
            parts.append(f"{p.schedule} m={p.microbatches}")
            if p.pp_layers:
                parts.append(f"layers {list(p.pp_layers)}")
        if p.activation_checkpointing != "none":
            parts.append(f"ckpt {p.activation_checkpointing}")
        return ", ".join(parts)

    def overrides(self) -> str:
        """The command-line overrides that select this layout."""
        p = self.cfg.parallel
        keys = ["dp_replicate", "dp_shard", "tp", "pp"]
        if p.pp > 1:
            keys += ["schedule", "stages_per_rank"]
        parts = [f"parallel.{k}={getattr(p, k)}" for k in keys]
        if p.pp_layers:
            parts.append(f"parallel.pp_layers=[{','.join(map(str, p.pp_layers))}]")
        if p.activation_checkpointing != "none":
            parts.append(f"parallel.activation_checkpointing={p.activation_checkpointing}")
        parts.append(f"train.micro_batch_size={self.cfg.train.micro_batch_size}")
        return " ".join(parts)

    def as_dict(self) -> dict:
        p = self.cfg.parallel
        return {
            "layout": self.label,
            "degrees": Layout.of(p).degrees(),
            "schedule": p.schedule if p.pp > 1 else None,
            "microbatches": p.microbatches,
            "micro_batch_size": self.cfg.train.micro_batch_size,
            "pp_layers": list(p.pp_layers) if p.pp_layers else None,
            "activation_checkpointing": p.activation_checkpointing,
            "fits": self.fits,
            "peak_bytes": self.peak,
            "memory_per_rank": [m.as_dict() for m in self.memory],
            "capacity_bytes": self.capacity,
            "speed": self.speed.as_dict() if self.speed else None,
            "speedup": self.speedup,
            "notes": self.notes,
        }


def target_facts(hardware: HardwareConfig, host: HostFacts) -> HostFacts:
    """The box a profile describes, as `validate` would see it there."""
    if hardware.device_type != "cuda" or hardware.name == "auto":
        return host
    devices = [CudaDevice(s.name, s.memory_gib) for s in hardware.devices for _ in range(s.count)]
    return HostFacts(devices, host.cpu_count, host.memory_gib)


def capacities(cfg: ExperimentConfig) -> list[int]:
    """Usable bytes per rank: its device's memory less the headroom; on CPU an equal share of
    the host's memory (the ranks share it)."""
    world = Layout.of(cfg.parallel).world_size
    headroom = cfg.plan.headroom_gib * GiB
    if cfg.hardware.device_type == "cpu":
        total = cfg.hardware.devices[0].memory_gib * GiB
        return [int((total - headroom) / world)] * world
    per_node = cfg.launcher.nproc_per_node or world
    specs = [device_for_rank(cfg.hardware.devices, r % per_node) for r in range(world)]
    return [int(s.memory_gib * GiB - headroom) if s else 0 for s in specs]


def host_flops(cfg: ExperimentConfig) -> float | None:
    """A rank's matmul rate on this host with the run's ranks on it all computing."""
    if cfg.hardware.device_type != "cpu":
        return None
    ranks = Layout.of(cfg.parallel).world_size // cfg.launcher.nnodes
    return host_matmul_flops(cfg.launcher.threads_per_rank or 1, ranks)


def evaluate(cfg: ExperimentConfig) -> Candidate:
    """`cfg` resolved (validated)."""
    return Candidate(cfg, predict_memory(cfg), capacities(cfg),
                     predict_speed(cfg, host_flops(cfg)))  # fmt: skip


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
            for (rep, shard), (schedule, chunks) in ((d, s) for d in dps for s in schedules):
                grid.append(dict(pp=pp, tp=tp, dp_replicate=rep, dp_shard=shard,
                                 schedule=schedule, stages_per_rank=chunks))  # fmt: skip
    return grid


def with_parallel(cfg: ExperimentConfig, world: int, **degrees) -> ExperimentConfig:
    name = Layout(**{k: v for k, v in degrees.items() if k in ("pp", "tp", "dp_replicate",
                                                              "dp_shard")}).describe()  # fmt: skip
    parallel = ParallelConfig(name=name.replace(" x ", "_"), **degrees)
    plan = dataclasses.replace(cfg.plan, allow_oom=True)  # judged here, not refused
    launcher = dataclasses.replace(
        cfg.launcher, nproc_per_node=world // cfg.launcher.nnodes, threads_per_rank=None
    )
    # A layout is not illegal for the micro-batch the run happened to ask for: shrink it
    # to what the layout's data-parallel share of the batch allows.
    t = cfg.train
    local = t.global_batch_size // max(1, degrees["dp_replicate"] * degrees["dp_shard"])
    micro = math.gcd(t.micro_batch_size, local) or t.micro_batch_size
    train = dataclasses.replace(t, micro_batch_size=micro)
    return dataclasses.replace(cfg, parallel=parallel, launcher=launcher, train=train, plan=plan)


def legal(cfg: ExperimentConfig, facts: HostFacts) -> ExperimentConfig | None:
    try:
        return validate(cfg, facts)
    except ConfigError:
        return None


def search(cfg: ExperimentConfig, world: int, facts: HostFacts) -> list[Candidate]:
    """Ranked candidates; a layout that does not fit is retried with full activation
    checkpointing, and pipelines on mixed boxes get an uneven split as well."""
    from meshrun.plan.split import uneven_variant

    candidates = []
    for degrees in layout_grid(world, cfg.model.n_layers):
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


def best_layout(cfg: ExperimentConfig, world: int, facts: HostFacts) -> ExperimentConfig:
    """`parallel=auto`: the fastest predicted layout that fits (the config to validate)."""
    ranked = [c for c in search(cfg, world, facts) if c.fits]
    if not ranked:
        fail("parallel", "auto", f"no layout of {world} ranks is predicted to fit "
             "(meshrun-plan lists them with their memory)",
             "more devices, a smaller model or a shorter train.seq_len")  # fmt: skip
    best = ranked[0].cfg
    return dataclasses.replace(cfg, parallel=best.parallel, train=best.train)


def _rank(c: Candidate) -> tuple:
    return (not c.fits, -(c.speed.tokens_per_s if c.speed else 0.0), c.peak)


def add_speedups(cfg: ExperimentConfig, candidates: list[Candidate], facts: HostFacts) -> None:
    """Against the single-device twin of each (weak scaling: one device's share of the batch)."""
    from meshrun.results import baseline_config

    for c in candidates:
        twin = legal(baseline_config(c.cfg), facts)
        if twin is None or c.speed is None:
            continue
        single = predict_speed(twin, host_flops(twin))
        if single is not None:
            c.speedup = c.speed.tokens_per_s / single.tokens_per_s


def suggest_micro_batch(c: Candidate, facts: HostFacts) -> int | None:
    """The micro-batch size with the best predicted speed among those that fit (ties: the
    largest, which keeps a device busiest)."""
    t = c.cfg.train
    local = t.global_batch_size // Layout.of(c.cfg.parallel).dp_size
    best: tuple[float, int] | None = None
    for size in [2**i for i in range(int(math.log2(local)) + 1) if local % 2**i == 0]:
        parallel = dataclasses.replace(c.cfg.parallel, microbatches=None)
        trial = legal(dataclasses.replace(c.cfg, parallel=parallel,
                                          train=dataclasses.replace(t, micro_batch_size=size)),
                      facts)  # fmt: skip
        if trial is None:
            continue
        scored = evaluate(trial)
        if scored.fits and scored.speed is not None:
            key = (scored.speed.tokens_per_s, size)
            best = max(best, key) if best else key
    return best[1] if best else None
