"""The loss without the whole fp32 logits (train.loss, issue 63) on this box: a step's peak
memory and activations, and tokens/s, of the default loss (auto: chunked on one rank,
vocab_parallel under tp2) against train.loss=full, with the planner's predicted peak beside
the measured one. Every figure is a `meshrun` run's own results.json (peak: the max over
ranks), all in one invocation, so the ratios share a host.

    .venv/bin/python benchmarks/loss_memory.py                 # issue 63's case
    .venv/bin/python benchmarks/loss_memory.py --vocab 32768   # another vocabulary
    .venv/bin/python benchmarks/loss_memory.py --rounds 3      # speed: median of 3 rounds

The case: model=tiny (dim 64) with a 65,536-token vocabulary, one micro-batch of 8 x 512
tokens a step, fp32: the logits (4,096 x 65,536 fp32, 1 GiB) and what the loss makes of them
are nearly all of a step's activations, so the activations' ratio is the loss's. The runs go
in rounds, each round every run once (auto and full alternating), and tokens/s is each run's
median over the rounds: on a shared host one round's speeds move by 20%.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from common import meshrun_results
from rich.console import Console
from rich.table import Table

MiB = 2**20
RUNS = {  # name: (layout, train.loss)
    "tp1 auto": ("parallel=single", "auto"),
    "tp1 full": ("parallel=single", "full"),
    "tp2 auto": ("parallel=tp2", "auto"),
    "tp2 full": ("parallel=tp2", "full"),
}
COMMON = (
    "model=tiny",
    "train.seq_len=512",
    "train.micro_batch_size=8",
    "train.global_batch_size=8",
    "train.steps=5",
    "train.untimed_steps=2",
    "launcher.threads_per_rank=1",
)


def main(vocab: int, rounds: int) -> None:
    table = Table(title=f"the loss: tiny, vocabulary {vocab:,}, micro-batch 8 x 512, fp32")
    columns = ("run", "loss", "peak MiB", "vs full", "activations MiB", "vs full")
    columns += ("predicted MiB", "pred / meas", "tokens/s", "vs full")
    for column in columns:
        table.add_column(column, justify="left" if column in ("run", "loss") else "right")
    runs: dict[str, list[dict]] = {name: [] for name in RUNS}
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(rounds):
            for name, (layout, loss) in RUNS.items():
                overrides = [*COMMON, f"model.vocab_size={vocab}", layout, f"train.loss={loss}"]
                work = Path(tmp) / f"{name.replace(' ', '-')}-{index}"
                runs[name].append(meshrun_results(overrides, work))
    results = {name: rs[0] | {"tokens_per_s": median_speed(rs)} for name, rs in runs.items()}
    for name, r in results.items():
        full = results[f"{name.split()[0]} full"]
        peak, activations = r["peak_memory_max_bytes"], r["memory_activations_bytes"]
        predicted, tps = r["predicted_peak_memory_bytes"], r["tokens_per_s"]
        table.add_row(
            name,
            r["loss"],
            f"{peak / MiB:,.0f}",
            f"{peak / full['peak_memory_max_bytes']:.2f}x",
            f"{activations / MiB:,.0f}",
            f"{activations / full['memory_activations_bytes']:.2f}x",
            f"{predicted / MiB:,.0f}" if predicted else "n/a",
            f"{predicted / peak:.2f}" if predicted else "n/a",
            f"{tps:,.0f}",
            f"{tps / full['tokens_per_s']:.2f}x",
        )
    Console().print(table)
    tp1, tp2 = results["tp1 auto"], results["tp2 auto"]
    ratio = tp2["memory_activations_bytes"] / tp1["memory_activations_bytes"]
    print(f"tp2's activations (vocab_parallel) / tp1's (chunked): {ratio:.2f}x")
    ratio = tp2["memory_activations_bytes"] / results["tp1 full"]["memory_activations_bytes"]
    print(f"tp2's activations (vocab_parallel) / tp1's (full): {ratio:.2f}x")


def median_speed(results: list[dict]) -> float:
    return statistics.median(r["tokens_per_s"] for r in results)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    main(args.vocab, args.rounds)
