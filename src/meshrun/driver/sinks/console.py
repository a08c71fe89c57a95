"""Terminal output of the driver: errors, warnings and the summary table at the end."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from meshrun.core.record import MEMORY_CATEGORIES, RunRecord
from meshrun.core.run_files.profiles import PROFILE_DIR, TIMELINE_FILE
from meshrun.driver.inspection import MIN_JUDGED_STEPS
from meshrun.driver.measured import RunMeta
from meshrun.driver.sinks.run_rows import budget_rows, checkpoint_rows
from meshrun.driver.trial_ranking import (
    Trial,
    calibration_said,
    fastest,
    first_choice_loss,
    node_sets,
    rank_correlation,
)

console = Console()
# A run waiting this share of its step time for batches is flagged as data-bound.
DATA_STALL_SHARE = 0.05


def print_error(what: str, message: str) -> None:
    """One unwrapped line, so the key and value stay greppable in logs."""
    console.print(Text(f"meshrun: {what} ", style="bold red") + Text(message), soft_wrap=True)


def print_traceback(traceback: str | None) -> None:
    """The failing rank's traceback, as it raised it (a rank killed by a signal has none)."""
    if traceback:
        console.print(Text(traceback.rstrip(), style="dim"), soft_wrap=True, highlight=False)


def print_note(message: str) -> None:
    """What meshrun decided for the user (e.g. parallel=auto's layout), unwrapped."""
    console.print(Text("meshrun: ", style="bold") + Text(message), soft_wrap=True)


def print_warning(message: str) -> None:
    console.print(Text("meshrun: warning ", style="bold yellow") + Text(message), soft_wrap=True)


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:,.3g}{unit}" if abs(value) < 100 else f"{value:,.0f}{unit}"
    return f"{value}{unit}"


def _breakdown(r: RunRecord) -> str:
    """The categories of the rank with the highest peak, in MiB."""
    values = [getattr(r.memory, f"memory_{c}_bytes") for c in MEMORY_CATEGORIES]
    if any(v is None for v in values):
        return "n/a"
    return " / ".join(f"{v / 2**20:.1f}" for v in values) + " MiB"


def _routers(r: RunRecord) -> list[tuple[str, str]]:
    """An MoE model's routers at the last step (models/moe.router_fields)."""
    s = r.series
    if s.router_max_load is None:
        return []
    figures = f"busiest expert {s.router_max_load:.2f}x the mean, {s.router_dropped:.1%} dropped"
    if s.router_aux_loss is not None:
        figures += f", balance loss {s.router_aux_loss:.3f}"
    return [("routers (last step)", figures)]


def _mfu(r: RunRecord) -> str:
    """An MoE's MFU counts a token's own experts: PaLM's 6N (+ attention) with N the
    parameters a token meets, that share of them. A float8 run's is against the peak of
    its precision (bf16), as is usual, and against the fp8 peak too."""
    text = _fmt(r.flops.mfu)
    if r.flops.active_param_share is not None and r.flops.mfu is not None:
        text += f" (6N: N active, {r.flops.active_param_share:.1%})"
    if r.flops.float8_recipe is not None:
        text += f" of the {r.precision} peak, {_fmt(r.flops.mfu_fp8_peak)} of the fp8 peak"
    return text


def _float8(r: RunRecord) -> list[tuple[str, str]]:
    """train.float8: how much of the model ran in float8, and what did not."""
    f = r.flops
    if f.float8_recipe is None:
        return []
    what = (
        f"{f.float8_recipe}: {f.float8_linears} linears, {f.float8_flops_share:.0%} of a "
        "token's training FLOPs"
    )
    return [("float8", what + (f"; {f.float8_note}" if f.float8_note else ""))]


def print_trials(trials: list[Trial], steps: int, model: str, world: int) -> None:
    """plan.trials: each trial's predicted and measured speed in the planner's order, whether
    the predictions were calibrated on this host, the rank correlation of the two, and what
    the prediction's first choice would have lost."""
    calibrated = all(t.calibrated_at for t in trials)
    table = Table(title=f"meshrun: trials ({steps} timed steps each), tokens/s")
    predicted = "predicted" if calibrated else "predicted (uncalibrated)"
    for header in ("#", "layout", predicted, "measured", "ratio"):
        table.add_column(header, justify="left" if header == "layout" else "right")
    table.add_column("status")
    for index, t in enumerate(trials, start=1):
        ratio = (
            f"{t.tokens_per_s / t.predicted_tokens_per_s:.2f}"
            if t.measured and t.predicted_tokens_per_s
            else "n/a"
        )
        status = t.status if t.status == "completed" else f"{t.status}: {t.error}"
        figures = (_fmt(t.predicted_tokens_per_s), _fmt(t.tokens_per_s), ratio)
        table.add_row(str(index), t.layout_name, *figures, status)
    console.print(table)
    print_note(calibration_said([t.calibrated_at for t in trials], model, world))
    print_note(trials_verdict(trials))


