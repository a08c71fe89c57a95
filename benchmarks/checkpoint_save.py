"""What checkpointing costs a run: the same `meshrun` run (model=small, DDP on 2 gloo ranks)
without checkpoints, saving every N steps in the background (checkpoint.async_save, the
default) and saving synchronously, in ABAB... rounds.

Per mode: the median step time (saves land inside timed steps), how long training waited per
save (staging to host memory, or the whole write when synchronous), how long a save took from
staging to its last byte, and the size of one checkpoint. Writes
outputs/benchmarks/checkpoint_save.json.

    .venv/bin/python benchmarks/checkpoint_save.py              # ~3 min on 2 idle cores
    .venv/bin/python benchmarks/checkpoint_save.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from common import meshrun_results
from rich.console import Console
from rich.table import Table

from meshrun.core.checkpoints import complete, read_manifest
from meshrun.core.paths import REPO_ROOT

MODES = {
    "none": [],
    "async": ["checkpoint.async_save=true"],
    "sync": ["checkpoint.async_save=false"],
}


def measure(mode: str, steps: int, every: int, model: str) -> dict[str, Any]:
    overrides = [
        f"model={model}",
        "parallel=ddp",
        f"train.steps={steps}",
        "train.untimed_steps=2",
        *MODES[mode],
    ]
    if mode != "none":
        overrides.append(f"checkpoint.every_steps={every}")
    with tempfile.TemporaryDirectory() as work:
        results = meshrun_results(overrides, Path(work))
        saved = complete(Path(work) / "meshrun" / "checkpoints")
        size = read_manifest(saved[-1]).bytes if saved else None
    return {
        "step_time_s": results["step_time_s"],
        "blocked_s": results["checkpoint_blocked_s"],
        "save_s": results["checkpoint_save_s"],
        "bytes": size,
    }


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--model", default="small")
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / "outputs/benchmarks/checkpoint_save.json"
    )
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            runs[mode].append(measure(mode, args.steps, args.every, args.model))
    table = Table(
        title=f"checkpoints of {args.model} (DDP x2) every {args.every} steps, "
        f"{args.steps} steps, {args.rounds} round(s)"
    )
    for column in (
        "mode",
        "step time (s)",
        "vs none",
        "waited per save (s)",
        "save took (s)",
        "checkpoint (MiB)",
    ):
        table.add_column(column)
    base = statistics.median(r["step_time_s"] for r in runs["none"])
    summary = {}
    for mode, rounds in runs.items():
        step = statistics.median(r["step_time_s"] for r in rounds)
        row = {"step_time_s": step, "vs_none": step / base, "rounds": rounds}
        for key in ("blocked_s", "save_s", "bytes"):
            values = [r[key] for r in rounds if r[key] is not None]
            row[key] = statistics.median(values) if values else None
        summary[mode] = row
        size = row["bytes"] / 2**20 if row["bytes"] else None
        table.add_row(
            mode,
            f"{step:.4f}",
            f"{step / base:.3f}",
            _cell(row["blocked_s"], ".4f"),
            _cell(row["save_s"], ".4f"),
            _cell(size, ".1f"),
        )
    Console().print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
