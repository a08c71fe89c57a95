"""`meshrun-plan`: will this model fit, and which layout is fastest, before anything launches.

    meshrun-plan model=llama-7b hardware=a6000
    meshrun-plan model=llama-13b hardware=a100-80g launcher.nnodes=8 train.seq_len=4096

Plans `launcher.nnodes` boxes of the hardware profile (or `world_size` ranks, spread over
as many boxes as it takes). The keys given on the command line constrain the search; on a
GPU profile, precision, sequence and global batch default to what a real run of the model
would use (bf16, its context, GLOBAL_BATCH_TOKENS), said in the title; a model that names
no context needs train.seq_len there (the CPU's default would plan a toy sequence).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Table

from meshrun.core.batch import derived_global_batch
from meshrun.core.config import ExperimentConfig, TrainConfig, with_resolved
from meshrun.core.errors import ConfigError, choice, fail, positive
from meshrun.core.hardware import HostFacts, resolve_hardware, target_facts
from meshrun.core.layout import DIMENSIONS, Layout
from meshrun.core.precision import auto_precision
from meshrun.driver.command import hydra_command
from meshrun.driver.resolution import fill_degree, legal_on
from meshrun.driver.sinks.console import print_error
from meshrun.driver.tool_config import PlanCommandConfig
from meshrun.plan.candidate import Candidate, host_calibration, trace
from meshrun.plan.placement import devices_per_node
from meshrun.plan.run_time import RunTime
from meshrun.plan.search import Box, Plan, float8_unplanned, search
from meshrun.tools.plan.resolved import show_resolved
from meshrun.tools.plan.run_table import (
    print_cheapest,
    print_runs,
    run_cells,
    run_columns,
    run_dict,
    run_of,
)
from meshrun.validate import check_experiment
from meshrun.validate.launcher import CPU_DEFAULT_RANKS
from meshrun.validate.layout import check_degrees
from meshrun.validate.model import model_context, model_overrides, read_pretrained

GiB = 2**30
SHOWN = ("plan", "resolved")  # show=: the ranked layouts, or the run's RunPlan
COLUMNS_WIDTH = 175  # the table's columns but the layout's, whole, their borders included
# LLaMA's and LLaMA 2's global batch (4M tokens); GPT-3 175B used 3.2M.
GLOBAL_BATCH_TOKENS = 4 * 2**20
TOO_BIG_LISTED = 6
REASONS_LISTED = 8
ALTERNATIVES = 3
# What a preset (`parallel=tp2`) fixes: the whole layout.
PARALLEL_KEYS = tuple(f"parallel.{key}" for dim in DIMENSIONS for key in (dim.name, *dim.settings))


def given_keys(overrides: Iterable[str]) -> frozenset[str]:
    """The config keys a command line sets (`+k=v`, `k=v`); a parallel preset sets its
    layout."""
    keys = {o.lstrip("+~").split("=", 1)[0] for o in overrides}
    if "parallel" in keys:
        keys |= set(PARALLEL_KEYS)
    return frozenset(keys)


def command_keys() -> frozenset[str]:
    """The keys this command's line set (none outside a Hydra job)."""
    if not HydraConfig.initialized():
        return frozenset()
    return given_keys(HydraConfig.get().overrides.task)


