"""The planner against measurement: for each (model, layout) of the accuracy set, one real
meshrun run (gloo, this host) and the predictions its results.json carries beside the
measurement: the formulas' (plan/memory.py), and the rank's parallel module traced on fake
tensors (plan/traced.py, `plan.trace=true`), which is the only prediction for a user's own
module (model=custom).

Prints, per rank, measured/predicted MiB and the relative error of the peak and of each
category, the traced peak's error beside it, FLOPs per token by formula and as torch counts
them, and step time predicted vs measured; writes outputs/benchmarks/planner_accuracy.json.
The bar: peak within 10%, params/grads/optimizer/activations within 15%.

    .venv/bin/python benchmarks/planner_accuracy.py            # ~8 min on 2 cores
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
# The other models at `small`'s sizes (384 wide, 4 layers), each under a layout of each kind
# it takes (GPT-2 ties its head: no pipeline).
MODELS = {
    "hf/llama": (
        [
            "model=hf/tiny-llama",
            "model.config.hidden_size=384",
            "model.config.intermediate_size=1024",
            "model.config.num_attention_heads=6",
            "model.config.num_key_value_heads=2",
            "model.config.vocab_size=512",
        ],
        ("single", "fsdp", "tp2", "pp2 1f1b"),
    ),
    "hf/gpt2": (
        [
            "model=hf/tiny-gpt2",
            "model.config.n_embd=384",
            "model.config.n_head=6",
            "model.config.n_positions=1024",
        ],
        ("single", "fsdp", "tp2"),
    ),
    "custom": (
        [
            "model=custom",
            "model.target=tests.user_model:build",
            "+model.kwargs.dim=384",
            "+model.kwargs.heads=6",
            "model.layers=blocks",
            "model.embedding=embed",
            "model.norm=norm",
            "model.head=head",
            "model.tp_plan=tests.user_model:tp_plan",
        ],
        ("single", "fsdp", "tp2", "pp2 1f1b"),
    ),
}


def runs(models: list[str]) -> list[tuple[str, list[str]]]:
    """(label, overrides) of every run of the set, for `models` ("small" and MODELS' keys)."""
    out = []
    if "small" in models:
        out += [
            (
                f"small {name}, ckpt {ckpt}",
                [*overrides, f"parallel.activation_checkpointing={ckpt}"],
            )
            for name, overrides in LAYOUTS.items()
            for ckpt in CHECKPOINTING
        ]
    for model, (overrides, layouts) in MODELS.items():
        if model in models:
            out += [(f"{model} {name}", [*overrides, *LAYOUTS[name]]) for name in layouts]
    return out


def relative(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured else float("nan")


def compare(label: str, results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    traced = results["memory_traced"] or [None] * len(results["memory_per_rank"])
    for measured, predicted, trace in zip(
        results["memory_per_rank"], results["memory_predicted"], traced, strict=True
    ):
        errors = {c: relative(predicted[c], measured[c]) for c in ("peak", *CATEGORIES)}
        rows.append(
            {
                "layout": label,
                "rank": measured["rank"],
                "measured": measured,
                "predicted": predicted,
                "errors": errors,
                "traced": trace,
                "traced_peak_error": relative(trace["peak"], measured["peak"]),
                "ok": abs(errors["peak"]) <= PEAK_BAR
                and all(abs(errors[c]) <= CATEGORY_BAR for c in CATEGORIES),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument(
        "--models",
        default=",".join(["small", *MODELS]),
        help="comma-separated: small and/or " + ", ".join(MODELS),
    )
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / "outputs/benchmarks/planner_accuracy.json"
    )
    args = parser.parse_args()
    rows, speeds = [], []
    for label, overrides in runs(args.models.split(",")):
        with tempfile.TemporaryDirectory() as work:
            results = meshrun_results(
                [*overrides, f"train.steps={args.steps}", "plan.trace=true"], Path(work)
            )
        rows += compare(label, results)
        speeds.append(
            {
                "layout": label,
                "measured_s": results["step_time_s"],
                "predicted_s": results["predicted_step_time_s"],
                "flops_per_token": results["flops_per_token"],
                "flops_per_token_counted": results["flops_per_token_counted"],
            }
        )
    table = Table(title="planner vs measured, MiB per rank (measured / predicted, error)")
    for column in ("layout", "rank", "peak", *CATEGORIES, "other", "traced peak", "ok"):
        table.add_column(column)
    for row in rows:
        m, p, e = row["measured"], row["predicted"], row["errors"]
        cells = [
            f"{m[c] / MiB:.1f} / {p[c] / MiB:.1f} ({e[c]:+.0%})" for c in ("peak", *CATEGORIES)
        ]
        other = f"{m['other'] / MiB:.1f} / {p['other'] / MiB:.1f}"
        traced = f"{row['traced']['peak'] / MiB:.1f} ({row['traced_peak_error']:+.0%})"
        table.add_row(
            row["layout"], str(row["rank"]), *cells, other, traced, "yes" if row["ok"] else "NO"
        )
    speed_table = Table(title="step time, predicted vs measured")
    for column in (
        "layout",
        "measured s",
        "predicted s",
        "predicted / measured",
        "FLOPs/token formula",
        "counted",
    ):
        speed_table.add_column(column)
    for s in speeds:
        ratio = s["predicted_s"] / s["measured_s"] if s["predicted_s"] and s["measured_s"] else None
        speed_table.add_row(
            s["layout"],
            f"{s['measured_s']:.3f}",
            f"{s['predicted_s']:.3f}" if s["predicted_s"] else "n/a",
            f"{ratio:.2f}" if ratio else "n/a",
            f"{s['flops_per_token']:.3g}",
            f"{s['flops_per_token_counted']:.3g}",
        )
    console = Console(width=200)
    console.print(table)
    console.print(speed_table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"memory": rows, "speed": speeds}, indent=2))
    failed = [f"{r['layout']} rank {r['rank']}" for r in rows if not r["ok"]]
    console.print(
        f"{len(rows) - len(failed)} of {len(rows)} ranks within the bars"
        + (f"; outside: {', '.join(failed)}" if failed else "")
    )


if __name__ == "__main__":
    main()
