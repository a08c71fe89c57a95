"""meshrun against its peers, side by side: HF accelerate (DDP) and Lightning Fabric (DDP, FSDP).

Each peer trains what meshrun trains, written with the peer's API as its documentation shows:
meshrun's LLaMA model with its seeded init, the same synthetic tokens in the same order, each
rank its contiguous share of every global batch, the same AdamW (weight decay on matrices),
clipping at 1.0 by the global norm, seed and threads per rank; the user's step loop is
common.hand_rank's, as a peer user writes it.

- accelerate DDP: `Accelerator()`, `prepare`, micro-batches under `accelerator.no_sync` but
  the last, `accelerator.backward`, `accelerator.clip_grad_norm_`.
- accelerate FSDP cannot run on CPU: see ACCELERATE_FSDP.
- Fabric DDP: `Fabric(strategy="ddp")`, `fabric.no_backward_sync` but the last micro-batch,
  `fabric.backward`, `fabric.clip_gradients`.
- Fabric FSDP: `ModelParallelStrategy` (Fabric's FSDP2) with a `parallelize_fn` that
  `fully_shard`s every block (`reshard_after_forward=True`) and the root, as Fabric's FSDP2
  example does. Fabric's `strategy="fsdp"` (torch's FSDP1) cannot run on CPU: Fabric refuses
  it (connector.py: "FSDP is only available on GPU") and so does torch 2.13's FSDP1
  (fsdp/_init_utils.py: "FSDP needs a non-CPU accelerator device").

Under FSDP no side skips the gradient sync of a micro-batch (FSDP reduce-scatters every one,
as meshrun does: no_sync would hold unsharded gradients). What still differs, by each
framework's design, is in the benchmarks README. torchtitan: not run, see TORCHTITAN.

All three train what meshrun trains: the step losses agree to the last bit or one float32 ulp
(LOSS_TOLERANCE flags more): two ranks sum each gradient element in one order on every side,
but meshrun's clipping norm (the root of the summed squares of the per-tensor norms) and
torch's clip_grad_norm_ (the 2-norm of the stacked per-tensor norms) differ in the last bit
about half the time, and so does the clipping factor.

The meshrun side runs once per layout and round; the peers of that layout run beside it, in an
order that reverses every round (so drift of the machine hits all sides alike). How each side
is run, timed and compared: common.py. Needs the `peers` extra (`pip install -e '.[peers]'`).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from importlib.metadata import version
from typing import Any

import torch
from common import (
    GRAD_CLIP,
    SEED,
    Benchmark,
    Build,
    HandRank,
    Measurement,
    Setup,
    accumulate,
    adamw,
    console,
    contended,
    parse_args,
    round_record,
    run_hand,
    run_meshrun,
    run_side,
    seeded_model,
    setup_of,
    step_tokens,
)
from rich.console import Console
from rich.table import Table
from torch import nn

from meshrun.core.config import LlamaModelConfig
from meshrun.rank.train.data import SyntheticTokens

wide = Console(width=130)  # the table's nine columns, also where stdout is no terminal
# Largest step-loss difference that is still rounding (a few float32 ulps of a loss of ~6);
# over it, the sides did not train the same thing and the row is flagged.
LOSS_TOLERANCE = 1e-5
# Why torchtitan is not among the peers; the README has each step and torchtitan_cpu.patch.
TORCHTITAN = (
    "not run: torchtitan 0.3.0's language models take only masked attention backends (flex, "
    "flex_flash, varlen; models/common/config_utils.py get_attention_config), and torch's "
    "FlexAttention has no backward on CPU (torch/nn/attention/flex_attention.py "
    "_validate_device); see benchmarks/README.md"
)
# Why accelerate's FSDP is not among them: on CPU it trains DDP under the FSDP plugin's name.
ACCELERATE_FSDP = (
    "not run: accelerate 1.16 on CPU ignores its FSDP plugin without a word (state.py, "
    "AcceleratorState: DistributedType.FSDP is set only for the multi-accelerator types, so "
    "Accelerator(cpu=True, fsdp_plugin=...) stays MULTI_CPU and prepare() wraps the model in "
    "DistributedDataParallel); an earlier table compared meshrun's FSDP with that DDP (0.79)"
)


def _forward_backward(
    rank: int,
    setup: Setup,
    model_cfg: LlamaModelConfig,
    model: nn.Module,
    backward: Any,
    no_sync: Any = None,
) -> Any:
    """The step's forward/backward on this rank's share of the global batch."""
    data = SyntheticTokens(model_cfg.vocab_size, SEED)

    def forward_backward(step: int) -> torch.Tensor:
        tokens = step_tokens(data, setup, step, rank, setup.ranks)
        return accumulate(model, tokens, setup.micro_batch_size, no_sync, backward)

    return forward_backward


def build_accelerate(rank: int, setup: Setup, model_cfg: LlamaModelConfig) -> HandRank:
    """One rank of accelerate's DDP."""
    from accelerate import Accelerator  # noqa: PLC0415 (the peers extra)

    accelerator = Accelerator(cpu=True)
    model = seeded_model(model_cfg, setup)
    model, optimizer = accelerator.prepare(model, adamw(list(model.parameters())))
    no_sync = functools.partial(accelerator.no_sync, model)
    clip = functools.partial(accelerator.clip_grad_norm_, list(model.parameters()), GRAD_CLIP)
    return HandRank(
        optimizer,
        _forward_backward(rank, setup, model_cfg, model, accelerator.backward, no_sync),
        clip,
    )


