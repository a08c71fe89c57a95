"""The planner against measurement: for each layout of the accuracy set, one real meshrun run
(gloo, this host) and the prediction its results.json carries beside the measurement.

Prints, per rank, measured/predicted MiB and the relative error of the peak and of each
category, and step time predicted vs measured; writes outputs/benchmarks/planner_accuracy.json.
The bar: peak within 10%, params/grads/optimizer/activations within 15%.

    .venv/bin/python benchmarks/planner_accuracy.py            # ~4 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from common import meshrun_results
from rich.console import Console
from rich.table import Table

from meshrun.core.paths import REPO_ROOT

MiB = 2**20
CATEGORIES = ("params", "grads", "optimizer", "activations")
PEAK_BAR, CATEGORY_BAR = 0.10, 0.15
LAYOUTS = {
    "single": ["parallel=single"],
    "ddp": ["parallel=ddp"],
    "fsdp": ["parallel=fsdp"],
    "tp2": ["parallel=tp2"],
    "pp2 1f1b": ["parallel=pp2", "parallel.schedule=1f1b"],
    "pp2 gpipe": ["parallel=pp2", "parallel.schedule=gpipe"],
    "tp2_pp2": ["parallel=tp2_pp2"],
}
CHECKPOINTING = ("none", "full")


def relative(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured else float("nan")


def compare(label: str, results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for measured, predicted in zip(results["memory_per_rank"], results["memory_predicted"],
                                   strict=True):  # fmt: skip
        errors = {c: relative(predicted[c], measured[c]) for c in ("peak", *CATEGORIES)}
        rows.append({"layout": label, "rank": measured["rank"], "measured": measured,
                     "predicted": predicted, "errors": errors,
                     "ok": abs(errors["peak"]) <= PEAK_BAR
                     and all(abs(errors[c]) <= CATEGORY_BAR for c in CATEGORIES)})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path,
                        default=REPO_ROOT / "outputs/benchmarks/planner_accuracy.json")  # fmt: skip
    args = parser.parse_args()
    rows, speeds = [], []
    for name, overrides in LAYOUTS.items():
        for ckpt in CHECKPOINTING:
            label = f"{name}, ckpt {ckpt}"
            with tempfile.TemporaryDirectory() as work:
                results = meshrun_results([*overrides, f"train.steps={args.steps}",
                                           f"parallel.activation_checkpointing={ckpt}"],
                                          Path(work))  # fmt: skip
            rows += compare(label, results)
            speeds.append({"layout": label, "measured_s": results["step_time_s"],
                           "predicted_s": results["predicted_step_time_s"]})  # fmt: skip
    table = Table(title="planner vs measured, MiB per rank (measured / predicted, error)")
    for column in ("layout", "rank", "peak", *CATEGORIES, "other", "ok"):
        table.add_column(column)
    for row in rows:
        m, p, e = row["measured"], row["predicted"], row["errors"]
        cells = [
            f"{m[c] / MiB:.1f} / {p[c] / MiB:.1f} ({e[c]:+.0%})" for c in ("peak", *CATEGORIES)
        ]
        other = f"{m['other'] / MiB:.1f} / {p['other'] / MiB:.1f}"
        table.add_row(row["layout"], str(row["rank"]), *cells, other, "yes" if row["ok"] else "NO")
    speed_table = Table(title="step time, predicted vs measured")
    for column in ("layout", "measured s", "predicted s", "predicted / measured"):
        speed_table.add_column(column)
    for s in speeds:
        ratio = s["predicted_s"] / s["measured_s"] if s["predicted_s"] and s["measured_s"] else None
        speed_table.add_row(s["layout"], f"{s['measured_s']:.3f}",
                            f"{s['predicted_s']:.3f}" if s["predicted_s"] else "n/a",
                            f"{ratio:.2f}" if ratio else "n/a")  # fmt: skip
    console = Console(width=200)
    console.print(table)
    console.print(speed_table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"memory": rows, "speed": speeds}, indent=2))
    failed = [f"{r['layout']} rank {r['rank']}" for r in rows if not r["ok"]]
    console.print(f"{len(rows) - len(failed)} of {len(rows)} ranks within the bars"
                  + (f"; outside: {', '.join(failed)}" if failed else ""))  # fmt: skip


if __name__ == "__main__":
    main()
