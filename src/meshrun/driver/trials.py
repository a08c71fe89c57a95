"""`parallel=auto plan.trials=K`: the planner's first K layouts that fit each run a few timed
steps on the real ranks, one after another, and the run trains with the fastest measured.
A prediction ranks layouts; a measurement settles the ones it cannot tell apart (NeMo's
auto-configurator runs trials with no model; here the model picks what to try).

Each trial is a run of its own (store row, run dir under the run's `trials/`, W&B run in one
group), tagged with the id of the run it chose for; one that fails or runs out of memory is
recorded as such and left out of the choice. The run's record lists the trials with the
prediction's rank correlation and what its first choice would have lost (driver/trial_ranking.py);
under plan.trials_only, where no run trains after them, that record is the verdict's own
(role `trials`: the fastest trial's layout and figures under the run's id, in its run dir).

Under launcher=slurm each trial is a job of its own, waited for before the next is
submitted; the trials after the first that reported its nodes are pinned to those nodes
(sbatch --nodelist, unless launcher.sbatch_extra names some), so they are measured on the
same hardware, one after another, as local trials are. The run itself goes where SLURM
puts it."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict
from pathlib import Path

from meshrun.core.choices import BaselineMode, ExportFormat
from meshrun.core.config import PlanConfig, RunConfig, with_resolved
from meshrun.core.record import RunRecord
from meshrun.core.record_parts import Selection
from meshrun.driver.experiment import Launch, RunFailed, publish, run_experiment
from meshrun.driver.measured import new_run_id, utc_now
from meshrun.driver.results import trials_fields
from meshrun.driver.sinks.console import print_note, print_trials
from meshrun.driver.sinks.store import ResultsStore
from meshrun.driver.trial_ranking import Trial, fastest

TRIALS_DIR = "trials"


def run_with_trials(runs: list[RunConfig], plan: PlanConfig, launch: Launch) -> RunRecord:
    """`runs`: the layouts to try, resolved as their runs, in the planner's order; `plan`
    the settings of the trials. The chosen run's record, or (plan.trials_only) the trials'
    verdict; raises RunFailed where no trial completed."""
    run_id = new_run_id()
    main = runs[0]
    group = f"{main.name}-trials-{run_id}"
    records: list[RunRecord] = []
    nodes: list[str] | None = None
    for index, run in enumerate(runs, start=1):
        cfg = trial_config(on_nodes(run, nodes), index, plan.trial_steps, group)
        records.append(_trial(cfg, launch, run_id))
        nodes = nodes or Trial.of(records[-1]).nodes
    trials = [Trial.of(r) for r in records]
    print_trials(trials, plan.trial_steps, main.model.name, records[0].world_size or 1)
    best = fastest(trials)
    if best is None:
        first = records[0]
        error = f"none of the {len(trials)} trials completed (trial 1: {first.error})"
        raise RunFailed(dataclasses.replace(first, error=error))
    if plan.trials_only:
        return record_verdict(main, records[best], trials, run_id)
    chosen = runs[best]
    print_note(f"plan.trials: training with trial {best + 1}, {trials[best].layout_name}")
    return run_experiment(chosen, launch, run_id=run_id, trials=trials)


def record_verdict(run: RunConfig, best: RunRecord, trials: list[Trial], run_id: str) -> RunRecord:
    """plan.trials_only: the run the trials were for, recorded as a trained one would be
    (results.json in its run dir, a store row, a W&B run), as the fastest trial's layout and
    figures under the run's id, role `trials`, with the trials and their verdict."""
    verdict = dataclasses.replace(
        best,
        run_id=run_id,
        role="trials",
        created_at=utc_now(),
        name=run.name,
        sweep=run.sweep,
        run_dir=run.run_dir,
        selection=Selection(trials=[asdict(t) for t in trials], **trials_fields(trials)),
    )
    publish(run, verdict, [], ResultsStore(run.store.path))
    return verdict


def _trial(cfg: RunConfig, launch: Launch, run_id: str) -> RunRecord:
    try:
        return run_experiment(cfg, launch, role="trial", trial_of=run_id)
    except RunFailed as failed:  # recorded; the others go on
        return failed.results


def on_nodes(run: RunConfig, nodes: list[str] | None) -> RunConfig:
    """A SLURM trial pinned to the nodes an earlier one ran on (the module docstring); any
    other as it is."""
    if nodes is None:
        return run
    return dataclasses.replace(run, launcher=run.launcher.pinned_to(nodes))


def trial_config(run: RunConfig, index: int, timed_steps: int, group: str) -> RunConfig:
    """A run's layout for `timed_steps` after its untimed ones: no
    checkpoint, evaluation, export or baseline (the trials compare with each other), in a run
    dir of its own under the run's; its W&B group and store sweep are the trials'."""
    t = run.train
    steps = t.untimed_steps + timed_steps
    schedule = dataclasses.replace(
        t.lr_schedule, warmup_steps=min(t.lr_schedule.warmup_steps, steps - 1)
    )
    train = dataclasses.replace(
        t,
        steps=steps,
        lr_schedule=schedule,
        eval=dataclasses.replace(t.eval, every_steps=0),
    )
    checkpoint = dataclasses.replace(run.checkpoint, every_steps=0, export=ExportFormat["none"])
    cfg = dataclasses.replace(
        run,
        train=train,
        checkpoint=checkpoint,
        metrics=dataclasses.replace(run.metrics, baseline=BaselineMode["off"]),
        run_dir=str(Path(run.run_dir) / TRIALS_DIR / f"trial{index}"),
        name=f"{run.name}-trial{index}",
        sweep=group,
    )
    return with_resolved(cfg, baseline_beside=False)