def build_fabric(
    rank: int, setup: Setup, model_cfg: LlamaModelConfig, fsdp: bool = False
) -> HandRank:
    """One rank of Lightning Fabric: DDP, or FSDP2 through its ModelParallelStrategy (see
    the module docstring for why not its FSDPStrategy)."""
    from lightning_fabric import Fabric  # noqa: PLC0415 (the peers extra)
    from lightning_fabric.strategies import ModelParallelStrategy  # noqa: PLC0415

    strategy = "ddp"
    if fsdp:
        strategy = ModelParallelStrategy(
            _fully_shard, data_parallel_size=setup.ranks, tensor_parallel_size=1
        )
    fabric = Fabric(accelerator="cpu", devices=setup.ranks, strategy=strategy)
    fabric.launch()  # joins the process group common.hand_rank started
    model = fabric.setup_module(seeded_model(model_cfg, setup))
    optimizer = fabric.setup_optimizers(adamw(list(model.parameters())))
    no_sync = None if fsdp else functools.partial(fabric.no_backward_sync, model)
    clip = functools.partial(fabric.clip_gradients, model, optimizer, max_norm=GRAD_CLIP)
    return HandRank(
        optimizer, _forward_backward(rank, setup, model_cfg, model, fabric.backward, no_sync), clip
    )


def _fully_shard(model: nn.Module, mesh: Any) -> nn.Module:
    """Fabric's FSDP2: the user's own `fully_shard` calls, every block then the root
    (reshard_after_forward as meshrun's fsdp config; the root left to torch's default)."""
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    for block in model.layers.values():
        fully_shard(block, mesh=mesh["data_parallel"], reshard_after_forward=True)
    return fully_shard(model, mesh=mesh["data_parallel"])


def peer(side: str, layout: str, build: Build) -> Benchmark:
    return Benchmark("peers", f"{side} {layout}", layout, None, build, __doc__, side)


PEERS = [
    peer("accelerate", "ddp", build_accelerate),
    peer("fabric", "ddp", build_fabric),
    peer("fabric", "fsdp", functools.partial(build_fabric, fsdp=True)),
]


