"""What a layout's checkpoints cost a run: the bytes each rank writes (its shards of the model
and of AdamW's state, as DCP writes them), how long a save takes to reach the checkpoint
dir, how long it holds training up, and how long a restart takes (launch, then every rank
reading its state back).

DCP (torch/distributed/checkpoint) writes each rank's own pieces: a DTensor's local shard
(FSDP, TP), a pipeline stage's tensors; a tensor several ranks hold whole (DDP's replicas,
TP's norms) is written once, by the rank whose plan is smallest so far
(`_dedup_save_plans.dedup_save_plans`), which spreads a stage's tensors evenly over its
ranks. So a rank writes its stage's state over the stage's ranks: measured on model=small,
within 1% under ddp, fsdp and tp2_pp2 (tests/test_run_plan.py). An async save first copies
every tensor the rank holds, replicas included, into host memory (`async_save` stages the
whole state dict before the plan dedups it), and training waits for that copy only.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from meshrun.core.calibration import Calibration
from meshrun.core.checkpoints import BYTES_PER_PARAM
from meshrun.core.config import ExperimentConfig
from meshrun.core.layout import Layout
from meshrun.models import param_counts
from meshrun.plan import predict
from meshrun.plan.memory import MemoryPrediction
from meshrun.plan.shapes import Dims, local_param_elements, stage_shares

GB = 1e9
# A node's share of a large cluster's storage when every node saves at once: the Llama 3
# paper's (Dubey et al. 2024, sec. 3.3.1) Tectonic sustains 2 TB/s for its 16,384-GPU job,
# 2,048 nodes of 8 GPUs.
CITED_STORAGE_GBS = 2000 / 2048
CITED_STORAGE = "Llama 3's 2 TB/s over 2,048 nodes (Dubey et al. 2024)"
# Staging, without a calibration. async_save's default stager copies into pageable host
# memory, fresh each save (torch/distributed/checkpoint/state_dict_saver.py, async_save:
# DefaultStager(StagingOptions(False, False, False, False)), no pinned or cached storage).
# On a GPU the copy crosses PCIe: 4.0 x16 carries 32 GB/s a direction (A100's datasheet,
# 64 GB/s both ways; PCIe 5.0 parts twice that), an upper bound for pageable copies. On a
# CPU it is a copy into memory never touched: the stager at 2.4-2.8 GB/s a rank, measured
# on this project's 2-vCPU host (core/calibration.py's `staging_gbs` measures a host's own).
STAGING_GBS = {"cuda": 32.0, "cpu": 2.4}
STAGING_FROM = {
    "cuda": "PCIe 4.0 x16's 32 GB/s a direction, an upper bound",
    "cpu": "a copy into fresh memory, 2.4 GB/s measured on a 2-vCPU host",
}
# A restart's launch, before the checkpoint is read: `meshrun model=small parallel=ddp
# train.steps=1` (2 gloo ranks: the driver's imports, the ranks forked, the process group,
# the model built, one step) took 2.05-2.37 s on this project's 2-vCPU host. A floor on a GPU
# cluster, which adds its scheduler, CUDA's and NCCL's start-up.
LAUNCH_S = 2.1


@dataclass(frozen=True)
class StorageRates:
    """GB/s a node writes (and reads) its checkpoints at, GB/s a rank stages its state into
    host memory at, and where each figure came from."""

    storage_gbs: float
    storage_from: str
    staging_gbs: float
    staging_from: str


def storage_rates(cfg: ExperimentConfig, calibration: Calibration | None) -> StorageRates:
    """hardware.storage_gbs where given, else this host's calibration, else the cited figure;
    the staging rate the calibration's, else the device type's (STAGING_GBS)."""
    if cfg.hardware.storage_gbs is not None:
        storage = (cfg.hardware.storage_gbs, "hardware.storage_gbs")
    elif calibration is not None and calibration.storage_gbs:
        storage = (calibration.storage_gbs, f"calibrated on {calibration.storage_dir}")
    else:
        storage = (CITED_STORAGE_GBS, CITED_STORAGE)
    kind = cfg.hardware.device_type
    if calibration is not None and calibration.staging_gbs:
        staging = (calibration.staging_gbs, "calibrated")
    else:
        staging = (STAGING_GBS.get(kind, STAGING_GBS["cpu"]), STAGING_FROM.get(kind, ""))
    return StorageRates(*storage, *staging)


@dataclass(frozen=True)
class CheckpointCost:
    """One checkpoint of the layout: bytes a rank writes (the most of any rank) and stages
    into host memory, what its node writes; seconds a save takes to its last byte, seconds it
    holds training up (async: the staging; else the whole save), seconds a restart takes
    (`launch_s`, then the node's state read back at the storage's rate)."""

    bytes_per_rank: int
    staged_bytes_per_rank: int
    node_bytes: int
    save_s: float
    blocked_s: float
    load_s: float
    launch_s: float
    rates: StorageRates

    @property
    def restart_s(self) -> float:
        return self.launch_s + self.load_s

    def as_dict(self) -> dict:
        return {**asdict(self), "restart_s": self.restart_s}


def stage_state_bytes(cfg: ExperimentConfig) -> list[int]:
    """Bytes of model and optimizer state each pipeline rank's stage holds, whole (before any
    shard or replica): fp32 weights and AdamW's two fp32 moments."""
    layout = Layout.of(cfg.parallel)
    if not predict.has_formula(cfg):  # a user's module: its parameters split evenly
        total = param_counts(cfg.model, cfg.train.seq_len)[0]
        return [math.ceil(total / layout.pp) * BYTES_PER_PARAM] * layout.pp
    whole = Dims.of(cfg.model, layout.tp)  # the vocabulary padded as TP pads it
    return [
        local_param_elements(whole, share, 1, 1) * BYTES_PER_PARAM
        for share in stage_shares(cfg.model, cfg.parallel, layout)
    ]


def checkpoint_cost(
    cfg: ExperimentConfig, memory: list[MemoryPrediction], rates: StorageRates
) -> CheckpointCost:
    """`memory`: the layout's prediction per pipeline rank (what a rank holds: what it stages
    and reads back on a restart)."""
    layout = Layout.of(cfg.parallel)
    ranks_per_stage = layout.world_size // layout.pp
    written = max(math.ceil(b / ranks_per_stage) for b in stage_state_bytes(cfg))
    held = max(m.params + m.optimizer for m in memory)
    per_node = math.ceil(layout.world_size / cfg.launcher.nnodes)
    staging_s = held / (rates.staging_gbs * GB)
    save_s = staging_s + written * per_node / (rates.storage_gbs * GB)
    return CheckpointCost(
        bytes_per_rank=written,
        staged_bytes_per_rank=held,
        node_bytes=written * per_node,
        save_s=save_s,
        blocked_s=staging_s if cfg.checkpoint.async_save else save_s,
        load_s=held * per_node / (rates.storage_gbs * GB),
        launch_s=LAUNCH_S,
        rates=rates,
    )
