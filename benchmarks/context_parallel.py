"""Context parallelism on this box: peak memory per rank and tokens/s of cp2 under each CP
method against one rank (cp1), at growing sequence lengths, and the planner's predicted peak
beside the measured one. Every figure is a `meshrun` run's own results.json (its peak is the
max over ranks, as the summary prints it), all in one invocation, so the ratios share a host.

    .venv/bin/python benchmarks/context_parallel.py              # seq 1024 2048 4096
    .venv/bin/python benchmarks/context_parallel.py 2048 8192    # other lengths

cp1 trains the whole sequence on one rank; cp2 trains the same global batch with each
sequence split over 2 ranks (each holding half the tokens). The activation share is what CP
is for: the ratio is reported, not assumed. The model is `tiny` (4 layers, 8 heads, 4 K/V
heads): its attention, not its weights, grows with the sequence.
"""

from __future__ import annotations

import sys
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
    "train.precision=fp32",
    "launcher.threads_per_rank=1",
)


def run(seq: int, name: str, work: Path) -> dict:
    overrides = [*COMMON, f"train.seq_len={seq}", *LAYOUTS[name]]
    return meshrun_results(overrides, work / f"{seq}-{name.replace(' ', '-')}")


def main(seqs: list[int]) -> None:
    table = Table(title="context parallelism: tiny, batch 2, fp32, one thread a rank")
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
                r = run(seq, name, Path(tmp))
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


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1024, 2048, 4096])
