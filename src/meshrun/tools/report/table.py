"""The runs table: every column on the HTML page, the narrower set in the terminal (with the
reasons of skipped and failed runs listed under it rather than in a column)."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from meshrun.core.record import report_columns
from meshrun.driver.sinks.console import _fmt, _fmt_bytes, console

COLUMNS = report_columns()  # (record field, header), from the record's metadata
HEADERS = tuple(header for _, header in COLUMNS)
TERMINAL = tuple(h for h in HEADERS if h not in ("created (UTC)", "sweep", "backend", "reason"))
STATUS_STYLE = {"completed": "green", "failed": "red", "skipped": "yellow"}


def _bubble(run: dict[str, Any]) -> str:
    if run.get("bubble_theoretical") is None:
        return "n/a"
    return f"{_fmt(run.get('bubble_measured'))} ({_fmt(run['bubble_theoretical'])})"


# How each shown field is written; a field without an entry is written as its text.
FORMATS = {
    "created_at": lambda run: run["created_at"][:19].replace("T", " "),
    "layout_name": lambda run: run.get("layout_name") or run.get("parallel") or "",
    "world_size": lambda run: _fmt(run.get("world_size")),
    "global_batch_size": lambda run: (
        f"{_fmt(run.get('global_batch_size'))} / {_fmt(run.get('micro_batch_size'))}"
    ),
    "tokens_per_s": lambda run: _fmt(run.get("tokens_per_s")),
    "speedup": lambda run: _fmt(run.get("speedup"), "x"),
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


def print_table(runs: list[dict[str, Any]], title: str) -> None:
    """Fitted to a terminal; written to a pipe or log, at full width rather than rich's 80."""
    table = Table(title=title, box=box.SIMPLE_HEAD)
    for header in TERMINAL:
        table.add_column(header, overflow="fold", no_wrap=header == "run")
    for run in runs:
        row = cells(run)
        texts = [Text(row[h]) for h in TERMINAL]
        texts[TERMINAL.index("status")].stylize(STATUS_STYLE.get(run["status"], ""))
        table.add_row(*texts)
    out = console if console.is_terminal else Console(width=160)
    out.print(table)
    for run in runs:
        if run.get("error"):
            out.print(Text(f"{run['run_id']} {run['status']}: ", style="bold")
                          + Text(run["error"]), soft_wrap=True)  # fmt: skip