def run_rounds(peers: list[Benchmark], setup: Setup, rounds: int) -> dict[str, list[dict]]:
    """Each peer's per-round records (common.round_record), keyed by its title. A round runs
    every layout's meshrun side once and the layout's peers beside it, meshrun first in odd
    rounds and last in even ones."""
    records: dict[str, list[dict]] = {bench.title: [] for bench in peers}
    layouts = dict.fromkeys(bench.parallel for bench in peers)
    for index in range(rounds):
        for layout in layouts:
            group = [bench for bench in peers if bench.parallel == layout]
            sides = [*group, None] if index % 2 else [None, *group]  # None: meshrun
            measured: dict[str | None, Measurement] = {}
            for bench in sides:
                if bench is None:
                    measured[None] = run_side(run_meshrun, group[0], setup)
                else:
                    measured[bench.title] = run_side(run_hand, bench, setup)
            ours = measured[None]
            for bench in group:
                record = round_record(index, "peer", measured[bench.title], ours)
                records[bench.title].append(record)
                console.print(
                    f"round {index + 1}/{rounds} {bench.title}: peer "
                    f"{record['peer_tokens_per_s']:,.0f} tok/s, meshrun "
                    f"{ours.tokens_per_s:,.0f} tok/s, ratio {record['ratio']:.3f}, "
                    f"max |loss diff| {record['loss_diff']:.1e}"
                )
    return records


def summary(bench: Benchmark, rounds: list[dict]) -> dict[str, Any]:
    """One peer's row: medians over rounds, the largest loss difference, contended rounds."""
    return {
        "peer": bench.side,
        "layout": bench.parallel,
        "rounds": len(rounds),
        "meshrun_tokens_per_s": statistics.median(r["meshrun_tokens_per_s"] for r in rounds),
        "peer_tokens_per_s": statistics.median(r["peer_tokens_per_s"] for r in rounds),
        "median_ratio": statistics.median(r["ratio"] for r in rounds),
        "max_loss_diff": max(r["loss_diff"] for r in rounds),
        "contended_rounds": sum(contended(r) for r in rounds),
        "per_round": rounds,
    }


def print_table(setup: Setup, rows: list[dict[str, Any]]) -> None:
    table = Table(title=f"meshrun vs peers, {setup.model} on {setup.ranks} gloo ranks")
    columns = (
        "peer",
        "layout",
        "rounds",
        "meshrun tok/s",
        "peer tok/s",
        "ratio (median)",
        "ratio per round",
        "max |loss diff|",
        "contended",
    )
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            row["peer"],
            row["layout"],
            str(row["rounds"]),
            f"{row['meshrun_tokens_per_s']:,.0f}",
            f"{row['peer_tokens_per_s']:,.0f}",
            f"{row['median_ratio']:.3f}",
            " ".join(f"{r['ratio']:.2f}" for r in row["per_round"]),
            f"{row['max_loss_diff']:.1e}{'!' if row['max_loss_diff'] > LOSS_TOLERANCE else ''}",
            f"{row['contended_rounds']}/{row['rounds']}{'*' if row['contended_rounds'] else ''}",
        )
    wide.print(table)
    wide.print(
        "ratio = meshrun tok/s / peer tok/s within a round; contended: rounds where other "
        "processes took > 1 CPU s beside a side (* : rerun on an idle machine); ! : losses "
        f"differ by more than {LOSS_TOLERANCE:g}, the sides trained different things"
    )


def _only(parser: argparse.ArgumentParser) -> None:
    names = sorted({name for bench in PEERS for name in (bench.side, bench.parallel)})
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        choices=names,
        help="run only these peers or layouts (default: all)",
    )


def main() -> None:
    args = parse_args("peers", __doc__, {"steps": 24, "rounds": 3}, _only)
    setup = setup_of(args)
    chosen = [b for b in PEERS if not args.only or {b.side, b.parallel} & set(args.only)]
    started = time.perf_counter()
    records = run_rounds(chosen, setup, args.rounds)
    rows = [summary(bench, records[bench.title]) for bench in chosen]
    wall_s = time.perf_counter() - started
    print_table(setup, rows)
    wide.print(f"accelerate fsdp: {ACCELERATE_FSDP}\ntorchtitan: {TORCHTITAN}")
    wide.print(f"wall time {wall_s:.0f} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": "peers",
        "setup": vars(args) | {"out": str(args.out)},
        "torch": torch.__version__,
        "versions": {name: version(name) for name in ("accelerate", "lightning-fabric")},
        "peers": rows,
        "not_run": {"accelerate fsdp": ACCELERATE_FSDP, "torchtitan": TORCHTITAN},
        "wall_s": wall_s,
    }
    args.out.write_text(json.dumps(record, indent=2))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
