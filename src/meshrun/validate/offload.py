"""The offloads' rules: FSDP2's replaces no DDP or DataParallel replication (one device, TP, PP
and CP alone shard over one rank: rank/parallel/fsdp.py);
activation offload's hooks do not reach inside a compiled block (nor DataParallel's threads:
that rule is DataParallel's, validate/layout.check_dataparallel)."""

from __future__ import annotations

from meshrun.core.config import ExperimentConfig
from meshrun.core.errors import fail
from meshrun.core.layout import Layout, keeps_whole_replicas


def check_offload(cfg: ExperimentConfig) -> None:
    p = cfg.parallel
    layout = Layout.of(p)
    if p.fsdp.offload == "cpu" and keeps_whole_replicas(p):
        fail(
            "parallel.fsdp.offload",
            "cpu",
            f"is FSDP2's CPUOffloadPolicy, and layout {layout.describe()} replicates through "
            f"{'DataParallel' if p.data_parallel == 'dataparallel' else 'DDP'}, which keeps "
            "every parameter on the device",
            "parallel.dp_shard >= 2 in place of dp_replicate (parallel=fsdp, hsdp, ...), one "
            "device, or parallel.fsdp.offload=none",
        )
    if p.activation_offload == "cpu" and cfg.train.compile:
        fail(
            "parallel.activation_offload",
            "cpu",
            "keeps what a block saves in host memory through saved-tensor hooks, which a "
            "compiled block's saved tensors bypass (measured: only the blocks' inputs moved, "
            "1/27 of tiny's activations)",
            "train.compile=false, or parallel.activation_offload=none",
        )
