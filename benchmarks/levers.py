"""What issue 63's memory levers save and cost on this host: the same `meshrun` run with
each lever and without, one run each, as ratios.

- train.optimizer_states: model=small on one rank in fp32, bf16 and 8bit: the measured
  optimizer bytes against fp32's (8-bit at most 0.3x), the step time against fp32's, and
  the largest relative difference of a step's loss from fp32's (`--loss-steps 200`: issue
  63's 2% over 200 steps, at one micro-batch of 8 x 64 tokens a step so that the three runs
  take minutes, not hours, on a shared 2-core host).
- parallel.activation_offload=cpu: the bytes a step's forward sends to the host (counted by
  the hooks on model=small, micro-batch 8 x 512, with and without full checkpointing) and
  the step time against the run without it.
- parallel.fsdp.offload=cpu: the step time of fsdp on 2 ranks against fsdp without it.

On a CPU the host is the device, so the offloads save no memory here: their byte counts
and copies' time are what is measured; the PCIe transfer costs need a GPU. Writes
outputs/benchmarks/levers.json.

    .venv/bin/python benchmarks/levers.py                     # ~5 min on 2 idle cores
    .venv/bin/python benchmarks/levers.py --loss-steps 200    # + 3 runs of 200 steps
    .venv/bin/python benchmarks/levers.py --loss-steps 200 --loss-only
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from common import meshrun_results, model_config
from rich.console import Console
from rich.table import Table

from meshrun.core.paths import REPO_ROOT
from meshrun.models import build_model
from meshrun.rank.parallel.activation_offload import apply_activation_offload
from meshrun.rank.parallel.checkpointing import apply_activation_checkpointing

console = Console()
RUN = ["model=small", "train.precision=fp32", "train.seq_len=256", "train.micro_batch_size=2"]


def run(work: Path, name: str, steps: int, *overrides: str) -> dict[str, Any]:
    result = meshrun_results(
        [*RUN, f"train.steps={steps}", "train.untimed_steps=2", *overrides], work / name
    )
    return {
        "step_time_s": result["step_time_s"],
        "optimizer_bytes": result["memory_optimizer_bytes"],
        "losses": result["losses"],
    }


def largest_loss_difference(losses: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))


def optimizer_states(work: Path, steps: int, *overrides: str) -> dict[str, Any]:
    runs = {
        mode: run(
            work, mode, steps, "parallel=single", f"train.optimizer_states={mode}", *overrides
        )
        for mode in ("fp32", "bf16", "8bit")
    }
    fp32 = runs["fp32"]
    return {
        mode: {
            "optimizer_bytes_ratio": r["optimizer_bytes"] / fp32["optimizer_bytes"],
            "step_time_ratio": r["step_time_s"] / fp32["step_time_s"],
            "largest_loss_difference": largest_loss_difference(r["losses"], fp32["losses"]),
            "last_loss": r["losses"][-1],
            "steps": steps,
        }
        for mode, r in runs.items()
    }


def offloaded_bytes(checkpointing: str) -> int:
    """Bytes one forward of model=small (micro-batch 8 x 512) sends to the host."""
    model_cfg = model_config("small")
    model = build_model(model_cfg, 512, "cpu")
    model.init_weights(0)
    apply_activation_checkpointing(model, checkpointing)
    host = apply_activation_offload(model, torch.device("cpu"))
    tokens = torch.randint(0, model_cfg.vocab_size, (8, 512))
    model(tokens).float().logsumexp(-1).mean().backward()
    return host.moved


def offload_costs(work: Path, steps: int) -> dict[str, Any]:
    single = run(work, "single", steps, "parallel=single")
    act = run(work, "act", steps, "parallel=single", "parallel.activation_offload=cpu")
    fsdp = ["parallel=fsdp", "launcher.nproc_per_node=2"]
    sharded = run(work, "fsdp", steps, *fsdp)
    offloaded = run(work, "fsdp_offload", steps, *fsdp, "parallel.fsdp.offload=cpu")
    return {
        "activation_offload": {
            "bytes_moved_per_forward": offloaded_bytes("none"),
            "bytes_moved_per_forward_full_checkpointing": offloaded_bytes("full"),
            "step_time_ratio": act["step_time_s"] / single["step_time_s"],
        },
        "fsdp_offload": {"step_time_ratio": offloaded["step_time_s"] / sharded["step_time_s"]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="steps of each speed run")
    parser.add_argument("--loss-steps", type=int, default=0, help="steps of the loss runs")
    parser.add_argument("--loss-only", action="store_true", help="only the loss runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        record: dict[str, Any] = {}
        if not args.loss_only:
            record["optimizer_states"] = optimizer_states(work, args.steps)
            record |= offload_costs(work, args.steps)
        if args.loss_steps:  # one micro-batch of 8 x 64 tokens a step: 200 steps in minutes
            short = ("train.seq_len=64", "train.micro_batch_size=8", "train.global_batch_size=8")
            record["optimizer_states_loss"] = optimizer_states(
                work / "loss", args.loss_steps, *short
            )
    console.print(table(record))
    out = REPO_ROOT / "outputs" / "benchmarks" / "levers.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    console.print(f"written: {out}")


def table(record: dict[str, Any]) -> Table:
    rows = Table("lever", "figure", "value")
    for mode in ("bf16", "8bit"):
        if "optimizer_states" in record:
            states = record["optimizer_states"][mode]
            ratio = states["optimizer_bytes_ratio"]
            rows.add_row(f"states {mode}", "optimizer bytes / fp32's", f"{ratio:.3f}")
            rows.add_row(f"states {mode}", "step time / fp32's", f"{states['step_time_ratio']:.2f}")
        if "optimizer_states_loss" in record:
            loss = record["optimizer_states_loss"][mode]
            rows.add_row(
                f"states {mode}",
                f"largest loss difference over {loss['steps']} steps",
                f"{loss['largest_loss_difference']:.2%}",
            )
    if "activation_offload" in record:
        act = record["activation_offload"]
        moved, ckpt = (
            act["bytes_moved_per_forward"],
            act["bytes_moved_per_forward_full_checkpointing"],
        )
        rows.add_row("activation offload", "bytes to host a forward", f"{moved:,}")
        rows.add_row("activation offload", "... with full checkpointing", f"{ckpt:,}")
        rows.add_row("activation offload", "step time / without", f"{act['step_time_ratio']:.2f}")
        fsdp = record["fsdp_offload"]["step_time_ratio"]
        rows.add_row("fsdp offload", "step time / without", f"{fsdp:.2f}")
    return rows


if __name__ == "__main__":
    main()
