"""Which stored runs a comparison shows: a RunFilter applied to the store's rows, grouped by
layout, and the store's sweeps. Here rather than in meshrun-report because a sweep's closing
table (driver/sweep.py) selects its runs the same way."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date, datetime, timezone
from typing import Any

from meshrun.core.errors import ConfigError
from meshrun.core.naming import is_preset_layout
from meshrun.driver.tool_config import RunFilter

LATEST = "latest"


@dataclass(frozen=True)
class Sweep:
    """A sweep in the store: its runs (baselines not counted) and when they were created."""

    name: str
    runs: int
    first: str
    last: str


@dataclass(frozen=True)
class Selection:
    """The runs a filter chose, grouped by layout; `sweep` is the sweep it named (what
    `latest` picked), `sweeps` every sweep of the store, newest last."""

    runs: list[dict[str, Any]]
    sweep: str | None
    sweeps: list[Sweep]


def parse_day(key: str, value: str | None) -> date | None:
    if value is None:
        return None
    try:
        return date.fromisoformat(str(value))
    except ValueError:
        raise ConfigError(key, value, "not a date", "YYYY-MM-DD, e.g. 2026-01-31") from None


def _day(created_at: str) -> date:
    return datetime.fromisoformat(created_at).astimezone(timezone.utc).date()


def sweeps(runs: list[dict[str, Any]]) -> list[Sweep]:
    """Every sweep among `runs` (the store's rows), ordered by its newest row."""
    rows: dict[str, list[dict[str, Any]]] = {}
    for run in runs:
        if run.get("sweep"):
            rows.setdefault(run["sweep"], []).append(run)
    found = [
        Sweep(
            name,
            sum(r.get("role") != "baseline" for r in group),
            min(r["created_at"] for r in group),
            max(r["created_at"] for r in group),
        )
        for name, group in rows.items()
    ]
    return sorted(found, key=lambda s: s.last)


def layout_of(run: dict[str, Any]) -> str:
    """The run's canonical layout name (core.naming.layout_name); a point skipped before its
    degrees were known is stored under its preset's name, a row without any by its preset."""
    return run.get("layout_name") or run.get("parallel") or "?"


def matches_layout(run: dict[str, Any], wanted: str) -> bool:
    """`wanted` is the run's layout name, or the preset it ran as shipped: `ddp` matches a
    ddp2 run, not a run of the ddp preset that overrode its degrees into pp2 x fsdp2 x tp2."""
    if wanted == layout_of(run):
        return True
    if wanted != run.get("parallel"):
        return False
    return run.get("layout") is None or is_preset_layout(wanted, run["layout"])


def grouped(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs of one layout together, layouts in the order they first ran, each one's runs
    oldest first (a stable sort of rows that come oldest first)."""
    first: dict[str, int] = {}
    for index, run in enumerate(runs):
        first.setdefault(layout_of(run), index)
    return sorted(runs, key=lambda run: first[layout_of(run)])


def select_runs(runs: list[dict[str, Any]], flt: RunFilter) -> Selection:
    """The rows of `runs` (the store's, ResultsStore.runs) that match, grouped by layout;
    baselines (the single-device baselines measured for a speedup) only when asked for, since
    each belongs to a run already shown."""
    since, until = parse_day("since", flt.since), parse_day("until", flt.until)
    found = sweeps(runs)
    sweep = (found[-1].name if found else None) if flt.sweep == LATEST else flt.sweep

    def keep(run: dict[str, Any]) -> bool:
        return (
            (flt.baselines or run.get("role") != "baseline")
            and (flt.sweep is None or (sweep is not None and run.get("sweep") == sweep))
            and (flt.model is None or run.get("model") == flt.model)
            and (flt.layout is None or matches_layout(run, flt.layout))
            and (since is None or _day(run["created_at"]) >= since)
            and (until is None or _day(run["created_at"]) <= until)
        )

    return Selection(grouped([run for run in runs if keep(run)]), sweep, found)
