"""The results record of one run: who it is, how it ended and what ran, with what it measured
in sub-records (core/record_parts.py) as the way back fills them (driver/results.py).
results.json, the store, W&B and the report keep one flat column a field: `as_dict` and
`from_dict` are the one mapping between the record and them, and the store's columns (SQLite
types from the annotations), the W&B summary keys and the report's columns are read off each
field's metadata. A sweep's skipped point is the same record with its defaults."""

# ruff: noqa: RUF009 (`_f` and `_part` return a dataclasses.field)
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from meshrun.core.record_parts import (
    Checkpoints,
    Comparison,
    Evaluation,
    Faults,
    Flops,
    Host,
    Inspection,
    Memory,
    Pipeline,
    Prediction,
    Selection,
    Series,
    Speed,
)
from meshrun.core.record_parts import record_field as _f

# The breakdown of a rank's peak memory, as the record's memory_<category>_bytes fields.
MEMORY_CATEGORIES = ("params", "grads", "optimizer", "activations", "other")
# Keys older meshruns wrote under another name.
RENAMED = {"pp_microbatches": "n_microbatches", "warmup_steps": "untimed_steps"}
SQLITE_TYPES = {str: "TEXT", int: "INTEGER", float: "REAL", bool: "INTEGER"}


def _part(kind: type) -> Any:
    """A sub-record: its fields are the record's flat columns, not the sub-record itself."""
    return field(default_factory=kind, metadata={"part": kind})


@dataclass
class RunRecord:
    """One run: who it is, how it ended and what ran, then what it measured, part by part."""

    # identity and outcome
    run_id: str = _f("", column=True, report=(0, "run"))
    role: str = _f("run", column=True)
    created_at: str = _f("", column=True, report=(1, "created (UTC)"))
    status: str = _f("skipped", column=True, summary=True, report=(11, "status"))
    error: str | None = _f(column=True, summary=True, report=(19, "reason"))
    failed_rank: int | None = _f()
    traceback: str | None = _f()  # the failing rank's, where it raised
    duration_s: float | None = _f()
    name: str | None = _f(column=True)
    sweep: str | None = _f(column=True, summary=True, report=(2, "sweep"))
    # checkpoints: the step and checkpoint it resumed from; a new run from another run's
    # checkpoint (resumed into a run dir of its own): that run
    resumed_from_step: int | None = _f(column=True, summary=True)
    resumed_from_checkpoint: str | None = _f(summary=True)
    parent_run_id: str | None = _f(column=True, summary=True)
    # what ran
    model: str | None = _f(column=True, summary=True, report=(3, "model"))
    # model=hf/auto: the architecture read from model.pretrained's config.json, and its sizes
    model_read: str | None = _f(column=True, summary=True)
    data: str | None = _f(column=True, summary=True, report=(6, "data"))  # synthetic|text|hf
    parallel: str | None = _f(column=True)  # preset (auto: planner's pick)
    layout: dict[str, int] | None = _f()
    layout_name: str | None = _f(column=True, summary=True, report=(4, "layout"))
    overrides: str | None = _f()  # `meshrun <these>` runs it again
    # the experiment as composed, before the resolution filled it (its auto, -1, null)
    settings: dict[str, Any] | None = _f()
    world_size: int | None = _f(column=True, summary=True, report=(5, "ranks"))
    devices: int | None = _f()
    hardware: str | None = _f(column=True, summary=True)
    device_type: str | None = _f()
    backend: str | None = _f(column=True, summary=True, report=(7, "backend"))
    precision: str | None = _f(column=True)
    precision_auto: str | None = _f()  # train.precision=auto: why (sm90, CPU, ...)
    # the rate its matmuls run at, which MFU counts: tf32 for fp32 on CUDA with train.tf32
    matmul_precision: str | None = _f()
    # train.loss as it ran (chunked, vocab_parallel, full) and, where auto chose, why
    loss: str | None = _f(column=True, summary=True)
    loss_auto: str | None = _f()
    # what computed a chunked loss (liger, torch) and, where train.loss_kernel=auto chose, why
    loss_kernel: str | None = _f()
    loss_kernel_auto: str | None = _f()
    seq_len: int | None = _f(column=True)
    global_batch_size: int | None = _f(column=True, summary=True, report=(8, "batch / micro"))
    # train.global_batch_size null: how the layout made it (micro x dp x micro-batches)
    batch_derived: str | None = _f()
    micro_batch_size: int | None = _f(column=True, summary=True)
    # micro-batches per step on a data-parallel rank: a pipeline's m, else accumulation
    grad_accum_steps: int | None = _f(report=(9, "micro-batches"))
    steps: int | None = _f()
    untimed_steps: int | None = _f()
    steps_completed: int | None = _f()
    params: int | None = _f()
    run_dir: str | None = _f(column=True)
    # what makes a figure of this run untrustworthy, each a sentence (efficiency above 1 +
    # noise, a busy host): shown beside the figures, never hidden
    flags: list[str] = _f(factory=list)
    # what it measured, part by part
    speed: Speed = _part(Speed)
    comparison: Comparison = _part(Comparison)
    flops: Flops = _part(Flops)
    pipeline: Pipeline = _part(Pipeline)
    memory: Memory = _part(Memory)
    prediction: Prediction = _part(Prediction)
    evaluation: Evaluation = _part(Evaluation)
    checkpoints: Checkpoints = _part(Checkpoints)
    selection: Selection = _part(Selection)
    inspection: Inspection = _part(Inspection)
    faults: Faults = _part(Faults)
    series: Series = _part(Series)
    host: Host = _part(Host)

    def as_dict(self) -> dict[str, Any]:
        """The record's flat columns: results.json's content (and the store's results_json,
        W&B's summary, the report's rows)."""
        nested = dataclasses.asdict(self)
        flat = {}
        for part, f in flat_fields():
            flat[f.name] = nested[f.name] if part is None else nested[part][f.name]
        return flat

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunRecord:
        """A record from its flat columns, written by any meshrun: older names renamed,
        missing keys defaulted, keys this meshrun no longer knows dropped."""
        given = {RENAMED.get(k, k): v for k, v in data.items()}
        own: dict[str, Any] = {}
        parts: dict[str, dict[str, Any]] = {name: {} for name in _parts()}
        for part, f in flat_fields():
            if f.name in given:
                (own if part is None else parts[part])[f.name] = given[f.name]
        return cls(**own, **{name: kind(**parts[name]) for name, kind in _parts().items()})


