"""Measured pipeline bubble against the schedule's theory, (p-1)/(m+p-1), on the
compute-balanced two-stage pipeline of `conf/experiment/pipeline_bubble.yaml`.

One real meshrun run (2 gloo ranks) per schedule and micro-batch count and round; prints
theory, measured (mean over ranks of each rank's median over the timed steps; with rounds,
the median over rounds, each round listed), the relative error, and the step time, and
writes outputs/benchmarks/pipeline_bubble.json. The bar: within 25% (relative) of theory.

    .venv/bin/python benchmarks/pipeline_bubble.py              # ~7 min on 2 idle cores
    .venv/bin/python benchmarks/pipeline_bubble.py --rounds 3   # rounds alternate the cases
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

from meshrun.core.paths import REPO_ROOT

BAR = 0.25
CASES = [("gpipe", m) for m in (1, 2, 4, 8)] + [("1f1b", m) for m in (2, 4, 8)]
BATCH = 64  # the experiment's global batch (one data-parallel rank: its local batch too)


def measure(schedule: str, microbatches: int, steps: int) -> dict[str, Any]:
    """`microbatches` m, run as train.micro_batch_size = BATCH / m (the one knob)."""
    overrides = ["experiment=pipeline_bubble", f"parallel.schedule={schedule}",
                 f"train.micro_batch_size={BATCH // microbatches}",
                 f"train.steps={steps}"]  # fmt: skip
    with tempfile.TemporaryDirectory() as work:
        return meshrun_results(overrides, Path(work))


def summary(schedule: str, microbatches: int, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    theory = rounds[0]["bubble_theoretical"]
    measured = statistics.median(r["bubble_measured"] for r in rounds)
    return {"schedule": schedule, "microbatches": microbatches, "theory": theory,
            "measured": measured, "error": (measured - theory) / theory,
            "rounds": [r["bubble_measured"] for r in rounds],
            "per_rank": [r["bubble_per_rank"] for r in rounds],
            "step_time_s": statistics.median(r["step_time_s"] for r in rounds)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--out", type=Path,
                        default=REPO_ROOT / "outputs/benchmarks/pipeline_bubble.json")  # fmt: skip
    args = parser.parse_args()
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {case: [] for case in CASES}
    for _ in range(args.rounds):
        for schedule, m in CASES:
            runs[schedule, m].append(measure(schedule, m, args.steps))
    rows = [summary(schedule, m, runs[schedule, m]) for schedule, m in CASES]
    table = Table(title=f"pipeline bubble, pp=2, measured vs (p-1)/(m+p-1) (bar {BAR:.0%})")
    for column in ("schedule", "m", "theory", "measured", "error", "rounds (ranks)", "step s",
                   "ok"):  # fmt: skip
        table.add_column(column)
    for r in rows:
        rounds = "; ".join(
            f"{b:.3f} ({', '.join(f'{x:.3f}' for x in ranks)})"
            for b, ranks in zip(r["rounds"], r["per_rank"], strict=True)
        )
        ok = "yes" if abs(r["error"]) <= BAR else "NO"
        table.add_row(r["schedule"], str(r["microbatches"]), f"{r['theory']:.3f}",
                      f"{r['measured']:.3f}", f"{r['error']:+.0%}", rounds,
                      f"{r['step_time_s']:.2f}", ok)  # fmt: skip
    Console(width=200).print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
