"""Which runs a report compares: store rows filtered by sweep, model, layout and date."""

from __future__ import annotations

from datetime import date, datetime, timezone
from typing import Any

from meshrun.core.errors import ConfigError
from meshrun.core.tool_config import RunFilter
from meshrun.driver.sinks.store import ResultsStore


def parse_day(key: str, value: str | None) -> date | None:
    if value is None:
        return None
    try:
        return date.fromisoformat(str(value))
    except ValueError:
        raise ConfigError(key, value, "not a date", "YYYY-MM-DD, e.g. 2026-01-31") from None


def _day(created_at: str) -> date:
    return datetime.fromisoformat(created_at).astimezone(timezone.utc).date()


def latest_sweep(runs: list[dict[str, Any]]) -> str | None:
    swept = [r for r in runs if r.get("sweep")]
    return max(swept, key=lambda r: r["created_at"])["sweep"] if swept else None


def select_runs(store: ResultsStore, flt: RunFilter) -> list[dict[str, Any]]:
    """Matching rows, oldest first; baselines (the single-device twins measured for a
    speedup) only when asked for, since each belongs to a run already shown."""
    since, until = parse_day("since", flt.since), parse_day("until", flt.until)
    runs = store.runs()
    sweep = latest_sweep(runs) if flt.sweep == "latest" else flt.sweep

    def keep(run: dict[str, Any]) -> bool:
        return (
            (flt.baselines or run.get("role") != "baseline")
            and (sweep is None or run.get("sweep") == sweep)
            and (flt.model is None or run.get("model") == flt.model)
            and (flt.layout is None or flt.layout in (run.get("parallel"), run.get("layout_name")))
            and (since is None or _day(run["created_at"]) >= since)
            and (until is None or _day(run["created_at"]) <= until)
        )

    return [run for run in runs if keep(run)]