@cache
def _parts() -> dict[str, type]:
    """The record's sub-records by attribute."""
    return {
        f.name: f.metadata["part"] for f in dataclasses.fields(RunRecord) if "part" in f.metadata
    }


@cache
def flat_fields() -> tuple[tuple[str | None, dataclasses.Field], ...]:
    """Every flat column's field, in record order, with the sub-record holding it (None: the
    record itself)."""
    flat: list[tuple[str | None, dataclasses.Field]] = []
    for f in dataclasses.fields(RunRecord):
        if "part" in f.metadata:
            flat.extend((f.name, g) for g in dataclasses.fields(f.metadata["part"]))
        else:
            flat.append((None, f))
    return tuple(flat)


@cache
def _hints() -> dict[str, Any]:
    hints = typing.get_type_hints(RunRecord)
    for kind in _parts().values():
        hints |= typing.get_type_hints(kind)
    return hints


def _sqlite_type(annotation: Any) -> str:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    return SQLITE_TYPES.get(annotation, "TEXT")


@cache
def store_columns() -> dict[str, str]:
    """Store column -> SQLite type, in record order; run_id is the primary key."""
    columns = {}
    for _, f in flat_fields():
        if f.metadata["column"]:
            kind = _sqlite_type(_hints()[f.name])
            columns[f.name] = f"{kind} PRIMARY KEY" if f.name == "run_id" else kind
    return columns


def summary_keys() -> tuple[str, ...]:
    return tuple(f.name for _, f in flat_fields() if f.metadata["summary"])


def report_columns() -> tuple[tuple[str, str], ...]:
    """(field, header) of each column the report shows, in the report's order."""
    shown = [f for _, f in flat_fields() if f.metadata["report"]]
    return tuple((f.name, f.metadata["report"][1]) for f in sorted(shown, key=_position))


def _position(f: dataclasses.Field) -> int:
    return f.metadata["report"][0]
