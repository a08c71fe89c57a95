"""The driver's flow for one experiment: baseline (from the store, or measured first), the run
itself, then results.json, the store row and W&B. Failed runs go through the same path, and
so do a sweep's skipped points."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig

from meshrun.core.attached import attached_rank
from meshrun.core.baseline import baseline_config, is_own_baseline
from meshrun.core.batch import global_batch_size
from meshrun.core.checkpoints import (
    RESULTS_FILE,
    RUN_FILE,
    checkpoint_root,
    find_resume,
    read_manifest,
    same_dir,
    step_dir,
)
from meshrun.core.config import ExperimentConfig
from meshrun.core.errors import ConfigError
from meshrun.core.layout import Layout
from meshrun.core.naming import layout_name, rerun_overrides
from meshrun.core.rank_report import RankReport
from meshrun.core.record import RunRecord
from meshrun.core.run_files.failures import Stopped
from meshrun.core.run_files.library_warnings import other_ranks_warnings
from meshrun.core.run_files.metrics import METRICS_FILE, StepRow, read_records
from meshrun.core.run_files.positions import clear_records, with_diagnosis
from meshrun.core.stages import with_layers
from meshrun.driver.baseline import age_s, needs_baseline, stored_baseline
from meshrun.driver.failure import explained, with_unflushed
from meshrun.driver.launch import RankFailure, RunInterrupted
from meshrun.driver.measured import BaselineMode, Measured, Role, RunMeta
from meshrun.driver.results import assemble
from meshrun.driver.sinks.console import (
    print_error,
    print_note,
    print_summary,
    print_traceback,
    print_warning,
    resumed_line,
)
from meshrun.driver.sinks.live import LiveRun
from meshrun.driver.sinks.store import ResultsStore
from meshrun.driver.sinks.wandb_sink import WandbRun

Launch = Callable[[ExperimentConfig], RankReport | None]
EXPORT_DIR = "export"


class RunFailed(RuntimeError):
    def __init__(self, results: RunRecord) -> None:
        self.results = results
        super().__init__(results.error)


INTERRUPTED_EXIT = 130  # a shell's code for a command stopped by Ctrl-C


def reported(run: Callable[[], RunRecord]) -> int:
    """Runs an experiment to its record and prints the summary; the command's exit code."""
    try:
        results = run()
    except RunFailed as failed:
        print_summary(failed.results)
        if failed.results.status == "interrupted":
            print_error("run interrupted", str(failed))
            return INTERRUPTED_EXIT
        print_traceback(failed.results.traceback)
        print_error("run failed", str(failed))
        return 1
    print_summary(results)
    return 0


def run_experiment(
    cfg: ExperimentConfig, launch: Launch, role: Role = "run", **decided: Any
) -> RunRecord:
    """Returns the results record; raises RunFailed (after recording) if a rank failed.
    `cfg` carries the baseline's plan (driver/baseline.baseline_plan): with
    `resolved.baseline_beside`, rank 0 trains the baseline beside the run, between its steps.
    `decided`: RunMeta fields the driver decided before the run (a trial's, driver/trials.py)."""
    meta = begin(cfg, role, **decided)
    live = live_run(cfg, meta)
    measured = measured_run(cfg, meta, time.time(), lambda: launch(cfg))
    return finish_experiment(cfg, measured, launch, live)


def finish_experiment(
    cfg: ExperimentConfig, measured: Measured, launch: Launch, live: LiveRun | None = None
) -> RunRecord:
    """Baseline and record of a run measured already (here, or by a job submitted earlier)."""
    store = ResultsStore(cfg.store.path)
    meta, baseline = measured.meta, None
    if measured.ok and cfg.checkpoint.export != "none":
        meta = replace(meta, export_path=export(cfg))
    if is_own_baseline(cfg):
        meta = replace(meta, baseline_mode="own")
    elif needs_baseline(cfg):
        had = baseline_of(cfg, measured, launch, store)
        meta = replace(meta, baseline_mode=had.mode, baseline_age_s=had.age_s)
        baseline = had.record
    return record(cfg, replace(measured, meta=meta), baseline, store, live)


