"""One AdamW step (LocalAdamW) on a model's parameters in each of torch's implementations:
`for_loop` (torch's default on CPU: a Python loop over the tensors), `foreach` (each stage
of the update one op over the tensor list) and `fused` (one kernel; what meshrun picks where
the device has it), stepped in turns (ABC, ABC, ...) so the machine's drift hits all alike;
the median per implementation and its ratio to for_loop. One process, `--threads` threads
(a rank's share on 2 cores: 1); `--device cuda` on a GPU box.

    .venv/bin/python -m benchmarks.optimizer_step                # ~15 s on CPU
    .venv/bin/python -m benchmarks.optimizer_step --model llama-1b --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from meshrun.models import build_model
from meshrun.rank.train.optim import LocalAdamW
from tests.helpers import compose_config

KERNELS = {"for_loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model = build_model(compose_config(f"model={args.model}").model, 128, device)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    optimizers = {
        name: LocalAdamW([{"params": params, "weight_decay": 0.1}], lr=1e-4, **kw)
        for name, kw in KERNELS.items()
    }
    for optimizer in optimizers.values():
        optimizer.step()  # creates the state
    times: dict[str, list[float]] = {name: [] for name in KERNELS}
    for _ in range(args.rounds):
        for name, optimizer in optimizers.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            optimizer.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - started)
    count = sum(p.numel() for p in params)
    table = Table(
        title=f"AdamW step, {args.model} ({count:,} parameters in {len(params)} "
        f"tensors), {args.device}, {args.threads} thread(s)"
    )
    for column in ("implementation", "median ms", "p10-p90 ms", "for_loop / it"):
        table.add_column(column, justify="right")
    base = statistics.median(times["for_loop"])
    for name, values in times.items():
        deciles = statistics.quantiles(values, n=10)
        table.add_row(
            name,
            f"{statistics.median(values) * 1e3:.2f}",
            f"{deciles[0] * 1e3:.2f}-{deciles[-1] * 1e3:.2f}",
            f"{base / statistics.median(values):.2f}x",
        )
    Console().print(table)


if __name__ == "__main__":
    main()
