"""From what a run measured to its results record: throughput, speedup against the
single-device baseline (driver/comparison.py), scaling efficiency, MFU, memory. One function
builds the record (core.record's RunRecord) for completed and failed runs alike, so a failed
run keeps the metrics of the steps it finished."""

from __future__ import annotations

import shlex
from dataclasses import asdict, fields
from typing import Any

from meshrun.core.baseline import baseline_key, is_own_baseline, n_devices
from meshrun.core.batch import n_microbatches
from meshrun.core.checkpoints import checkpoint_root
from meshrun.core.config import ExperimentConfig, resolved_of
from meshrun.core.flops import mfu, peak_flops
from meshrun.core.hardware import device_for_rank, fingerprint_key
from meshrun.core.layout import Layout
from meshrun.core.naming import layout_name, rerun_overrides
from meshrun.core.precision import matmul_precision
from meshrun.core.rank_report import CheckpointSave, RankReport, StageSplit
from meshrun.core.record import MEMORY_CATEGORIES, RunRecord
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
from meshrun.core.run_files.metrics import StepRow
from meshrun.core.stages import PP_AUTO, stage_layer_counts, theoretical_bubble
from meshrun.core.step_stats import summarize_steps
from meshrun.driver.comparison import host_flags, memory_flags, speedup_fields
from meshrun.driver.float8 import float8_fields
from meshrun.driver.inspection import (
    profile_fields,
    replica_fields,
    rollback_fields,
    skipped_fields,
    straggler_fields,
    timed_step_times,
)
from meshrun.driver.measured import Measured, RunMeta
from meshrun.driver.run_plan import budget_fields, checkpoint_plan_fields
from meshrun.driver.trial_ranking import Trial, first_choice_loss, rank_correlation
from meshrun.models import model_shape, param_counts
from meshrun.models.loss import chunked_loss_kernel, loss_method
from meshrun.plan import predict
from meshrun.plan.run_prediction import prediction_of
from meshrun.validate.model import describe_read

# Stage costs further apart than this (relative) after pp_layers=auto are noted as uneven.
UNEVEN = 0.01


def pipeline_fields(cfg: ExperimentConfig, report: RankReport | None) -> dict[str, Any]:
    """Measured bubble (mean over ranks, and each rank's) beside the schedule's theory; the
    layers each stage held, and where `parallel.pp_layers=auto` chose them (`split`, the
    ranks' StageSplit), the stage costs it balanced and a note of what stayed uneven."""
    p = cfg.parallel
    split = report.pp_split if report else None
    bubbles = report.pipeline_bubble_per_rank if report else None
    if p.pp == 1:
        return dict.fromkeys(
            (
                "pp_schedule",
                "n_microbatches",
                "bubble_theoretical",
                "bubble_measured",
                "bubble_per_rank",
                "pp_layers",
                "pp_stage_costs_s",
                "pp_split_note",
            )
        )
    m = n_microbatches(cfg)
    if split:
        layers = split.counts
    elif p.pp_layers == PP_AUTO:
        layers = None  # the ranks stopped before they chose
    else:
        n_layers = model_shape(cfg.model).n_layers
        layers = stage_layer_counts(n_layers, p.pp * p.stages_per_rank, p.pp_layers or None)
    return {
        "pp_schedule": p.schedule,
        "n_microbatches": m,
        "bubble_theoretical": theoretical_bubble(p.pp, m, p.stages_per_rank),
        "bubble_measured": sum(bubbles) / len(bubbles) if bubbles else None,
        "bubble_per_rank": bubbles,
        "pp_layers": layers,
        "pp_stage_costs_s": split.stage_costs_s if split else None,
        "pp_split_note": split_note(split) if split else None,
    }


def split_note(split: StageSplit) -> str:
    """What `parallel.pp_layers=auto` chose, from what, and how uneven it stayed."""
    costs = split.stage_costs_s
    ms = ", ".join(f"{c * 1e3:.0f}" for c in costs)
    note = (
        f"parallel.pp_layers=auto chose {split.counts}: stages measured at {ms} ms a "
        "micro-batch (forward + backward)"
    )
    spread = (max(costs) - min(costs)) / max(costs)
    if spread > UNEVEN:
        block = split.block_s * 1e3
        note += (
            f"; still {spread:.0%} apart: layers move whole (one is {block:.0f} ms) and "
            "every stage keeps at least one"
        )
    return note