@dataclass(frozen=True)
class HadBaseline:
    """A run's single-device baseline (its record, where it has one) and how it was had."""

    record: RunRecord | None
    mode: BaselineMode | None = None
    age_s: float | None = None  # `stored`: how old the reused baseline is


def baseline_of(
    cfg: ExperimentConfig, measured: Measured, launch: Launch, store: ResultsStore
) -> HadBaseline:
    """The run's single-device baseline, recorded in the store as a run of its own, and how
    it was had: trained beside the run (`fresh`), a stored one of the same
    fingerprint (`stored`, its age), or, where both did not fit at once, measured by a launch
    of its own after the run (`after`)."""
    baseline = baseline_config(cfg)
    baseline_steps = measured.report.baseline_steps if measured.report else None
    if baseline_steps:
        return HadBaseline(
            record(baseline, baseline_measured(measured, baseline_steps), None, store), "fresh"
        )
    stored = stored_baseline(cfg, store)
    if stored is not None:
        return HadBaseline(stored, "stored", round(age_s(stored)))
    if not measured.ok:
        return HadBaseline(None)
    return HadBaseline(
        record(baseline, measure(baseline, "baseline", launch), None, store), "after"
    )


def baseline_measured(run: Measured, steps: list[StepRow]) -> Measured:
    """The baseline beside the run rank 0 trained between the run's steps, as a measured run of its
    own, on the run's host."""
    report = RankReport(memory_per_rank=[], fingerprint=run.report.fingerprint)
    return Measured(RunMeta(role="baseline"), steps, report)


def export(cfg: ExperimentConfig) -> str | None:
    """The final checkpoint's model as `checkpoint.export` asks; a failure costs the export
    (a warning), never the run: the checkpoint stays for another try."""
    # DCP and the model converters: a second of imports that only exporting runs pay
    from meshrun.models.export import export_checkpoint  # noqa: PLC0415

    final = step_dir(checkpoint_root(cfg.checkpoint, cfg.run_dir), cfg.train.steps)
    try:
        path = export_checkpoint(
            final,
            cfg.model,
            cfg.train.seq_len,
            cfg.checkpoint.export,
            Path(cfg.run_dir) / EXPORT_DIR,
        )
    except Exception as err:  # the model's library may raise anything; the run is done
        print_warning(f"export to {cfg.checkpoint.export} failed ({type(err).__name__}: {err})")
        return None
    return str(path)


def read_steps(run_dir: str) -> list[StepRow]:
    return read_records(Path(run_dir) / METRICS_FILE)


def measure(cfg: ExperimentConfig, role: Role, launch: Launch) -> Measured:
    """One launch, measured; no W&B run follows it (a baseline, meshrun-verify's runs)."""
    return measured_run(cfg, begin(cfg, role), time.time(), lambda: launch(cfg))


def new_run(run_dir: str) -> None:
    """The run dir cleared of what an earlier attempt's ranks left there (every command
    that starts ranks begins here)."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    if attached_rank() is None:  # under torchrun the peers may have written theirs already
        clear_records(run_dir)


def attempt(
    meta: RunMeta, run_dir: str, started: float, wait: Callable[[], Any]
) -> tuple[RunMeta, Any]:
    """Waits for the ranks (`wait` raises RankFailure if one failed): `meta` with how the
    attempt ended (status, error with the hang diagnosis, failed rank, duration), and rank
    0's return value."""
    returned, ended = None, {}
    try:
        returned = wait()
    except RankFailure as failure:
        stopped = failure.error.startswith(f"{Stopped.__name__}: ")  # saved, says how to resume
        if stopped or isinstance(failure, RunInterrupted):
            error = failure.error.removeprefix(f"{Stopped.__name__}: ")
            ended = {"status": "interrupted", "error": error}
        else:
            ended = {
                "status": "failed",
                "error": with_diagnosis(str(failure), run_dir, failure.rank),
                "failed_rank": failure.rank,
                "traceback": failure.traceback,
            }
    duration_s = round(time.time() - started, 3)
    return replace(meta, **ended, duration_s=duration_s), returned


