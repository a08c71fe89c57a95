"""What train.compile buys: the same `meshrun` run (model=small by default, 2 gloo ranks)
with and without torch.compile of its decoder blocks, under DDP and TP, in ABAB rounds
(uncompiled, then compiled; slow drift of the machine hits both alike).

Per layout and round: tokens/s of each side and their ratio (compiled / uncompiled: above 1,
compile is faster), the seconds the compiled run spent compiling (its `compile_s`, in no
step time; later rounds find inductor's on-disk cache warm), the largest loss difference
between the sides (same seed, batch and steps: only kernels' reordered float sums may move
it) and the CPU seconds other processes took while each side ran (a round marked `*` had
more than 1 s: rerun). The median ratio per layout is the result. Writes
outputs/benchmarks/compile_speedup.json.

`--paired` compares step by step instead, for a shared machine where whole runs minutes apart
see different loads: both trainings (meshrun's own build_training and train_step) live in the
same two gloo ranks and take turns, one step each; the ratio of each pair of timed steps
(ranks level at a barrier before and after each) and their median.

    .venv/bin/python benchmarks/compile_speedup.py               # ~6 min on 2 idle cores
    .venv/bin/python benchmarks/compile_speedup.py --layouts ddp --rounds 3
    .venv/bin/python benchmarks/compile_speedup.py --paired     # ~3 min
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import CONTENDED_CPU_S, free_port, meshrun_results, with_others_cpu
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from meshrun.core.config import ExperimentConfig, from_dict
from meshrun.core.hardware import HostFacts
from meshrun.core.layout import Layout, dp_rank
from meshrun.core.paths import CONF_DIR, REPO_ROOT
from meshrun.driver.resolve import resolve
from meshrun.driver.schemas import register_schemas
from meshrun.models import model_shape
from meshrun.rank.mesh import build_mesh, dp_group, pp_group
from meshrun.rank.metrics.memory import MemoryMeter
from meshrun.rank.train.build import build_training
from meshrun.rank.train.data import LocalBatches, build_streams
from meshrun.rank.train.loop import LoopContext, train_step
from meshrun.rank.train.pending import PendingSteps

LAYOUTS = {"ddp": ["parallel=ddp"], "tp2": ["parallel=tp2", "train.micro_batch_size=4"]}
console = Console()


def measure(overrides: list[str]) -> dict[str, Any]:
    """One run's figures and the CPU seconds other processes took while it ran."""
    with tempfile.TemporaryDirectory(prefix="compile_speedup_") as work:
        results, other = with_others_cpu(lambda: meshrun_results(overrides, Path(work)))
    return {
        "tokens_per_s": results["tokens_per_s"],
        "step_time_s": results["step_time_s"],
        "compile_s": results["compile_s"],
        "losses": results["losses"],
        "other_cpu_s": other,
    }