def trials_verdict(trials: list[Trial]) -> str:
    best = fastest(trials)
    if best is None:
        return "no trial completed"
    rho = rank_correlation(trials)
    said = f"fastest measured: trial {best + 1} ({trials[best].layout_name}); "
    said += f"rank correlation (Spearman) {rho:.2f}" if rho is not None else "no rank correlation"
    said += f" over {sum(t.measured for t in trials)} measured"
    loss = first_choice_loss(trials)
    if loss is not None:
        said += f"; the predicted first choice ({trials[0].layout_name}) would have lost {loss:.1%}"
    else:
        said += f"; the predicted first choice ({trials[0].layout_name}) {trials[0].status}"
    apart = node_sets(trials)
    if len(apart) > 1:
        nodes = " / ".join(",".join(n) for n in apart)
        said += f"; measured on different nodes ({nodes}): not side by side"
    return said


def _trials_row(r: RunRecord) -> list[tuple[str, str]]:
    if not r.selection.trials:
        return []
    trials = [Trial(**t) for t in r.selection.trials]
    return [(f"trials ({len(trials)})", trials_verdict(trials))]


def print_summary(r: RunRecord) -> None:
    table = Table(title=f"meshrun: {r.model} / {r.layout_name}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    loss = ("loss first -> last", _loss_span(r.series.losses))
    rows = [
        ("status", r.status),
        ("layout", f"{r.layout_name} on {r.world_size} rank(s), {r.backend}"),
        ("hardware", r.hardware),
        *_one_device(r),
        ("precision", _precision(r)),
        ("loss", _loss(r)),
        ("batch", _batch(r)),
        ("tokens/s", _fmt(r.speed.tokens_per_s)),
        ("step time (median, p10-p90, cv)", _step_times(r)),
        *budget_rows(r),
        *_compile_time(r),
        *_host_load(r),
        ("baseline tokens/s", f"{_fmt(r.comparison.baseline_tokens_per_s)}{_baseline_source(r)}"),
        (f"speedup ({r.comparison.scaling} scaling)", _speedup(r)),
        ("scaling efficiency", _efficiency(r)),
        ("MFU", _mfu(r)),
        *_float8(r),
        *_data_stall(r),
        ("peak memory (max rank)", _fmt_bytes(r.memory.peak_memory_max_bytes)),
        ("  params/grads/optim/activ/other", _breakdown(r)),
        ("  predicted peak", _fmt_bytes(r.prediction.predicted_peak_memory_bytes)),
        loss,
        *_routers(r),
        *_evaluation(r),
        *checkpoint_rows(r.checkpoints),
        *_trials_row(r),
        *_skipped(r),
        *_rollbacks(r),
        *_replicas(r),
        *_slowest_rank(r),
        *_profile(r),
    ]
    if (pp := r.pipeline).pp_schedule:
        bubble = f"{_fmt(pp.bubble_measured)} measured, {_fmt(pp.bubble_theoretical)} theory"
        per_rank = ", ".join(_fmt(b) for b in pp.bubble_per_rank or [])
        bubble += f" (per rank {per_rank})" if per_rank else ""
        rows.insert(rows.index(loss), (f"bubble ({pp.pp_schedule}, m={pp.n_microbatches})", bubble))
        if pp.pp_split_note:
            rows.insert(rows.index(loss), ("pipeline split", pp.pp_split_note))
    if r.model_read:
        rows.insert(1, ("model", r.model_read))
    if r.error:
        rows.insert(1, ("error", r.error))
    rows[1:1] = [("flagged", Text(flag, style="bold yellow")) for flag in r.flags]
    for key, value in rows:
        table.add_row(key, value if isinstance(value, Text) else Text(str(value)))
    console.print(table)
    # Below the table, whole on one line each (a log's 80 columns would wrap them): what a
    # user copies.
    if r.resumed_from_step is not None:
        console.print(Text("resume: ", style="bold") + Text(resumed_line(r)), soft_wrap=True)
    if r.run_dir:
        console.print(Text("run dir: ", style="bold") + Text(r.run_dir), soft_wrap=True)
    if r.overrides:
        again = Text("run again: ", style="bold") + Text(f"meshrun {r.overrides}")
        console.print(again, soft_wrap=True)


def resumed_line(r: RunRecord | RunMeta) -> str:
    """Which run a resume is: the run it continues, or a new one from another run's
    checkpoint (a SLURM requeue continues its own run from its last save)."""
    if r.parent_run_id is not None:
        return (
            f"new run {r.run_id} from {r.resumed_from_checkpoint} (step "
            f"{r.resumed_from_step}) of run {r.parent_run_id}"
        )
    line = f"resumed run {r.run_id} from step {r.resumed_from_step}"
    return f"{line} ({r.resumed_from_checkpoint})" if r.resumed_from_checkpoint else line


def _precision(r: RunRecord) -> str:
    """`bf16 (auto: sm90)`, `fp32 (matmuls in tf32)`: what the run computed in, and why."""
    notes = []
    if r.matmul_precision and r.matmul_precision != r.precision:
        notes.append(f"matmuls in {r.matmul_precision}")
    if r.precision_auto:
        notes.append(f"auto: {r.precision_auto}")
    return f"{r.precision} ({'; '.join(notes)})" if notes else str(r.precision)


def _batch(r: RunRecord) -> str:
    derived = f" (derived: {r.batch_derived})" if r.batch_derived else ""
    return f"global {r.global_batch_size}{derived}, micro {r.micro_batch_size}"


def _one_device(r: RunRecord) -> list[tuple[str, str]]:
    """A data-parallel preset on one device (parallel=ddp's -1 filled with 1 on a 1-GPU box)
    runs the model alone, without its wrapper: it is its own baseline."""
    if r.world_size != 1 or r.parallel in ("single", None) or r.comparison.baseline_mode != "own":
        return []
    return [
        (
            "one device",
            f"parallel={r.parallel} on 1 device runs the model alone (no data-parallel "
            "wrapper): its own baseline, speedup 1 by definition; it measures one device's "
            "speed, MFU and memory. A speedup needs 2+ devices",
        )
    ]


def _step_times(r: RunRecord) -> str:
    if r.speed.step_time_s is None:
        return "n/a"
    spread = f"{_fmt(r.speed.step_time_p10_s)}-{_fmt(r.speed.step_time_p90_s, ' s')}"
    cv = f", cv {r.speed.step_time_cv:.1%}" if r.speed.step_time_cv is not None else ""
    return f"{_fmt(r.speed.step_time_s, ' s')}, {spread}{cv}"


def _compile_time(r: RunRecord) -> list[tuple[str, str]]:
    if r.speed.compile_s is None:
        return []
    return [("compile time (untimed steps)", _fmt(r.speed.compile_s, " s"))]


def _skipped(r: RunRecord) -> list[tuple[str, str]]:
    f = r.faults
    if not f.skipped_steps:
        return []
    listed = ", ".join(map(str, f.skipped_steps[:10])) + (", ..." if f.steps_skipped > 10 else "")
    return [("skipped steps (non-finite)", f"{f.steps_skipped}: {listed}")]


def _rollbacks(r: RunRecord) -> list[tuple[str, str]]:
    """Each loss spike and what the guard did about it."""
    rows = []
    for b in r.faults.rollbacks or []:
        first, last = b["skipped_batches"]
        rows.append(
            (
                f"loss spike at step {b['step']}",
                f"{b['loss']:.4g} against {b['mean']:.4g} +- {b['std']:.3g}: rolled back to "
                f"step {b['restored_step']}, skipped batches {first}-{last}",
            )
        )
    return rows


def _replicas(r: RunRecord) -> list[tuple[str, str]]:
    """torchft: each replica that failed, and the steps the others trained on without it."""
    rows = [
        (
            f"replica {f['replica']} failed",
            f"rank {f['rank']}: {f['error']} at {f['at_s']:.1f} s, start {f['attempt']}",
        )
        for f in r.faults.replica_failures or []
    ]
    if r.faults.steps_with_fewer_replicas:
        spans = _spans([step for step, _ in r.faults.fewer_replica_steps])
        fewest = min(n for _, n in r.faults.fewer_replica_steps)
        rows.append(
            (
                "steps with fewer replicas",
                f"{r.faults.steps_with_fewer_replicas} ({spans}; fewest {fewest})",
            )
        )
    if r.faults.retried_steps:
        rows.append(("steps trained again", _spans(r.faults.retried_steps)))
    return rows


def _spans(steps: list[int]) -> str:
    """Consecutive steps as ranges: 3-7, 12."""
    spans: list[list[int]] = []
    for step in steps:
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)


