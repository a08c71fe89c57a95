"""From a composed experiment to the one that runs: model=hf/auto's architecture and config
read from its checkpoint, the rules (validate), the layout if the planner is to pick it
(`parallel=auto`), and the memory check (plan.fit) between the layout's rules and the rest.
The one place that composes the two layers, so neither calls the other. Last, data=hf's
tokens are prepared (once; later runs find them cached)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from meshrun.core.config import ExperimentConfig, RunConfig, with_resolved
from meshrun.core.hardware import HostFacts, resolve_hardware, unknown_device_note
from meshrun.driver.box_defaults import with_batch, with_precision
from meshrun.driver.prepare_data import prepare_data
from meshrun.driver.resolution import legal_on, resolved_layout, resolved_run
from meshrun.driver.run_plan import with_checkpoint_interval
from meshrun.plan.candidate import Candidate
from meshrun.plan.fit import check_fit
from meshrun.plan.search import fitting_layouts, why, with_layout
from meshrun.validate import check_experiment
from meshrun.validate.custom import vocabulary_note
from meshrun.validate.launcher import CPU_DEFAULT_RANKS
from meshrun.validate.model import describe_read, read_pretrained
from meshrun.validate.trials import check_trials


def resolve(
    cfg: ExperimentConfig, facts: HostFacts, say: Callable[[str], None] | None = None
) -> RunConfig:
    """The resolved config for `facts`' box, or ConfigError before any process starts. `say`
    hears what model=hf/auto read, and which layout `parallel=auto` chose, and why."""
    cfg = _read_model(cfg, say)
    check_trials(cfg)
    if cfg.parallel.name == "auto":
        cfg, ranked = _fitting(cfg, facts)
        cfg = with_layout(cfg, ranked[0])
        if say is not None:
            say(f"parallel=auto chose {why(ranked)}")
    return _resolved(cfg, facts, say)


def resolve_trials(
    cfg: ExperimentConfig, facts: HostFacts, say: Callable[[str], None] | None = None
) -> list[RunConfig]:
    """`parallel=auto plan.trials=K`: the plan's first K layouts that fit, each resolved as
    its run would be (plan.trials cleared: the layout is given), in the plan's order."""
    cfg = _read_model(cfg, say)
    check_trials(cfg)
    cfg, ranked = _fitting(cfg, facts)
    ranked = ranked[: cfg.plan.trials]
    if say is not None:
        tried = ", ".join(c.label for c in ranked)
        say(f"parallel=auto plan.trials={cfg.plan.trials}: trying {tried}")
    given = dataclasses.replace(cfg.plan, trials=0, trials_only=False)
    chosen = [dataclasses.replace(with_layout(cfg, c), plan=given) for c in ranked]
    return [_resolved(c, facts, None) for c in chosen]


def _fitting(cfg: ExperimentConfig, facts: HostFacts) -> tuple[ExperimentConfig, list[Candidate]]:
    """parallel=auto's candidates: the plan's rows that fit every device of the box; `cfg`
    with the batch and precision it leaves to the box, resolved before the search (the batch
    derived over every rank: each layout's data-parallel size divides it)."""
    check_experiment(cfg)
    hardware = resolve_hardware(cfg.hardware, facts)
    per_node = cfg.launcher.nproc_per_node or len(facts.cuda_devices) or CPU_DEFAULT_RANKS
    world = per_node * cfg.launcher.nnodes
    cfg = with_precision(with_batch(cfg, world), hardware, facts)
    return cfg, fitting_layouts(dataclasses.replace(cfg, hardware=hardware), world, legal_on(facts))


def _resolved(
    cfg: ExperimentConfig, facts: HostFacts, say: Callable[[str], None] | None
) -> RunConfig:
    """The rules, the memory check and data=hf's tokens, for a config with its layout."""
    resolved = resolved_layout(cfg, facts)
    check_fit(resolved, legal_on(facts))  # before the batch rules: "does not fit" is the news
    resolved = with_checkpoint_interval(prepare_data(resolved_run(resolved)))
    for note in (vocabulary_note(resolved), unknown_device_note(resolved.hardware)):
        if note and say is not None:
            say(note)
    return resolved


def _read_model(cfg: ExperimentConfig, say: Callable[[str], None] | None) -> ExperimentConfig:
    """model=hf/auto's architecture and config, read from its checkpoint (the experiment's
    default name, `<model>_<parallel>`, follows the model's new one); any other as it is."""
    model, read_from = read_pretrained(cfg.model)
    if read_from is None:
        return cfg
    name = cfg.name
    if name == f"{cfg.model.name}_{cfg.parallel.name}":
        name = f"{model.name}_{cfg.parallel.name}"
    if say is not None:
        say(f"model {model.name}: {describe_read(model, read_from)}")
    return with_resolved(
        dataclasses.replace(cfg, model=model, name=name), model_read_from=read_from
    )
