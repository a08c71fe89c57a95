"""The plan's whole run (plan/run_time.py): each row's time for the token budget, its
device-hours, their cost and its checkpoint interval as columns of the table; below it the
budget, the failure rate and the storage they assume, each row's checkpoint and what
failures cost it, the band that says how sure the times are, and how far the first row is
from the cheapest row that fits."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console

from meshrun.core.config import ExperimentConfig
from meshrun.driver.sinks.run_rows import duration
from meshrun.driver.sinks.store import stored_records
from meshrun.plan.candidate import Candidate, host_calibration
from meshrun.plan.prediction_band import Band, documented_band, measured_band
from meshrun.plan.run_time import RunTime, run_time
from meshrun.plan.search import Plan

GiB = 2**30


def run_of(c: Candidate) -> RunTime | None:
    """The row's run at its predicted speed (None where it has none)."""
    if c.speed is None:
        return None
    return run_time(c.cfg, c.speed.tokens_per_s, c.memory, host_calibration(c.cfg))


def run_dict(c: Candidate) -> dict | None:
    """The row's run in the plan's JSON."""
    found = run_of(c)
    return found.as_dict() if found else None


def duration_range(low: float, high: float) -> str:
    """`low`-`high` in the unit of `high`: 61.5-84.3 days."""
    number, unit = duration(high).split(" ", 1)
    shown = duration(low)
    if shown.endswith(f" {unit}"):
        shown = shown.removesuffix(f" {unit}")
    return f"{shown}-{number} {unit}"


def count(n: float) -> str:
    """1T, 84M, 20.5k."""
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.3g}"


def _money(value: float) -> str:
    return f"${value:,.0f}" if value >= 100 else f"${value:.3g}"


def _hours(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def hours_header(cfg: ExperimentConfig) -> str:
    return "GPU-hours" if cfg.hardware.device_type == "cuda" else "rank-hours"


def run_columns(cfg: ExperimentConfig) -> list[str]:
    """The table's columns of the whole run (a cost only where plan.price_per_gpu_hour)."""
    priced = cfg.plan.price_per_gpu_hour is not None
    return ["run time", hours_header(cfg), *(["cost"] if priced else []), "ckpt every"]


def run_cells(cfg: ExperimentConfig, run: RunTime | None) -> list[str]:
    """A row's whole run: the expected time with checkpoints and failures, its device-hours,
    their cost, the seconds of training between two saves."""
    priced = cfg.plan.price_per_gpu_hour is not None
    if run is None:
        return ["n/a"] * len(run_columns(cfg))
    cost = [_money(run.cost)] if priced and run.cost is not None else []
    return [duration(run.expected_s), _hours(run.gpu_hours), *cost, _every(run)]


def _every(run: RunTime) -> str:
    """The interval, or `the end` where the run is shorter than it: one save, the last."""
    return "the end" if run.interval_s >= run.compute_s else duration(run.interval_s)


def prediction_band(cfg: ExperimentConfig) -> Band:
    """This host's calibrated runs' spread, where two or more stand behind the calibration
    (trials among them); else the documented one for the device type."""
    calibration = host_calibration(cfg)
    if calibration is None:
        return documented_band(cfg.hardware.device_type, calibrated=False)
    ratios = [
        r.speed.step_time_s / r.prediction.predicted_step_time_s
        for r in stored_records(Path(cfg.store.path))
        if r.status == "completed"
        and r.prediction.predicted_calibrated_at == calibration.created_at
        and r.speed.step_time_s
        and r.prediction.predicted_step_time_s
    ]
    found = measured_band(ratios, calibration.created_at)
    return found or documented_band(cfg.hardware.device_type, calibrated=True)


def print_runs(console: Console, shown: list[Candidate], runs: list[RunTime | None]) -> None:
    """What the run columns assume, then a line a row: its time in the band, its checkpoint,
    what saves, redone work and restarts take of it."""
    first = next((r for r in runs if r is not None), None)
    if first is None:
        return
    cfg = shown[0].cfg
    band = prediction_band(cfg)
    c, f = first.checkpoint, first.failures
    budget = "plan.tokens" if cfg.plan.tokens else "train.steps x tokens a step"
    console.print(
        f"the run: {count(first.tokens)} tokens ({budget}); a node fails every "
        f"{f.mtbf_node_hours:,.0f} h ({f.source}), the job's {f.nodes} node(s) every "
        f"{duration(f.mtbf_s)}; checkpoints to storage at {c.rates.storage_gbs:.3g} GB/s "
        f"a node ({c.rates.storage_from}), staged at {c.rates.staging_gbs:.3g} GB/s a rank "
        f"({c.rates.staging_from}); times in a band of {band.describe()}",
        soft_wrap=True,
        highlight=False,
    )
    console.print(
        "each row's run: at its predicted speed (the band), with checkpoints and failures:"
    )
    for index, run in enumerate(runs, start=1):
        if run is not None:
            console.print(f"  {index:>2}  {_run_line(run, band)}", soft_wrap=True, highlight=False)


def _run_line(run: RunTime, band: Band) -> str:
    low, high = band.around(run.compute_s)
    c = run.checkpoint
    blocks = "holding training" if c.blocked_s < c.save_s else "training waiting"
    when = "at the end" if _every(run) == "the end" else f"every {_every(run)}"
    return (
        f"{duration(run.compute_s)} ({duration_range(low, high)}), "
        f"{duration(run.expected_s)} with {run.lost_share:.2%} lost (saves "
        f"{run.save_share:.2%}, work redone {run.lost_work_share:.2%}, restarts "
        f"{run.restart_share:.2%}); a checkpoint {c.bytes_per_rank / GiB:.3g} GiB a rank "
        f"{when}, saved in {duration(c.save_s)}, {blocks} "
        f"{duration(c.blocked_s)}; a restart {duration(c.restart_s)}"
    )


def print_cheapest(console: Console, found: Plan, cfg: ExperimentConfig) -> None:
    """How far apart the first row and the cheapest row that fits are (by cost where there
    is a price, else by device-hours: the same unless their device counts differ)."""
    fitting = [(i, c, run_of(c)) for i, c in enumerate(found.ranked, start=1) if c.fits]
    fitting = [(i, c, r) for i, c, r in fitting if r is not None]
    if not fitting:
        return
    by = "cost" if cfg.plan.price_per_gpu_hour is not None else "gpu_hours"
    first = fitting[0]
    cheapest = min(fitting, key=lambda row: getattr(row[2], by))
    said = f"row {first[0]} ({first[1].label}): {_budget(first[2], by)}"
    if cheapest is first:
        console.print(f"{said}, the cheapest that fits", soft_wrap=True, highlight=False)
        return
    saved = 1 - getattr(cheapest[2], by) / getattr(first[2], by)
    longer = cheapest[2].expected_s / first[2].expected_s - 1
    console.print(
        f"{said}; the cheapest that fits, row {cheapest[0]} ({cheapest[1].label}): "
        f"{_budget(cheapest[2], by)}, {saved:.1%} cheaper, {abs(longer):.1%} "
        f"{'longer' if longer > 0 else 'sooner'}",
        soft_wrap=True,
        highlight=False,
    )


def _budget(run: RunTime, by: str) -> str:
    cost = f", {_money(run.cost)}" if by == "cost" else ""
    return f"{duration(run.expected_s)}, {_hours(run.gpu_hours)} device-hours{cost}"
