"""What train.float8 costs on a CPU: the same `meshrun` run (model=small, bf16) with float8 off
and on, on one rank and under FSDP2 over 2 gloo ranks, in ABAB rounds (off, then on); and
one of small's linears alone, forward and backward, split into its matmuls and its casts.

A CPU has no float8 units: torch's CPU `_scaled_mm` dequantizes and multiplies, slower than
the bf16 matmul it replaces, and torchao's casts (amax, scale, clamp, cast: op by op without
torch.compile) come on top. float8 is slower here by design; what runs here is the GPU's
numerics (every layout's parity is checked on it: tests/test_float8.py), and what the GPU
gains is the planner's to predict (docs/planner.md, "Float8 rows").

Per layout and round: tokens/s of each side, their ratio (float8 / bf16), the largest
relative loss difference a step (float8 rounds its operands: meshrun-verify's
high-precision bound, FLOAT8_LOSS_BOUND, applies) and the CPU seconds other processes took
(`*`: more than 1 s, rerun). Writes outputs/benchmarks/float8_cpu.json.

    .venv/bin/python benchmarks/float8_cpu.py              # ~5 min on 2 idle cores
    .venv/bin/python benchmarks/float8_cpu.py --rounds 1 --layouts single
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from common import CONTENDED_CPU_S, meshrun_results, with_others_cpu
from rich.console import Console
from rich.table import Table
from torch import nn

from meshrun.core.config import Float8Config
from meshrun.core.paths import REPO_ROOT
from meshrun.driver.tool_config import FLOAT8_LOSS_BOUND
from meshrun.rank.parallel.float8 import convert

LAYOUTS = {"single": ["parallel=single"], "fsdp": ["parallel=fsdp"]}
console = Console()


def measure(overrides: list[str]) -> dict[str, Any]:
    """One run's figures and the CPU seconds other processes took while it ran."""
    with tempfile.TemporaryDirectory(prefix="float8_cpu_") as work:
        results, other = with_others_cpu(lambda: meshrun_results(overrides, Path(work)))
    return {
        "tokens_per_s": results["tokens_per_s"],
        "losses": results["losses"],
        "float8_linears": results.get("float8_linears"),
        "float8_flops_share": results.get("float8_flops_share"),
        "other_cpu_s": other,
    }


def run_layout(layout: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    common = [
        "model=small",
        *LAYOUTS[layout],
        f"train.steps={args.steps}",
        "train.untimed_steps=2",
        "train.precision=bf16",
        "train.seed=0",
    ]
    rounds = []
    for index in range(args.rounds):
        bf16 = measure(common)
        float8 = measure([*common, "train.float8.enabled=true"])
        pairs = zip(float8["losses"], bf16["losses"], strict=True)
        rounds.append(
            {
                "round": index + 1,
                "bf16": bf16,
                "float8": float8,
                "ratio": float8["tokens_per_s"] / bf16["tokens_per_s"],
                "loss_apart": max(abs(f - b) / b for f, b in pairs),
            }
        )
        console.print(
            f"{layout} round {index + 1}/{args.rounds}: {bf16['tokens_per_s']:,.0f} bf16, "
            f"{float8['tokens_per_s']:,.0f} float8 tok/s, ratio {rounds[-1]['ratio']:.3f}"
        )
    return rounds


def _seconds(run, repeats: int = 10) -> float:
    """Median seconds of `run()`, after one call to warm it."""
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def one_linear(tokens: int = 1024, inp: int = 384, out: int = 1024) -> dict[str, float]:
    """small's w1 (384 -> 1024) over a micro-batch of 2 x 512 tokens, forward and backward,
    on one thread: bf16 under autocast against float8 (tensorwise), and float8's parts: its
    three scaled matmuls alone, and the rest (casts)."""
    torch.set_num_threads(1)
    x = torch.randn(tokens, inp, requires_grad=True)
    linear = nn.Sequential(nn.Linear(inp, out, bias=False))

    def step(module: nn.Module) -> float:
        def run() -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                module(x).float().sum().backward()

        return _seconds(run)

    bf16 = step(linear)
    convert(linear, Float8Config(enabled=True), under_fsdp=False)
    float8 = step(linear)
    a = torch.randn(tokens, inp).to(torch.float8_e4m3fn)
    w = torch.randn(out, inp).to(torch.float8_e4m3fn)
    g = torch.randn(tokens, out).to(torch.float8_e5m2)
    one = torch.tensor(1.0)
    gemms = (
        (a, w.t()),  # output
        (g, w.t().contiguous().t()),  # input gradient
        (g.t().contiguous(), a.t().contiguous().t()),  # weight gradient
    )
    matmuls = sum(
        _seconds(lambda p=p: torch._scaled_mm(p[0], p[1], one, one, out_dtype=torch.bfloat16))
        for p in gemms
    )
    return {"bf16_s": bf16, "float8_s": float8, "float8_matmuls_s": matmuls}


def print_table(results: dict[str, list[dict[str, Any]]]) -> None:
    table = Table(title="float8 on a CPU: meshrun model=small, bf16, float8 off vs on")
    for column in (
        "layout",
        "bf16 tok/s",
        "float8 tok/s",
        "ratio (median)",
        "per round",
        "loss apart",
    ):
        table.add_column(column, justify="left" if column == "layout" else "right")
    for layout, rounds in results.items():
        marked = [
            f"{r['ratio']:.2f}"
            + (
                "*"
                if max(r["bf16"]["other_cpu_s"], r["float8"]["other_cpu_s"]) > CONTENDED_CPU_S
                else ""
            )
            for r in rounds
        ]
        table.add_row(
            layout,
            f"{statistics.median(r['bf16']['tokens_per_s'] for r in rounds):,.0f}",
            f"{statistics.median(r['float8']['tokens_per_s'] for r in rounds):,.0f}",
            f"{statistics.median(r['ratio'] for r in rounds):.3f}",
            " ".join(marked),
            f"{max(r['loss_apart'] for r in rounds):.1e} (bound {FLOAT8_LOSS_BOUND:.1e})",
        )
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    args = parser.parse_args()
    linear = one_linear()
    console.print(
        f"one linear (1024 tokens, 384 -> 1024), forward + backward on one thread: bf16 "
        f"{linear['bf16_s'] * 1e3:.2f} ms, float8 {linear['float8_s'] * 1e3:.2f} ms "
        f"({linear['float8_s'] / linear['bf16_s']:.1f}x), of which its three scaled matmuls "
        f"{linear['float8_matmuls_s'] * 1e3:.2f} ms"
    )
    results = {layout: run_layout(layout, args) for layout in args.layouts}
    print_table(results)
    out = REPO_ROOT / "outputs" / "benchmarks" / "float8_cpu.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"one_linear": linear, "layouts": results}, indent=2))


if __name__ == "__main__":
    main()