def run_layout(layout: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    common = [
        f"model={args.model}",
        *LAYOUTS[layout],
        f"train.steps={args.steps}",
        f"train.seq_len={args.seq_len}",
        "train.precision=fp32",
        "train.seed=0",
    ]
    rounds = []
    for index in range(args.rounds):
        eager = measure([*common, "train.compile=false"])
        compiled = measure([*common, "train.compile=true"])
        diff = max(abs(a - b) for a, b in zip(eager["losses"], compiled["losses"], strict=True))
        rounds.append(
            {
                "round": index + 1,
                "eager": eager,
                "compiled": compiled,
                "ratio": compiled["tokens_per_s"] / eager["tokens_per_s"],
                "loss_diff": diff,
            }
        )
        console.print(
            f"{layout} round {index + 1}/{args.rounds}: {eager['tokens_per_s']:,.0f} "
            f"-> {compiled['tokens_per_s']:,.0f} tok/s, ratio {rounds[-1]['ratio']:.3f}, "
            f"compile {compiled['compile_s']:.1f} s"
        )
    return rounds


def resolved(overrides: list[str], work: Path) -> ExperimentConfig:
    """`meshrun <overrides>`'s config, resolved on this host (as the driver does); its run
    dir and store in `work` (nothing is written there: no driver runs)."""
    register_schemas()
    where = [f"run_dir={work}", f"store.path={work / 'meshrun.db'}", "logger=none"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = OmegaConf.to_object(compose(config_name="train", overrides=[*where, *overrides]))
    return resolve(cfg, HostFacts.detect()).config


def _paired_rank(rank: int, cfgs: dict[str, dict], port: int, pairs: int, out: Path) -> None:
    """Both trainings on this rank, one step each in turn; rank 0 writes the step times."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)  # a rank's share of 2 cores, as meshrun's launcher gives it
    dist.init_process_group("gloo")
    device = torch.device("cpu")
    sides = {}
    for name, raw in cfgs.items():
        cfg = from_dict(raw)
        layout, t = Layout.of(cfg.parallel), cfg.train
        mesh = build_mesh(layout, "cpu")
        vocab_size = model_shape(cfg.model).vocab_size
        data, _ = build_streams(cfg.data, cfg.resolved.data_cache, vocab_size, t.seed, t.seq_len)
        ctx = LoopContext(
            device=device,
            dp_group=dp_group(mesh),
            pp_group=pp_group(mesh, layout),
            autocast_dtype=None,
            memory=MemoryMeter([device]),
            on_log=lambda _: None,
            pending=PendingSteps(device, 0),
        )
        batches = LocalBatches(
            data, t.global_batch_size, t.seq_len, dp_rank(layout, rank), layout.dp_size, device
        )
        sides[name] = (build_training(cfg, layout, device, mesh), batches, t, ctx)
    times: dict[str, list[float]] = {name: [] for name in sides}
    losses: dict[str, list[float]] = {name: [] for name in sides}
    for step in range(UNTIMED_PAIRS + pairs):
        for name, (training, batches, t, ctx) in sides.items():
            dist.barrier()
            started = time.perf_counter()
            loss, _, _ = train_step(
                training.model, training.optimizer, training.schedule, batches, step, t, ctx
            )
            dist.barrier()
            if step >= UNTIMED_PAIRS:
                times[name].append(time.perf_counter() - started)
            losses[name].append(loss.item())
    if rank == 0:
        out.write_text(json.dumps({"times": times, "losses": losses}))
    dist.destroy_process_group()


UNTIMED_PAIRS = 2  # compile and warm-up


def run_paired(layout: str, args: argparse.Namespace) -> dict[str, Any]:
    common = [
        f"model={args.model}",
        *LAYOUTS[layout],
        f"train.seq_len={args.seq_len}",
        "train.precision=fp32",
        "train.seed=0",
        "launcher.nproc_per_node=2",
    ]
    with tempfile.TemporaryDirectory(prefix="compile_paired_") as work:
        cfgs = {
            side: dataclasses.asdict(resolved([*common, f"train.compile={flag}"], Path(work)))
            for side, flag in (("eager", "false"), ("compiled", "true"))
        }
        out = Path(work) / "paired.json"
        mp.spawn(_paired_rank, args=(cfgs, free_port(), args.steps, out), nprocs=2)
        raw = json.loads(out.read_text())
    eager, compiled = raw["times"]["eager"], raw["times"]["compiled"]
    ratios = [e / c for e, c in zip(eager, compiled, strict=True)]
    diff = max(abs(a - b) for a, b in zip(*raw["losses"].values(), strict=True))
    deciles = statistics.quantiles(ratios, n=10)
    result = {
        "eager_step_s": statistics.median(eager),
        "compiled_step_s": statistics.median(compiled),
        "ratio": statistics.median(ratios),
        "ratio_p10": deciles[0],
        "ratio_p90": deciles[-1],
        "pairs": len(ratios),
        "loss_diff": diff,
    }
    console.print(
        f"{layout}: step {result['eager_step_s']:.3f} s -> {result['compiled_step_s']:.3f} s, "
        f"ratio (uncompiled / compiled step time) median {result['ratio']:.3f}, p10-p90 "
        f"{deciles[0]:.3f}-{deciles[-1]:.3f} over {len(ratios)} pairs, max |loss diff| {diff:.1e}"
    )
    return result


def print_table(model: str, results: dict[str, list[dict[str, Any]]]) -> None:
    table = Table(title=f"train.compile, {model} on 2 gloo ranks: ratio = compiled / uncompiled")
    for column in (
        "layout",
        "round",
        "uncompiled tok/s",
        "compiled tok/s",
        "ratio",
        "compile s",
        "max |loss diff|",
        "other CPU s",
    ):
        table.add_column(column, justify="right")
    for layout, rounds in results.items():
        for r in rounds:
            others = (r["eager"]["other_cpu_s"], r["compiled"]["other_cpu_s"])
            table.add_row(
                layout,
                f"{r['round']}{'*' if max(others) > CONTENDED_CPU_S else ''}",
                f"{r['eager']['tokens_per_s']:,.0f}",
                f"{r['compiled']['tokens_per_s']:,.0f}",
                f"{r['ratio']:.3f}",
                f"{r['compiled']['compile_s']:.1f}",
                f"{r['loss_diff']:.1e}",
                f"{others[0]:.1f} / {others[1]:.1f}",
            )
        median = statistics.median(r["ratio"] for r in rounds)
        table.add_row(layout, "median", "", "", f"{median:.3f}", "", "", "", style="bold")
        table.add_section()
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--paired", action="store_true", help="step by step in the same ranks")
    out = REPO_ROOT / "outputs" / "benchmarks" / "compile_speedup.json"
    parser.add_argument("--out", type=Path, default=out)
    args = parser.parse_args()
    load_before, started = os.getloadavg(), time.perf_counter()
    if args.paired:
        results = {layout: run_paired(layout, args) for layout in args.layouts}
        medians = {layout: r["ratio"] for layout, r in results.items()}
    else:
        results = {layout: run_layout(layout, args) for layout in args.layouts}
        print_table(args.model, results)
        medians = {k: statistics.median(r["ratio"] for r in v) for k, v in results.items()}
    load = {"before": load_before, "after": os.getloadavg()}
    console.print(f"load average (1, 5, 15 min) before {load_before}, after {load['after']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "setup": vars(args) | {"out": str(args.out)},
                "torch": torch.__version__,
                "results": results,
                "load_average": load,
                "wall_s": time.perf_counter() - started,
                "median_ratio": medians,
            },
            indent=2,
        )
    )
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
