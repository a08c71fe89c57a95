"""What the side-by-side benchmarks share: the setup, the hand-written side's process spawning
and step timing, the meshrun side's CLI run, the CPU-contention measurement, and the driver
(ABAB rounds, ratio table, JSON record).

A benchmark is a meshrun `parallel` preset and a `build` function that sets up one rank of
the same training written by hand with the torch APIs, or with a peer framework's (its
optimizer, its forward/backward of a step and its gradient clipping; `hand_rank` runs the
steps around them).
Both sides train meshrun's LLaMA model on its synthetic tokens with the same hyperparameters
and threads per rank, and both time only the steps after warmup (tokens/s = timed tokens /
timed seconds, rank 0's clock), so process start-up, Hydra and model construction are not
counted on either side.

Rounds run hand then meshrun (ABAB...) so slow drift of the machine hits both alike. The ratio
is meshrun tokens/s over hand tokens/s of the same round; the median over rounds is the
result. 1.0 means no overhead, the target is >= 0.98. The losses of both sides are compared
too: a non-zero difference means they did not train the same thing and the ratio is
meaningless. "other CPU s" is CPU time other processes took while a side ran; with every core
busy with a rank it comes straight out of that side's throughput, so rounds where it is large
are flagged.
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
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table
from torch import nn

from meshrun.core.config import LlamaModelConfig
from meshrun.core.paths import CONF_DIR, REPO_ROOT
from meshrun.models import build_model
from meshrun.models.llama import Transformer
from meshrun.rank.metrics.host import host_busy_s
from meshrun.rank.train.data import SyntheticTokens

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
    untimed_steps: int
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
    wall_s: float = 0.0


def measurement(setup: Setup, step_times: list[float], losses: list[float]) -> Measurement:
    """The same summary as meshrun's results.json (core/step_stats.py summarize_steps)."""
    tokens_per_s = setup.tokens_per_step * len(step_times) / sum(step_times)
    return Measurement(tokens_per_s, statistics.median(step_times), losses)


@dataclasses.dataclass(frozen=True)
class HandRank:
    """One rank of a hand-written run, as its `Build` set it up."""

    optimizer: torch.optim.Optimizer
    # Forward and backward of a step (its index in): this rank's loss, or None where the
    # rank computes none (a pipeline stage without the head).
    forward_backward: Callable[[int], torch.Tensor | None]
    clip: Callable[[], None]  # clips the gradients to GRAD_CLIP by their global norm


# Sets up one rank of the hand-written run: (rank, setup, model config) -> the rank. Must be a
# module-level function: it is pickled to the spawned ranks.
Build = Callable[[int, Setup, LlamaModelConfig], HandRank]


@dataclasses.dataclass(frozen=True)
class Benchmark:
    name: str  # output file stem
    title: str  # table title, before "<model> on <n> gloo ranks"
    parallel: str  # the meshrun `parallel` preset of the meshrun side
    degree: str | None  # its degree that --ranks sets (None: the preset fills the world)
    build: Build  # the other side: hand-written, or a peer framework's
    doc: str  # the script's docstring; its first line is the --help description
    side: str = "hand"  # the other side's name


# --- helpers for the hand-written sides ------------------------------------------------------


def model_config(name: str) -> LlamaModelConfig:
    preset = OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml")
    del preset["defaults"]  # the schema it names is the one merged here
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(LlamaModelConfig), preset))


def seeded_model(model_cfg: LlamaModelConfig, setup: Setup) -> Transformer:
    """meshrun's model, whole on the CPU, with the weights meshrun's seeded init gives any
    layout."""
    model = build_model(model_cfg, setup.seq_len, torch.device("cpu"))
    model.init_weights(SEED)
    return model


def adamw(params: list[nn.Parameter], fused: bool | None = None) -> torch.optim.Optimizer:
    """LLaMA's AdamW: weight decay on matrices only. `fused`: torch's fused kernel (what
    meshrun steps where the device has one); None: torch's default (a for loop on CPU)."""
    return torch.optim.AdamW(
        [
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ],
        lr=LR,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=fused,
    )


