"""`meshrun-plan`: will this model fit, and which layout is fastest, before anything launches.

meshrun-plan model=llama-7b hardware=a6000 world_size=8
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from meshrun.core.config import ExperimentConfig
from meshrun.core.errors import ConfigError, positive
from meshrun.core.hardware import HostFacts, resolve_hardware, target_facts
from meshrun.core.tool_config import PlanCommandConfig
from meshrun.driver.command import hydra_command
from meshrun.driver.sinks.console import print_error
from meshrun.plan.candidate import Candidate
from meshrun.plan.search import search, suggest_micro_batch
from meshrun.validate import check_experiment

GiB = 2**30


def default_world(cfg: ExperimentConfig) -> int:
    if cfg.hardware.device_type == "cpu":
        return 2
    return sum(spec.count for spec in cfg.hardware.devices)


def plan(cfg: PlanCommandConfig, host: HostFacts) -> tuple[int, list[Candidate], HostFacts]:
    positive("world_size", cfg.world_size, allow_none=True)
    check_experiment(cfg)  # the model's own mistakes before any layout is tried
    hardware = resolve_hardware(cfg.hardware, target_facts(cfg.hardware, host))
    facts = target_facts(hardware, host)
    cfg.hardware = hardware
    world = cfg.world_size or default_world(cfg)
    return world, search(cfg, world, facts), facts


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def render(cfg: PlanCommandConfig, world: int, ranked: list[Candidate], facts) -> None:
    console = Console(width=max(160, Console().width))
    title = (f"meshrun-plan: {cfg.model.name} on {cfg.hardware.name}, {world} ranks, global "
             f"batch {cfg.train.global_batch_size} x seq {cfg.train.seq_len}, "
             f"{cfg.train.precision}")  # fmt: skip
    table = Table(title=title)
    for column in (
        "#",
        "layout",
        "fits",
        "peak GiB/rank (max)",
        "capacity GiB",
        "params",
        "grads",
        "optim",
        "activ.",
        "other",
        "tokens/s",
        "speedup",
        "micro-batch",
    ):
        table.add_column(column, justify="left" if column == "layout" else "right")  # fmt: skip
    for index, c in enumerate(ranked[: cfg.top], start=1):
        top = max(c.memory, key=lambda m: m.peak)
        tokens = f"{c.speed.tokens_per_s:,.0f}" if c.speed else "n/a"
        speedup = f"{c.speedup:.2f}x" if c.speedup else "n/a"
        micro = suggest_micro_batch(c, facts) if c.fits else None
        table.add_row(
            str(index), c.label, "yes" if c.fits else "[red]no[/red]", _gib(c.peak),
            _gib(min(c.capacity)), _gib(top.params), _gib(top.grads), _gib(top.optimizer),
            _gib(top.activations), _gib(top.other), tokens, speedup,
            str(micro) if micro else "-",
        )  # fmt: skip
    console.print(table)
    console.print("run a row again with:")
    for index, c in enumerate(ranked[: cfg.top], start=1):
        console.print(f"  {index:>2}  meshrun {c.overrides()}", soft_wrap=True, highlight=False)
    for c in ranked[: cfg.top]:
        for note in c.notes:
            console.print(f"[bold]{c.label}[/bold]: {note}")
    fitting = [c for c in ranked if c.fits]
    too_big = [f"{c.label} ({_gib(c.peak)} > {_gib(min(c.capacity))} GiB)"
               for c in ranked if not c.fits]  # fmt: skip
    if too_big:
        console.print(f"[red]do not fit[/red]: {'; '.join(too_big)}")
    if fitting:
        console.print(
            f"{len(fitting)} of {len(ranked)} legal layouts fit; best: {fitting[0].label}"
        )
    else:
        console.print(f"[red]none of {len(ranked)} legal layouts fits[/red]: more devices, "
                      "a smaller model or a shorter sequence")  # fmt: skip


def run(dict_cfg: DictConfig) -> int:
    cfg: PlanCommandConfig = OmegaConf.to_object(dict_cfg)
    try:
        world, ranked, facts = plan(cfg, HostFacts.detect())
    except ConfigError as err:
        print_error("config error", str(err))
        return 2
    render(cfg, world, ranked, facts)
    if cfg.json:
        Path(cfg.json).write_text(json.dumps(
            {"model": cfg.model.name, "hardware": cfg.hardware.name, "world_size": world,
             "layouts": [c.as_dict() for c in ranked]}, indent=2))  # fmt: skip
    return 0


main = hydra_command("plan", run)


if __name__ == "__main__":
    main()
