"""`meshrun-report`: select runs from the results store, print the store's sweeps and the
runs' comparison table, and write the HTML page with the plots where `html=` asks for it.
Reads the store only; no run, no W&B, and no file unless asked (no Hydra run dir either:
conf/report/report.yaml)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from rich.table import Table

from meshrun.core.errors import ConfigError
from meshrun.core.paths import CONF_DIR
from meshrun.driver.command import hydra_command
from meshrun.driver.sinks.compare import print_table
from meshrun.driver.sinks.console import console, print_error
from meshrun.driver.sinks.selection import LATEST, Selection, select_runs
from meshrun.driver.sinks.store import ResultsStore
from meshrun.driver.tool_config import ReportConfig
from meshrun.tools.report.html import render
from meshrun.tools.report.query import check_filters

PAGE_SUFFIXES = (".html", ".htm")
LISTED_SWEEPS = 8  # the newest, in the terminal; the page lists more


def page_path(value: str | None) -> Path | None:
    """Where `html=` asks for the page; an .html file, so `html=true` is an error rather
    than a page written to a file named True."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_dir():
        raise ConfigError("html", value, "is a directory", "a file path, e.g. html=report.html")
    if path.suffix.lower() not in PAGE_SUFFIXES:
        raise ConfigError(
            "html",
            value,
            "not an .html file path",
            "a path ending in .html, e.g. html=report.html; unset: none",
        )
    return path


def print_sweeps(selection: Selection) -> None:
    """The newest sweeps of the store, marking which one `sweep=latest` picks."""
    if not selection.sweeps:
        return
    listed = selection.sweeps[-LISTED_SWEEPS:]
    older = len(selection.sweeps) - len(listed)
    table = Table(
        title=f"sweeps in the store{f' ({older} older not listed)' if older else ''}",
        show_edge=False,
        box=None,
    )
    for header in ("sweep", "runs", "first run (UTC)", "last run (UTC)", ""):
        table.add_column(header)
    latest = selection.sweeps[-1].name
    for s in listed:
        mark = ", ".join(
            w for w, on in ((LATEST, s.name == latest), ("shown", s.name == selection.sweep)) if on
        )
        table.add_row(
            s.name, str(s.runs), s.first[:19].replace("T", " "), s.last[:19].replace("T", " "), mark
        )
    console.print(table)


def run(dict_cfg: DictConfig) -> int:
    """0: runs shown (and the page written, where asked); 1: no run matched; 2: bad config."""
    cfg: ReportConfig = OmegaConf.to_object(dict_cfg)
    try:
        page = page_path(cfg.html)
        if not Path(cfg.store.path).is_file():
            raise ConfigError(
                "store.path",
                cfg.store.path,
                "no results store there",
                "the meshrun.db that meshrun wrote (its store.path)",
            )
        rows = ResultsStore(cfg.store.path).runs()
        check_filters(cfg, rows)
        selection = select_runs(rows, cfg)
    except ConfigError as err:
        print_error("config error", str(err))
        return 2
    described = cfg.selection(selection.sweep)
    print_sweeps(selection)
    if not selection.runs:
        print_error("no runs", f"match {described}")
        return 1
    print_table(selection.runs, f"{cfg.title}: {described}")
    if page is None:
        console.print("the page with the plots: add html=<file>.html", highlight=False)
        return 0
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(render(selection, cfg.title, described))
    console.print(f"report: {page}", soft_wrap=True, highlight=False)
    return 0


# Its own config dir: in conf/ `model=` would name the model group, not the filter.
main = hydra_command("report", run, CONF_DIR / "report")


if __name__ == "__main__":
    main()
