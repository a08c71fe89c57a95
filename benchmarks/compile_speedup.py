"""What train.compile buys: the same `meshrun` run (model=small by default, 2 gloo ranks)
with and without torch.compile of its decoder blocks, under DDP and TP, in ABAB rounds
(uncompiled, then compiled; slow drift of the machine hits both alike).

Per layout and round: tokens/s of each side and their ratio (compiled / uncompiled: above 1,
compile is faster), the seconds the compiled run spent compiling (its `compile_s`, in no
step time; later rounds find inductor's on-disk cache warm), the largest loss difference
between the sides (same seed, batch and steps: only kernels' reordered float sums may move
it) and the CPU seconds other processes took while each side ran (a round marked `*` had
more than 1 s: rerun). The median ratio per layout is the result. Writes
outputs/benchmarks/compile_speedup.json.

    .venv/bin/python benchmarks/compile_speedup.py               # ~6 min on 2 idle cores
    .venv/bin/python benchmarks/compile_speedup.py --layouts ddp --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import CONTENDED_CPU_S, busy_cpu_s, meshrun_results, own_cpu_s
from rich.console import Console
from rich.table import Table

from meshrun.core.paths import REPO_ROOT

LAYOUTS = {"ddp": ["parallel=ddp"], "tp2": ["parallel=tp2", "train.micro_batch_size=4"]}
console = Console()


def measure(overrides: list[str]) -> dict[str, Any]:
    """One run's figures and the CPU seconds other processes took while it ran."""
    busy, own = busy_cpu_s(), own_cpu_s()
    with tempfile.TemporaryDirectory(prefix="compile_speedup_") as work:
        results = meshrun_results(overrides, Path(work))
    other = (busy_cpu_s() - busy) - (own_cpu_s() - own)
    return {"tokens_per_s": results["tokens_per_s"], "step_time_s": results["step_time_s"],
            "compile_s": results["compile_s"], "losses": results["losses"],
            "other_cpu_s": max(0.0, other)}  # fmt: skip


def run_layout(layout: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    common = [f"model={args.model}", *LAYOUTS[layout], f"train.steps={args.steps}",
              f"train.seq_len={args.seq_len}", "train.precision=fp32", "train.seed=0"]  # fmt: skip
    rounds = []
    for index in range(args.rounds):
        eager = measure([*common, "train.compile=false"])
        compiled = measure([*common, "train.compile=true"])
        diff = max(abs(a - b) for a, b in zip(eager["losses"], compiled["losses"], strict=True))
        rounds.append({"round": index + 1, "eager": eager, "compiled": compiled,
                       "ratio": compiled["tokens_per_s"] / eager["tokens_per_s"],
                       "loss_diff": diff})  # fmt: skip
        console.print(f"{layout} round {index + 1}/{args.rounds}: {eager['tokens_per_s']:,.0f} "
                      f"-> {compiled['tokens_per_s']:,.0f} tok/s, ratio {rounds[-1]['ratio']:.3f}, "
                      f"compile {compiled['compile_s']:.1f} s")  # fmt: skip
    return rounds


def print_table(model: str, results: dict[str, list[dict[str, Any]]]) -> None:
    table = Table(title=f"train.compile, {model} on 2 gloo ranks: ratio = compiled / uncompiled")
    for column in ("layout", "round", "uncompiled tok/s", "compiled tok/s", "ratio",
                   "compile s", "max |loss diff|", "other CPU s"):  # fmt: skip
        table.add_column(column, justify="right")
    for layout, rounds in results.items():
        for r in rounds:
            others = (r["eager"]["other_cpu_s"], r["compiled"]["other_cpu_s"])
            table.add_row(layout, f"{r['round']}{'*' if max(others) > CONTENDED_CPU_S else ''}",
                          f"{r['eager']['tokens_per_s']:,.0f}",
                          f"{r['compiled']['tokens_per_s']:,.0f}", f"{r['ratio']:.3f}",
                          f"{r['compiled']['compile_s']:.1f}", f"{r['loss_diff']:.1e}",
                          f"{others[0]:.1f} / {others[1]:.1f}")  # fmt: skip
        median = statistics.median(r["ratio"] for r in rounds)
        table.add_row(layout, "median", "", "", f"{median:.3f}", "", "", "", style="bold")
        table.add_section()
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1)
    out = REPO_ROOT / "outputs" / "benchmarks" / "compile_speedup.json"
    parser.add_argument("--out", type=Path, default=out)
    args = parser.parse_args()
    load_before, started = os.getloadavg(), time.perf_counter()
    results = {layout: run_layout(layout, args) for layout in args.layouts}
    print_table(args.model, results)
    load = {"before": load_before, "after": os.getloadavg()}
    console.print(f"load average (1, 5, 15 min) before {load_before}, after {load['after']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "setup": vars(args) | {"out": str(args.out)}, "torch": torch.__version__,
        "results": results, "load_average": load, "wall_s": time.perf_counter() - started,
        "median_ratio": {k: statistics.median(r["ratio"] for r in v) for k, v in results.items()},
    }, indent=2))  # fmt: skip
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
