"""meshrun's overhead over hand-written DDP, measured side by side in one run.

(A) "hand": plain torch, as a user would write it: mp.spawn, gloo, DistributedDataParallel,
AdamW, gradient accumulation with no_sync, clip_grad_norm_. (B) "meshrun": the same training
through the `meshrun` CLI (parallel=ddp). Both train meshrun's LLaMA model on its synthetic
tokens with the same hyperparameters, threads per rank and per-rank data, and both time only
the steps after warmup (tokens/s = timed tokens / timed seconds, rank 0's clock), so process
start-up, Hydra and model construction are not counted on either side.

Rounds run A then B (ABAB...) so slow drift of the machine hits both alike. The ratio is
meshrun tokens/s over hand tokens/s of the same round; the median over rounds is the result.
1.0 means no overhead, the target is >= 0.98. The losses of both sides are compared too: a
non-zero difference means they did not train the same thing and the ratio is meaningless.
"other CPU s" is CPU time other processes took while a side ran; with every core busy with a
rank it comes straight out of that side's throughput, so rounds where it is large are flagged.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table
from torch.nn.parallel import DistributedDataParallel

from meshrun.config import ModelConfig
from meshrun.models.llama import build_model
from meshrun.paths import CONF_DIR, REPO_ROOT
from meshrun.train.data import SyntheticTokens

# Hyperparameters of both sides; meshrun gets them as overrides, so they cannot drift apart.
LR = 3e-4
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
SEED = 0
# CPU seconds other processes may take during one side before its round is flagged.
CONTENDED_CPU_S = 1.0

console = Console()


@dataclasses.dataclass(frozen=True)
class Setup:
    model: str
    ranks: int
    steps: int
    warmup_steps: int
    global_batch_size: int
    micro_batch_size: int
    seq_len: int

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len


@dataclasses.dataclass(frozen=True)
class Measurement:
    tokens_per_s: float
    step_time_s: float
    losses: list[float]
    other_cpu_s: float = 0.0


def measurement(setup: Setup, step_times: list[float], losses: list[float]) -> Measurement:
    """The same summary as meshrun's results.json (metrics/throughput.py summarize_steps)."""
    tokens_per_s = setup.tokens_per_step * len(step_times) / sum(step_times)
    return Measurement(tokens_per_s, statistics.median(step_times), losses)


# --- (A) hand-written DDP --------------------------------------------------------------------


def hand_rank(rank: int, setup: Setup, port: int, out: Path) -> None:
    """One rank of the hand-written run; rank 0 writes its step times and the mean losses."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // setup.ranks))
    cpu = torch.device("cpu")
    dist.init_process_group("gloo", rank=rank, world_size=setup.ranks)

    preset = OmegaConf.load(CONF_DIR / "model" / f"{setup.model}.yaml")
    model_cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ModelConfig), preset))
    model = build_model(model_cfg, setup.seq_len, cpu)
    model.init_weights(SEED)
    ddp_model = DistributedDataParallel(model)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=LR,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    data = SyntheticTokens(model_cfg.vocab_size, SEED)
    per_rank = setup.global_batch_size // setup.ranks
    accum = per_rank // setup.micro_batch_size

    step_times: list[float] = []
    losses: list[torch.Tensor] = []
    for step in range(setup.steps):
        if step == setup.warmup_steps:
            start = time.perf_counter()
        first = step * setup.global_batch_size + rank * per_rank
        tokens = data.batch(range(first, first + per_rank), setup.seq_len + 1, cpu)
        step_loss = torch.zeros(())
        for index, chunk in enumerate(tokens.split(setup.micro_batch_size)):
            inputs, targets = chunk[:, :-1], chunk[:, 1:]
            sync = index == accum - 1
            with contextlib.nullcontext() if sync else ddp_model.no_sync():
                logits = ddp_model(inputs)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
                (loss / accum).backward()
            step_loss += loss.detach()
        torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_loss / accum)
        if step >= setup.warmup_steps:
            now = time.perf_counter()
            step_times.append(now - start)
            start = now

    mean_losses = torch.stack(losses)
    dist.all_reduce(mean_losses)
    mean_losses /= setup.ranks
    if rank == 0:
        out.write_text(json.dumps({"step_times": step_times, "losses": mean_losses.tolist()}))
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_hand(setup: Setup, work: Path) -> Measurement:
    out = work / "hand.json"
    mp.spawn(hand_rank, args=(setup, free_port(), out), nprocs=setup.ranks)
    raw = json.loads(out.read_text())
    return measurement(setup, raw["step_times"], raw["losses"])


# --- (B) meshrun -----------------------------------------------------------------------------


def run_meshrun(setup: Setup, work: Path) -> Measurement:
    run_dir = work / "meshrun"
    overrides = [
        f"model={setup.model}",
        "parallel=ddp",
        "logger=none",
        "metrics.baseline=false",
        f"launcher.nproc_per_node={setup.ranks}",
        f"train.steps={setup.steps}",
        f"train.warmup_steps={setup.warmup_steps}",
        f"train.global_batch_size={setup.global_batch_size}",
        f"train.micro_batch_size={setup.micro_batch_size}",
        f"train.seq_len={setup.seq_len}",
        f"train.lr={LR}",
        f"train.weight_decay={WEIGHT_DECAY}",
        f"train.grad_clip={GRAD_CLIP}",
        f"train.seed={SEED}",
        "train.precision=fp32",
        "train.progress_bar=false",
        f"hydra.run.dir={run_dir}",
        f"store.path={work / 'meshrun.db'}",
    ]
    cli = Path(sys.executable).with_name("meshrun")
    proc = subprocess.run([cli, *overrides], capture_output=True, text=True, check=False)
    if proc.returncode:
        sys.exit(f"meshrun failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    results = json.loads((run_dir / "results.json").read_text())
    return Measurement(results["tokens_per_s"], results["step_time_s"], results["losses"])


# --- contention: the machine must be otherwise idle ------------------------------------------


def busy_cpu_s() -> float:
    """CPU seconds every process on this machine has used so far (Linux /proc/stat)."""
    # cpu  user nice system idle iowait irq softirq steal ...: all but idle and iowait are busy.
    ticks = [int(t) for t in Path("/proc/stat").read_text().split(maxsplit=9)[1:9]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and its waited-for descendants (both sides' ranks)."""
    me, kids = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def run_side(side: Callable[[Setup, Path], Measurement], setup: Setup) -> Measurement:
    """Runs one side and adds the CPU time other processes took meanwhile: with every core
    busy with a rank, any of it is stolen from the ranks and slows that side down."""
    busy, own = busy_cpu_s(), own_cpu_s()
    with tempfile.TemporaryDirectory(prefix="ddp_overhead_") as tmp:
        result = side(setup, Path(tmp))
    other = (busy_cpu_s() - busy) - (own_cpu_s() - own)
    return dataclasses.replace(result, other_cpu_s=max(0.0, other))


