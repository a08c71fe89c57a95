"""From a composed experiment to the one that runs: model=hf/auto's architecture and config
read from its checkpoint, the rules (validate), the layout if the planner is to pick it
(`parallel=auto`), and the memory check (plan.fit) between the layout's rules and the rest.
The one place that composes the two layers, so neither calls the other. Last, data=hf's
tokens are prepared (once; later runs find them cached)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from meshrun.core.config import ExperimentConfig, RunConfig, with_resolved
from meshrun.core.hardware import HostFacts, resolve_hardware
from meshrun.driver.prepare_data import prepare_data
from meshrun.plan.fit import check_fit
from meshrun.plan.search import best_layout
from meshrun.validate import check_experiment, validate_layout, validate_run
from meshrun.validate.custom import vocabulary_note
from meshrun.validate.launcher import CPU_DEFAULT_RANKS
from meshrun.validate.model import describe_read, read_pretrained


def resolve(
    cfg: ExperimentConfig, facts: HostFacts, say: Callable[[str], None] | None = None
) -> RunConfig:
    """The resolved config for `facts`' box, or ConfigError before any process starts. `say`
    hears what model=hf/auto read, and which layout `parallel=auto` chose, and why."""
    cfg = _read_model(cfg, say)
    if cfg.parallel.name == "auto":
        check_experiment(cfg)
        hardware = resolve_hardware(cfg.hardware, facts)
        per_node = cfg.launcher.nproc_per_node or len(facts.cuda_devices) or CPU_DEFAULT_RANKS
        world = per_node * cfg.launcher.nnodes
        cfg, why = best_layout(dataclasses.replace(cfg, hardware=hardware), world, facts)
        if say is not None:
            say(f"parallel=auto chose {why}")
    resolved = validate_layout(cfg, facts)
    check_fit(resolved, facts)  # before the batch rules: "does not fit" is the news to give
    resolved = prepare_data(validate_run(resolved))
    note = vocabulary_note(resolved)
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