def memory_fields(cfg: ExperimentConfig, report: RankReport | None) -> Memory:
    """Per-rank peaks and breakdowns, the categories of the rank with the highest peak, and
    the bytes each rank read of a pretrained directory."""
    memory = report.memory_per_rank if report else None
    peaks = [m["peak"] for m in memory] if memory else None
    top = max(memory, key=lambda m: m["peak"]) if memory else {}
    return Memory(
        peak_memory_bytes=peaks,
        peak_memory_max_bytes=max(peaks) if peaks else None,
        memory_per_rank=memory,
        **{f"memory_{c}_bytes": top.get(c) for c in MEMORY_CATEGORIES},
        pretrained_read_bytes_per_rank=report.pretrained_read_bytes_per_rank if report else None,
    )


def predicted_memory_fields(cfg: ExperimentConfig) -> dict[str, Any]:
    """The planner's prediction of each rank's memory (and plan.trace's, on fake tensors), as
    the resolution made it (plan/run_prediction.py)."""
    prediction = prediction_of(cfg)
    predicted = prediction.memory
    return {
        "memory_predicted": predicted,
        "memory_traced": prediction.traced,
        "predicted_peak_memory_bytes": max(p["peak"] for p in predicted),
    }


def predicted_speed_fields(cfg: ExperimentConfig) -> dict[str, Any]:
    """The speed model's step, on this host's calibration where plan.calibration finds one
    (the prediction the resolution made, plan/run_prediction.py)."""
    prediction = prediction_of(cfg)
    return {
        "predicted_step_time_s": prediction.step_time_s,
        "predicted_tokens_per_s": prediction.tokens_per_s,
        "predicted_step_parts": prediction.step_parts,
        "predicted_calibrated_at": prediction.calibrated_at,
    }


def checkpoint_fields(cfg: ExperimentConfig, saves: list[CheckpointSave] | None) -> dict[str, Any]:
    """Where the checkpoints are and what saving them cost training (mean over the saves in
    the background: the last, at the end, is written whole before the ranks exit)."""
    if not saves:
        return {}
    background = [s for s in saves if s.step != cfg.train.steps] or saves
    return {
        "checkpoint_dir": str(checkpoint_root(cfg.checkpoint, cfg.run_dir)),
        "checkpoint_saves": [asdict(s) for s in saves],
        "checkpoint_blocked_s": sum(s.blocked_s for s in background) / len(background),
        "checkpoint_save_s": sum(s.total_s for s in background) / len(background),
    }


def data_wait_share(steps: list[StepRow]) -> float | None:
    """The share of the timed steps' time rank 0 spent waiting for its batches (records
    older than the measurement have none)."""
    timed = [r for r in steps if r.step_time_s is not None and r.data_wait_s is not None]
    total = sum(r.step_time_s for r in timed)
    return sum(r.data_wait_s for r in timed) / total if total else None


def eval_fields(steps: list[StepRow]) -> dict[str, Any]:
    """The last evaluation's loss and perplexity, the mean seconds of one, the curve."""
    evaluated = [r for r in steps if r.eval_loss is not None]
    if not evaluated:
        return {}
    return {
        "eval_loss": evaluated[-1].eval_loss,
        "eval_perplexity": evaluated[-1].eval_perplexity,
        "eval_time_s": sum(r.eval_time_s for r in evaluated) / len(evaluated),
        "eval_losses": [[r.step, r.eval_loss] for r in evaluated],
    }


def params(cfg: ExperimentConfig) -> int:
    return param_counts(cfg.model, cfg.train.seq_len)[0]


