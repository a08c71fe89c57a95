"""A host's measured rates (`meshrun-plan calibrate`, tools/calibrate.py): what the speed
model otherwise takes from a datasheet or one matmul probe, measured with the run's ranks
all busy at once and the run's own shapes. Written as JSON beside the results store; a plan
or run on the same host (fingerprint: host, devices, versions, threads) with the same ranks
uses it (plan.calibration), and says so."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CALIBRATION_FILE = "calibration.json"


@dataclass(frozen=True)
class Calibration:
    """Per rank, with `ranks` ranks of `threads_per_rank` threads computing at once.
    `matmul_flops`: FLOPs over seconds of the block's matmuls at the run's token count
    (forward and both backward GEMMs, each shape weighted by its FLOPs), on a CPU as they
    ran inside a block's step (`matmul_alone_flops`: each shape timed alone); `attention_flops`:
    causal SDPA's counted FLOPs (half of 4·b·s²·h forward, 2.5x that backward) a second;
    `memory_bw`: bytes a second of a large elementwise add; `op_seconds`: the eager
    dispatch of one small op (what a step pays per kernel however small its tensors);
    `ops_per_layer`: aten ops one block's forward and backward dispatch (counted on the
    run's model); `tp_layer_overhead`, `sp_layer_overhead`, `fsdp_layer_overhead`: what a
    block's forward and backward cost the host more under TP's DTensors (without and with
    sequence parallelism) and FSDP2's hooks; `checkpoint_layer_overhead`: what a block costs
    the host more under each activation checkpointing policy (`full`, `selective`, `op`: the
    forward dispatched again, selective checkpointing's policy called for every op, forward
    and recompute); `context_layer_overhead`: what a block costs the host more under each CP
    method over the calibration's ranks (the function mode that catches its attention, the
    ring's steps and merges); `link_bw_gbs` and `link_latency_us`:
    meshrun-comm's all-reduce bus bandwidth at its largest size and a small all-reduce's
    time per hop; `link_bw_by_op`: each collective's bus bandwidth at its largest size
    (all-reduce, all-gather, reduce-scatter), GB/s; `link_curves`: each one's bus bandwidth
    at every size measured, [bytes, GB/s] from the smallest (a TP block's activations sit
    between 4 KiB and 16 MiB, where gloo's time is neither latency nor bandwidth alone);
    `storage_gbs`: GB/s the node wrote to `storage_dir` (the checkpoint dir), every rank a
    file at once, synced as DCP syncs its files; `staging_gbs`: GB/s a rank copied its state
    into host memory as DCP's async_save stages it (tools/plan/storage.py)."""

    fingerprint_key: str
    created_at: str
    device_type: str
    ranks: int
    threads_per_rank: int
    precision: str
    model: str
    tokens: int  # the micro-batch's tokens the matmuls were timed at
    matmul_flops: float
    attention_flops: float
    memory_bw: float
    op_seconds: float
    ops_per_layer: int
    tp_layer_overhead: float = 0.0
    sp_layer_overhead: float = 0.0
    fsdp_layer_overhead: float = 0.0
    checkpoint_layer_overhead: dict[str, float] = field(default_factory=dict)
    context_layer_overhead: dict[str, float] = field(default_factory=dict)
    link_bw_gbs: float | None = None
    link_latency_us: float | None = None
    link_bw_by_op: dict[str, float] = field(default_factory=dict)
    link_curves: dict[str, list[list[float]]] = field(default_factory=dict)
    matmul_alone_flops: float | None = None
    shapes: list[dict[str, Any]] = field(default_factory=list)  # each matmul shape's rate
    storage_gbs: float | None = None
    storage_dir: str | None = None
    staging_gbs: float | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        link = (
            f", link {self.link_bw_gbs:.2f} GB/s + {self.link_latency_us:.0f} us a hop"
            if self.link_bw_gbs
            else ""
        )
        alone = (
            f" in a step ({self.matmul_alone_flops / 1e9:.1f} alone)"
            if self.matmul_alone_flops and self.matmul_alone_flops != self.matmul_flops
            else ""
        )
        storage = (
            f", checkpoints {self.storage_gbs:.2f} GB/s to {self.storage_dir}, staged at "
            f"{self.staging_gbs:.2f}"
            if self.storage_gbs and self.staging_gbs
            else ""
        )
        return (
            f"matmul {self.matmul_flops / 1e9:.1f} GFLOP/s{alone}, attention "
            f"{self.attention_flops / 1e9:.1f} GFLOP/s, memory {self.memory_bw / 1e9:.1f} GB/s, "
            f"{self.op_seconds * 1e6:.1f} us an op x {self.ops_per_layer} a layer (+"
            f"{self.tp_layer_overhead * 1e3:.2f} ms under TP, "
            f"{self.sp_layer_overhead * 1e3:.2f} with SP, "
            f"{self.fsdp_layer_overhead * 1e3:.2f} under FSDP2{self._checkpointing()}"
            f"{self._context()}){link}{storage} "
            f"per rank, {self.ranks} ranks x {self.threads_per_rank} threads, "
            f"measured {self.created_at}"
        )

    def _checkpointing(self) -> str:
        said = ", ".join(f"{s * 1e3:.2f} {p}" for p, s in self.checkpoint_layer_overhead.items())
        return f", checkpointing {said}" if said else ""

    def _context(self) -> str:
        said = ", ".join(f"{s * 1e3:.2f} {m}" for m, s in self.context_layer_overhead.items())
        return f", CP {said}" if said else ""


def calibration_path(store_path: str) -> Path:
    """Where `meshrun-plan calibrate` writes and plans look: beside the results store."""
    return Path(store_path).parent / CALIBRATION_FILE


def read_calibration(path: Path) -> Calibration | None:
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    known = {f.name for f in dataclasses.fields(Calibration)}
    return Calibration(**{k: v for k, v in data.items() if k in known})


def write_calibration(calibration: Calibration, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(calibration.as_dict(), indent=2))
