"""Read back what W&B wrote for an offline run.

wandb 0.31 writes offline runs only to the run's `.wandb` transaction log (no
wandb-summary.json or config.yaml yet: wandb/wandb#9646). That log is leveldb's log format
(32 KiB blocks of [crc32, length, type] framed chunks) after a 7-byte W&B header, each
record a `wandb_internal_pb2.Record` protobuf.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2

BLOCK = 32 * 1024
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _chunks(data: bytes) -> list[bytes]:
    records, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # block trailer too small for a header: padding
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        pos += HEADER
        if kind == 0:
            break
        pending += data[pos : pos + length]
        pos += length
        if kind in (FULL, LAST):
            records.append(pending)
            pending = b""
    return records


def read_offline_run(run_dir: Path) -> dict[str, Any]:
    """{'summary': {...}, 'config': {...}, 'history': [{...}, ...], 'run': {group, tags,
    job_type, name}, 'files': <the run's files dir>} of the one offline run."""
    [run] = read_offline_runs(run_dir)
    return run


def step_rows(logged: dict[str, Any]) -> list[dict[str, Any]]:
    """An offline run's history rows of training steps (each carries train/loss)."""
    return [h for h in logged["history"] if "train/loss" in h]


def read_offline_runs(run_dir: Path) -> list[dict[str, Any]]:
    """Every offline run W&B wrote in `run_dir` (a resumed run writes one per attempt), in
    the order they were made; each as `read_offline_run` has it, with its W&B `id`."""
    logs = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"), key=lambda p: p.parent.name)
    return [_read_log(log) for log in logs]


def _read_log(log: Path) -> dict[str, Any]:
    data = log.read_bytes()
    assert data.startswith(b":W&B"), "not a W&B transaction log"
    summary: dict[str, Any] = {}
    config: dict[str, Any] = {}
    history: list[dict[str, Any]] = []
    run: dict[str, Any] = {}
    for raw in _chunks(data):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = {
                "group": record.run.run_group,
                "tags": list(record.run.tags),
                "job_type": record.run.job_type,
                "name": record.run.display_name,
            }
        if kind == "summary":
            for item in record.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind in ("run", "config"):  # the run record carries the initial config
            updates = record.run.config.update if kind == "run" else record.config.update
            for item in updates:
                config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
        elif kind == "history":
            history.append(
                {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
            )
    return {
        "summary": summary,
        "config": config,
        "history": history,
        "run": run,
        "files": log.parent / "files",
        "id": log.stem.removeprefix("run-"),
    }


def read_table(wandb_run: dict[str, Any], key: str) -> dict[str, Any]:
    """{'columns': [...], 'data': [[...], ...]} of the wandb.Table logged under `key`."""
    [path] = [h[f"{key}/path"] for h in wandb_run["history"] if f"{key}/path" in h]
    return json.loads((wandb_run["files"] / path).read_text())