# --- driver ----------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="a conf/model preset")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=36)
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / "outputs" / "benchmarks" / "ddp_overhead.json"
    )
    return parser.parse_args()


def run_rounds(setup: Setup, rounds: int) -> tuple[list[dict[str, Any]], float]:
    """Per-round records, and the largest loss difference between the sides (0 expected)."""
    records: list[dict[str, Any]] = []
    max_loss_diff = 0.0
    for index in range(rounds):
        hand = run_side(run_hand, setup)
        ours = run_side(run_meshrun, setup)
        diff = max(abs(a - b) for a, b in zip(hand.losses, ours.losses, strict=True))
        max_loss_diff = max(max_loss_diff, diff)
        records.append(
            {
                "round": index + 1,
                "hand_tokens_per_s": hand.tokens_per_s,
                "meshrun_tokens_per_s": ours.tokens_per_s,
                "hand_step_time_s": hand.step_time_s,
                "meshrun_step_time_s": ours.step_time_s,
                "hand_other_cpu_s": hand.other_cpu_s,
                "meshrun_other_cpu_s": ours.other_cpu_s,
                "ratio": ours.tokens_per_s / hand.tokens_per_s,
            }
        )
        console.print(f"round {index + 1}/{rounds}: ratio {records[-1]['ratio']:.3f}")
    return records, max_loss_diff


def contended(record: dict[str, Any]) -> bool:
    return max(record["hand_other_cpu_s"], record["meshrun_other_cpu_s"]) > CONTENDED_CPU_S


def print_table(setup: Setup, rounds: list[dict[str, Any]], median_ratio: float) -> None:
    title = f"DDP overhead, {setup.model} on {setup.ranks} gloo ranks: ratio = meshrun / hand"
    table = Table(title=title)
    for column in ("round", "hand tok/s", "meshrun tok/s", "other CPU s", "ratio"):
        table.add_column(column, justify="right")
    for r in rounds:
        table.add_row(
            f"{r['round']}{'*' if contended(r) else ''}",
            f"{r['hand_tokens_per_s']:,.0f}",
            f"{r['meshrun_tokens_per_s']:,.0f}",
            f"{r['hand_other_cpu_s']:.1f} / {r['meshrun_other_cpu_s']:.1f}",
            f"{r['ratio']:.3f}",
        )
    table.add_section()
    table.add_row("median", "", "", "", f"{median_ratio:.3f}", style="bold")
    console.print(table)
    if any(contended(r) for r in rounds):
        console.print(
            f"* other processes took > {CONTENDED_CPU_S:g} CPU s during this round: its ratio "
            "measures them as much as meshrun; rerun on an idle machine",
            style="yellow",
        )


def main() -> None:
    args = parse_args()
    setup = Setup(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Setup)})
    started = time.perf_counter()
    rounds, max_loss_diff = run_rounds(setup, args.rounds)
    median_ratio = statistics.median(r["ratio"] for r in rounds)
    wall_s = time.perf_counter() - started
    print_table(setup, rounds, median_ratio)
    console.print(f"max |loss hand - loss meshrun|: {max_loss_diff:.2e}; wall time {wall_s:.0f} s")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "setup": vars(args) | {"out": str(args.out)},
        "torch": torch.__version__,
        "rounds": rounds,
        "median_ratio": median_ratio,
        "max_loss_diff": max_loss_diff,
        "wall_s": wall_s,
    }
    args.out.write_text(json.dumps(record, indent=2))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