def _given_overrides() -> list[str]:
    """The overrides `meshrun` was given (a sweep job's own), which its `run again` line
    repeats; none where another command (meshrun-verify) composed a config of its own."""
    if not HydraConfig.initialized() or HydraConfig.get().job.config_name != "train":
        return []
    return list(HydraConfig.get().overrides.task)


def begin(cfg: ExperimentConfig, role: Role, **decided: Any) -> RunMeta:
    """A training run's identity; its metrics file from an earlier attempt removed. A resume
    in the checkpoint's own run dir continues its run: its identity (run.json) and the steps
    before the checkpoint kept. In another run dir it is a new run, which notes the
    checkpoint it starts from and that checkpoint's run (validate/checkpoint.py made sure it
    loads that checkpoint and saves into a checkpoint dir of its own)."""
    resume = find_resume(cfg.checkpoint, cfg.run_dir)
    manifest = read_manifest(resume) if resume is not None else None
    identity = Path(cfg.run_dir) / RUN_FILE
    meta = RunMeta(role=role, given_overrides=_given_overrides(), **decided)
    continued = manifest is not None and same_dir(manifest.run_dir, cfg.run_dir)
    if continued and identity.is_file():
        clear_records(cfg.run_dir)  # rank 0 drops the steps after the checkpoint from metrics
        kept = json.loads(identity.read_text())
        meta = replace(meta, run_id=kept["run_id"], created_at=kept["created_at"])
    else:
        new_run(cfg.run_dir)
        (Path(cfg.run_dir) / METRICS_FILE).unlink(missing_ok=True)
        root = str(checkpoint_root(cfg.checkpoint, cfg.run_dir).absolute())
        created = {"run_id": meta.run_id, "created_at": meta.created_at, "checkpoint_dir": root}
        identity.write_text(json.dumps(created))
    if manifest is not None:
        meta = replace(
            meta,
            resumed_from_step=manifest.step,
            resumed_from_checkpoint=str(resume.absolute()),
            parent_run_id=None if continued else _run_id_in(manifest.run_dir),
        )
    if manifest is not None:
        print_note(f"{resumed_line(meta)}; run dir {cfg.run_dir}")
    return meta


def _run_id_in(run_dir: str) -> str:
    """The id of the run whose dir `run_dir` is (its run.json); `unknown` without one."""
    try:
        return json.loads((Path(run_dir) / RUN_FILE).read_text())["run_id"]
    except (OSError, ValueError, KeyError):
        return "unknown"


def measured_run(
    cfg: ExperimentConfig,
    meta: RunMeta,
    started: float,
    wait: Callable[[], RankReport | None],
) -> Measured:
    """`wait` returns rank 0's report once the ranks are done, or raises RankFailure;
    `started` is the epoch second the launch began. A failed run's steps are completed with
    those its ranks had not logged yet."""
    meta, report = attempt(meta, cfg.run_dir, started, explained(cfg, wait))
    for text, ranks in other_ranks_warnings(cfg.run_dir).items():
        print_warning(f"rank(s) {', '.join(map(str, ranks))} (not rank 0) warned: {text}")
    steps = with_unflushed(read_steps(cfg.run_dir), cfg.run_dir, Layout.of(cfg.parallel))
    return Measured(meta, steps, report)


def live_run(cfg: ExperimentConfig, meta: RunMeta) -> LiveRun | None:
    """The run's W&B run, fed as rank 0 logs (driver/sinks/live.py); none for a baseline."""
    if not _on_wandb(cfg, meta.role):
        return None
    identity = {
        "name": cfg.name,
        "sweep": cfg.sweep,
        "run_dir": cfg.run_dir,
        "layout_name": layout_name(cfg),
        "model": cfg.model.name,
        "hardware": cfg.hardware.name,
        "backend": cfg.backend.name,
        **asdict(meta),
    }
    return LiveRun(lambda: _wandb_run(cfg, identity), Path(cfg.run_dir) / METRICS_FILE)