def box_of(cfg: ExperimentConfig) -> Box:
    per_node = cfg.launcher.nproc_per_node or (
        CPU_DEFAULT_RANKS if cfg.hardware.device_type == "cpu" else devices_per_node(cfg)
    )
    if cfg.world_size is None:
        return Box(cfg.launcher.nnodes, per_node)
    if cfg.world_size <= per_node:
        return Box(1, cfg.world_size)
    if cfg.world_size % per_node:
        fail(
            "world_size",
            cfg.world_size,
            f"spans nodes of {per_node} devices unevenly",
            f"a multiple of {per_node}, or launcher.nnodes=N",
        )
    return Box(cfg.world_size // per_node, per_node)


@dataclass(frozen=True)
class Chosen:
    """What the command chose for keys not given, said in the title: the key the sequence
    came from, and a GPU plan's other defaults."""

    seq_from: str
    defaults: list[str]


def plan_sequence(cfg: PlanCommandConfig, given: frozenset[str]) -> str:
    """Sets the plan's sequence and returns the key it came from: train.seq_len where given
    (or on a CPU plan, its default), else on a GPU the model's context (model_context). A
    GPU plan of a model that names none is refused: the CPU's default, 128, planned a
    real model as a toy (its top row a pipeline of a thousand micro-batches)."""
    t = cfg.train
    if "train.seq_len" in given or cfg.hardware.device_type != "cuda":
        return "train.seq_len"
    context = model_context(cfg.model)
    if context is None:
        fail(
            "train.seq_len",
            t.seq_len,
            f"is the CPU's default; a GPU plan takes the model's context, and "
            f"model={cfg.model.name} names none (model.context_len, or a transformers "
            "config's max_position_embeddings)",
            "train.seq_len=N, the sequence to train at (or model.context_len: N in the preset)",
        )
    t.seq_len, key = context
    return key


def plan_defaults(
    cfg: PlanCommandConfig, given: frozenset[str], box: Box, facts: HostFacts
) -> list[str]:
    """What the plan leaves to its box, set in place once the sequence is known: the
    precision (auto: the profile's, core/precision.py), on a GPU profile the batch a real run
    of the model would use where the user gave none, elsewhere a null batch derived as a run
    derives it (over the box's ranks, or the given layout's data-parallel size); what a GPU
    plan set."""
    t, said = cfg.train, []
    if t.precision == "auto":
        t.precision = auto_precision(cfg.hardware, [d.capability for d in facts.cuda_devices])[0]
        said.append(str(t.precision))
    if cfg.hardware.device_type == "cuda" and "train.global_batch_size" not in given:
        t.global_batch_size = max(1, GLOBAL_BATCH_TOKENS // t.seq_len)
        said.append(f"a {GLOBAL_BATCH_TOKENS / 2**20:g}M-token batch")
    if t.global_batch_size is None:
        whole = set(PARALLEL_KEYS) <= given  # a preset: its own data-parallel size
        dp = Layout.of(cfg.parallel).dp_size if whole else box.world
        t.global_batch_size = derived_global_batch(t.micro_batch_size, dp)
    return said if cfg.hardware.device_type == "cuda" else []


def prepared(
    cfg: PlanCommandConfig, host: HostFacts, given: frozenset[str] = frozenset()
) -> tuple[Box, HostFacts, Chosen, str | None]:
    """`cfg` completed in place (the model model=hf/auto reads, the hardware, the sequence,
    a GPU plan's defaults); the box to plan, its facts, what was chosen, where the model was
    read."""
    positive("world_size", cfg.world_size, allow_none=True)
    positive("launcher.nnodes", cfg.launcher.nnodes)
    cfg.model, read_from = read_pretrained(cfg.model)  # model=hf/auto's, before the rules
    check_experiment(cfg, read_from)  # the model's own mistakes before any layout is tried
    hardware = resolve_hardware(cfg.hardware, target_facts(cfg.hardware, host))
    facts = target_facts(hardware, host)
    cfg.hardware = hardware
    box = box_of(cfg)
    if given & set(PARALLEL_KEYS):  # a layout the search keeps: its -1 filled as a run's is
        check_degrees(cfg.parallel)
        cfg.parallel = fill_degree(cfg.parallel, box.world, "world_size")
    seq_from = plan_sequence(cfg, given)
    return box, facts, Chosen(seq_from, plan_defaults(cfg, given, box, facts)), read_from


def plan(
    cfg: PlanCommandConfig, host: HostFacts, given: frozenset[str] = frozenset()
) -> tuple[Box, Plan, Chosen]:
    box, facts, chosen, read_from = prepared(cfg, host, given)
    experiment = with_resolved(cfg, model_read_from=read_from)  # what each layout's run gets
    found = search(experiment, box, legal_on(facts), given)
    if cfg.plan.trace:
        for c in found.ranked[: cfg.top]:
            trace(c)
    layout_keys = sorted(k for k in given if k.startswith("parallel"))
    if layout_keys and not any(c.fits for c in found.ranked):
        unconstrained = search(experiment, box, legal_on(facts), given - set(layout_keys)).ranked
        found.alternatives = [c for c in unconstrained if c.fits][:ALTERNATIVES]
        found.alternative_to = layout_keys
    return box, found, chosen


def command(c: Candidate, box: Box, model: str) -> str:
    """The `meshrun` command that runs the row: `model` (model_overrides), hardware, the
    layout, the training keys a run of it would not arrive at by itself, and SLURM where it
    spans nodes."""
    t = c.cfg.train
    derived = derived_global_batch(t.micro_batch_size, Layout.of(c.cfg.parallel).dp_size)
    differs = {
        # a GPU row names its precision (auto would decide on the box it runs on); CPU's is fp32
        "precision": c.cfg.hardware.device_type == "cuda" or t.precision != "fp32",
        "seq_len": t.seq_len != TrainConfig().seq_len,
        "global_batch_size": t.global_batch_size != derived,
    }
    train = [f"train.{k}={getattr(t, k)}" for k, shown in differs.items() if shown]
    train += ["train.compile=true"] if t.compile else []
    states = t.optimizer_states
    train += (
        [f"train.optimizer_states={states}"] if states != TrainConfig().optimizer_states else []
    )
    train += [
        f"train.float8.{k}={_value(getattr(t.float8, k))}"
        for k in ("enabled", "recipe")
        if getattr(t.float8, k) != getattr(TrainConfig().float8, k)
    ]
    nodes = [f"launcher=slurm launcher.nnodes={box.nodes}"] if box.nodes > 1 else []
    return " ".join(
        [
            "meshrun",
            model,
            f"hardware={c.cfg.hardware.name}",
            c.overrides(),
            *train,
            *nodes,
        ]
    )


def _value(value: object) -> str:
    """A value as a command line writes it (true, not True)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def step_line(c: Candidate) -> str:
    """`1.23 s = matmul 0.8 + attention 0.2 + ...`, the parts over 0.5% of the step."""
    if c.speed is None:
        return "n/a (no peak FLOP/s for this device)"
    step = c.speed.step_time_s
    shown = [(k, v) for k, v in c.speed.step_parts().items() if v > 0.005 * step]
    return f"{_seconds(step)} = " + " + ".join(f"{k} {_seconds(v)}" for k, v in shown)


def _seconds(value: float) -> str:
    return f"{value * 1e3:.3g} ms" if value < 1 else f"{value:.3g} s"


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


def render(cfg: PlanCommandConfig, box: Box, found: Plan, chosen: Chosen, model: str) -> None:
    """The plan's table, each row's command (`model`: the overrides that select the model),
    and why the rest do not fit."""
    shown = found.ranked[: cfg.top]
    widest = max((len(c.label) for c in shown), default=0)
    console = Console(width=max(widest + COLUMNS_WIDTH, Console().width))
    # soft-wrapped, whole: the title says what was planned
    console.print(_title(cfg, box, chosen), soft_wrap=True, highlight=False)
    calibration = host_calibration(shown[0].cfg) if shown else None
    if calibration is not None:
        said = (
            f"speed on this host's calibration (meshrun-plan calibrate): {calibration.describe()}"
        )
        console.print(said, soft_wrap=True, highlight=False)
    runs = [run_of(c) for c in shown]
    console.print(_table(shown, box, runs))
    console.print("run a row with:")
    for index, c in enumerate(shown, start=1):
        console.print(f"  {index:>2}  {command(c, box, model)}", soft_wrap=True, highlight=False)
    console.print("each row's predicted step, by what it waits for (exposed communication only):")
    for index, c in enumerate(shown, start=1):
        console.print(f"  {index:>2}  {step_line(c)}", soft_wrap=True, highlight=False)
    print_runs(console, shown, runs)
    rows: dict[str, list[str]] = {}  # a note once, with the rows it applies to
    for index, c in enumerate(shown, start=1):
        for note in c.notes:
            rows.setdefault(note, []).append(str(index))
    for note, numbers in rows.items():
        console.print(
            f"[bold]{'row' if len(numbers) == 1 else 'rows'} {', '.join(numbers)}[/bold]: {note}"
        )
    console.print(float8_line(cfg, found), soft_wrap=True, highlight=False)
    _why_not(console, box, found, model)


def float8_line(cfg: PlanCommandConfig, found: Plan) -> str:
    """What the plan says of float8: its rows' terms, or why it has none."""
    if any(c.cfg.train.float8.enabled for c in found.ranked):
        recipe = next(c.cfg.train.float8.recipe for c in found.ranked if c.cfg.train.float8.enabled)
        return (
            f"float8 rows: train.float8 ({recipe}, torchao) with train.compile, which fuses its "
            "casts; `float8 gain` is the predicted tokens/s over the same layout's without "
            "float8; MFU is against the bf16 peak (as is usual), a float8 row's against the "
            "fp8 peak too (after the /)"
        )
    why = float8_unplanned(cfg)
    return f"float8: none planned: {why}" if why else "float8: off (train.float8.enabled=false)"


def _title(cfg: PlanCommandConfig, box: Box, chosen: Chosen) -> str:
    """What was planned, with the defaults the command chose, so that a reader need not guess."""
    t = cfg.train
    nodes = (
        f"{box.nodes} x {cfg.hardware.name} ({box.per_node} ranks each)"
        if box.nodes > 1
        else f"{cfg.hardware.name}, {box.world} ranks"
    )
    title = (
        f"meshrun-plan: {cfg.model.name} on {nodes}, global batch {t.global_batch_size} x "
        f"seq {t.seq_len} ({chosen.seq_from}), {t.tokens_per_step / 1e6:.2f}M tokens a step, "
        f"{t.precision}"
    )
    if chosen.defaults:
        title += f" (GPU plan defaults: {', '.join(chosen.defaults)})"
    return title


def _table(shown: list[Candidate], box: Box, runs: list[RunTime | None]) -> Table:
    """The ranked layouts, one a row, numbered as the commands to run them are; `runs` each
    one's whole run."""
    table = Table()
    traced = any(c.traced for c in shown)
    cfg = shown[0].cfg if shown else None
    for column in (
        "#",
        "layout",
        "fits",
        "peak GiB/rank",
        "capacity GiB",
        "activ. GiB",
        "tokens/s",
        "per device",
        "speedup",
        "float8 gain",
        "MFU bf16/fp8 peak",
        "micro-batch",
        *(run_columns(cfg) if cfg else []),
        *(["traced GiB"] if traced else []),
    ):
        table.add_column(
            column, justify="left" if column == "layout" else "right", no_wrap=column == "layout"
        )
    for index, (c, run) in enumerate(zip(shown, runs, strict=True), start=1):
        top = max(c.memory, key=lambda m: m.peak)
        tokens = f"{c.speed.tokens_per_s:,.0f}" if c.speed else "n/a"
        per_device = f"{c.speed.tokens_per_s / box.world:,.0f}" if c.speed else "n/a"
        speedup = f"{c.speedup:.2f}x" if c.speedup else "n/a"
        table.add_row(
            str(index),
            c.label,
            "yes" if c.fits else "[red]no[/red]",
            _gib(c.peak),
            _gib(min(c.capacity)),
            _gib(top.activations),
            tokens,
            per_device,
            speedup,
            _float8(c),
            _mfu(c),
            str(c.cfg.train.micro_batch_size),
            *run_cells(c.cfg, run),
            *([_gib(max(m.peak for m in c.traced)) if c.traced else "n/a"] if traced else []),
        )
    return table


def _float8(c: Candidate) -> str:
    """A float8 row's predicted gain over the same layout without float8."""
    if not c.cfg.train.float8.enabled:
        return "-"
    return f"{c.float8_gain:.2f}x" if c.float8_gain else "on"


def _mfu(c: Candidate) -> str:
    """MFU against the devices' peak at the run's precision (bf16), as is usual; a float8
    row's against the fp8 peak too. The first device's peaks (a mixed box: its first kind)."""
    spec = c.cfg.hardware.devices[0] if c.cfg.hardware.devices else None
    if c.speed is None or spec is None:
        return "n/a"
    achieved = c.speed.model_tflops_per_device
    peak = spec.peak_tflops.get(str(c.cfg.train.precision))
    text = f"{achieved / peak:.0%}" if peak else "n/a"
    fp8 = spec.peak_tflops.get("fp8")
    if c.cfg.train.float8.enabled and fp8:
        text += f"/{achieved / fp8:.0%}"
    return text


def _why_not(console: Console, box: Box, found: Plan, model: str) -> None:
    """How many fit; what rules out the rest, and by how much the closest miss."""
    fitting = [c for c in found.ranked if c.fits]
    too_big = sorted((c for c in found.ranked if not c.fits), key=_excess)
    if too_big:
        listed = "; ".join(
            f"{c.label} ({_gib(c.peak)} > {_gib(min(c.capacity))} GiB)"
            for c in too_big[:TOO_BIG_LISTED]
        )
        more = f" and {len(too_big) - TOO_BIG_LISTED} more" if len(too_big) > TOO_BIG_LISTED else ""
        console.print(
            f"[red]do not fit[/red] (each with the least memory of its variants, "
            f"closest first): {listed}{more}",
            soft_wrap=True,
            highlight=False,
        )
    if fitting:
        console.print(
            f"{len(fitting)} of {len(found.ranked)} layouts fit; best: {fitting[0].label}",
            highlight=False,
        )
        print_cheapest(console, found, fitting[0].cfg)
    else:
        console.print(
            f"[red]no layout of {box.world} ranks fits[/red]: more devices, a "
            "smaller model, a shorter sequence or a smaller batch"
        )
        for c in sorted(found.ranked, key=_excess)[:3]:
            console.print(f"  closest: {c.label}: {_miss(c)}", highlight=False, soft_wrap=True)
    _experts(console, found)
    if found.alternatives:
        console.print(f"layouts that fit without your {', '.join(found.alternative_to)}:")
        for c in found.alternatives:
            console.print(f"  {c.label}: {command(c, box, model)}", highlight=False, soft_wrap=True)
    if found.ruled_out:
        console.print("ruled out by the rules a run checks (layouts and variants, by rule):")
        for example, count in found.reasons()[:REASONS_LISTED]:
            alike = " (and alike)" if count > 1 else ""
            console.print(f"  {count:>5} x  {example}{alike}", highlight=False, soft_wrap=True)


def _experts(console: Console, found: Plan) -> None:
    """For an MoE model: the best layout with expert parallelism, the same layout without it
    (each rank of its data-parallel group holding, or gathering, every expert) and why that
    does not fit where it does not, and the best layout without ep."""
    with_ep = [c for c in found.ranked if c.cfg.parallel.ep > 1]
    without = [c for c in found.ranked if c.cfg.parallel.ep == 1]
    if not (with_ep and without):
        return
    best = _best(with_ep)
    same = next((c for c in without if _mesh(c) == _mesh(best)), None)
    text = f"experts: the best layout with ep is {_said(best)}"
    if same is not None:
        text += f"; the same without ep, {_said(same)}"
    other = _best(without)
    if other is not same:
        text += f"; the best without ep, {_said(other)}"
    console.print(text, highlight=False, soft_wrap=True)


def _mesh(c: Candidate) -> tuple:
    p = c.cfg.parallel
    return (Layout.of(p).degrees(), p.etp, p.schedule, p.stages_per_rank, p.sequence_parallel)


def _said(c: Candidate) -> str:
    if not c.fits:
        return f"{c.label}, does not fit: {_miss(c)}"
    return f"{c.label} ({c.speed.tokens_per_s:,.0f} tokens/s)" if c.speed else c.label


def _best(candidates: list[Candidate]) -> Candidate:
    """The first in the plan's order that fits, else the closest to fitting."""
    return next((c for c in candidates if c.fits), None) or min(candidates, key=_excess)


def _excess(c: Candidate) -> float:
    return max(m.peak / cap for m, cap in zip(c.memory, c.capacity, strict=True) if cap > 0)


def _miss(c: Candidate) -> str:
    over = [m.peak - cap for m, cap in zip(c.memory, c.capacity, strict=True)]
    stage = over.index(max(over))
    device = c.cfg.hardware.devices[0].name if len(c.cfg.hardware.devices) == 1 else "its device"
    where = f"on pipeline stage {stage}" if len(c.memory) > 1 else "on every rank"
    return (
        f"needs {_gib(over[stage])} GiB more than {device} has {where} (predicted "
        f"{_gib(c.memory[stage].peak)} GiB)"
    )


def run(dict_cfg: DictConfig) -> int:
    cfg: PlanCommandConfig = OmegaConf.to_object(dict_cfg)
    given = command_keys()
    model = model_overrides(cfg.model)  # as composed: plan() reads model=hf/auto's
    try:
        choice("show", cfg.show, SHOWN)
        if cfg.show == "resolved":
            return show_resolved(cfg)
        box, found, chosen = plan(cfg, HostFacts.detect(), given)
    except ConfigError as err:
        print_error("config error", str(err))
        return 2
    render(cfg, box, found, chosen, model)
    if cfg.json:
        Path(cfg.json).write_text(
            json.dumps(
                {
                    "model": cfg.model.name,
                    "hardware": cfg.hardware.name,
                    "nodes": box.nodes,
                    "ranks_per_node": box.per_node,
                    "world_size": box.world,
                    "train": dataclasses.asdict(cfg.train),
                    "layouts": [
                        {**c.as_dict(), "command": command(c, box, model), "run": run_dict(c)}
                        for c in found.ranked
                    ],
                    "ruled_out": [{"rule": e, "count": n} for e, n in found.reasons()],
                },
                indent=2,
            )
        )
    return 0


main = hydra_command("plan", run)