def step_tokens(
    data: SyntheticTokens, setup: Setup, step: int, dp_rank: int = 0, dp_size: int = 1
) -> torch.Tensor:
    """A data-parallel rank's contiguous share of the step's global batch, seq_len + 1 long."""
    per_rank = setup.global_batch_size // dp_size
    first = step * setup.global_batch_size + dp_rank * per_rank
    return data.batch(range(first, first + per_rank), setup.seq_len + 1, torch.device("cpu"))


def accumulate(
    model: nn.Module,
    tokens: torch.Tensor,
    micro_batch_size: int,
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
) -> torch.Tensor:
    """Forward/backward each micro-batch (gradient accumulation); `no_sync` wraps all but the
    last; `backward`: a peer framework's. Returns the mean loss."""
    chunks = tokens.split(micro_batch_size)
    total = torch.zeros(())
    for index, chunk in enumerate(chunks):
        inputs, targets = chunk[:, :-1], chunk[:, 1:]
        last = index == len(chunks) - 1
        with contextlib.nullcontext() if no_sync is None or last else no_sync():
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
            backward(loss / len(chunks))
        total += loss.detach()
    return total / len(chunks)


def join_process_group(rank: int, setup: Setup, port: int) -> None:
    """A spawned rank's gloo process group, with torchrun's environment (where a peer framework
    looks for the group it joins) and the threads meshrun gives a rank (accelerate sets its
    own where OMP_NUM_THREADS is unset)."""
    threads = max(1, len(os.sched_getaffinity(0)) // setup.ranks)
    os.environ |= {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(setup.ranks),
        "LOCAL_WORLD_SIZE": str(setup.ranks),
        "OMP_NUM_THREADS": str(threads),
    }
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=setup.ranks)


def hand_rank(rank: int, setup: Setup, port: int, out: Path, build: Build) -> None:
    """One rank of the hand-written run; rank 0 writes its step times and the mean losses."""
    join_process_group(rank, setup, port)
    hand = build(rank, setup, model_config(setup.model))

    step_times: list[float] = []
    losses: list[torch.Tensor] = []
    for step in range(setup.steps):
        if step == setup.untimed_steps:
            start = time.perf_counter()
        loss = hand.forward_backward(step)
        hand.clip()
        hand.optimizer.step()
        hand.optimizer.zero_grad(set_to_none=True)
        # (loss, 1) where this rank has a loss, (0, 0) where not: summed over ranks, the
        # ratio is the mean over the ranks that have one.
        losses.append(torch.stack([loss, torch.ones(())]) if loss is not None else torch.zeros(2))
        if step >= setup.untimed_steps:
            now = time.perf_counter()
            step_times.append(now - start)
            start = now

    summed = torch.stack(losses)
    dist.all_reduce(summed)
    if rank == 0:
        mean_losses = (summed[:, 0] / summed[:, 1]).tolist()
        out.write_text(json.dumps({"step_times": step_times, "losses": mean_losses}))
    dist.barrier()  # no rank tears down while another still talks to it
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_hand(bench: Benchmark, setup: Setup, work: Path, attempts: int = 2) -> Measurement:
    """The hand-written (or peer) side; run again once if a rank dies, which a peer's
    teardown sometimes does on CPU (Fabric FSDP2: "terminate called without an active
    exception", SIGABRT, after training)."""
    out = work / "hand.json"
    for attempt in range(1, attempts + 1):
        try:
            mp.spawn(hand_rank, args=(setup, free_port(), out, bench.build), nprocs=setup.ranks)
            break
        except mp.ProcessExitedException as error:
            if attempt == attempts:
                raise
            console.print(f"[yellow]{bench.title}: {error}; running it again[/yellow]")
    raw = json.loads(out.read_text())
    return measurement(setup, raw["step_times"], raw["losses"])


