"""The comparison table of runs: every column on meshrun-report's page, a narrower set in the
terminal, where columns that are the same for every run are said once above the table and
the reasons of skipped and failed runs and the flags of untrustworthy figures are listed
under it. Here rather than in meshrun-report because a sweep prints it when it ends
(driver/sweep.py); the columns come from the record's metadata (core/record.py)."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from meshrun.core.record import report_columns
from meshrun.driver.sinks.console import _fmt, _fmt_bytes, console
from meshrun.driver.sinks.selection import layout_of, select_runs
from meshrun.driver.sinks.store import ResultsStore
from meshrun.driver.tool_config import RunFilter

COLUMNS = report_columns()  # (record field, header), from the record's metadata
HEADERS = tuple(header for _, header in COLUMNS)
# Left out in the terminal: said elsewhere (reasons under the table) or too wide for it.
PAGE_ONLY = ("created (UTC)", "sweep", "baseline", "reason")
TERMINAL = tuple(h for h in HEADERS if h not in PAGE_ONLY)
# Said once above the terminal's table where every run has the same value.
CONTEXT = ("model", "data", "backend", "ranks", "schedule")
STATUS_STYLE = {"completed": "green", "failed": "red", "skipped": "yellow"}
FLAG = "⚠"
PIPE_WIDTH = 200


def _bubble(run: dict[str, Any]) -> str:
    if run.get("bubble_theoretical") is None:
        return "n/a"
    return f"{_fmt(run.get('bubble_measured'))} ({_fmt(run['bubble_theoretical'])})"


def spread(value: Any, low: Any, high: Any, unit: str = "") -> str:
    """`value` with its 10th-90th percentile range, `(n/a)` where it was not measured."""
    if value is None:
        return "n/a"
    if low is None or high is None:
        return f"{_fmt(value, unit)} (n/a)"
    return f"{_fmt(value, unit)} ({_fmt(low)}-{_fmt(high)})"


def _step_time(run: dict[str, Any]) -> str:
    """In ms below a second (CPU and small-model steps), else in s."""
    times = [run.get(k) for k in ("step_time_s", "step_time_p10_s", "step_time_p90_s")]
    if times[0] is not None and times[0] < 1:
        return spread(*(t * 1e3 if t is not None else None for t in times), " ms")
    return spread(*times, " s")


def _baseline(run: dict[str, Any]) -> str:
    """How the speedup's baseline was measured: `fresh, 5 rounds`, `stored, 3.2 h old`."""
    mode = run.get("baseline_mode")
    if mode is None:  # no speedup, or a row from before baselines said how
        return "n/a"
    if run.get("speedup_rounds"):
        return f"{mode}, {run['speedup_rounds']} rounds"
    if run.get("baseline_age_s") is not None:
        return f"{mode}, {run['baseline_age_s'] / 3600:.1f} h old"
    return mode


# How each shown field is written; a field without an entry is written as its text.
FORMATS: dict[str, Callable[[dict[str, Any]], str]] = {
    "created_at": lambda run: run["created_at"][:16].replace("T", " "),
    "layout_name": layout_of,
    "world_size": lambda run: _fmt(run.get("world_size")),
    "data": lambda run: run.get("data") or "n/a",
    "global_batch_size": lambda run: (
        f"{_fmt(run.get('global_batch_size'))} / {_fmt(run.get('micro_batch_size'))}"
    ),
    "grad_accum_steps": lambda run: _fmt(run.get("grad_accum_steps")),
    "pp_schedule": lambda run: run.get("pp_schedule") or "-",
    "tokens_per_s": lambda run: _fmt(run.get("tokens_per_s")),
    "step_time_s": _step_time,
    "speedup": lambda run: spread(
        run.get("speedup"), run.get("speedup_p10"), run.get("speedup_p90"), "x"
    ),
    "baseline_mode": _baseline,
    "scaling_efficiency": lambda run: _fmt(run.get("scaling_efficiency")),
    "peak_memory_max_bytes": lambda run: _fmt_bytes(run.get("peak_memory_max_bytes")),
    "bubble_theoretical": _bubble,
}


def cells(run: dict[str, Any]) -> dict[str, str]:
    """The text of each column for one run; a skipped or failed run's reason is its error."""
    return {
        header: FORMATS[key](run) if key in FORMATS else str(run.get(key) or "")
        for key, header in COLUMNS
    }


def flags(run: dict[str, Any]) -> list[str]:
    """Why a figure of the run is not to be trusted (rows of older meshruns have none)."""
    return list(run.get("flags") or [])


def print_table(runs: list[dict[str, Any]], title: str) -> None:
    """Fitted to a terminal (headers over two lines); written to a pipe or log, at a width
    that fits every column rather than rich's 80."""
    rows = [cells(run) for run in runs]
    same = [h for h in CONTEXT if len(runs) > 1 and len({row[h] for row in rows}) == 1]
    shown = [h for h in TERMINAL if h not in same]
    context = ", ".join(f"{h} {rows[0][h]}" for h in same)
    table = Table(title=f"{title}\n{context}" if context else title, box=box.SIMPLE_HEAD)
    for header in shown:
        table.add_column(textwrap.fill(header, 10), overflow="fold", no_wrap=header == "run")
    for run, row in zip(runs, rows, strict=True):
        texts = [Text(row[h]) for h in shown]
        texts[shown.index("status")].stylize(STATUS_STYLE.get(run["status"], ""))
        if flags(run):
            texts[shown.index("status")].append(f" {FLAG}", style="bold yellow")
        table.add_row(*texts)
    out = console if console.is_terminal else Console(width=PIPE_WIDTH)
    out.print(table)
    for run in runs:
        if run.get("error"):
            out.print(
                Text(f"{run['run_id']} {run['status']}: ", style="bold") + Text(run["error"]),
                soft_wrap=True,
            )
        for flag in flags(run):
            out.print(
                Text(f"{FLAG} {run['run_id']} ({layout_of(run)}): ", style="bold yellow")
                + Text(flag),
                soft_wrap=True,
            )


def print_sweep_table(store_path: str, sweep: str | None) -> None:
    """A sweep's closing table: its runs as meshrun-report shows them, and the command that
    draws them. Nothing where the sweep recorded no run (every job refused at compose)."""
    if sweep is None or not Path(store_path).is_file():
        return
    runs = select_runs(ResultsStore(store_path).runs(), RunFilter(sweep=sweep)).runs
    if not runs:
        return
    print_table(runs, f"sweep {sweep}: {len(runs)} runs")
    console.print(
        f"plots: meshrun-report sweep={sweep} html={sweep}.html", highlight=False, soft_wrap=True
    )
