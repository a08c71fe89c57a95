"""`meshrun-report`: select runs from the results store, print them as a table, write the
HTML page with the plots. Reads the store only; no run, no W&B."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from meshrun.core.errors import ConfigError
from meshrun.core.paths import CONF_DIR
from meshrun.core.tool_config import ReportConfig
from meshrun.driver.command import hydra_command
from meshrun.driver.sinks.console import console, print_error
from meshrun.driver.sinks.store import ResultsStore
from meshrun.tools.report.html import render
from meshrun.tools.report.query import select_runs
from meshrun.tools.report.table import print_table


def run(dict_cfg: DictConfig) -> int:
    """0: page written; 1: no run matched; 2: bad config."""
    cfg: ReportConfig = OmegaConf.to_object(dict_cfg)
    try:
        if not Path(cfg.store.path).is_file():
            raise ConfigError("store.path", cfg.store.path, "no results store there",
                              "the meshrun.db that meshrun wrote (its store.path)")  # fmt: skip
        runs = select_runs(ResultsStore(cfg.store.path), cfg)
    except ConfigError as err:
        print_error("config error", str(err))
        return 2
    if not runs:
        print_error("no runs", f"match {cfg.selection()}")
        return 1
    print_table(runs, cfg.title)
    out = Path(cfg.html)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(runs, cfg.title, cfg.selection()))
    console.print(f"report: {out}", soft_wrap=True)
    return 0


# Its own config dir: in conf/ `model=` would name the model group, not the filter.
main = hydra_command("report", run, CONF_DIR / "report")


if __name__ == "__main__":
    main()
