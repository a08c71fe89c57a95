"""Context parallelism on this box: peak memory per rank and tokens/s of cp2 under each CP
method against one rank (cp1), at growing sequence lengths, and the planner's predicted peak
beside the measured one. Every figure is a `meshrun` run's own results.json (its peak is the
max over ranks, as the summary prints it), all in one invocation, so the ratios share a host.

    .venv/bin/python benchmarks/context_parallel.py              # seq 2048 4096 8192
    .venv/bin/python benchmarks/context_parallel.py 1024 16384   # other lengths
    .venv/bin/python benchmarks/context_parallel.py --cap-mib 256   # and the longest under it
    .venv/bin/python benchmarks/context_parallel.py 16384 --precision bf16   # a GPU's 16-bit

cp1 trains the whole sequence on one rank; cp2 trains the same global batch with each
sequence split over 2 ranks (each holding half the tokens). The activation share is what CP
is for: the ratio is reported, not assumed. The model is `tiny` (4 layers, 8 heads, 4 K/V
heads): its attention, not its weights, grows with the sequence. `--precision` (fp32 by
default): on CUDA, bf16 runs the chunk pairs on flash, fp32 on the memory-efficient kernel
(core/attention_kernels.py).

With `--cap-mib`, the longest sequence cp1 and cp2 (ring) each train with a measured peak
per rank under that cap: the sequence doubled from 512 tokens until a run's peak passes the
cap, then bisected to a multiple of 256 tokens, every point a run.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from common import meshrun_results
from rich.console import Console
from rich.table import Table

MiB = 2**20
LAYOUTS = {
    "cp1": ("parallel=single",),
    "cp2 ring": ("parallel=cp2", "parallel.cp_method=ring"),
    "cp2 allgather": ("parallel=cp2", "parallel.cp_method=allgather"),
    "cp2 alltoall": ("parallel=cp2", "parallel.cp_method=alltoall"),
}
COMMON = (
    "model=tiny",
    "train.steps=3",
    "train.untimed_steps=1",
    "train.global_batch_size=2",
    "train.micro_batch_size=2",
    "launcher.threads_per_rank=1",
)


def run(seq: int, name: str, work: Path, precision: str) -> dict:
    overrides = [*COMMON, f"train.precision={precision}", f"train.seq_len={seq}"]
    overrides += LAYOUTS[name]
    return meshrun_results(overrides, work / f"{seq}-{name.replace(' ', '-')}")


def main(seqs: list[int], precision: str) -> None:
    title = f"context parallelism: tiny, batch 2, {precision}, one thread a rank"
    table = Table(title=title)
    for column in (
        "seq",
        "layout",
        "peak MiB/rank",
        "vs cp1",
        "predicted MiB",
        "pred / meas",
        "tokens/s",
        "vs cp1",
    ):
        table.add_column(column, justify="left" if column == "layout" else "right")
    with tempfile.TemporaryDirectory() as tmp:
        for seq in seqs:
            base = None
            for name in LAYOUTS:
                r = run(seq, name, Path(tmp), precision)
                peak, tps = r["peak_memory_max_bytes"], r["tokens_per_s"]
                predicted = r["predicted_peak_memory_bytes"]
                base = base or (peak, tps)
                table.add_row(
                    str(seq),
                    name,
                    f"{peak / MiB:.1f}",
                    f"{peak / base[0]:.2f}x",
                    f"{predicted / MiB:.1f}" if predicted else "n/a",
                    f"{predicted / peak:.2f}" if predicted else "n/a",
                    f"{tps:,.0f}",
                    f"{tps / base[1]:.2f}x",
                )
    Console().print(table)


GRAIN = 256  # the longest sequence is found to this many tokens


def longest_under(cap: int, name: str, work: Path, precision: str) -> tuple[int, int]:
    """(seq, measured peak per rank): the longest multiple of GRAIN tokens `name` trains
    with its peak under `cap` bytes (0, 0 if not even GRAIN)."""
    peaks: dict[int, int] = {}

    def fits(seq: int) -> bool:
        peaks[seq] = run(seq, name, work, precision)["peak_memory_max_bytes"]
        return peaks[seq] <= cap

    fit, over = 0, 2 * GRAIN
    while fits(over):
        fit, over = over, 2 * over
    while over - fit > GRAIN:
        mid = (fit + over) // 2 // GRAIN * GRAIN
        fit, over = (mid, over) if fits(mid) else (fit, mid)
    return fit, peaks.get(fit, 0)


def main_cap(cap_mib: int, precision: str) -> None:
    table = Table(title=f"the longest sequence under {cap_mib} MiB a rank (measured peaks)")
    for column in ("layout", "longest seq", "its peak MiB/rank", "vs cp1"):
        table.add_column(column, justify="left" if column == "layout" else "right")
    with tempfile.TemporaryDirectory() as tmp:
        base = None
        for name in ("cp1", "cp2 ring"):
            seq, peak = longest_under(cap_mib * MiB, name, Path(tmp), precision)
            base = base or seq
            table.add_row(name, str(seq), f"{peak / MiB:.1f}", f"{seq / base:.2f}x")
    Console().print(table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("seqs", nargs="*", type=int, default=[2048, 4096, 8192])
    parser.add_argument("--cap-mib", type=int, help="also the longest sequence under this cap")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    args = parser.parse_args()
    main(args.seqs, args.precision)
    if args.cap_mib:
        main_cap(args.cap_mib, args.precision)
