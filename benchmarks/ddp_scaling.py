"""Where DDP's weak scaling goes on this host: the step of one rank alone, of N ranks that
compute without synchronizing, and of DDP, in the same processes, step by step.

meshrun's scaling efficiency (results.json) is the run's tokens/s over N times its
single-device baseline's, the baseline trained beside the run by rank 0 between its steps
while the other ranks wait (rank/train/baseline_beside.py). This script splits the gap into
its two causes, each step of each mode in turn in the same N gloo ranks (so drift of the host
hits all alike):

- **solo**: rank 0 trains its share of the batch on a plain model while the others wait at a
  barrier (what meshrun's baseline beside the run measures);
- **nosync**: every rank trains its share on its plain model at once, with no gradient sync
  at all: N ranks computing beside each other;
- **ddp**: torch's DistributedDataParallel as meshrun builds it (`bucket_cap_mb`, and
  `gradient_as_bucket_view` with `--bucket-view`): the gradients all-reduced once a step,
  in buckets, overlapped with the last micro-batch's backward.

solo / nosync is what N ranks lose to each other on the host's cores, caches and memory;
nosync / ddp what the all-reduce costs beside compute; solo / ddp the efficiency. A plain
gloo all-reduce of the gradients (one flat tensor) is timed alone too: its wall and its CPU
seconds per rank. `--meshrun N` adds N runs of `meshrun parallel=ddp` with the same setup and
prints the scaling efficiency each reports. AdamW is torch's fused kernel on every mode, as
meshrun steps it (train.optim.step_kernels), so the step being scaled is meshrun's.
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
import torch.distributed as dist
import torch.multiprocessing as mp
from common import (
    GRAD_CLIP,
    SEED,
    Setup,
    accumulate,
    adamw,
    console,
    free_port,
    join_process_group,
    meshrun_overrides,
    meshrun_results,
    model_config,
    seeded_model,
    step_tokens,
)
from rich.table import Table
from torch.nn.parallel import DistributedDataParallel

from meshrun.core.paths import REPO_ROOT
from meshrun.rank.train.data import SyntheticTokens

MODES = ("solo", "nosync", "ddp")
OUT = REPO_ROOT / "outputs" / "benchmarks" / "ddp_scaling.json"


def _allreduce_cost(numel: int, repeats: int = 10) -> tuple[float, float]:
    """(wall s, this rank's CPU s) of one gloo all-reduce of `numel` float32: the mean of
    `repeats` after 3 untimed."""
    flat = torch.ones(numel)
    for _ in range(3):
        dist.all_reduce(flat)
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(repeats):
        dist.all_reduce(flat)
    return (time.perf_counter() - wall) / repeats, (time.process_time() - cpu) / repeats


def rank_main(rank: int, setup: Setup, port: int, args: argparse.Namespace, out: Path) -> None:
    join_process_group(rank, setup, port)
    model_cfg = model_config(setup.model)
    data = SyntheticTokens(model_cfg.vocab_size, SEED)
    model = seeded_model(model_cfg, setup)
    ddp = DistributedDataParallel(
        model, bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=args.bucket_view
    )
    optimizer = adamw(list(model.parameters()), fused=True)
    local = seeded_model(model_cfg, setup)  # solo's (rank 0) and nosync's (every rank)
    local_optimizer = adamw(list(local.parameters()), fused=True)
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for step in range(setup.steps):
        tokens = step_tokens(data, setup, step, rank, setup.ranks)
        for mode in MODES:
            dist.barrier()
            started = time.perf_counter()
            if mode == "ddp":
                accumulate(ddp, tokens, setup.micro_batch_size, ddp.no_sync)
                _step(model, optimizer)
            elif mode == "nosync" or rank == 0:
                accumulate(local, tokens, setup.micro_batch_size)
                _step(local, local_optimizer)
            if step >= setup.untimed_steps:
                times[mode].append(time.perf_counter() - started)
    wall, cpu = _allreduce_cost(sum(p.numel() for p in model.parameters()))
    if rank == 0:
        out.write_text(
            json.dumps({"times": times, "allreduce_wall_s": wall, "allreduce_cpu_s": cpu})
        )
    dist.barrier()
    dist.destroy_process_group()


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def meshrun_efficiency(setup: Setup, args: argparse.Namespace) -> dict[str, Any]:
    """One `meshrun parallel=ddp` run with the same setup: its scaling efficiency (against
    its baseline, measured alongside)."""
    overrides = [
        *meshrun_overrides(setup, "ddp"),
        f"parallel.ddp.bucket_cap_mb={args.bucket_cap_mb}",
        f"parallel.ddp.gradient_as_bucket_view={args.bucket_view}",
    ]
    with tempfile.TemporaryDirectory(prefix="ddp_scaling_") as tmp:
        results = meshrun_results(overrides, Path(tmp), baseline=True)
    keys = (
        "scaling_efficiency",
        "speedup_p10",
        "speedup_p90",
        "step_time_s",
        "host_other_cpu_share",
    )
    return {key: results[key] for key in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=18)
    parser.add_argument("--untimed-steps", type=int, default=3)
    parser.add_argument("--per-rank-batch", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--bucket-view", action="store_true")
    parser.add_argument(
        "--meshrun", type=int, default=0, metavar="N", help="also N meshrun parallel=ddp runs"
    )
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    batch = args.per_rank_batch * args.ranks
    setup = Setup(
        args.model,
        args.ranks,
        args.steps,
        args.untimed_steps,
        batch,
        args.micro_batch_size,
        args.seq_len,
    )
    with tempfile.TemporaryDirectory(prefix="ddp_scaling_") as tmp:
        out = Path(tmp) / "ranks.json"
        mp.spawn(rank_main, args=(setup, free_port(), args, out), nprocs=setup.ranks)
        raw = json.loads(out.read_text())
    median = {mode: statistics.median(raw["times"][mode]) for mode in MODES}
    table = Table(
        title=f"DDP weak scaling, {setup.model} on {setup.ranks} gloo ranks, "
        f"{args.per_rank_batch} samples a rank, {len(raw['times']['ddp'])} "
        "steps a mode"
    )
    for column in ("mode", "median step s", "solo / mode"):
        table.add_column(column, justify="right")
    for mode in MODES:
        table.add_row(mode, f"{median[mode]:.3f}", f"{median['solo'] / median[mode]:.3f}")
    console.print(table)
    console.print(
        f"ranks beside each other (solo / nosync) {median['solo'] / median['nosync']:.3f}; "
        f"the all-reduce beside compute (nosync / ddp) {median['nosync'] / median['ddp']:.3f}; "
        f"one gloo all-reduce of the gradients alone: {1e3 * raw['allreduce_wall_s']:.1f} ms "
        f"wall, {1e3 * raw['allreduce_cpu_s']:.1f} ms CPU a rank"
    )
    runs = [meshrun_efficiency(setup, args) for _ in range(args.meshrun)]
    for run in runs:
        console.print(
            f"meshrun parallel=ddp: scaling efficiency {run['scaling_efficiency']:.3f} "
            f"(speedup p10-p90 {run['speedup_p10']:.2f}-{run['speedup_p90']:.2f}), "
            f"others' CPU share {run['host_other_cpu_share']:.0%}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "ddp_scaling",
        "setup": vars(args) | {"out": str(args.out)},
        "torch": torch.__version__,
        "median_step_s": median,
        "raw": raw,
        "meshrun": runs,
    }
    args.out.write_text(json.dumps(record, indent=2))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
