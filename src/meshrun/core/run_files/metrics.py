"""metrics.jsonl: the run's per-step records (`StepRow`), a JSON object a line. Rank 0
appends each log step's as it happens (rank/metrics/log.py); the driver follows the file while
the ranks train (its live W&B run) and reads it whole once they are done (completed or failed).
rolled_back.jsonl: the steps a train.guard rollback trained again, as they were the first
time, each with the rollback's number."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from meshrun.core.atomic_write import write_atomic

METRICS_FILE = "metrics.jsonl"
ROLLED_BACK_FILE = "rolled_back.jsonl"
REPLICAS_DIR = "replicas"


def replica_metrics(run_dir: str, replica: int) -> Path:
    """A torchft replica's own records (replica 0's are metrics.jsonl): the same steps, the
    same global losses, written while it lives."""
    return Path(run_dir) / REPLICAS_DIR / f"replica{replica}.jsonl"


def replicas_ended(run_dir: str) -> Path:
    """Written by the driver as the first torchft replica group ends the run: a restarted one
    still waiting for a live peer stops instead of training alone."""
    return Path(run_dir) / REPLICAS_DIR / "ended"


# Every row's keys, null where a step has none (an untimed step's time); the other fields are
# written only where a step has them.
ALWAYS = ("step", "loss", "grad_norm", "lr", "step_time_s", "data_wait_s")


@dataclass(frozen=True)
class StepRow:
    """One step's record: written by the ranks (rank 0's log step, a failing rank's own
    unlogged steps, a torchft replica's), read by the driver into the run's record and W&B."""

    step: int
    loss: float
    grad_norm: float | None = None  # global; not finite: every rank skipped the step
    lr: float | None = None
    step_time_s: float | None = None  # None: an untimed step
    data_wait_s: float | None = None  # rank 0's wait for its batch (older rows: none)
    # train.eval: the evaluation after this step
    eval_loss: float | None = None
    eval_perplexity: float | None = None
    eval_time_s: float | None = None
    # an MoE model's routers (models/moe.router_fields)
    moe_max_load: float | None = None
    moe_max_load_per_layer: list[float] | None = None
    moe_dropped: float | None = None
    moe_aux_loss: float | None = None
    # the step's slowest rank by busy time, its seconds and the other ranks' median
    slowest_rank: int | None = None
    busy_max_s: float | None = None
    busy_others_median_s: float | None = None
    # debug.profile_steps: traced, or the step after the traces (both left out of the timing)
    profiled: bool | None = None
    after_profile: bool | None = None
    # parallel.fault_tolerance=torchft: the replicas that trained it, how often it was trained
    # again; the replica whose file it came from where replica 0 did not write it
    replicas: int | None = None
    retried: int | None = None
    written_by_replica: int | None = None
    # a failed run's step where some loss-holding ranks died before writing theirs
    partial_loss: bool | None = None
    rollback: int | None = None  # rolled_back.jsonl: the rollback that undid it (from 1)

    def to_json(self) -> dict[str, Any]:
        """The row as written: ALWAYS's keys, then those of the other fields the step has."""
        row = dataclasses.asdict(self)
        return {k: v for k, v in row.items() if k in ALWAYS or v is not None}

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> StepRow:
        """A written row, by any meshrun: missing keys are None (rows older than a field),
        keys this meshrun does not know are dropped."""
        return cls(**{k: v for k, v in row.items() if k in _FIELDS})


_FIELDS = frozenset(f.name for f in dataclasses.fields(StepRow))


def step_line(row: StepRow) -> str:
    return json.dumps(row.to_json()) + "\n"


def read_records(path: Path) -> list[StepRow]:
    if not path.exists():
        return []
    return [StepRow.from_json(json.loads(line)) for line in path.read_text().splitlines() if line]


def fill_from_replicas(run_dir: str) -> list[int]:
    """metrics.jsonl completed with the steps replica 0 did not write (it was down, or its
    last steps died unwritten with it) from the other replicas' files; the steps filled."""
    path = Path(run_dir) / METRICS_FILE
    rows = {r.step: r for r in read_records(path)}
    filled: list[int] = []
    for other in sorted((Path(run_dir) / REPLICAS_DIR).glob("replica*.jsonl")):
        for row in read_records(other):
            if row.step not in rows:
                rows[row.step] = dataclasses.replace(row, written_by_replica=_number(other))
                filled.append(row.step)
    if filled:
        write_atomic(path, "".join(step_line(rows[s]) for s in sorted(rows)))
    return sorted(filled)


def _number(path: Path) -> int:
    return int(path.stem.removeprefix("replica"))
