"""Measured pipeline bubble against the schedule's theory, (p-1)/(m+p-1), per rank, on the
two-stage pipeline of `conf/experiment/pipeline_bubble.yaml` (layers split by measured cost,
`parallel.pp_layers=auto`).

One real meshrun run (2 gloo ranks) per schedule, micro-batch count and round. Per case it
prints the theory, each rank's measured bubble (its median over the timed steps; with
rounds, the median over rounds) and its relative error against the bar, the stage costs
the split was balanced on, the step time and the other processes' share of the host's CPU
(a busy host inflates the bubble: a rank the host slows stalls its peer), and each rank's
bubble expected from the probed stage costs t0, t1 alone: 1 - m t_r / ((m-1) max(t) + t0 + t1)
(two stages filling, the slower pacing, draining; (p-1)/(m+p-1) when they are equal), which
separates what the split left uneven from what the pipeline adds (transfers, waits, load).
Extra overrides go to every run. Writes outputs/benchmarks/pipeline_bubble.json.

    .venv/bin/python benchmarks/pipeline_bubble.py              # m = 4, 8; ~4 min idle
    .venv/bin/python benchmarks/pipeline_bubble.py --rounds 3   # rounds alternate the cases
    .venv/bin/python benchmarks/pipeline_bubble.py --all        # also m = 1, 2
    .venv/bin/python benchmarks/pipeline_bubble.py model.n_layers=8 train.global_batch_size=32
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

BAR = 0.10  # each rank's bubble within 10% (relative) of theory
CASES = [(schedule, m) for schedule in ("gpipe", "1f1b") for m in (4, 8)]
SMALL_CASES = [("gpipe", 1), ("gpipe", 2), ("1f1b", 2)]  # --all; the bar is for m = 4, 8
BATCH = 64  # the experiment's global batch (one data-parallel rank: its local batch too)


def measure(
    schedule: str, microbatches: int, steps: int, batch: int, extra: list[str]
) -> dict[str, Any]:
    """`microbatches` m, run as train.micro_batch_size = batch / m (the one knob)."""
    overrides = [
        "experiment=pipeline_bubble",
        f"parallel.schedule={schedule}",
        f"train.micro_batch_size={batch // microbatches}",
        f"train.steps={steps}",
        *extra,
    ]
    with tempfile.TemporaryDirectory() as work:
        return meshrun_results(overrides, Path(work))


def from_costs(m: int, costs: list[float]) -> list[float]:
    """Each rank's bubble were the stages to take exactly `costs` a micro-batch (2 stages)."""
    span = (m - 1) * max(costs) + sum(costs)
    return [1 - m * t / span for t in costs]


def summary(schedule: str, microbatches: int, rounds: list[dict[str, Any]]) -> dict[str, Any]:
    theory = rounds[0]["bubble_theoretical"]
    expected = [
        statistics.median(ranks)
        for ranks in zip(
            *(from_costs(microbatches, r["pp_stage_costs_s"]) for r in rounds), strict=True
        )
    ]
    per_rank = [
        statistics.median(ranks)
        for ranks in zip(*(r["bubble_per_rank"] for r in rounds), strict=True)
    ]
    return {
        "schedule": schedule,
        "microbatches": microbatches,
        "theory": theory,
        "per_rank": per_rank,
        "error_per_rank": [(b - theory) / theory for b in per_rank],
        "from_stage_costs": expected,
        "rounds": [r["bubble_per_rank"] for r in rounds],
        "pp_layers": rounds[0]["pp_layers"],
        "stage_costs_s": [r["pp_stage_costs_s"] for r in rounds],
        "step_time_s": statistics.median(r["step_time_s"] for r in rounds),
        "host_other_cpu_share": [r["host_other_cpu_share"] for r in rounds],
    }


def _ms(costs: list[float] | None) -> str:
    return "/".join(f"{c * 1e3:.0f}" for c in costs) if costs else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--all", action="store_true", help="also m = 1, 2 (no bar)")
    parser.add_argument("overrides", nargs="*", help="meshrun overrides for every run")
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / "outputs/benchmarks/pipeline_bubble.json"
    )
    args = parser.parse_args()
    cases = (SMALL_CASES if args.all else []) + CASES
    given = [o.split("=", 1)[1] for o in args.overrides if o.startswith("train.global_batch_size=")]
    batch = int(given[-1]) if given else BATCH
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {case: [] for case in cases}
    for _ in range(args.rounds):
        for schedule, m in cases:
            runs[schedule, m].append(measure(schedule, m, args.steps, batch, args.overrides))
    rows = [summary(schedule, m, runs[schedule, m]) for schedule, m in cases]
    table = Table(
        title=f"pipeline bubble, pp=2, each rank against (p-1)/(m+p-1) (bar {BAR:.0%} at m >= 4)"
    )
    for column in (
        "schedule",
        "m",
        "theory",
        "rank 0",
        "rank 1",
        "error 0",
        "error 1",
        "from costs",
        "rounds (rank 0, rank 1)",
        "split, stage ms",
        "step s",
        "host busy",
        "ok",
    ):
        table.add_column(column)
    for r in rows:
        rounds = "; ".join(", ".join(f"{x:.3f}" for x in ranks) for ranks in r["rounds"])
        costs = "; ".join(_ms(c) for c in r["stage_costs_s"])
        busy = ", ".join(f"{s:.0%}" if s is not None else "-" for s in r["host_other_cpu_share"])
        ok = (
            "-"
            if r["microbatches"] < 4
            else ("yes" if all(abs(e) <= BAR for e in r["error_per_rank"]) else "NO")
        )
        table.add_row(
            r["schedule"],
            str(r["microbatches"]),
            f"{r['theory']:.3f}",
            *(f"{b:.3f}" for b in r["per_rank"]),
            *(f"{e:+.0%}" for e in r["error_per_rank"]),
            ", ".join(f"{b:.3f}" for b in r["from_stage_costs"]),
            rounds,
            f"{r['pp_layers']} {costs}",
            f"{r['step_time_s']:.2f}",
            busy,
            ok,
        )
    Console(width=220).print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
