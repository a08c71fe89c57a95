"""Terminal output of the driver: errors, warnings and the summary table at the end."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from meshrun.core.record import RunRecord
from meshrun.rank.metrics.memory import MEMORY_CATEGORIES

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
    values = [getattr(r, f"memory_{c}_bytes") for c in MEMORY_CATEGORIES]
    if any(v is None for v in values):
        return "n/a"
    return " / ".join(f"{v / 2**20:.1f}" for v in values) + " MiB"


def print_summary(r: RunRecord) -> None:
    table = Table(title=f"meshrun: {r.model} / {r.layout_name}", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    step_time = _fmt(r.step_time_s, " s")
    step_time_p90 = _fmt(r.step_time_p90_s, " s")
    loss = ("loss first -> last", _loss_span(r.losses))
    rows = [
        ("status", r.status),
        ("layout", f"{r.layout_name} on {r.world_size} rank(s), {r.backend}"),
        ("hardware", r.hardware),
        ("batch", f"global {r.global_batch_size}, micro {r.micro_batch_size}"),
        ("tokens/s", _fmt(r.tokens_per_s)),
        ("step time (median, p90)", f"{step_time}, {step_time_p90}"),
        ("baseline tokens/s", _fmt(r.baseline_tokens_per_s)),
        (f"speedup ({r.scaling} scaling)", _fmt(r.speedup, "x")),
        ("scaling efficiency", _fmt(r.scaling_efficiency)),
        ("MFU", _fmt(r.mfu)),
        *_data_stall(r),
        ("peak memory (max rank)", _fmt_bytes(r.peak_memory_max_bytes)),
        ("  params/grads/optim/activ/other", _breakdown(r)),
        ("  predicted peak", _fmt_bytes(r.predicted_peak_memory_bytes)),
        loss,
        *_evaluation(r),
        ("run dir", r.run_dir),
    ]
    if r.overrides:
        rows.append(("run again", f"meshrun {r.overrides}"))
    if r.pp_schedule:
        bubble = f"{_fmt(r.bubble_measured)} measured, {_fmt(r.bubble_theoretical)} theory"
        rows.insert(rows.index(loss), (f"bubble ({r.pp_schedule}, m={r.n_microbatches})", bubble))
    if r.error:
        rows.insert(1, ("error", r.error))
    for key, value in rows:
        table.add_row(key, Text(str(value)))
    console.print(table)


def _data_stall(r: RunRecord) -> list[tuple[str, str]]:
    if r.data_wait_share is None or r.data_wait_share <= DATA_STALL_SHARE:
        return []
    share = f"{r.data_wait_share:.0%}"
    return [("data stall", f"{share} of step time waiting for batches (see data.num_workers)")]


def _evaluation(r: RunRecord) -> list[tuple[str, str]]:
    """The last evaluation (train.eval), and what one costs."""
    if r.eval_loss is None:
        return []
    after = f"after {r.eval_losses[-1][0] + 1} steps, {_fmt(r.eval_time_s, ' s')} per eval"
    value = f"{r.eval_loss:.4f}, {_fmt(r.eval_perplexity)} ({after})"
    return [("held-out loss, perplexity", value)]


def _fmt_bytes(value: int | None) -> str:
    return "n/a" if value is None else f"{value / 2**20:,.1f} MiB"


def _loss_span(losses: list[float]) -> str:
    return "n/a" if not losses else f"{losses[0]:.4f} -> {losses[-1]:.4f}"