def assemble(cfg: ExperimentConfig, measured: Measured, baseline: RunRecord | None) -> RunRecord:
    """The record of a measured run (`cfg` holds the split `pp_layers=auto` chose); a failed
    run's too, with the figures of the steps it finished."""
    meta, report, steps = measured.meta, measured.report, measured.steps
    step_times = timed_step_times(steps)
    timing = timing_fields(cfg, step_times)
    tokens_per_s = timing["tokens_per_s"]
    if baseline is None and is_own_baseline(cfg):  # 1.0 by definition, no spread
        baseline = RunRecord(run_id=meta.run_id, speed=Speed(tokens_per_s=tokens_per_s))
    versus = speedup_fields(
        cfg, step_times, tokens_per_s, baseline, meta.baseline_mode, timing["step_time_cv"]
    )
    host_share = report.host_other_cpu_share if report else None
    flags = [*versus.pop("flags"), *host_flags(host_share), *memory_flags(cfg, report)]
    predicted = predicted_speed_fields(cfg)
    return RunRecord(
        **meta_fields(meta, report),
        **config_fields(cfg, meta),
        steps_completed=len(steps),
        flags=flags,
        speed=Speed(
            step_times=step_times,
            **timing,
            compile_s=report.compile_s if report else None,
            host_other_cpu_share=host_share,
            data_wait_share=data_wait_share(steps),
        ),
        comparison=Comparison(
            scaling=cfg.metrics.scaling,
            baseline_mode=meta.baseline_mode,
            baseline_age_s=meta.baseline_age_s,
            baseline_key=baseline_key(cfg),
            **versus,
        ),
        flops=Flops(**flops_fields(cfg, tokens_per_s), **float8_fields(cfg, tokens_per_s)),
        pipeline=Pipeline(**pipeline_fields(cfg, report)),
        memory=memory_fields(cfg, report),
        prediction=Prediction(
            **predicted_memory_fields(cfg),
            **predicted,
            **budget_fields(cfg, tokens_per_s, predicted["predicted_tokens_per_s"]),
        ),
        evaluation=Evaluation(**eval_fields(steps)),
        checkpoints=Checkpoints(
            **checkpoint_fields(cfg, report.checkpoint_saves if report else None),
            **checkpoint_plan_fields(cfg, report.auto_checkpoint if report else None),
            export_path=meta.export_path,
        ),
        selection=selection(meta),
        inspection=Inspection(
            **profile_fields(cfg, steps), **straggler_fields(cfg, report, len(step_times))
        ),
        faults=Faults(
            **skipped_fields(steps), **rollback_fields(report), **replica_fields(cfg, report, steps)
        ),
        series=Series(
            losses=[r.loss for r in steps],
            grad_norms=[r.grad_norm for r in steps],
            **router_fields(steps),
        ),
        host=host_of(report),
    )


def selection(meta: RunMeta) -> Selection:
    """The trials that chose this run's layout (plan.trials), or the run a trial chose it
    for, and their verdict."""
    trials = meta.trials
    return Selection(
        trial_of=meta.trial_of,
        trials=[asdict(t) for t in trials] if trials is not None else None,
        **trials_fields(trials),
    )


def trials_fields(trials: list[Trial] | None) -> dict[str, float | None]:
    """The verdict of the trials that chose this run's layout (plan.trials): how the
    prediction ranked them against what they measured, and what its first choice lacked."""
    return {
        "trials_rank_correlation": rank_correlation(trials) if trials else None,
        "trials_first_choice_loss": first_choice_loss(trials) if trials else None,
    }


def router_fields(steps: list[StepRow]) -> dict[str, float | None]:
    """The last step's router statistics, where the model has routers."""
    last = steps[-1] if steps else None
    return {
        "router_max_load": last.moe_max_load if last else None,
        "router_dropped": last.moe_dropped if last else None,
        "router_aux_loss": last.moe_aux_loss if last else None,
    }


def meta_fields(meta: RunMeta, report: RankReport | None) -> dict[str, Any]:
    """Who the run is and how it ended (the meta's fields the record holds itself); a SLURM
    requeue resumed from the checkpoint rank 0 names."""
    own = {f.name for f in fields(RunRecord)}
    identity = {k: v for k, v in asdict(meta).items() if k in own}
    if report is not None and report.requeues:
        identity["resumed_from_step"] = report.resumed_from_step
    return identity


