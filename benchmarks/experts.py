"""Mixture of experts on this box, in one invocation:

1. how even the routers' loads get over a run under each way of balancing them
   (model.moe.load_balance: the sequence-wise auxiliary loss, DeepSeek-V3's biases, none),
   from each run's own metrics.jsonl (`moe_max_load`: the busiest expert's tokens over the
   mean, the worst layer's); one rank, fp32, meshrun's synthetic tokens: what moves the loads
   is the routers' training and the balancing alone;
2. expert parallelism on 2 gloo ranks: each rank's parameters and peak memory (measured by
   meshrun) with every expert on each rank (DDP), FSDP's shards of them, and ep2's half of
   them; and the all-to-alls' share of an ep2 step: meshrun's parallel model (parallelize,
   the same dispatch) stepped in a plain loop, the wall time inside all_to_all_single (the
   counts and the rows, both ways, the wait for the other rank included) over the step's.

    .venv/bin/python benchmarks/experts.py              # 200 steps of tiny-moe
    .venv/bin/python benchmarks/experts.py --steps 500
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import (
    SEED,
    Setup,
    accumulate,
    adamw,
    free_port,
    join_process_group,
    meshrun_results,
    model_config,
    step_tokens,
)
from rich.console import Console
from rich.table import Table

from meshrun.core.config import ParallelConfig
from meshrun.core.layout import Layout
from meshrun.models import build_model
from meshrun.rank.mesh import build_mesh
from meshrun.rank.parallel import parallelize
from meshrun.rank.train.data import SyntheticTokens

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


# tiny-moe widened so that the experts are most of the model: 8 experts of 512 a block, top
# 2, a shared one; 2 ranks, a step of 8 sequences of 256 in micro-batches of 2
EP_MODEL = {"dim": 256, "expert_ffn_dim": 512}
EP_SETUP = Setup("tiny-moe", 2, 8, 2, 8, 2, 256)
EP_LAYOUTS = {
    "ddp: every expert on each rank": ("parallel=ddp",),
    "fsdp: each expert's shard": ("parallel=fsdp",),
    "ep2: half of the experts": ("parallel=ep2",),
}


def memory_run(layout: str, work: Path) -> dict:
    s = EP_SETUP
    overrides = [
        "model=tiny-moe",
        f"model.dim={EP_MODEL['dim']}",
        f"model.moe.expert_ffn_dim={EP_MODEL['expert_ffn_dim']}",
        *EP_LAYOUTS[layout],
        f"launcher.nproc_per_node={s.ranks}",
        f"train.steps={s.steps}",
        f"train.untimed_steps={s.untimed_steps}",
        f"train.global_batch_size={s.global_batch_size}",
        f"train.micro_batch_size={s.micro_batch_size}",
        f"train.seq_len={s.seq_len}",
        "train.precision=fp32",
    ]
    return meshrun_results(overrides, work / layout.split(":", maxsplit=1)[0])


def ep_rank(rank: int, port: int, out: Path) -> None:
    """One rank of ep2 stepping meshrun's parallel model; rank 0 writes the timings."""
    s = EP_SETUP
    join_process_group(rank, s, port)
    cfg = model_config(s.model)
    cfg = dataclasses.replace(
        cfg,
        dim=EP_MODEL["dim"],
        moe=dataclasses.replace(cfg.moe, expert_ffn_dim=EP_MODEL["expert_ffn_dim"]),
    )
    parallel = ParallelConfig(name="ep2", dp_shard=s.ranks, ep=2)
    layout = Layout.of(parallel)
    model = parallelize(
        build_model(cfg, s.seq_len, "meta"),
        build_mesh(layout, "cpu"),
        layout,
        parallel,
        torch.device("cpu"),
        SEED,
        torch.float32,
    ).parts[0]
    optimizer = adamw(list(model.parameters()))
    data = SyntheticTokens(cfg.vocab_size, SEED)
    spent = [0.0]
    all_to_all = dist.all_to_all_single

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return all_to_all(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    dist.all_to_all_single = timed  # what models/moe.py's dispatch calls
    steps, exchanges = [], []
    for step in range(s.steps):
        start, spent[0] = time.perf_counter(), 0.0
        accumulate(model, step_tokens(data, s, step, rank, s.ranks), s.micro_batch_size)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= s.untimed_steps:
            steps.append(time.perf_counter() - start)
            exchanges.append(spent[0])
    if rank == 0:
        out.write_text(json.dumps({"steps": steps, "all_to_all": exchanges}))
    dist.barrier()
    dist.destroy_process_group()


def expert_parallelism(work: Path) -> None:
    s = EP_SETUP
    table = Table(
        title=f"expert parallelism: tiny-moe at dim {EP_MODEL['dim']}, 8 experts of "
        f"{EP_MODEL['expert_ffn_dim']}, {s.ranks} gloo ranks, fp32"
    )
    for column in ("layout", "params/rank MiB", "peak/rank MiB", "tokens/s"):
        table.add_column(column, justify="right")
    measured = {layout: memory_run(layout, work) for layout in EP_LAYOUTS}
    ddp = measured[next(iter(EP_LAYOUTS))]["memory_per_rank"][0]
    for layout, results in measured.items():
        mine = results["memory_per_rank"][0]
        table.add_row(
            layout,
            f"{mine['params'] / 2**20:.1f} ({mine['params'] / ddp['params']:.2f}x)",
            f"{mine['peak'] / 2**20:.1f} ({mine['peak'] / ddp['peak']:.2f}x)",
            f"{results['tokens_per_s']:,.0f}",
        )
    Console().print(table)
    out = work / "ep_steps.json"
    mp.spawn(ep_rank, args=(free_port(), out), nprocs=s.ranks)
    timed = json.loads(out.read_text())
    share = sum(timed["all_to_all"]) / sum(timed["steps"])
    print(
        f"ep2, rank 0: all_to_all_single took {share:.1%} of the step time "
        f"({statistics.median(timed['all_to_all']) * 1e3:.1f} of "
        f"{statistics.median(timed['steps']) * 1e3:.1f} ms a step, median over "
        f"{len(timed['steps'])} steps)"
    )


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
    with tempfile.TemporaryDirectory() as tmp:
        expert_parallelism(Path(tmp))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    main(parser.parse_args().steps)
