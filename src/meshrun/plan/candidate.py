"""One layout judged: its resolved config, predicted memory per rank against each rank's
capacity, and predicted speed. Whether a layout is legal the caller says (`Legal`: the
driver's resolution, the same rules a run goes through): the plan computes, never checks."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from meshrun.core.batch import n_microbatches
from meshrun.core.calibration import Calibration, calibration_path, read_calibration
from meshrun.core.config import ExperimentConfig
from meshrun.core.hardware import HostFacts, fingerprint_key, host_fingerprint, rank_threads
from meshrun.core.layout import Layout
from meshrun.core.naming import layout_name, layout_overrides
from meshrun.plan import predict
from meshrun.plan.host import HostUse, host_use
from meshrun.plan.memory import MemoryPrediction
from meshrun.plan.placement import stage_devices
from meshrun.plan.probe import host_matmul_flops
from meshrun.plan.shapes import layer_counts
from meshrun.plan.speed import SpeedPrediction
from meshrun.plan.stage_time import EP_LOAD_ALLOWANCE

GiB = 2**30
# A layout filled for the box and checked by the rules a run goes through, or ConfigError.
Legal = Callable[[ExperimentConfig], ExperimentConfig]


@dataclass
class Candidate:
    """Memory and capacity per pipeline rank: the ranks of a stage hold the same, and the
    smallest device among them is the stage's capacity (plans of thousands of ranks compare
    a few stages, not every rank)."""

    cfg: ExperimentConfig
    memory: list[MemoryPrediction]
    capacity: list[int]
    speed: SpeedPrediction | None
    speedup: float | None = None
    float8_gain: float | None = None  # a float8 row's tokens/s over its layout's without
    notes: list[str] = field(default_factory=list)
    traced: list[MemoryPrediction] | None = None  # plan.trace: per stage, on fake tensors
    host: HostUse | None = None  # a node's offloaded bytes (plan/host.py)

    @property
    def fits(self) -> bool:
        on_device = all(m.peak <= c for m, c in zip(self.memory, self.capacity, strict=True))
        return on_device and (self.host is None or self.host.fits)

    @property
    def peak(self) -> int:
        return max(m.peak for m in self.memory)

    @property
    def ranks_per_stage(self) -> int:
        return Layout.of(self.cfg.parallel).world_size // len(self.memory)

    @property
    def label(self) -> str:
        """The layout's name, and the optimizer states where they are not fp32 (a lever the
        plan may pick; the offloads are in the layout's name)."""
        states = self.cfg.train.optimizer_states
        return layout_name(self.cfg) + ("" if states == "fp32" else f", {states} states")

    def overrides(self) -> str:
        """The command-line overrides that run this layout."""
        return layout_overrides(self.cfg)

    def as_dict(self) -> dict:
        p = self.cfg.parallel
        return {
            "layout": self.label,
            "degrees": Layout.of(p).degrees(),
            "ep": p.ep,  # drawn from dp_shard x cp, not a mesh degree of its own
            "schedule": p.schedule if p.pp > 1 else None,
            "n_microbatches": n_microbatches(self.cfg) if p.pp > 1 else None,
            "micro_batch_size": self.cfg.train.micro_batch_size,
            # auto: the formula's split, which the predictions are of
            "pp_layers": layer_counts(self.cfg.model, p, p.pp * p.stages_per_rank, p.tp)
            if p.pp_layers
            else None,
            "activation_checkpointing": p.activation_checkpointing,
            "fits": self.fits,
            "peak_bytes": self.peak,
            "memory_per_stage": [m.as_dict() for m in self.memory],
            "capacity_bytes": self.capacity,
            "host_bytes_per_node": self.host.per_node if self.host else None,
            "speed": self.speed.as_dict() if self.speed else None,
            "speedup": self.speedup,
            "float8": str(self.cfg.train.float8.recipe) if self.cfg.train.float8.enabled else None,
            "float8_gain": self.float8_gain,
            "notes": self.notes,
            "traced_memory_per_stage": [m.as_dict() for m in self.traced] if self.traced else None,
            "overrides": self.overrides(),
        }


def capacities(cfg: ExperimentConfig) -> list[int]:
    """Usable bytes per pipeline rank: the smallest device among its ranks less the
    headroom and the allocator's fragmentation share; on CPU an equal share of the host's
    memory (the ranks share it; glibc's allocator returns what it frees)."""
    layout = Layout.of(cfg.parallel)
    headroom = cfg.plan.headroom_gib * GiB
    if cfg.hardware.device_type == "cpu":
        total = cfg.hardware.devices[0].memory_gib * GiB
        return [int((total - headroom) / layout.world_size)] * layout.pp
    usable = 1 - cfg.plan.fragmentation
    return [
        min(
            (int((s.memory_gib * GiB - headroom) * usable) for s in stage_devices(cfg, layout, pp)),
            default=0,
        )
        for pp in range(layout.pp)
    ]


