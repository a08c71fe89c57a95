"""Where a run's single-device baseline comes from (metrics.baseline), decided before its
ranks start: trained beside the run by rank 0 (`fresh`, where both fit), reused
from the store (`stored`: same config, same host fingerprint, young enough), or none (`off`,
and a single-device run, which is its own baseline)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from meshrun.core.baseline import baseline_config, baseline_key, is_own_baseline
from meshrun.core.config import ExperimentConfig
from meshrun.core.hardware import fingerprint_key, host_fingerprint
from meshrun.core.record import RunRecord
from meshrun.driver.launch.registry import launcher_for
from meshrun.driver.sinks.store import ResultsStore
from meshrun.plan.fit import baseline_fits_beside


def needs_baseline(cfg: ExperimentConfig) -> bool:
    return cfg.metrics.baseline != "off" and not is_own_baseline(cfg)


def stored_baseline(cfg: ExperimentConfig, store: ResultsStore) -> RunRecord | None:
    """metrics.baseline=stored: the newest stored baseline of this run's baseline, measured on
    this host as it is now (devices, versions, threads) within baseline_max_age_h. A run
    whose ranks are not here (a SLURM job's nodes are not known here) measures its own."""
    if cfg.metrics.baseline != "stored" or not launcher_for(cfg.launcher.name).ranks_here:
        return None
    since = datetime.now(timezone.utc) - timedelta(hours=cfg.metrics.baseline_max_age_h)
    here = fingerprint_key(host_fingerprint(cfg.launcher.threads_per_rank))
    key = baseline_key(baseline_config(cfg))
    return store.find_baseline(key, here, since.isoformat(timespec="seconds"))


def baseline_plan(cfg: ExperimentConfig) -> str:
    """How the run's single-device baseline is to be had, decided before its ranks start:
    `beside` (rank 0 trains it between the run's steps: a fresh one is needed and both fit),
    `stored`, `after` (a launch of its own after the run), `own` (a single-device run is its
    own) or `off`. Not beside torchft's replicas: each is rank 0 of a world of its own, and
    any of them may restart."""
    if not needs_baseline(cfg):
        return "off" if cfg.metrics.baseline == "off" else "own"
    if stored_baseline(cfg, ResultsStore(cfg.store.path)) is not None:
        return "stored"
    beside = cfg.parallel.fault_tolerance == "none" and baseline_fits_beside(cfg)
    return "beside" if beside else "after"


def age_s(record: RunRecord) -> float:
    created = datetime.fromisoformat(record.created_at)
    return (datetime.now(timezone.utc) - created).total_seconds()
