"""The pre-launch memory checks: a run the planner predicts not to fit stops here, before any
process starts, with the predicted figure, the device's capacity and layouts that would fit;
and whether its single-device baseline fits beside it, to be measured beside it."""

from __future__ import annotations

from meshrun.core.baseline import baseline_config
from meshrun.core.config import ExperimentConfig
from meshrun.core.errors import fail
from meshrun.core.layout import Layout
from meshrun.plan import predict
from meshrun.plan.candidate import Candidate, Legal, evaluate, host_flops
from meshrun.plan.host import HostUse
from meshrun.plan.search import FLOAT8_KEY, Box, search

GiB = 2**30


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def check_fit(candidate: Candidate, legal: Legal) -> None:
    """The candidate of the run's own config fits, or ConfigError with layouts that would."""
    cfg = candidate.cfg
    if cfg.plan.allow_oom or candidate.fits:
        return
    if candidate.host is not None and not candidate.host.fits:
        _refuse_host(cfg, candidate.host)
    over = [m.peak - c for m, c in zip(candidate.memory, candidate.capacity, strict=True)]
    stage = over.index(max(over))
    m = candidate.memory[stage]
    rank = stage * candidate.ranks_per_stage  # the stage's first rank
    split = ", ".join(f"{k} {_gib(v)}" for k, v in m.as_dict().items() if k != "peak")
    world = Layout.of(cfg.parallel).world_size
    box = Box(cfg.launcher.nnodes, world // cfg.launcher.nnodes)
    keep = frozenset({FLOAT8_KEY})  # layouts of the run's own precision
    fitting = [c for c in search(cfg, box, legal, keep).ranked if c.fits][:3]
    if fitting:
        valid = "; ".join(f"{c.overrides()} (predicted {_gib(c.peak)} a rank)" for c in fitting)
    else:
        valid = (
            f"no layout of {world} ranks fits (meshrun-plan lists them): more devices, "
            "a smaller model or a shorter train.seq_len"
        )
    fail(
        "parallel",
        cfg.parallel.name,
        f"predicted peak memory {_gib(m.peak)} on rank {rank} ({split}) exceeds the "
        f"{_gib(candidate.capacity[stage])} usable there ({cfg.hardware.name}, less "
        f"plan.headroom_gib={cfg.plan.headroom_gib:g}"
        + (
            f" and plan.fragmentation={cfg.plan.fragmentation:g}"
            if cfg.hardware.device_type == "cuda"
            else ""
        )
        + ")",
        f"{valid}; or plan.allow_oom=true to launch anyway",
    )


def _refuse_host(cfg: ExperimentConfig, host: HostUse) -> None:
    """The node's ranks offload more than its host memory holds (plan/host.py)."""
    p = cfg.parallel
    key, value = ("parallel.fsdp.offload", "cpu")
    if p.activation_offload == "cpu":
        key = "parallel.activation_offload"
    per_node = Layout.of(p).world_size // cfg.launcher.nnodes
    fail(
        key,
        value,
        f"the {per_node} ranks of a node are predicted to keep {_gib(host.per_node)} in host "
        f"memory, more than the {_gib(host.capacity)} there ({cfg.hardware.name}'s "
        f"host_memory_gib={cfg.hardware.host_memory_gib:g}, less "
        f"plan.headroom_gib={cfg.plan.headroom_gib:g})",
        f"{key}=none, more nodes (launcher.nnodes), or plan.allow_oom=true to launch anyway",
    )


def baseline_fits_beside(cfg: ExperimentConfig) -> bool:
    """Whether rank 0 can hold the single-device baseline beside its share of the run and
    train a step of it within the backend's timeout (the baseline beside the run: the other
    ranks wait at a barrier meanwhile). On CPU the ranks share the host's memory, so the room
    is what all of them leave."""
    run, baseline = evaluate(cfg), baseline_config(cfg)
    if cfg.hardware.device_type == "cpu":
        room = (sum(run.capacity) - sum(m.peak for m in run.memory)) * run.ranks_per_stage
    else:
        room = run.capacity[0] - run.memory[0].peak
    if predict.memory(baseline)[0].peak > room:
        return False
    step = predict.speed(baseline, host_flops(cfg))  # the run's rate per rank: a bound from above
    return step is None or step.step_time_s < cfg.backend.timeout_s / 2
