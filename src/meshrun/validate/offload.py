"""parallel.fsdp.offload: FSDP2's offload needs a layout that goes through FSDP2
(rank/parallel/fsdp.py); activation offload's one rule is DataParallel's
(validate/layout.check_dataparallel)."""

from __future__ import annotations

from meshrun.core.config import ExperimentConfig
from meshrun.core.errors import fail
from meshrun.core.layout import Layout


def check_offload(cfg: ExperimentConfig) -> None:
    p = cfg.parallel
    layout = Layout.of(p)
    if p.fsdp.offload == "cpu" and (p.data_parallel == "dataparallel" or not layout.uses_fsdp):
        fail(
            "parallel.fsdp.offload",
            "cpu",
            f"is FSDP2's CPUOffloadPolicy, and layout {layout.describe()} does not go through "
            "FSDP2 (DDP, DataParallel and one device keep their parameters on the device)",
            "parallel.dp_shard >= 2 (parallel=fsdp, hsdp, fsdp2_tp2, ...), or "
            "parallel.fsdp.offload=none",
        )
