"""From a composed experiment to the plan of its run (RunPlan), once per run: model=hf/auto's
architecture and config read from its checkpoint, the rules (validate) with what the box
decides filled in (driver/resolution.py), the layout if the planner is to pick it
(`parallel=auto`), and the memory check (plan.fit) between the layout's rules and the rest,
whose prediction the record reads. First on the box the hardware profile describes (its
layout, whether it fits), then on the host where the ranks run, without reading or
preparing anything twice; for hardware=auto they are the same. The one place that composes
validate and plan, so neither calls the other. Last, data=hf's tokens are prepared (once;
later runs find them cached) and the baseline's way decided (driver/baseline.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from meshrun.core.config import ExperimentConfig, with_resolved
from meshrun.core.hardware import (
    HostFacts,
    resolve_hardware,
    target_facts,
    unknown_device_note,
)
from meshrun.driver.baseline import baseline_plan
from meshrun.driver.box_defaults import with_batch, with_loss_kernel, with_precision
from meshrun.driver.launch.registry import launcher_for
from meshrun.driver.prepare_data import prepare_data
from meshrun.driver.resolution import legal_on, resolved_layout, resolved_run
from meshrun.driver.run_plan import RunPlan, plain, with_checkpoint_interval
from meshrun.plan.candidate import Candidate, evaluate
from meshrun.plan.fit import check_fit
from meshrun.plan.run_prediction import predict_run
from meshrun.plan.search import fitting_layouts, why, with_layout
from meshrun.validate import check_experiment
from meshrun.validate.custom import vocabulary_note
from meshrun.validate.launcher import CPU_DEFAULT_RANKS
from meshrun.validate.model import describe_read, read_pretrained
from meshrun.validate.trials import check_trials

Say = Callable[[str], None] | None


def resolve(cfg: ExperimentConfig, host: HostFacts, say: Say = None) -> RunPlan:
    """The run's plan on `host` (and the profile's box), or ConfigError before any process
    starts. `say` hears what model=hf/auto read, and which layout `parallel=auto` chose,
    and why."""
    read, boxes = _read(cfg, host, say)
    for box in boxes[:-1]:  # the profile's box, where the ranks do not run on it
        _checked(_chosen(read, box, None), box)
    return _planned(cfg, _chosen(read, boxes[-1], say), boxes[-1], say)


def resolve_trials(cfg: ExperimentConfig, host: HostFacts, say: Say = None) -> list[RunPlan]:
    """`parallel=auto plan.trials=K`: the plan's first K layouts that fit, each resolved as
    its run would be (plan.trials cleared: the layout is given), in the plan's order."""
    read, boxes = _read(cfg, host, say)
    for box in boxes[:-1]:
        for trial in _trials(read, box, None):
            _checked(trial, box)
    return [_planned(cfg, trial, boxes[-1], None) for trial in _trials(read, boxes[-1], say)]


def _read(cfg: ExperimentConfig, host: HostFacts, say: Say) -> tuple[ExperimentConfig, list]:
    """`cfg` with its model read, and the boxes to resolve it on: the profile's, where it is
    not the one the ranks run on, then that one (a cluster's ranks run on the profile's box,
    not on this login host: the Launcher's `ranks_here`)."""
    ranks_here = launcher_for(cfg.launcher.name).ranks_here
    if ranks_here:  # a GPU profile without a GPU here is the news
        resolve_hardware(cfg.hardware, host)
    target = target_facts(cfg.hardware, host)
    ranks_on = host if ranks_here else target
    read = _read_model(cfg, say)
    check_trials(read)
    return read, [ranks_on] if target is ranks_on else [target, ranks_on]


def _chosen(cfg: ExperimentConfig, facts: HostFacts, say: Say) -> ExperimentConfig:
    """`cfg` with its layout: parallel=auto's choice on `facts`' box, else as given."""
    if cfg.parallel.name != "auto":
        return cfg
    cfg, ranked = _fitting(cfg, facts)
    if say is not None:
        say(f"parallel=auto chose {why(ranked)}")
    return with_layout(cfg, ranked[0])


def _trials(cfg: ExperimentConfig, facts: HostFacts, say: Say) -> list[ExperimentConfig]:
    cfg, ranked = _fitting(cfg, facts)
    ranked = ranked[: cfg.plan.trials]
    if say is not None:
        tried = ", ".join(c.label for c in ranked)
        say(f"parallel=auto plan.trials={cfg.plan.trials}: trying {tried}")
    given = dataclasses.replace(cfg.plan, trials=0, trials_only=False)
    return [dataclasses.replace(with_layout(cfg, c), plan=given) for c in ranked]


def _fitting(cfg: ExperimentConfig, facts: HostFacts) -> tuple[ExperimentConfig, list[Candidate]]:
    """parallel=auto's candidates: the plan's rows that fit every device of the box; `cfg`
    with the batch and precision it leaves to the box, resolved before the search (the batch
    derived over every rank: each layout's data-parallel size divides it)."""
    check_experiment(cfg)
    hardware = resolve_hardware(cfg.hardware, facts)
    per_node = cfg.launcher.nproc_per_node or len(facts.cuda_devices) or CPU_DEFAULT_RANKS
    world = per_node * cfg.launcher.nnodes
    cfg = with_loss_kernel(with_precision(with_batch(cfg, world), hardware, facts), hardware)
    return cfg, fitting_layouts(dataclasses.replace(cfg, hardware=hardware), world, legal_on(facts))


def _checked(cfg: ExperimentConfig, facts: HostFacts) -> tuple[ExperimentConfig, Candidate]:
    """The rules and the memory check for a config with its layout, on `facts`' box; the
    candidate the memory check judged."""
    resolved = resolved_layout(cfg, facts)
    candidate = evaluate(resolved)
    check_fit(candidate, legal_on(facts))  # before the batch rules: "does not fit" is the news
    return resolved_run(resolved), candidate


def _planned(
    settings: ExperimentConfig, cfg: ExperimentConfig, facts: HostFacts, say: Say
) -> RunPlan:
    """The run's plan on the box its ranks run on: checked, data=hf's tokens prepared, the
    checkpoint interval, the prediction and the baseline's way."""
    resolved, candidate = _checked(cfg, facts)
    prediction = predict_run(resolved, candidate.speed)
    resolved = with_checkpoint_interval(prepare_data(resolved), prediction)
    for note in (vocabulary_note(resolved), unknown_device_note(resolved.hardware)):
        if note and say is not None:
            say(note)
    baseline = baseline_plan(resolved)
    config = with_resolved(
        resolved,
        baseline_beside=baseline == "beside",
        prediction=prediction,
        settings=plain(settings),
    )
    return RunPlan(settings, config, baseline)


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
