"""The pre-launch memory check: a run the planner predicts not to fit stops here, before any
process starts, with the predicted figure, the device's capacity and layouts that would fit."""

from __future__ import annotations

from meshrun.core.config import ExperimentConfig
from meshrun.core.errors import fail
from meshrun.core.hardware import HostFacts
from meshrun.core.layout import Layout
from meshrun.plan.candidate import evaluate
from meshrun.plan.search import search

GiB = 2**30


def _gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


def check_fit(cfg: ExperimentConfig, facts: HostFacts) -> None:
    if cfg.plan.allow_oom:
        return
    candidate = evaluate(cfg)
    if candidate.fits:
        return
    over = [m.peak - c for m, c in zip(candidate.memory, candidate.capacity, strict=True)]
    rank = over.index(max(over))
    m = candidate.memory[rank]
    split = ", ".join(f"{k} {_gib(v)}" for k, v in m.as_dict().items() if k != "peak")
    world = Layout.of(cfg.parallel).world_size
    fitting = [c for c in search(cfg, world, facts) if c.fits][:3]
    if fitting:
        valid = "; ".join(f"{c.overrides()} (predicted {_gib(c.peak)} a rank)" for c in fitting)
    else:
        valid = (f"no layout of {world} ranks fits (meshrun-plan lists them): more devices, "
                 "a smaller model or a shorter train.seq_len")  # fmt: skip
    fail(
        "parallel",
        cfg.parallel.name,
        f"predicted peak memory {_gib(m.peak)} on rank {rank} ({split}) exceeds the "
        f"{_gib(candidate.capacity[rank])} usable there ({cfg.hardware.name}, less "
        f"plan.headroom_gib={cfg.plan.headroom_gib:g})",
        f"{valid}; or plan.allow_oom=true to launch anyway",
    )
