"""The report's filters checked against the store before selecting: a sweep, model or layout
that no stored run has is a config error naming what the store holds (a typo says so, rather
than `no runs`); runs that match each filter but not all of them together are no error."""

from __future__ import annotations

from typing import Any

from meshrun.core.errors import ConfigError
from meshrun.core.naming import preset_names
from meshrun.driver.compose import nearest
from meshrun.driver.sinks.selection import LATEST, layout_of, sweeps
from meshrun.driver.tool_config import ReportConfig

LISTED = 12  # values named in an error; the nearest is always among them


def _choices(value: str, known: list[str], what: str) -> str:
    near = nearest(value, known)
    shown = known if len(known) <= LISTED else [*known[-LISTED:], "..."]
    listed = f"{what}: {' | '.join(shown) if shown else 'none'}"
    return f"{near} (nearest); {listed}" if near else listed


def check_filters(cfg: ReportConfig, runs: list[dict[str, Any]]) -> None:
    """Raise ConfigError for the first filter value that no row of the store has."""
    names = [s.name for s in sweeps(runs)]
    if cfg.sweep == LATEST and not names:
        raise ConfigError(
            "sweep",
            cfg.sweep,
            "the store has no sweep",
            "unset (every run), or a sweep run first (meshrun -m)",
        )
    if cfg.sweep not in (None, LATEST) and cfg.sweep not in names:
        raise ConfigError(
            "sweep",
            cfg.sweep,
            "no sweep of that name in the store",
            _choices(cfg.sweep, [*names, LATEST], "its sweeps"),
        )
    models = sorted({r["model"] for r in runs if r.get("model")})
    if cfg.model is not None and cfg.model not in models:
        raise ConfigError(
            "model",
            cfg.model,
            "no run of that model in the store",
            _choices(cfg.model, models, "its models"),
        )
    layouts = sorted({layout_of(r) for r in runs})
    if cfg.layout is not None and cfg.layout not in (*layouts, *preset_names()):
        raise ConfigError(
            "layout",
            cfg.layout,
            "neither a layout in the store nor a preset",
            _choices(cfg.layout, layouts, "its layouts"),
        )