def host_of(report: RankReport | None) -> Host:
    """Where rank 0 reported the ranks ran: its host's fingerprint, each rank's node, the
    SLURM job and its requeues."""
    if report is None:
        return Host()
    fingerprint = report.fingerprint
    return Host(
        requeues=report.requeues or None,
        slurm_job_id=report.slurm_job_id,
        host_per_rank=report.host_per_rank,
        fingerprint=fingerprint,
        fingerprint_key=fingerprint_key(fingerprint) if fingerprint else None,
    )


def config_fields(cfg: ExperimentConfig, meta: RunMeta) -> dict[str, Any]:
    """What ran: the experiment's names, layout, batch and steps, and how to run it again."""
    t, layout = cfg.train, Layout.of(cfg.parallel)
    method, why = loss_method(cfg)
    return {
        "name": cfg.name,
        "sweep": cfg.sweep,
        "model": cfg.model.name,
        "model_read": describe_read(cfg.model, resolved_of(cfg).model_read_from),
        "data": cfg.data.name,
        "parallel": cfg.parallel.name,
        "layout": layout.degrees(),
        "layout_name": layout_name(cfg),
        "overrides": rerun(meta, cfg),
        "settings": resolved_of(cfg).settings or None,
        "world_size": layout.world_size,
        "devices": n_devices(cfg),
        "hardware": cfg.hardware.name,
        "device_type": cfg.hardware.device_type,
        "backend": cfg.backend.name,
        "precision": t.precision,
        "precision_auto": resolved_of(cfg).precision_auto,
        "matmul_precision": matmul_precision(cfg),
        "loss": method,
        "loss_auto": why,
        "loss_kernel": chunked_loss_kernel(cfg),
        "loss_kernel_auto": resolved_of(cfg).loss_kernel_auto if method == "chunked" else None,
        "seq_len": t.seq_len,
        "global_batch_size": t.global_batch_size,
        "batch_derived": batch_derivation(cfg) if resolved_of(cfg).batch_derived else None,
        "micro_batch_size": t.micro_batch_size,
        "grad_accum_steps": n_microbatches(cfg),
        "steps": t.steps,
        "untimed_steps": t.untimed_steps,
        "params": params(cfg),
        "run_dir": cfg.run_dir,
    }


def batch_derivation(cfg: ExperimentConfig) -> str:
    """What a derived global batch is made of: `micro 2 x dp 3 x 2 accumulation`."""
    p, m = Layout.of(cfg.parallel), n_microbatches(cfg)
    steps = f"{m} pipeline micro-batches" if p.pp > 1 else f"{m} accumulation"
    return f"micro {cfg.train.micro_batch_size} x dp {p.dp_size} x {steps}"


def rerun(meta: RunMeta, cfg: ExperimentConfig) -> str:
    """The overrides that run it again; a new run from another run's checkpoint names its run
    dir (with none, the same overrides would continue that other run)."""
    again = rerun_overrides(meta.given_overrides, cfg)
    named = any(o.lstrip("+").startswith("run_dir=") for o in meta.given_overrides)
    if meta.parent_run_id is None or named:
        return again
    return f"{again} hydra.run.dir={shlex.quote(cfg.run_dir)}"


def timing_fields(cfg: ExperimentConfig, step_times: list[float]) -> dict[str, Any]:
    """The timed steps' median, spread and variation, tokens and samples per second."""
    if not step_times:
        keys = ("step_time_s", "step_time_p10_s", "step_time_p90_s", "step_time_cv")
        return dict.fromkeys((*keys, "tokens_per_s", "samples_per_s"))
    t = cfg.train
    return summarize_steps(step_times, t.tokens_per_step, t.global_batch_size)


def flops_fields(cfg: ExperimentConfig, tokens_per_s: float | None) -> dict[str, Any]:
    """FLOPs per token (the formula's, and torch's count where plan.trace asks) and MFU
    against the devices' peak at the run's precision."""
    specs = [device_for_rank(cfg.hardware.devices, i) for i in range(n_devices(cfg))]
    per_token = predict.training_flops_per_token(cfg)
    peak = peak_flops(specs, matmul_precision(cfg))  # the planner's rate (device_peak)
    return {
        "flops_per_token": per_token,
        "flops_per_token_counted": predict.counted_flops(cfg),
        "mfu": mfu(tokens_per_s, per_token, peak) if tokens_per_s else None,
        "active_param_share": predict.active_share(cfg),
    }
