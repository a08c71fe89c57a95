"""W&B: one run per experiment (never per rank), held by the driver: opened when the ranks
start, fed each log step as rank 0 writes it (driver/sinks/live.py), then the per-rank memory
table and the summary once the run is recorded. Grouped by sweep (else by experiment name),
tagged by layout, model, hardware and backend.

The driver, not rank 0, holds it: W&B's import and its service process stay out of the ranks
being measured, and on a SLURM cluster the run is logged from the submitting host, which has
the network that compute nodes often lack.

Offline unless a key is available (WANDB_API_KEY or a netrc login), so no account or network
is needed; `wandb sync` uploads an offline run later. The key is wandb's to read: it never
enters the config, results or logs.
"""

from __future__ import annotations

import os
from typing import Any

from meshrun.core.config import LoggerConfig
from meshrun.core.record import summary_keys
from meshrun.core.run_files.metrics import StepRow
from meshrun.core.wandb_key import has_wandb_key

SUMMARY_KEYS = summary_keys()  # the record's fields marked `summary` (core/record.py)
# Byte counts per rank in results["memory_per_rank"], in table order; CUDA adds the last two.
MEMORY_COLUMNS = (
    "peak",
    "params",
    "grads",
    "optimizer",
    "activations",
    "other",
    "allocated",
    "reserved",
)


def resolve_mode(cfg: LoggerConfig) -> str:
    if cfg.mode != "auto":
        return cfg.mode
    return "online" if has_wandb_key() else "offline"


class WandbRun:
    """The experiment's W&B run. Its id is meshrun's run id (a W&B agent's own where one
    started the run), so a run resumed from a checkpoint continues its W&B run; steps before
    the resume, and any logged already, are not logged again."""

    def __init__(
        self,
        cfg: LoggerConfig,
        config: dict[str, Any],
        identity: dict[str, Any],
        tokens_per_step: int,
    ) -> None:
        import wandb  # noqa: PLC0415 (seconds to import: only runs logged to W&B pay it)

        os.environ.setdefault("WANDB_SILENT", "true")
        self.tokens_per_step = tokens_per_step
        self.logged_through = (identity.get("resumed_from_step") or 0) - 1
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            group=cfg.group or identity.get("sweep") or identity["name"],
            name=identity["name"],
            tags=[*run_tags(identity), *cfg.tags],
            job_type=identity["role"],
            config=config,
            dir=identity["run_dir"],
            mode=resolve_mode(cfg),
            settings=wandb.Settings(console="off"),
            id=None if "WANDB_RUN_ID" in os.environ else identity["run_id"],
            resume="allow",
        )

    def log_steps(self, records: list[StepRow]) -> None:
        for record in records:
            if record.step > self.logged_through:
                self.run.log(step_metrics(record, self.tokens_per_step), step=record.step)
                self.logged_through = record.step

    def finish(self, results: dict[str, Any]) -> None:
        """The memory and profile tables and the summary, then the run closed (also if they
        fail)."""
        import wandb  # noqa: PLC0415 (imported already by __init__)

        try:
            columns, rows = memory_rows(results)
            if rows:
                self.run.log({"memory/per_rank": wandb.Table(columns=columns, data=rows)})
            if results.get("profile"):  # debug.profile_steps: each rank's split, the picture
                self.run.log({"profile/per_rank": wandb.Table(*profile_table(results))})
            self.run.summary.update({k: results.get(k) for k in SUMMARY_KEYS})
        finally:
            self.close(exit_code=1 if results["status"] == "failed" else 0)

    def close(self, exit_code: int) -> None:
        """Finishes the run and waits until its files are complete. `finish()` returns once
        W&B has handled the run's exit, but wandb-core writes the transaction log (an offline
        run's `.wandb` file, all there is of it) through a buffer that it empties when a 32
        KiB block fills, every 15 s, or when it closes the run's stream, which it does after
        `finish()` has returned: a run read (or synced) right after it may have lost its
        history. `teardown()` waits for the W&B service to close its streams and exit; the
        next run starts a fresh one (0.2 s)."""
        import wandb  # noqa: PLC0415 (imported already by __init__)

        try:
            self.run.finish(exit_code=exit_code)
        finally:
            try:
                wandb.teardown()
            except SystemExit as stopped:  # teardown exits where the service exited non-zero
                raise RuntimeError(f"the W&B service exited with code {stopped.code}") from None


def step_metrics(record: StepRow, tokens_per_step: int) -> dict[str, float]:
    """One step's record (metrics.jsonl's) as W&B series, under train/ and eval/ so that the
    run-level summary keys stay the run's."""
    metrics = {
        "train/loss": record.loss,
        "train/grad_norm": record.grad_norm,
        "train/lr": record.lr,
    }
    if record.step_time_s:
        metrics["train/step_time_s"] = record.step_time_s
        metrics["train/tokens_per_s"] = tokens_per_step / record.step_time_s
    # an MoE model's routers; the step's slowest rank and its busy time beside the others';
    # how many torchft replicas trained it
    routers = ("moe_max_load", "moe_dropped", "moe_aux_loss")
    for key in (*routers, "slowest_rank", "busy_max_s", "busy_others_median_s", "replicas"):
        if getattr(record, key) is not None:
            metrics[f"train/{key}"] = getattr(record, key)
    if record.eval_loss is not None:
        metrics["eval/loss"] = record.eval_loss
        metrics["eval/perplexity"] = record.eval_perplexity
    return metrics


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
        [
            r["rank"],
            *(r.get(k) for k in keys),
            *(predicted.get(r["rank"], {}).get(k) for k in predicted_keys),
        ]
        for r in measured
    ]
    return columns, rows


PROFILE_COLUMNS = (
    "rank",
    "step_s",
    "compute_s",
    "comm_s",
    "overlapped_s",
    "exposed_comm_s",
    "idle_s",
)


def profile_table(results: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """One row per profiled rank: its traced steps split (core/run_files/profiles.py)."""
    rows = [[p[c] for c in PROFILE_COLUMNS] for p in results["profile"]]
    return list(PROFILE_COLUMNS), rows