def _slowest_rank(r: RunRecord) -> list[tuple[str, str | Text]]:
    i = r.inspection
    if r.device_type == "cuda" and (r.world_size or 1) > 1 and i.slowest_rank is None:
        # a CUDA rank computes on its device, which its CPU time does not see (metrics/busy.py)
        return [("slowest rank", "not measured on CUDA ranks (CPU ranks only)")]
    if i.slowest_rank is None or i.slowest_rank_slowdown is None:
        return []
    said = f"rank {i.slowest_rank}, {i.slowest_rank_slowdown:.2f}x the others' median busy time"
    timed = len(r.speed.step_times or [])
    if timed < MIN_JUDGED_STEPS:
        said += f" ({timed} timed step(s): too few to call a straggler)"
    if i.straggler:
        return [("slowest rank", Text(f"{said}: straggler", style="bold yellow"))]
    return [("slowest rank", said)]


def _profile(r: RunRecord) -> list[tuple[str, str]]:
    """Each profiled rank's steps split by what it did (compute, exposed communication and
    idle make the whole); where the traces are."""
    i = r.inspection
    if not i.profiled_steps:
        return []
    first, last = i.profiled_steps
    overhead = f", {i.profile_overhead:+.0%} step time" if i.profile_overhead is not None else ""
    where = f"{r.run_dir}/{PROFILE_DIR}: rank<N>.trace.json.gz, {TIMELINE_FILE}"
    rows = [(f"profiled steps {first}-{last}", f"{where}{overhead}")]
    for p in i.profile or []:
        share = {k: f"{p[k] / p['step_s']:.0%}" for k in p if k.endswith("_s")}
        rows.append(
            (
                f"  rank {p['rank']}",
                f"compute {share['compute_s']}, exposed communication "
                f"{share['exposed_comm_s']}, idle {share['idle_s']} (communication in flight "
                f"{share['comm_s']}, {share['overlapped_s']} during compute)",
            )
        )
    return rows


