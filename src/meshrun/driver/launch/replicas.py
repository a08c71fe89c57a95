"""parallel.fault_tolerance=torchft: the run's data-parallel replica groups as worlds of their
own (rank/train/replicas.py), joined each step through torchft's lighthouse, which this driver runs
for the run's length. Each group's ranks are started by torch elastic's start_processes on a
store hosted here; a group one of whose ranks was killed by a signal (the OOM killer, a lost
device) or left behind by its peers is stopped and started again while the others train on,
and joins them with a live group's state. `parallel.replica_restarts` bounds the restarts of
the whole run; an exception a rank raises is the run's failure, as in any run (the same error
would come back). Group 0's rank 0 returns the report, with the failures."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import (
    DefaultLogsSpecs,
    SignalException,
    start_processes,
)
from torch.distributed.elastic.multiprocessing.api import PContext, RunProcsResult

from meshrun.core.config import ExperimentConfig
from meshrun.core.layout import Layout
from meshrun.core.rank_report import ReplicaFailure
from meshrun.core.replica_place import (
    LIGHTHOUSE_ENV,
    REPLICA_ENV,
    ReplicaAlone,
    ReplicaLagged,
    ReplicaPlace,
)
from meshrun.core.run_files.failures import first_failure, recorded_failures
from meshrun.core.run_files.metrics import REPLICAS_DIR, fill_from_replicas, replicas_ended
from meshrun.driver.launch import TRAIN, RankEntry, RankFailure, interrupted
from meshrun.driver.launch.local import rank_start_method
from meshrun.driver.sinks.console import print_warning

# A replica silent this long is left out of the next quorum: the live ones wait this long
# for a dead peer once (torchft's default, 5 s, doubles a short run's stall).
HEARTBEAT_TIMEOUT_MS = 2000
# How long a quorum waits for replicas that heartbeat but have not asked to join (a restarted
# one still loading), before it goes on without them.
JOIN_TIMEOUT_MS = 500
# torchft's Rust half logs every quorum and commit at INFO (to stderr) unless told otherwise
RUST_LOG, QUIET = "RUST_LOG", "warn"


@dataclass
class _Running:
    place: ReplicaPlace
    process: PContext
    store: dist.TCPStore  # the group's rendezvous, hosted here as torch elastic's agent does


class _Replicas:
    """The replica groups of one run: started, polled, restarted."""

    def __init__(self, cfg: ExperimentConfig, entry: RankEntry, lighthouse: str) -> None:
        self.cfg, self.entry, self.lighthouse = cfg, entry, lighthouse
        self.group_size = Layout.of(cfg.parallel).world_size // cfg.parallel.dp_replicate
        self.method = rank_start_method(cfg.launcher.start_method, entry)
        self.started = time.monotonic()
        self.running: dict[int, _Running] = {}
        self.restarts: list[tuple[float, ReplicaPlace]] = []  # (when, replica) to start again
        self.finished: dict[int, Any] = {}  # replica -> its return value
        self.failures: list[ReplicaFailure] = []

    def start(self, place: ReplicaPlace) -> None:
        """The replica group's ranks, a world of their own: its own store, which the ranks
        and torchft's Manager join (torch elastic's agent store)."""
        size = self.group_size
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        shared = {
            REPLICA_ENV: place.env(),
            LIGHTHOUSE_ENV: self.lighthouse,
            "WORLD_SIZE": str(size),
            "LOCAL_WORLD_SIZE": str(size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": str(True),
            RUST_LOG: os.environ.get(RUST_LOG, QUIET),
        }
        ranks = range(size)
        process = start_processes(
            name=f"meshrun-replica{place.id}",
            entrypoint=self.entry,
            args=dict.fromkeys(ranks, (asdict(self.cfg),)),
            envs={
                r: {**shared, "RANK": str(r), "LOCAL_RANK": str(place.id * size + r)} for r in ranks
            },
            logs_specs=DefaultLogsSpecs(),
            start_method=self.method,
        )
        self.running[place.id] = _Running(place, process, store)

    def busy(self) -> bool:
        return bool(self.running or self.restarts)

    def poll(self) -> None:
        """Each replica that ended: kept (finished), started again, or the run's failure;
        the restarts that are due, started."""
        due = [place for when, place in self.restarts if when <= time.monotonic()]
        self.restarts = [(when, p) for when, p in self.restarts if p not in due]
        for place in due:
            if not self.finished:  # else the live ones ended the run meanwhile
                self._start_again(place)
        for replica, running in list(self.running.items()):
            result = running.process.wait(timeout=0)
            if result is None:
                continue
            del self.running[replica]
            if not result.is_failed():
                self.finished[replica] = result.return_values[0]
                replicas_ended(self.cfg.run_dir).touch()
                continue
            running.process.close()  # the group's other ranks, waiting on the failed one
            failure = self._failure(running.place, result)
            if self.finished and failure.error.startswith(f"{ReplicaAlone.__name__}: "):
                continue  # restarted as the others ended the run: it trained nothing
            self.failures.append(failure)
            self._restart_or_fail(running.place, failure)

    def _failure(self, place: ReplicaPlace, result: RunProcsResult) -> ReplicaFailure:
        """The group's root cause: a rank killed by a signal without a record of its own (its
        peers' errors are its consequence), else the first rank's recorded error. Only the
        group's own ranks and records count (launch/local.root_cause reads the whole run's:
        here another group's dead rank is no cause)."""
        first = place.id * self.group_size
        ended = {first + local: failure for local, failure in result.failures.items()}
        recorded = recorded_failures(self.cfg.run_dir)
        killed = [r for r, f in sorted(ended.items()) if f.exitcode < 0 and r not in recorded]
        rank = killed[0] if killed else min(ended)
        if killed:
            error = f"killed ({ended[rank].signal_name()})"
        elif rank in recorded:
            error = recorded[rank]["error"]
        else:
            error = f"exit code {ended[rank].exitcode}"
        at_s = round(time.monotonic() - self.started, 3)
        return ReplicaFailure(place.id, rank, place.attempt, error, at_s)

    def _restart_or_fail(self, place: ReplicaPlace, failure: ReplicaFailure) -> None:
        """Started again where a live replica has the state to give it and the run's restarts
        allow; else every replica stopped and the run failed."""
        restartable = failure.error.startswith(("killed (", f"{ReplicaLagged.__name__}: "))
        allowed = len(self.failures) <= self.cfg.parallel.replica_restarts
        if self.finished:
            return  # the live ones ended the run: nothing left to train
        if restartable and allowed:
            again = ReplicaPlace(place.id, place.replicas, place.attempt + 1)
            if not self.running:
                self._none_live(again)
            delay = self.cfg.parallel.replica_restart_delay_s
            self.restarts.append((time.monotonic() + delay, again))
            print_warning(
                f"replica {place.id} lost (rank {failure.rank}: {failure.error}); the others "
                f"train on, it starts again in {delay:g} s (restart {len(self.failures)} of "
                f"{self.cfg.parallel.replica_restarts})"
            )
            return
        self.stop()
        recorded = first_failure(self.cfg.run_dir)
        if not restartable and recorded is not None:
            raise RankFailure(*recorded)
        spent = f"parallel.replica_restarts={self.cfg.parallel.replica_restarts} spent"
        raise RankFailure(failure.rank, f"replica {place.id} {failure.error}; {spent}")

    def _start_again(self, place: ReplicaPlace) -> None:
        if not self.running:
            self._none_live(place)
        self.start(place)

    def _none_live(self, place: ReplicaPlace) -> None:
        """A failed replica needs a live one to load the run's state from: none is left."""
        self.stop()
        raise RankFailure(
            self.failures[-1].rank,
            f"replica {place.id} {self.failures[-1].error} with no live replica left to take "
            "the run's state from; resume from the last checkpoint (checkpoint.resume=auto)",
        )

    def stop(self) -> None:
        for running in self.running.values():
            running.process.close()
        self.running.clear()
        self.restarts.clear()


