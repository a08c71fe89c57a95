"""The planner against measurement: for each (model, layout) of the accuracy set, one real
meshrun run (gloo, this host) and the predictions its results.json carries beside the
measurement: the formulas' (plan/memory.py), and the rank's parallel module traced on fake
tensors (plan/traced.py, `plan.trace=true`), which is the only prediction for a user's own
module (model=custom).

Prints, per rank, measured/predicted MiB and the relative error of the peak and of each
category, the traced peak's error beside it, FLOPs per token by formula and as torch counts
them, and step time predicted vs measured; writes outputs/benchmarks/planner_accuracy.json.
The bar: peak within 10%, params/grads/optimizer/activations within 15%.

    .venv/bin/python -m benchmarks.planner_accuracy               # ~12 min on 2 cores
    .venv/bin/python -m benchmarks.planner_accuracy --only speed  # step times, ~4 min

Step times (SPEED_LAYOUTS, model=small): measured against the speed model's prediction
without calibration (the host's matmul probe, by FLOPs) and with this host's calibration
(`meshrun-plan calibrate`: by shapes with measured rates, the eager ops' dispatch, gloo's
measured link): the ratio per layout, the median ratio and Spearman's rho over the set.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from benchmarks.common import meshrun_results
from meshrun.core.calibration import Calibration, calibration_path, read_calibration
from meshrun.core.paths import REPO_ROOT
from meshrun.driver.trial_ranking import spearman
from meshrun.plan import predict
from meshrun.plan.candidate import host_flops
from tests.helpers import resolved_config

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


# The step-time set: every kind of layout on this host's ranks, each checkpointing policy.
SPEED_LAYOUTS = {
    "single": ["parallel=single"],
    "ddp": ["parallel=ddp"],
    "fsdp": ["parallel=fsdp"],
    "hsdp 2x2": ["parallel=hsdp", "launcher.nproc_per_node=4"],
    "tp2": ["parallel=tp2"],
    "tp2 sp": ["parallel=tp2", "parallel.sequence_parallel=true"],
    "pp2 1f1b": ["parallel=pp2", "parallel.schedule=1f1b"],
    "pp2 gpipe": ["parallel=pp2", "parallel.schedule=gpipe"],
    "tp2_pp2": ["parallel=tp2_pp2"],
    "cp2 ring": ["parallel=cp2", "train.seq_len=512", "train.global_batch_size=4"],
    "ddp ckpt full": ["parallel=ddp", "parallel.activation_checkpointing=full"],
    "ddp ckpt selective": ["parallel=ddp", "parallel.activation_checkpointing=selective"],
    "fsdp ckpt op": ["parallel=fsdp", "parallel.activation_checkpointing=op"],
}
SPEED_STEPS = 10


def speed_accuracy(console: Console, work: Path) -> dict[str, Any]:
    """Each SPEED_LAYOUTS run of model=small measured (plan.calibration=none), beside its
    prediction without and with this host's calibration (`meshrun-plan calibrate` for each
    rank count, run first): per layout the ratio, over the set the median ratio and the
    Spearman correlation of predicted and measured step times."""
    calibrations: dict[int, Calibration] = {}
    rows = []
    for label, overrides in SPEED_LAYOUTS.items():
        given = ["model=small", *overrides]
        cfg = resolved_config(*given, f"store.path={work / 'meshrun.db'}", "plan.calibration=none")
        ranks = cfg.launcher.nproc_per_node
        if ranks not in calibrations:
            calibrations[ranks] = _calibrate(work, ranks)
        results = meshrun_results(
            [*given, f"train.steps={SPEED_STEPS}", "plan.calibration=none"], work / label
        )
        plain = predict.speed(cfg, host_flops(cfg))
        calibrated = predict.speed(cfg, host_flops(cfg), calibrations[ranks])
        rows.append(
            {
                "layout": label,
                "ranks": ranks,
                "measured_s": results["step_time_s"],
                "predicted_s": plain.step_time_s,
                "calibrated_s": calibrated.step_time_s,
                "calibrated_parts": calibrated.step_parts(),
            }
        )
    summary = {}
    for key in ("predicted_s", "calibrated_s"):
        ratios = [r[key] / r["measured_s"] for r in rows]
        summary[key] = {
            "median_ratio": statistics.median(ratios),
            "spearman": spearman([r[key] for r in rows], [r["measured_s"] for r in rows]),
        }
    table = Table(title=f"step time of model=small, predicted vs measured ({SPEED_STEPS} steps)")
    for column in ("layout", "ranks", "measured", "predicted", "ratio", "calibrated", "ratio"):
        table.add_column(column)
    for r in rows:
        table.add_row(
            r["layout"],
            str(r["ranks"]),
            f"{r['measured_s'] * 1e3:.0f} ms",
            f"{r['predicted_s'] * 1e3:.0f} ms",
            f"{r['predicted_s'] / r['measured_s']:.2f}",
            f"{r['calibrated_s'] * 1e3:.0f} ms",
            f"{r['calibrated_s'] / r['measured_s']:.2f}",
        )
    console.print(table)
    for key, name in (("predicted_s", "without calibration"), ("calibrated_s", "calibrated")):
        rho = summary[key]["spearman"]
        console.print(
            f"{name}: median predicted/measured {summary[key]['median_ratio']:.2f}, Spearman "
            + (f"{rho:.2f}" if rho is not None else "n/a")
        )
    return {"layouts": rows, "summary": summary, "calibrations": calibrations}


def _calibrate(work: Path, ranks: int) -> Calibration:
    """`meshrun-plan calibrate` for `ranks` ranks, its profile beside a store of its own."""
    store = work / f"calibration-{ranks}" / "meshrun.db"
    command = [
        sys.executable,  # `-m`: runs where meshrun is not installed, with PYTHONPATH=src
        "-m",
        "meshrun.tools.plan.main",
        "calibrate",
        "model=small",
        f"launcher.nproc_per_node={ranks}",
        f"store.path={store}",
    ]
    subprocess.run(command, check=True, capture_output=True, cwd=REPO_ROOT)
    found = read_calibration(calibration_path(str(store)))
    assert found is not None
    return found


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
    parser.add_argument(
        "--only", choices=("memory", "speed"), help="one part of the set (default: both)"
    )
    args = parser.parse_args()
    console = Console(width=200)
    record: dict[str, Any] = {}
    if args.only != "memory":
        with tempfile.TemporaryDirectory() as work:
            speed = speed_accuracy(console, Path(work))
        speed["calibrations"] = {n: c.as_dict() for n, c in speed["calibrations"].items()}
        record["step_time"] = speed
    if args.only != "speed":
        record |= memory_accuracy(console, args.models.split(","), args.steps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2))


def memory_accuracy(console: Console, models: list[str], steps: int) -> dict[str, Any]:
    """The memory set (with plan.trace's traced peaks), and its step times by FLOPs."""
    rows, speeds = [], []
    for label, overrides in runs(models):
        with tempfile.TemporaryDirectory() as work:
            results = meshrun_results(
                [*overrides, f"train.steps={steps}", "plan.trace=true"], Path(work)
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
    console.print(_memory_table(rows))
    console.print(_speed_table(speeds))
    failed = [f"{r['layout']} rank {r['rank']}" for r in rows if not r["ok"]]
    console.print(
        f"{len(rows) - len(failed)} of {len(rows)} ranks within the bars"
        + (f"; outside: {', '.join(failed)}" if failed else "")
    )
    return {"memory": rows, "speed": speeds}


def _memory_table(rows: list[dict[str, Any]]) -> Table:
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
    return table


def _speed_table(speeds: list[dict[str, Any]]) -> Table:
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
    return speed_table


if __name__ == "__main__":
    main()