# --- the meshrun side ------------------------------------------------------------------------


def meshrun_results(overrides: list[str], work: Path, baseline: bool = False) -> dict[str, Any]:
    """results.json of one `meshrun` run in `work`: its own store, no W&B; no baseline run
    unless `baseline` (then the config's, by default measured alongside)."""
    run_dir = work / "meshrun"
    command = [
        sys.executable,  # `-m`: an image without meshrun installed runs it with PYTHONPATH=src
        "-m",
        "meshrun",
        f"hydra.run.dir={run_dir}",
        f"store.path={work / 'meshrun.db'}",
        "logger=none",
        "train.progress_bar=false",
        *([] if baseline else ["metrics.baseline=off"]),
        *overrides,
    ]
    proc = subprocess.run(command, capture_output=True, text=True, check=False, cwd=REPO_ROOT)
    if proc.returncode:
        sys.exit(f"meshrun failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return json.loads((run_dir / "results.json").read_text())


def meshrun_overrides(setup: Setup, parallel: str, degree: str | None = None) -> list[str]:
    """The `meshrun` overrides that train what the hand-written side trains: `setup` under the
    `parallel` preset (its `degree` set to the ranks where given), the same hyperparameters."""
    return [
        f"model={setup.model}",
        f"parallel={parallel}",
        *([f"parallel.{degree}={setup.ranks}"] if degree else []),
        f"launcher.nproc_per_node={setup.ranks}",
        f"train.steps={setup.steps}",
        f"train.untimed_steps={setup.untimed_steps}",
        f"train.global_batch_size={setup.global_batch_size}",
        f"train.micro_batch_size={setup.micro_batch_size}",
        f"train.seq_len={setup.seq_len}",
        f"train.lr={LR}",
        f"train.weight_decay={WEIGHT_DECAY}",
        f"train.grad_clip={GRAD_CLIP}",
        f"train.seed={SEED}",
        "train.precision=fp32",
        "train.tf32=false",  # the hand-written side's matmuls: torch's default, full fp32
    ]


def run_meshrun(bench: Benchmark, setup: Setup, work: Path) -> Measurement:
    results = meshrun_results(meshrun_overrides(setup, bench.parallel, bench.degree), work)
    return Measurement(results["tokens_per_s"], results["step_time_s"], results["losses"])


def _own_cpu_s() -> float:
    """CPU seconds of this process and its waited-for descendants (both sides' ranks)."""
    me, kids = (resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


T = TypeVar("T")


def with_others_cpu(run: Callable[[], T]) -> tuple[T, float]:
    """`run`'s result and the CPU seconds other processes took while it ran (the host's busy
    seconds less this process tree's): with every core busy with a rank, any of it is stolen
    from the ranks and slows that run down."""
    busy, own = host_busy_s(), _own_cpu_s()
    result = run()
    other = (host_busy_s() - busy) - (_own_cpu_s() - own)
    return result, max(0.0, other)


Side = Callable[[Benchmark, Setup, Path], Measurement]


def run_side(side: Side, bench: Benchmark, setup: Setup) -> Measurement:
    """Runs one side and adds the CPU time other processes took meanwhile."""
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"{bench.name}_") as tmp:
        result, other = with_others_cpu(lambda: side(bench, setup, Path(tmp)))
    wall = time.perf_counter() - started
    return dataclasses.replace(result, other_cpu_s=other, wall_s=wall)


# --- driver ----------------------------------------------------------------------------------

DEFAULTS = {
    "model": "small",
    "ranks": 2,
    "steps": 36,
    "untimed_steps": 3,
    "global_batch_size": 16,
    "micro_batch_size": 4,
    "seq_len": 128,
    "rounds": 3,
}


def parse_args(
    name: str,
    doc: str,
    defaults: dict[str, Any],
    options: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """The command line of script `name` (its output file stem) with docstring `doc`;
    `options` adds the script's own."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    if options is not None:
        options(parser)
    parser.add_argument("--model", help="a conf/model preset")
    for option in ("ranks", "steps", "untimed-steps", "global-batch-size", "micro-batch-size"):
        parser.add_argument(f"--{option}", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--rounds", type=int)
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / "outputs" / "benchmarks" / f"{name}.json"
    )
    parser.set_defaults(**(DEFAULTS | defaults))
    return parser.parse_args()


def setup_of(args: argparse.Namespace) -> Setup:
    return Setup(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Setup)})


def run_rounds(bench: Benchmark, setup: Setup, rounds: int) -> tuple[list[dict[str, Any]], float]:
    """Per-round records, and the largest loss difference between the sides (0 expected)."""
    records: list[dict[str, Any]] = []
    for index in range(rounds):
        hand = run_side(run_hand, bench, setup)
        ours = run_side(run_meshrun, bench, setup)
        records.append(round_record(index, "hand", hand, ours))
        console.print(
            f"round {index + 1}/{rounds}: hand {hand.tokens_per_s:,.0f} tok/s, meshrun "
            f"{ours.tokens_per_s:,.0f} tok/s, ratio {records[-1]['ratio']:.3f}"
        )
    return records, max(r["loss_diff"] for r in records)


def round_record(index: int, side: str, other: Measurement, ours: Measurement) -> dict[str, Any]:
    """Round `index`'s record: each side's figures (the other side's keys prefixed `side`),
    the ratio meshrun / other, and the largest difference of their step losses."""
    diff = max(abs(a - b) for a, b in zip(other.losses, ours.losses, strict=True))
    return (
        {"round": index + 1}
        | {f"{side}_{key}": value for key, value in _summary(other).items()}
        | {f"meshrun_{key}": value for key, value in _summary(ours).items()}
        | {"ratio": ours.tokens_per_s / other.tokens_per_s, "loss_diff": diff}
    )


def _summary(m: Measurement) -> dict[str, float]:
    return {
        "tokens_per_s": m.tokens_per_s,
        "step_time_s": m.step_time_s,
        "other_cpu_s": m.other_cpu_s,
        "wall_s": m.wall_s,
    }


def contended(record: dict[str, Any]) -> bool:
    """Whether other processes took more than CONTENDED_CPU_S while either side ran."""
    return max(v for k, v in record.items() if k.endswith("_other_cpu_s")) > CONTENDED_CPU_S


def print_table(
    bench: Benchmark, setup: Setup, rounds: list[dict[str, Any]], median_ratio: float
) -> None:
    title = f"{bench.title}, {setup.model} on {setup.ranks} gloo ranks: ratio = meshrun / hand"
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


def main(
    title: str,
    parallel: str,
    build: Build,
    script: str,
    doc: str,
    degree: str | None = None,
    **defaults: Any,
) -> None:
    """Runs a benchmark script: `script` is its __file__ (which names the output), `doc` its
    docstring, `degree` the `parallel` degree that --ranks sets, `defaults` overrides
    DEFAULTS (the command-line defaults)."""
    bench = Benchmark(Path(script).stem, title, parallel, degree, build, doc)
    args = parse_args(bench.name, doc, defaults)
    setup = setup_of(args)
    started = time.perf_counter()
    rounds, max_loss_diff = run_rounds(bench, setup, args.rounds)
    median_ratio = statistics.median(r["ratio"] for r in rounds)
    wall_s = time.perf_counter() - started
    print_table(bench, setup, rounds, median_ratio)
    console.print(f"max |loss hand - loss meshrun|: {max_loss_diff:.2e}; wall time {wall_s:.0f} s")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": bench.name,
        "parallel": bench.parallel,
        "setup": vars(args) | {"out": str(args.out)},
        "torch": torch.__version__,
        "rounds": rounds,
        "median_ratio": median_ratio,
        "max_loss_diff": max_loss_diff,
        "wall_s": wall_s,
    }
    args.out.write_text(json.dumps(record, indent=2))
    console.print(f"wrote {args.out}")
