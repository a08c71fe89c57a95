"""`meshrun-plan show=resolved`: the plan of the run `meshrun` would start with the same
overrides on this host (driver/resolve.py's RunPlan), printed without launching it: what
the resolution decided (hardware, backend, ranks and nodes, layout, batch, precision, the
baseline's way, the data cache, what was read from a pretrained directory), the prediction
the record will carry, and the settings it filled (`filled`: key: [as given, as resolved])."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import OmegaConf

from meshrun.core.config import settings_of
from meshrun.core.errors import ConfigError
from meshrun.core.hardware import HostFacts
from meshrun.driver.resolve import resolve
from meshrun.driver.sinks.console import console, print_error, print_note
from meshrun.driver.tool_config import PlanCommandConfig


def show_resolved(cfg: PlanCommandConfig) -> int:
    """Prints the RunPlan (and writes it to `json`, where named); 2 for a config error."""
    try:
        plan = resolve(settings_of(cfg), HostFacts.detect(), say=print_note)
    except ConfigError as err:
        print_error("config error", str(err))
        return 2
    shown = plan.as_dict()
    console.print(
        OmegaConf.to_yaml(shown).rstrip(),
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    if cfg.json:
        Path(cfg.json).write_text(json.dumps(shown, indent=2))
    return 0