def _on_wandb(cfg: ExperimentConfig, role: str) -> bool:
    """W&B mirrors the run itself (or plan.trials_only's verdict) and its trials, not its
    baseline."""
    return role in ("run", "trial", "trials") and cfg.logger.name == "wandb"


def _wandb_run(cfg: ExperimentConfig, identity: dict[str, Any]) -> WandbRun:
    return WandbRun(cfg.logger, asdict(cfg), identity, cfg.train.tokens_per_step)


def record(
    cfg: ExperimentConfig,
    measured: Measured,
    baseline: RunRecord | None,
    store: ResultsStore,
    live: LiveRun | None = None,
) -> RunRecord:
    """results.json, the store row, and (for the run itself) W&B; raises RunFailed after."""
    split = measured.report.pp_split if measured.report else None
    if split:  # the record names the split the ranks chose, to run it again
        cfg = with_layers(cfg, split.counts)
    results = assemble(cfg, measured, baseline)
    if results.inspection.profile:  # a profiled run's picture of its traced step
        # only here: matplotlib is half a second of every driver's start
        from meshrun.driver.sinks.timeline import write_timeline  # noqa: PLC0415

        write_timeline(results.as_dict())
    publish(cfg, results, measured.steps, store, live)
    if not measured.ok:
        raise RunFailed(results)
    return results


def record_skipped(cfg: ExperimentConfig, reason: ConfigError) -> RunRecord:
    """A sweep's invalid point: recorded like a run (status `skipped`, the reason as its
    error) so that the grid stays complete in the store and on W&B; no process starts. Its
    layout is named like a run's where its degrees are known, else by its preset."""
    p = cfg.parallel
    known = all(getattr(p, dim) >= 1 for dim in Layout().degrees())
    known = known and p.name != "auto" and p.data_parallel != "dataparallel"
    micro_ok = cfg.train.micro_batch_size >= 1
    known = known and micro_ok
    identity = RunMeta()
    results = RunRecord(
        run_id=identity.run_id,
        created_at=identity.created_at,
        error=str(reason),
        name=cfg.name,
        sweep=cfg.sweep,
        model=cfg.model.name,
        parallel=p.name,
        layout_name=layout_name(cfg) if known else p.name,
        overrides=rerun_overrides(_given_overrides(), cfg) if known else None,
        backend=cfg.backend.name,
        hardware=cfg.hardware.name,
        precision=cfg.train.precision,
        seq_len=cfg.train.seq_len,
        # a null batch as its degrees derive it (an unfilled -1 as 1): the report's maps sort it
        global_batch_size=global_batch_size(cfg) if micro_ok else cfg.train.global_batch_size,
        micro_batch_size=cfg.train.micro_batch_size,
        run_dir=cfg.run_dir,
    )
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    publish(cfg, results, [], ResultsStore(cfg.store.path))
    return results


def publish(
    cfg: ExperimentConfig,
    record: RunRecord,
    steps: list[StepRow],
    store: ResultsStore,
    live: LiveRun | None = None,
) -> None:
    """results.json and the store row first; W&B (the run itself only) last and fallible: a
    W&B failure costs the dashboard copy, never the run. The W&B run gets the steps it was
    not fed live (those a failed run's ranks had not logged; all of them without `live`)."""
    results = record.as_dict()
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    (Path(cfg.run_dir) / RESULTS_FILE).write_text(json.dumps(results, indent=2))
    store.record(record)
    if not _on_wandb(cfg, record.role):
        return
    try:
        run = live.stop() if live else _wandb_run(cfg, results)
        run.log_steps(steps)
        run.finish(results)
    except Exception as err:  # wandb raises anything from OSError to its own errors
        print_warning(
            f"W&B logging failed ({type(err).__name__}: {err}); the run is recorded in "
            f"{store.path} and {cfg.run_dir}/results.json"
        )