def host_calibration(cfg: ExperimentConfig) -> Calibration | None:
    """plan.calibration's profile for this run: `auto` the one beside the store where it was
    measured on this host (its fingerprint) with as many ranks of as many threads; a path
    names one to use as it is; `none`."""
    setting = cfg.plan.calibration
    if setting == "none":
        return None
    path = calibration_path(cfg.store.path) if setting == "auto" else Path(setting)
    found = _read_calibration(path, path.stat().st_mtime_ns if path.is_file() else 0)
    if found is None or setting != "auto":
        return found
    ranks = Layout.of(cfg.parallel).world_size // cfg.launcher.nnodes
    threads = rank_threads(cfg.launcher, ranks, _host_facts())  # as the run's ranks get them
    here = _fingerprint_here(threads)
    same = (found.fingerprint_key, found.ranks, found.threads_per_rank) == (here, ranks, threads)
    return found if same and found.device_type == cfg.hardware.device_type else None


@functools.cache
def _host_facts() -> HostFacts:
    return HostFacts.detect()


@functools.cache
def _fingerprint_here(threads: int) -> str:
    """This host's (a plan asks for every candidate)."""
    return fingerprint_key(host_fingerprint(threads))


@functools.cache
def _read_calibration(path: Path, mtime_ns: int) -> Calibration | None:
    return read_calibration(path) if mtime_ns else None


def host_flops(cfg: ExperimentConfig) -> float | None:
    """A rank's matmul rate on this host with the run's ranks on it all computing."""
    if cfg.hardware.device_type != "cpu":
        return None
    ranks = Layout.of(cfg.parallel).world_size // cfg.launcher.nnodes
    return host_matmul_flops(cfg.launcher.threads_per_rank or 1, ranks)


# What the memory prediction of a context-parallel layout leaves out, by method (plan/memory.py;
# the K/V traffic is in the speed, plan/comm_time.py). Transient: the measured peaks stay within 3%
# without them (benchmarks/context_parallel.py).
CP_UNCOUNTED = {
    "ring": "the ring's K/V block in flight a layer (transient) is not in this memory prediction",
    "alltoall": "Ulysses' head-sharded copies of q, k and v a layer (transient) are not in this "
    "memory prediction",
    "allgather": "",  # the gathered K/V are counted
}
CP_TRACED_UNCOUNTED = (
    "the K/V context parallelism holds beyond this rank's own (traced with its attention "
    "local) is not in this memory prediction"
)


def cp_uncounted(cfg: ExperimentConfig) -> str:
    """What a CP layout's memory prediction leaves out ("" for none)."""
    if cfg.parallel.cp == 1:
        return ""
    if not predict.has_formula(cfg):
        return CP_TRACED_UNCOUNTED
    return CP_UNCOUNTED[cfg.parallel.cp_method]


EP_LOAD = (
    "ep: the memory is at an even load of the routed tokens over the ep ranks; the speed waits "
    "for the busiest rank at {allowance}x its share (a router out of balance may need more of "
    "both)"
)


def traced_or_why(cfg: ExperimentConfig) -> list[MemoryPrediction] | str:
    """The layout's ranks traced, one a pipeline stage, each as one rank of a fake process
    group of the layout's world size running its real parallelize and a step on fake
    tensors; where it does not compose, why (torch's error)."""
    try:
        return predict.traced_stages(cfg)
    except Exception as err:  # torch's parallel APIs raise anything a layout trips on
        return f"{type(err).__name__}: {err}"


def trace(candidate: Candidate) -> None:
    """plan.trace: the row traced; a layout that does not compose says why in a note."""
    traced = traced_or_why(candidate.cfg)
    if isinstance(traced, str):
        candidate.notes.append(f"traced: does not compose ({traced})")
    else:
        candidate.traced = traced


def evaluate(cfg: ExperimentConfig) -> Candidate:
    """`cfg` resolved (validated)."""
    speed = predict.speed(cfg, host_flops(cfg), host_calibration(cfg))
    memory = predict.stage_memory(cfg)
    candidate = Candidate(cfg, memory, capacities(cfg), speed, host=host_use(cfg, memory))
    if note := cp_uncounted(cfg):
        candidate.notes.append(note)
    if cfg.parallel.ep > 1:
        candidate.notes.append(EP_LOAD.format(allowance=EP_LOAD_ALLOWANCE))
    return candidate