@contextlib.contextmanager
def _ignoring(*signals: signal.Signals) -> Iterator[None]:
    before = {s: signal.signal(s, signal.SIG_IGN) for s in signals}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def launch_replicas(cfg: ExperimentConfig, entry: RankEntry = TRAIN) -> Any:
    """Replica 0's return value (its report, with every replica's failures)."""
    quiet = RUST_LOG not in os.environ
    os.environ.setdefault(RUST_LOG, QUIET)  # read once, as torchft's Rust half loads
    from torchft._torchft import LighthouseServer  # noqa: PLC0415 (only these runs need it)

    if quiet:  # the forkserver of the driver's other launches started without it
        del os.environ[RUST_LOG]
    lighthouse = LighthouseServer(
        bind="[::]:0",
        min_replicas=1,
        join_timeout_ms=JOIN_TIMEOUT_MS,
        heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
    )
    replicas = _Replicas(cfg, entry, lighthouse.address())
    shutil.rmtree(Path(cfg.run_dir) / REPLICAS_DIR, ignore_errors=True)  # an earlier attempt's
    (Path(cfg.run_dir) / REPLICAS_DIR).mkdir(parents=True)
    try:
        for replica in range(cfg.parallel.dp_replicate):
            replicas.start(ReplicaPlace(replica, cfg.parallel.dp_replicate, 0))
        while replicas.busy():
            time.sleep(cfg.launcher.monitor_interval_s)
            replicas.poll()
    except SignalException as err:  # Ctrl-C or SIGTERM here: a run that checkpoints saves
        with _ignoring(signal.SIGINT, signal.SIGTERM):  # a second Ctrl-C, while they save
            replicas.stop()
        raise interrupted(err.sigval.name, cfg.run_dir) from None
    finally:
        replicas.stop()
        lighthouse.shutdown()
        fill_from_replicas(cfg.run_dir)
    report = replicas.finished.get(0)
    if report is None:
        return None
    return dataclasses.replace(report, replica_failures=replicas.failures)
