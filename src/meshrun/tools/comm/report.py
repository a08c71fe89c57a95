"""A comm run's report: the nccl-tests style tables on the console, comm.json, the store row
(`comm_runs`) and W&B (offline unless a key exists, like training runs)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from meshrun.core.config import LoggerConfig
from meshrun.driver.sinks.console import console, print_warning
from meshrun.driver.sinks.store import ResultsStore
from meshrun.driver.sinks.wandb_sink import resolve_mode

REPORT_FILE = "comm.json"
ROW_KEYS = (
    "op",
    "size_bytes",
    "count",
    "dtype",
    "redop",
    "root",
    "time_us",
    "algbw_gbs",
    "busbw_gbs",
    "wrong",
)
# nccl-tests' columns; widths fit its largest figures (sizes of GiB, times of seconds).
COLUMNS = (
    ("size", "(B)", 12),
    ("count", "(elements)", 12),
    ("type", "", 9),
    ("redop", "", 6),
    ("root", "", 5),
    ("time", "(us)", 10),
    ("algbw", "(GB/s)", 8),
    ("busbw", "(GB/s)", 8),
    ("#wrong", "", 7),
)
SUMMARY_KEYS = (
    "status",
    "backend",
    "world_size",
    "device_type",
    "avg_busbw_gbs",
    "peak_busbw_gbs",
    "wrong",
    "error",
)


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """nccl-tests' closing lines: average bus bandwidth over all rows, and wrong values."""
    busbw = [r["busbw_gbs"] for r in rows]
    return {
        "avg_busbw_gbs": sum(busbw) / len(busbw) if busbw else None,
        "peak_busbw_gbs": max(busbw, default=None),
        "wrong": sum(r["wrong"] for r in rows),
    }


def _by_op(rows: list[dict[str, Any]]) -> Iterable[tuple[str, list[dict[str, Any]]]]:
    for op in dict.fromkeys(r["op"] for r in rows):
        yield op, [r for r in rows if r["op"] == op]


def _line(cells: Iterable[str]) -> str:
    return " ".join(cell.rjust(width) for cell, (_, _, width) in zip(cells, COLUMNS, strict=True))


def table_lines(op: str, rows: list[dict[str, Any]]) -> list[str]:
    """One op's table as plain text, the way nccl-tests prints it (greppable, any width)."""
    lines = [
        f"# {op}",
        "#" + _line(c[0] for c in COLUMNS)[1:],
        "#" + _line(c[1] for c in COLUMNS)[1:],
    ]
    for r in rows:
        lines.append(
            _line(
                (
                    str(r["size_bytes"]),
                    str(r["count"]),
                    r["dtype"],
                    r["redop"],
                    "-" if r["root"] is None else str(r["root"]),
                    f"{r['time_us']:.1f}",
                    f"{r['algbw_gbs']:.3f}",
                    f"{r['busbw_gbs']:.3f}",
                    str(r["wrong"]),
                )
            )
        )
    return lines


def print_tables(report: dict[str, Any]) -> None:
    console.print(
        f"# meshrun-comm: {report['backend']}, {report['world_size']} rank(s) on "
        f"{report['device_type']}, {report['launcher']} launcher",
        soft_wrap=True,
        highlight=False,
    )
    for op, rows in _by_op(report["rows"]):
        console.print("\n".join(table_lines(op, rows)), soft_wrap=True, highlight=False)
    if report["rows"]:
        console.print(
            f"# Avg bus bandwidth: {report['avg_busbw_gbs']:.3f} GB/s over "
            f"{len(report['rows'])} measurements; wrong values: {report['wrong']}",
            soft_wrap=True,
            highlight=False,
        )


def write_json(report: dict[str, Any]) -> None:
    (Path(report["run_dir"]) / REPORT_FILE).write_text(json.dumps(report, indent=2))


def record(report: dict[str, Any], store_path: str, logger: LoggerConfig, config: dict) -> None:
    """The store row and W&B: a comm run's measurements, for comparison with others."""
    ResultsStore(store_path).record_comm(report)
    if logger.name != "wandb":
        return
    try:
        _log_wandb(logger, config, report)
    except Exception as err:  # as for training runs: W&B costs the dashboard copy only
        saved = f"{report['run_dir']}/{REPORT_FILE}"
        print_warning(
            f"W&B logging failed ({type(err).__name__}: {err}); the comm run is "
            f"recorded in {store_path} and {saved}"
        )


def _log_wandb(cfg: LoggerConfig, config: dict[str, Any], report: dict[str, Any]) -> None:
    """One W&B run per comm run: the rows as a table (size on x, busbw on y per op), peak
    busbw per op and the run's summary."""
    import wandb  # noqa: PLC0415 (seconds to import: only runs logged to W&B pay it)

    os.environ.setdefault("WANDB_SILENT", "true")
    run = wandb.init(
        project=cfg.project,
        entity=cfg.entity,
        group=cfg.group,
        name=report["name"],
        tags=list(cfg.tags),
        job_type="comm",
        config=config,
        dir=report["run_dir"],
        mode=resolve_mode(cfg),
        settings=wandb.Settings(console="off"),
    )
    try:
        data = [[r[key] for key in ROW_KEYS] for r in report["rows"]]
        run.log({"comm/rows": wandb.Table(columns=list(ROW_KEYS), data=data)})
        for op, rows in _by_op(report["rows"]):
            run.summary[f"{op}/peak_busbw_gbs"] = max(r["busbw_gbs"] for r in rows)
        run.summary.update({key: report[key] for key in SUMMARY_KEYS})
    finally:
        run.finish(exit_code=0 if report["status"] == "completed" else 1)
