"""parallel.fault_tolerance=torchft: the run's data-parallel replica groups as worlds of their
own (rank/train/replicas.py), joined each step through torchft's lighthouse, which this driver runs
for the run's length. The launcher starts each group (ReplicaGroups: local processes,
local_replicas.py, or one SLURM job a group, slurm_replicas.py); a group one of whose ranks was
killed by a signal (the OOM killer, a lost device or node, a preemption) or left behind by its
peers is stopped and started again while the others train on, and joins them with a live
group's state. `parallel.replica_restarts` bounds the restarts of the whole run; an exception a
rank raises is the run's failure, as in any run (the same error would come back). Group 0's
rank 0 returns the report, with the failures."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing import SignalException

from meshrun.core.config import ExperimentConfig
from meshrun.core.rank_report import ReplicaFailure
from meshrun.core.replica_place import (
    LIGHTHOUSE_ENV,
    REPLICA_ENV,
    ReplicaAlone,
    ReplicaLagged,
    ReplicaPlace,
)
from meshrun.core.run_files.failures import first_failure
from meshrun.core.run_files.metrics import REPLICAS_DIR, fill_from_replicas, replicas_ended
from meshrun.driver.launch import RankFailure, interrupted
from meshrun.driver.launch.launcher import KILLED, ReplicaGroup, ReplicaGroups
from meshrun.driver.sinks.console import print_warning

# A replica silent this long is left out of the next quorum: the live ones wait this long
# for a dead peer once (torchft's default, 5 s, doubles a short run's stall).
HEARTBEAT_TIMEOUT_MS = 2000
# How long a quorum waits for replicas that heartbeat but have not asked to join (a restarted
# one still loading), before it goes on without them.
JOIN_TIMEOUT_MS = 500
# torchft's Rust half logs every quorum and commit at INFO (to stderr) unless told otherwise
RUST_LOG, QUIET = "RUST_LOG", "warn"
# The start of a group failure's error where the group is started again: a rank killed by a
# signal, a group left behind by its peers (ReplicaLagged), one stopped (a preempted job).
RESTARTABLE = (KILLED, f"{ReplicaLagged.__name__}: ", "Stopped: ")


class _Replicas:
    """The replica groups of one run: started, polled, restarted."""

    def __init__(self, cfg: ExperimentConfig, groups: ReplicaGroups, lighthouse: str) -> None:
        self.cfg, self.groups, self.lighthouse = cfg, groups, lighthouse
        self.started = time.monotonic()
        self.running: dict[int, tuple[ReplicaPlace, ReplicaGroup]] = {}
        self.restarts: list[tuple[float, ReplicaPlace]] = []  # (when, replica) to start again
        self.finished: dict[int, Any] = {}  # replica -> its return value
        self.failures: list[ReplicaFailure] = []

    def start(self, place: ReplicaPlace) -> None:
        env = {
            REPLICA_ENV: place.env(),
            LIGHTHOUSE_ENV: self.lighthouse,
            RUST_LOG: os.environ.get(RUST_LOG, QUIET),
        }
        self.running[place.id] = (place, self.groups.start(place, env))

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
        for replica, (place, group) in list(self.running.items()):
            end = group.ended()
            if end is None:
                continue
            del self.running[replica]
            if end.failure is None:
                self.finished[replica] = end.value
                replicas_ended(self.cfg.run_dir).touch()
                continue
            group.stop()  # the group's other ranks, waiting on the failed one
            rank, error = end.failure
            at_s = round(time.monotonic() - self.started, 3)
            failure = ReplicaFailure(place.id, rank, place.attempt, error, at_s)
            if self.finished and error.startswith(f"{ReplicaAlone.__name__}: "):
                continue  # restarted as the others ended the run: it trained nothing
            self.failures.append(failure)
            self._restart_or_fail(place, failure)

    def _restart_or_fail(self, place: ReplicaPlace, failure: ReplicaFailure) -> None:
        """Started again where a live replica has the state to give it and the run's restarts
        allow; else every replica stopped and the run failed."""
        restartable = failure.error.startswith(RESTARTABLE)
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
        for _, group in self.running.values():
            group.stop()
        self.running.clear()
        self.restarts.clear()


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def _handling(handler: signal.Handlers | Callable[[int, object], None]) -> Iterator[None]:
    """Ctrl-C and SIGTERM handled by `handler` inside, as before after."""
    before = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, old in before.items():
            signal.signal(s, old)


def _stop_signal(signum: int, frame: object) -> None:
    """Ctrl-C or SIGTERM to the driver, as torch elastic's processes raise it (a launcher
    whose groups are not this host's processes installs no handler of its own)."""
    sigval = signal.Signals(signum)
    raise SignalException(f"the driver received {sigval.name}", sigval)


def _lighthouse(host: str) -> tuple[Any, str]:
    """torchft's lighthouse, listening on every address; the address the ranks reach it by."""
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
    port = lighthouse.address().rsplit(":", 1)[1]
    return lighthouse, f"http://{host}:{port}"


def launch_replicas(cfg: ExperimentConfig, groups: ReplicaGroups) -> Any:
    """Replica 0's return value (its report, with every replica's failures)."""
    lighthouse, address = _lighthouse(groups.lighthouse_host)
    replicas = _Replicas(cfg, groups, address)
    shutil.rmtree(Path(cfg.run_dir) / REPLICAS_DIR, ignore_errors=True)  # an earlier attempt's
    (Path(cfg.run_dir) / REPLICAS_DIR).mkdir(parents=True)
    try:
        with _handling(_stop_signal):
            for replica in range(cfg.parallel.dp_replicate):
                replicas.start(ReplicaPlace(replica, cfg.parallel.dp_replicate, 0))
            while replicas.busy():
                time.sleep(groups.poll_interval_s)
                replicas.poll()
    except SignalException as err:  # Ctrl-C or SIGTERM here: a run that checkpoints saves
        with _handling(signal.SIG_IGN):  # a second Ctrl-C, while they save
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
