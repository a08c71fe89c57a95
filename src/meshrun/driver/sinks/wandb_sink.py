"""W&B: one run per experiment (never per rank), logged by the driver after the ranks have
exited: the resolved config, per-step metrics, per-rank memory as a table and a summary.
Grouped by sweep (else by experiment name), tagged by layout, model, hardware and backend.

Offline unless a key is available (WANDB_API_KEY or a netrc login), so no account or network
is needed; `wandb sync` uploads an offline run later. The key is wandb's to read: it never
enters the config, results or logs.
"""

from __future__ import annotations

import netrc
import os
from typing import Any

from meshrun.core.config import LoggerConfig
from meshrun.core.record import summary_keys
from meshrun.rank.metrics.live import close_run

SUMMARY_KEYS = summary_keys()  # the record's fields marked `summary` (core/record.py)
# Byte counts per rank in results["memory_per_rank"], in table order; CUDA adds the last two.
MEMORY_COLUMNS = (
    "peak", "params", "grads", "optimizer", "activations", "other", "allocated", "reserved"
)  # fmt: skip


def _has_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def resolve_mode(cfg: LoggerConfig) -> str:
    if cfg.mode != "auto":
        return cfg.mode
    return "online" if _has_key() else "offline"


def log_run(
    cfg: LoggerConfig,
    config: dict[str, Any],
    results: dict[str, Any],
    steps: list[dict[str, Any]],
    tokens_per_step: int,
) -> None:
    """Offline runs land in <run_dir>/wandb/offline-run-*, where `wandb sync` finds them.
    The W&B run's id is meshrun's run id (a W&B agent's own where one started the run), so
    a run resumed from a checkpoint continues its W&B run from the step it resumed at."""
    import wandb  # noqa: PLC0415 (seconds to import: only runs logged to W&B pay it)

    os.environ.setdefault("WANDB_SILENT", "true")
    run = wandb.init(
        project=cfg.project,
        entity=cfg.entity,
        group=cfg.group or results.get("sweep") or results["name"],
        name=results["name"],
        tags=[*run_tags(results), *cfg.tags],
        job_type=results["role"],
        config=config,
        dir=results["run_dir"],
        mode=resolve_mode(cfg),
        settings=wandb.Settings(console="off"),
        id=None if "WANDB_RUN_ID" in os.environ else results["run_id"],
        resume="allow",
    )
    resumed = results.get("resumed_from_step") or 0
    try:
        # Per-step series live under train/ so the run-level summary keys stay the run's.
        for record in (r for r in steps if r["step"] >= resumed):
            metrics = {"train/loss": record["loss"], "train/grad_norm": record["grad_norm"],
                       "train/lr": record["lr"]}  # fmt: skip
            if record["step_time_s"]:
                metrics["train/step_time_s"] = record["step_time_s"]
                metrics["train/tokens_per_s"] = tokens_per_step / record["step_time_s"]
            if "eval_loss" in record:
                metrics["eval/loss"] = record["eval_loss"]
                metrics["eval/perplexity"] = record["eval_perplexity"]
            run.log(metrics, step=record["step"])
        columns, rows = memory_rows(results)
        if rows:
            run.log({"memory/per_rank": wandb.Table(columns=columns, data=rows)})
        run.summary.update({k: results.get(k) for k in SUMMARY_KEYS})
    finally:
        close_run(run, exit_code=1 if results["status"] == "failed" else 0)


def run_tags(results: dict[str, Any]) -> list[str]:
    """`key:value` tags, so that the W&B run table filters by each; a sweep's skipped point
    (a finished W&B run, not a crashed one) is tagged `skipped`."""
    keys = {"layout": "layout_name", "model": "model", "hardware": "hardware", "backend": "backend"}
    tags = [f"{tag}:{results[key]}" for tag, key in keys.items() if results.get(key)]
    return [*tags, "skipped"] if results.get("status") == "skipped" else tags


def memory_rows(results: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """One row per rank: the measured breakdown where the run has one (predicted beside it as
    `predicted_<category>`), else the peak alone; no rows for a run without memory figures."""
    measured = results.get("memory_per_rank")
    if not measured:
        peaks = results.get("peak_memory_bytes") or []
        return ["rank", "peak"], [[rank, peak] for rank, peak in enumerate(peaks)]
    keys = [k for k in MEMORY_COLUMNS if k in measured[0]]
    predicted = {p.get("rank", i): p for i, p in enumerate(results.get("memory_predicted") or [])}
    predicted_keys = [k for k in MEMORY_COLUMNS if any(k in p for p in predicted.values())]
    columns = ["rank", *keys, *(f"predicted_{k}" for k in predicted_keys)]
    rows = [
        [r["rank"], *(r.get(k) for k in keys),
         *(predicted.get(r["rank"], {}).get(k) for k in predicted_keys)]
        for r in measured
    ]  # fmt: skip
    return columns, rows