def _host_load(r: RunRecord) -> list[tuple[str, str]]:
    if r.speed.host_other_cpu_share is None:
        return []
    return [("host CPU busy with other work", f"{r.speed.host_other_cpu_share:.0%}")]


def _baseline_source(r: RunRecord) -> str:
    c = r.comparison
    sources = {
        "fresh": " (measured beside the run, alternating with its steps)",
        "after": " (measured after the run: both did not fit at once)",
        "own": " (a single device is its own baseline)",
    }
    if c.baseline_mode == "stored":
        return f" (stored, measured {(c.baseline_age_s or 0) / 3600:.1f} h ago on this host)"
    return sources.get(c.baseline_mode or "", "")


def _speedup(r: RunRecord) -> str:
    c = r.comparison
    if c.speedup is None:
        return "n/a"
    if c.speedup_p10 is None:
        return f"{c.speedup:.2f}x"
    return (
        f"{c.speedup:.2f}x (p10-p90 {c.speedup_p10:.2f}-{c.speedup_p90:.2f} over "
        f"{c.speedup_rounds} rounds)"
    )


def _efficiency(r: RunRecord) -> str:
    """Above 1 + the noise, the efficiency is no result (the flag says why)."""
    c = r.comparison
    e, noise = c.scaling_efficiency, c.speedup_noise or 0.0
    if e is not None and e > 1 + noise:
        return f"not a result: {e:.2f} is above 1 + noise {noise:.2f}"
    return _fmt(e)


def _data_stall(r: RunRecord) -> list[tuple[str, str]]:
    if r.speed.data_wait_share is None or r.speed.data_wait_share <= DATA_STALL_SHARE:
        return []
    share = f"{r.speed.data_wait_share:.0%}"
    return [("data stall", f"{share} of step time waiting for batches (see data.num_workers)")]


def _evaluation(r: RunRecord) -> list[tuple[str, str]]:
    """The last evaluation (train.eval), and what one costs."""
    e = r.evaluation
    if e.eval_loss is None:
        return []
    after = f"after {e.eval_losses[-1][0] + 1} steps, {_fmt(e.eval_time_s, ' s')} per eval"
    value = f"{e.eval_loss:.4f}, {_fmt(e.eval_perplexity)} ({after})"
    return [("held-out loss, perplexity", value)]


def _fmt_bytes(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:,.1f} MiB"


def _loss(r: RunRecord) -> str:
    """train.loss as it ran, a chunked one's kernel where it could have been Liger's (CUDA),
    and why auto chose the loss."""
    said = str(r.loss)
    if r.loss_kernel == "liger":
        said += " on Liger's fused kernel"
    elif r.loss_kernel == "torch" and r.device_type == "cuda":
        said += " on torch's chunks" + (
            f", not Liger's: {r.loss_kernel_auto}" if r.loss_kernel_auto else ""
        )
    return f"{said} (auto: {r.loss_auto})" if r.loss_auto else said


def _loss_span(losses: list[float]) -> str:
    return "n/a" if not losses else f"{losses[0]:.4f} -> {losses[-1]:.4f}"
