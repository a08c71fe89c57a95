"""The sub-records of a run's results record (core/record.py's RunRecord), one for each part
of the way back that fills it (driver/results.py): speed, the comparison with the baseline,
FLOPs, the pipeline, memory, the plan's prediction, evaluation, checkpoints, the trials that
chose the layout, what inspection saw, faults, the steps' series and where the ranks ran.
Every field is a flat column of results.json, the store, W&B and the report under its own
name (record.py's mapping), so a field's name is unique across them all."""

# ruff: noqa: RUF009 (`_f` returns a dataclasses.field)
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def record_field(
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


_f = record_field


@dataclass
class Speed:
    """Step times of the timed steps, their median, spread and coefficient of variation, and
    what else the clock saw."""

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
    data_wait_share: float | None = _f(column=True, summary=True)  # of timed step time, rank 0


@dataclass
class Comparison:
    """The run against its single-device baseline."""

    scaling: str | None = _f(summary=True)
    # the single-device baseline: `fresh` (measured beside the run, alternating),
    # `after` (measured on its own after the run: both did not fit at once), `stored` (a
    # stored one of the same fingerprint, `baseline_age_s` old), `own` (a single-device run)
    baseline_mode: str | None = _f(column=True, summary=True, report=(15, "baseline"))
    baseline_age_s: float | None = _f(summary=True)
    baseline_tokens_per_s: float | None = _f(summary=True)
    baseline_run_id: str | None = _f()
    baseline_key: str | None = _f(column=True)  # the store key its baseline is found by
    speedup: float | None = _f(column=True, summary=True, report=(14, "speedup (p10-p90)"))
    # the spread of the speedup over the alternating rounds (10th and 90th percentile)
    speedup_p10: float | None = _f(column=True, summary=True)
    speedup_p90: float | None = _f(column=True, summary=True)
    speedup_rounds: int | None = _f(summary=True)
    # the measurement's relative noise: the spread's half-width over the speedup, or without
    # rounds the run's and the baseline's step-time variation combined
    speedup_noise: float | None = _f(summary=True)
    scaling_efficiency: float | None = _f(column=True, summary=True, report=(16, "efficiency"))


@dataclass
class Flops:
    """FLOPs a token and the share of the devices' peak they ran at (MFU)."""

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


@dataclass
class Pipeline:
    n_microbatches: int | None = _f()  # a pipeline's per step
    pp_schedule: str | None = _f(report=(10, "schedule"))
    bubble_theoretical: float | None = _f(column=True, summary=True, report=(18, "bubble (theory)"))
    bubble_measured: float | None = _f(column=True, summary=True)
    bubble_per_rank: list[float] | None = _f()
    pp_layers: list[int] | None = _f()  # layers per stage (parallel.pp_layers=auto: its pick)
    # pp_layers=auto: each stage's probed seconds of a micro-batch's forward and backward, and
    # what the split left uneven (a layer is its finest step)
    pp_stage_costs_s: list[float] | None = _f()
    pp_split_note: str | None = _f(summary=True)


@dataclass
class Memory:
    """Measured memory (parallel=dataparallel: a device's where others have a rank's)."""

    peak_memory_bytes: list[int] | None = _f()
    peak_memory_max_bytes: int | None = _f(column=True, summary=True, report=(17, "peak memory"))
    memory_per_rank: list[dict[str, int]] | None = _f()
    memory_params_bytes: int | None = _f(column=True, summary=True)
    memory_grads_bytes: int | None = _f(column=True, summary=True)
    memory_optimizer_bytes: int | None = _f(column=True, summary=True)
    memory_activations_bytes: int | None = _f(column=True, summary=True)
    memory_other_bytes: int | None = _f(column=True, summary=True)
    pretrained_read_bytes_per_rank: list[int] | None = _f()  # each rank reads its share


@dataclass
class Prediction:
    """The plan's prediction for the run's layout, beside what it measured."""

    memory_predicted: list[dict[str, int]] | None = _f()
    memory_traced: list[dict[str, int]] | None = _f()  # plan.trace: on fake tensors
    predicted_peak_memory_bytes: int | None = _f(column=True, summary=True)
    predicted_step_time_s: float | None = _f(column=True, summary=True)
    predicted_tokens_per_s: float | None = _f()
    predicted_step_parts: dict[str, float] | None = _f()  # the step by what it waits for
    # the calibration (meshrun-plan calibrate) the speed prediction used: when it was measured
    predicted_calibrated_at: str | None = _f(summary=True)
    # the run's whole budget (plan.tokens, else its own steps x tokens a step) in seconds at
    # the speed it measured and at the plan's predicted speed for its layout (plan/run_time.py)
    tokens_budget: float | None = _f(column=True, summary=True)
    measured_budget_s: float | None = _f(column=True, summary=True)
    predicted_budget_s: float | None = _f(column=True, summary=True)


@dataclass
class Evaluation:
    """train.eval: the last evaluation's loss and perplexity, seconds per evaluation."""

    eval_loss: float | None = _f(column=True, summary=True)
    eval_perplexity: float | None = _f(column=True, summary=True)
    eval_time_s: float | None = _f(summary=True)
    eval_losses: list[list[float]] = _f(factory=list)  # [step, eval loss] of each evaluation


@dataclass
class Checkpoints:
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


@dataclass
class Selection:
    """plan.trials: a trial's run it chose the layout for; that run's trials
    (driver/trial_ranking.py), how the prediction ranked them against what they measured
    (Spearman) and the share of the fastest measured speed that the prediction's first
    choice lacked."""

    trial_of: str | None = _f(column=True)
    trials: list[dict[str, Any]] | None = _f()
    trials_rank_correlation: float | None = _f(column=True, summary=True)
    trials_first_choice_loss: float | None = _f(summary=True)


@dataclass
class Inspection:
    """debug.profile_steps: the steps traced (left out of step_times), their step time over
    the others' less one, and each rank's trace summarised (core/run_files/profiles.py); each
    rank's busy seconds a timed step (median; rank/metrics/busy.py), the slowest rank, its
    busy time over the ranks' median, and the sentence naming it as a straggler where that is
    above metrics.straggler_threshold."""

    profiled_steps: list[int] | None = _f()
    profile_overhead: float | None = _f(summary=True)
    profile: list[dict[str, Any]] | None = _f()
    busy_per_rank: list[float] | None = _f()
    slowest_rank: int | None = _f(column=True, summary=True)
    slowest_rank_slowdown: float | None = _f(column=True, summary=True)
    straggler: str | None = _f(summary=True)


@dataclass
class Faults:
    """What went wrong inside the steps and what the run did about it."""

    # steps whose global gradient norm was not finite (fp16's overflows, a non-finite loss):
    # every rank skipped them, the weights not updated (rank/train/guard.py)
    skipped_steps: list[int] | None = _f()
    steps_skipped: int | None = _f(column=True, summary=True)
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


@dataclass
class Series:
    """The steps' losses and gradient norms; an MoE model's routers at the last step: the
    busiest expert's load over the mean (the worst layer's), the share of assignments
    dropped, the balance loss (models/moe.py)."""

    losses: list[float] = _f(factory=list)
    grad_norms: list[float | None] = _f(factory=list)
    router_max_load: float | None = _f(summary=True)
    router_dropped: float | None = _f(summary=True)
    router_aux_loss: float | None = _f(summary=True)


@dataclass
class Host:
    """Where the ranks ran: rank 0's host (core/hardware.host_fingerprint: devices, versions,
    threads) and its hash, which a stored baseline must match to be reused; each rank's node;
    launcher=slurm's job and how often SLURM requeued it (time limit, preemption)."""

    requeues: int | None = _f(summary=True)
    slurm_job_id: str | None = _f(column=True, summary=True)
    host_per_rank: list[str] | None = _f()
    fingerprint: dict[str, Any] | None = _f()
    fingerprint_key: str | None = _f(column=True)
