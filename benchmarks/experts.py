"""Mixture of experts on this box: how even the routers' loads get over a run under each way
of balancing them (model.moe.load_balance: the sequence-wise auxiliary loss, DeepSeek-V3's
biases, none), from each run's own metrics.jsonl (`moe_max_load`: the busiest expert's
tokens over the mean, the worst layer's), all in one invocation.

    .venv/bin/python benchmarks/experts.py              # 200 steps of tiny-moe
    .venv/bin/python benchmarks/experts.py --steps 500

The data is meshrun's synthetic tokens, one rank, fp32: what moves the loads is the routers'
training and the balancing alone. Expert parallelism's memory and all-to-all share come with
parallel.ep.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from common import meshrun_results
from rich.console import Console
from rich.table import Table

METHODS = {
    "none": ("model.moe.load_balance=none",),
    "aux_loss": ("model.moe.load_balance=aux_loss",),
    "bias": ("model.moe.load_balance=bias",),
}
WINDOW = 20  # steps averaged at each end


def run(steps: int, method: str, work: Path) -> tuple[list[float], dict]:
    overrides = [
        "model=tiny-moe",
        "parallel=single",
        f"train.steps={steps}",
        "train.precision=fp32",
        "train.lr=1e-3",
        *METHODS[method],
    ]
    results = meshrun_results(overrides, work / method)
    records = (work / method / "meshrun" / "metrics.jsonl").read_text().splitlines()
    loads = [r["moe_max_load"] for r in map(json.loads, records) if "moe_max_load" in r]
    return loads, results


def main(steps: int) -> None:
    table = Table(title=f"tiny-moe (8 experts, top 2), {steps} steps, one rank, fp32")
    for column in ("balancing", "busiest/mean, first steps", "last steps", "loss last", "tok/s"):
        table.add_column(column, justify="right")
    with tempfile.TemporaryDirectory() as tmp:
        for method in METHODS:
            loads, results = run(steps, method, Path(tmp))
            first = statistics.mean(loads[:WINDOW])
            last = statistics.mean(loads[-WINDOW:])
            table.add_row(
                method,
                f"{first:.3f}",
                f"{last:.3f}",
                f"{results['losses'][-1]:.4f}",
                f"{results['tokens_per_s']:,.0f}",
            )
    Console().print(table)
    print(f"(the mean of moe_max_load over the first and the last {WINDOW} steps)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    main(parser.parse_args().steps)
