"""The results record of one run: every field typed, once. results.json is `as_dict()`; the
store's columns (SQLite types from the annotations), the W&B summary keys and the report's
columns are read off each field's metadata. A sweep's skipped point is the same record with
its defaults; a completed or failed run fills it in (driver/results.py)."""

# ruff: noqa: RUF009 (`_f` returns a dataclasses.field)
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from functools import cache
from typing import Any

# The breakdown of a rank's peak memory, as the record's memory_<category>_bytes fields.
MEMORY_CATEGORIES = ("params", "grads", "optimizer", "activations", "other")
# Keys older meshruns wrote under another name.
RENAMED = {"pp_microbatches": "n_microbatches", "warmup_steps": "untimed_steps"}
SQLITE_TYPES = {str: "TEXT", int: "INTEGER", float: "REAL", bool: "INTEGER"}


def _f(
    default: Any = None,
    *,
    column: bool = False,
    summary: bool = False,
    report: tuple[int, str] | None = None,
    factory: Any = None,
) -> Any:
    """A dataclasses.field with its metadata. `column`: a store column; `summary`: in the W&B
    run summary; `report`: (position, header) of the report column showing it."""
    meta = {"column": column, "summary": summary, "report": report}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class RunRecord:
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
    seq_len: int | None = _f(column=True)
    global_batch_size: int | None = _f(column=True, summary=True, report=(8, "batch / micro"))
    # train.global_batch_size null: how the layout made it (micro x dp x micro-batches)
    batch_derived: str | None = _f()
    micro_batch_size: int | None = _f(column=True, summary=True)
    n_microbatches: int | None = _f()  # a pipeline's per step
    # micro-batches per step on a data-parallel rank: a pipeline's m, else accumulation
    grad_accum_steps: int | None = _f(report=(9, "micro-batches"))
    steps: int | None = _f()
    untimed_steps: int | None = _f()
    steps_completed: int | None = _f()
    # steps whose global gradient norm was not finite (fp16's overflows, a non-finite loss):
    # every rank skipped them, the weights not updated (rank/train/guard.py)
    skipped_steps: list[int] | None = _f()
    steps_skipped: int | None = _f(column=True, summary=True)
    params: int | None = _f()
    # speed: step times of the timed steps, their median, spread and coefficient of variation
    step_times: list[float] = _f(factory=list)
    step_time_s: float | None = _f(column=True, summary=True, report=(13, "step time (p10-p90)"))
    step_time_p10_s: float | None = _f(column=True, summary=True)
    step_time_p90_s: float | None = _f(column=True, summary=True)
    step_time_cv: float | None = _f(column=True, summary=True)
    tokens_per_s: float | None = _f(column=True, summary=True, report=(12, "tokens/s"))
    samples_per_s: float | None = _f(summary=True)
    # train.compile: seconds spent compiling (torch.compile's traces and code generation,
    # forward and backward) during the untimed steps, on the slowest rank; in no step time
    compile_s: float | None = _f(column=True, summary=True)
    # the host's CPU that processes other than this run's used while it was timed (share of
    # all cores); None where not measured (another host's ranks)
    host_other_cpu_share: float | None = _f(column=True, summary=True)
    scaling: str | None = _f(summary=True)
    # the single-device baseline: `fresh` (measured side by side with the run, alternating),
    # `after` (measured on its own after the run: both did not fit at once), `stored` (a
    # stored one of the same fingerprint, `baseline_age_s` old), `own` (a single-device run)
    baseline_mode: str | None = _f(column=True, summary=True, report=(15, "baseline"))
    baseline_age_s: float | None = _f(summary=True)
    baseline_tokens_per_s: float | None = _f(summary=True)
    baseline_run_id: str | None = _f()
    speedup: float | None = _f(column=True, summary=True, report=(14, "speedup (p10-p90)"))
    # the spread of the speedup over the alternating rounds (10th and 90th percentile)
    speedup_p10: float | None = _f(column=True, summary=True)
    speedup_p90: float | None = _f(column=True, summary=True)
    speedup_rounds: int | None = _f(summary=True)
    # the measurement's relative noise: the spread's half-width over the speedup, or without
    # rounds the run's and the baseline's step-time variation combined
    speedup_noise: float | None = _f(summary=True)
    scaling_efficiency: float | None = _f(column=True, summary=True, report=(16, "efficiency"))
    # what makes a figure of this run untrustworthy, each a sentence (efficiency above 1 +
    # noise, a busy host): shown beside the figures, never hidden
    flags: list[str] = _f(factory=list)
    flops_per_token: float | None = _f()
    flops_per_token_counted: float | None = _f()  # plan.trace: torch's FlopCounterMode
    mfu: float | None = _f(column=True, summary=True)
    # an MoE model: the share of its matmul parameters a token meets, the N of MFU's 6N
    active_param_share: float | None = _f()
    # train.float8: the recipe, how many linears it converted (models/float8.py), their
    # share of the training FLOPs a token, what stayed in high precision (an MoE's
    # experts), and MFU against the devices' fp8 peak (`mfu` is against the run's
    # precision's: bf16)
    float8_recipe: str | None = _f(column=True, summary=True)
    float8_linears: int | None = _f(summary=True)
    float8_flops_share: float | None = _f(summary=True)
    float8_note: str | None = _f()
    mfu_fp8_peak: float | None = _f(summary=True)
    data_wait_share: float | None = _f(column=True, summary=True)  # of timed step time, rank 0
    # pipeline
    pp_schedule: str | None = _f(report=(10, "schedule"))
    bubble_theoretical: float | None = _f(column=True, summary=True, report=(18, "bubble (theory)"))
    bubble_measured: float | None = _f(column=True, summary=True)
    bubble_per_rank: list[float] | None = _f()
    pp_layers: list[int] | None = _f()  # layers per stage (parallel.pp_layers=auto: its pick)
    # pp_layers=auto: each stage's probed seconds of a micro-batch's forward and backward, and
    # what the split left uneven (a layer is its finest step)
    pp_stage_costs_s: list[float] | None = _f()
    pp_split_note: str | None = _f(summary=True)
    # memory (parallel=dataparallel: a device's where others have a rank's)
    peak_memory_bytes: list[int] | None = _f()
    peak_memory_max_bytes: int | None = _f(column=True, summary=True, report=(17, "peak memory"))
    memory_per_rank: list[dict[str, int]] | None = _f()
    memory_params_bytes: int | None = _f(column=True, summary=True)
    memory_grads_bytes: int | None = _f(column=True, summary=True)
    memory_optimizer_bytes: int | None = _f(column=True, summary=True)
    memory_activations_bytes: int | None = _f(column=True, summary=True)
    memory_other_bytes: int | None = _f(column=True, summary=True)
    memory_predicted: list[dict[str, int]] | None = _f()
    pretrained_read_bytes_per_rank: list[int] | None = _f()  # each rank reads its share
    # evaluation (train.eval): the last one's loss and perplexity, seconds per evaluation
    eval_loss: float | None = _f(column=True, summary=True)
    eval_perplexity: float | None = _f(column=True, summary=True)
    eval_time_s: float | None = _f(summary=True)
    # checkpoints
    resumed_from_step: int | None = _f(column=True, summary=True)
    resumed_from_checkpoint: str | None = _f(summary=True)  # the checkpoint it started from
    # a new run from another run's checkpoint (resumed into a run dir of its own): that run
    parent_run_id: str | None = _f(column=True, summary=True)
    requeues: int | None = _f(summary=True)  # SLURM requeued the job (time limit, preemption)
    slurm_job_id: str | None = _f(column=True, summary=True)  # launcher=slurm's job
    host_per_rank: list[str] | None = _f()  # the node each rank ran on
    checkpoint_dir: str | None = _f()
    checkpoint_saves: list[dict[str, Any]] | None = _f()  # step, blocked_s, total_s of each
    checkpoint_blocked_s: float | None = _f(summary=True)  # training waited, per save
    checkpoint_save_s: float | None = _f(summary=True)  # staging to the last byte, per save
    # the steps between saves (checkpoint.every_steps=auto: its choice, and why); the plan's
    # prediction of one save (plan/checkpoint_cost.py), beside what the saves measured
    checkpoint_every_steps: int | None = _f(column=True, summary=True)
    checkpoint_interval: str | None = _f(summary=True)
    predicted_checkpoint_bytes_per_rank: int | None = _f(summary=True)
    predicted_checkpoint_blocked_s: float | None = _f(summary=True)
    predicted_checkpoint_save_s: float | None = _f(summary=True)
    export_path: str | None = _f()  # checkpoint.export: the final model, whole
    # plan.trials: a trial's run it chose the layout for; that run's trials (core/trials.py),
    # how the prediction ranked them against what they measured (Spearman) and the share of
    # the fastest measured speed that the prediction's first choice lacked
    trial_of: str | None = _f(column=True)
    trials: list[dict[str, Any]] | None = _f()
    trials_rank_correlation: float | None = _f(column=True, summary=True)
    trials_first_choice_loss: float | None = _f(summary=True)
    memory_traced: list[dict[str, int]] | None = _f()  # plan.trace: on fake tensors
    predicted_peak_memory_bytes: int | None = _f(column=True, summary=True)
    predicted_step_time_s: float | None = _f(column=True, summary=True)
    predicted_tokens_per_s: float | None = _f()
    predicted_step_parts: dict[str, float] | None = _f()  # the step by what it waits for
    # the run's whole budget (plan.tokens, else its own steps x tokens a step) in seconds at
    # the speed it measured and at the plan's predicted speed for its layout (plan/run_time.py)
    tokens_budget: float | None = _f(column=True, summary=True)
    measured_budget_s: float | None = _f(column=True, summary=True)
    predicted_budget_s: float | None = _f(column=True, summary=True)
    # the calibration (meshrun-plan calibrate) the speed prediction used: when it was measured
    predicted_calibrated_at: str | None = _f(summary=True)
    # debug.profile_steps: the steps traced (left out of step_times), their step time over
    # the others' less one, and each rank's trace summarised (core/run_files/profiles.py)
    profiled_steps: list[int] | None = _f()
    profile_overhead: float | None = _f(summary=True)
    profile: list[dict[str, Any]] | None = _f()
    # each rank's busy seconds a timed step (median; rank/metrics/busy.py), the slowest
    # rank, its busy time over the ranks' median, and the sentence naming it as a straggler
    # where that is above metrics.straggler_threshold
    busy_per_rank: list[float] | None = _f()
    slowest_rank: int | None = _f(column=True, summary=True)
    slowest_rank_slowdown: float | None = _f(column=True, summary=True)
    straggler: str | None = _f(summary=True)
    # train.guard.spike: each rollback (the spike's step and loss against the window's mean
    # and deviation, the checkpoint's step it went back to, the batches it skipped); the
    # steps trained again are in the run dir's rolled_back.jsonl as they were the first time
    rollbacks: list[dict[str, Any]] | None = _f()
    rollback_count: int | None = _f(column=True, summary=True)
    # parallel.fault_tolerance=torchft: each replica that ended before the run (which, its
    # start, how, when), the steps that fewer replicas than the run's trained (and how many
    # replicas each had), and the steps trained again because a replica failed during them
    replica_failures: list[dict[str, Any]] | None = _f()
    replica_failure_count: int | None = _f(column=True, summary=True)
    steps_with_fewer_replicas: int | None = _f(column=True, summary=True)
    fewer_replica_steps: list[list[int]] | None = _f()
    retried_steps: list[int] | None = _f()
    # series and bookkeeping
    losses: list[float] = _f(factory=list)
    grad_norms: list[float | None] = _f(factory=list)
    # an MoE model's routers at the last step: the busiest expert's load over the mean (the
    # worst layer's), the share of assignments dropped, the balance loss (models/moe.py)
    router_max_load: float | None = _f(summary=True)
    router_dropped: float | None = _f(summary=True)
    router_aux_loss: float | None = _f(summary=True)
    eval_losses: list[list[float]] = _f(factory=list)  # [step, eval loss] of each evaluation
    baseline_key: str | None = _f(column=True)
    # where rank 0 ran: host, devices, versions, threads (core/hardware.host_fingerprint),
    # and its hash, which a stored baseline must match to be reused
    fingerprint: dict[str, Any] | None = _f()
    fingerprint_key: str | None = _f(column=True)
    run_dir: str | None = _f(column=True)

    def as_dict(self) -> dict[str, Any]:
        """results.json's content (and the store's results_json)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunRecord:
        """A stored record, from any meshrun: older names renamed, missing keys defaulted,
        keys this meshrun no longer knows dropped."""
        known = {f.name for f in dataclasses.fields(cls)}
        given = {RENAMED.get(k, k): v for k, v in data.items()}
        return cls(**{k: v for k, v in given.items() if k in known})


def _sqlite_type(annotation: Any) -> str:
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
        annotation = args[0]
    return SQLITE_TYPES.get(annotation, "TEXT")


@cache
def store_columns() -> dict[str, str]:
    """Store column -> SQLite type, in record order; run_id is the primary key."""
    hints = typing.get_type_hints(RunRecord)
    columns = {}
    for f in dataclasses.fields(RunRecord):
        if f.metadata["column"]:
            kind = _sqlite_type(hints[f.name])
            columns[f.name] = f"{kind} PRIMARY KEY" if f.name == "run_id" else kind
    return columns


def summary_keys() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(RunRecord) if f.metadata["summary"])


def report_columns() -> tuple[tuple[str, str], ...]:
    """(field, header) of each column the report shows, in the report's order."""
    shown = [f for f in dataclasses.fields(RunRecord) if f.metadata["report"]]
    return tuple((f.name, f.metadata["report"][1]) for f in sorted(shown, key=_position))


def _position(f: dataclasses.Field) -> int:
    return f.metadata["report"][0]
