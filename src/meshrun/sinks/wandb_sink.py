"""W&B: the resolved config, per-step metrics and a summary, from the driver after the run.

Offline unless a key is available (WANDB_API_KEY or a netrc login), so no account or network
is needed; `wandb sync` uploads an offline run later. The key is wandb's to read: it never
enters the config, results or logs.
"""

from __future__ import annotations

import netrc
import os
from typing import Any

from meshrun.config import LoggerConfig

SUMMARY_KEYS = (
    "status",
    "tokens_per_s",
    "samples_per_s",
    "step_time_s",
    "step_time_p90_s",
    "speedup",
    "scaling_efficiency",
    "baseline_tokens_per_s",
    "mfu",
    "peak_memory_max_bytes",
    "world_size",
    "layout_name",
    "scaling",
    "error",
)


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
    """Offline runs land in <run_dir>/wandb/offline-run-*, where `wandb sync` finds them."""
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")
    run = wandb.init(
        project=cfg.project,
        entity=cfg.entity,
        group=cfg.group,
        name=results["name"],
        tags=list(cfg.tags),
        job_type=results["role"],
        config=config,
        dir=results["run_dir"],
        mode=resolve_mode(cfg),
        settings=wandb.Settings(console="off"),
    )
    try:
        # Per-step series live under train/ so the run-level summary keys stay the run's.
        for record in steps:
            metrics = {"train/loss": record["loss"]}
            if record["step_time_s"]:
                metrics["train/step_time_s"] = record["step_time_s"]
                metrics["train/tokens_per_s"] = tokens_per_step / record["step_time_s"]
            run.log(metrics, step=record["step"])
        run.summary.update({k: results.get(k) for k in SUMMARY_KEYS})
    finally:
        run.finish(exit_code=0 if results["status"] == "completed" else 1)
