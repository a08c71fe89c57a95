"""Which rank failed first, and what it had not logged yet. When one rank raises, its peers
soon fail too (a closed connection, a timed-out collective), often within the same second,
which is all the resolution torch elastic's error files have. Each rank therefore notes the
exact time of its own exception (and its traceback) in the run dir, and the driver names the
earliest. A failing rank also writes the steps it finished since the last log step, which
only a log step's collective would have put in metrics.jsonl; the driver completes the
metrics with them (driver/failure.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import time
import traceback
from pathlib import Path
from typing import Any, NamedTuple

from meshrun.core.atomic_write import write_atomic
from meshrun.core.errors import Refused
from meshrun.core.run_files.metrics import StepRow

FAILURES_DIR = "failures"


class Stopped(Exception):
    """A signal stopped the run after it saved `step` steps in `path`."""

    def __init__(self, signum: int, step: int, path: Path) -> None:
        self.signum, self.step, self.path = signum, step, path
        name = signal.Signals(signum).name
        super().__init__(
            f"stopped by {name} after step {step - 1}, saved in {path}; "
            f"resume with checkpoint.resume={path.parent.absolute()}"
        )


class Failure(NamedTuple):
    rank: int
    error: str
    traceback: str | None = None


def note_process(run_dir: str, rank: int) -> None:
    """This rank's host and pid, by which a failing peer tells whether it is already gone."""
    folder = Path(run_dir) / FAILURES_DIR
    folder.mkdir(parents=True, exist_ok=True)
    noted = {"host": socket.gethostname(), "pid": os.getpid()}
    write_atomic(folder / f"process-rank{rank}.json", json.dumps(noted))


def note_finished(run_dir: str, rank: int) -> None:
    """This rank ended well: a peer failing after it is gone must not suspect it."""
    (Path(run_dir) / FAILURES_DIR / f"process-rank{rank}.json").unlink(missing_ok=True)


def _peer_states(folder: Path, rank: int) -> dict[int, str]:
    """Peers noted on this host (note_process) -> their process's state ("X": ended, "Z":
    a zombie)."""
    states, host = {}, socket.gethostname()
    for path in folder.glob("process-rank*.json"):
        peer, noted = int(path.stem.removeprefix("process-rank")), json.loads(path.read_text())
        if peer == rank or noted["host"] != host:
            continue
        try:
            states[peer] = (
                Path(f"/proc/{noted['pid']}/stat").read_text().rsplit(")", 1)[1].split()[0]
            )
        except (OSError, IndexError):
            states[peer] = "X"
    return states


def _gone_peers(folder: Path, rank: int) -> list[int]:
    """Peers on this host whose process had ended (or is a zombie) when this rank failed:
    they died first, and a peer that recorded nothing died by a signal. torch elastic
    reports the exit of only one rank, often this one's, whose error is only the symptom."""
    return sorted(peer for peer, state in _peer_states(folder, rank).items() if state in "ZX")


def await_peers_records(run_dir: str, rank: int, seconds: float) -> None:
    """Until every peer on this host still running has recorded its failure too, at most
    `seconds`. A failed rank's exit is what torch elastic acts on: it stops the others with
    SIGTERM at its next look (every 0.1 s), and a peer that had not yet seen the closed
    connection lost its unflushed steps (a loaded host: a DDP run's mean became one rank's).
    A peer that never notices (NCCL waits for its timeout) costs the wait, then is stopped."""
    folder = Path(run_dir) / FAILURES_DIR
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        recorded = recorded_failures(run_dir)
        states = _peer_states(folder, rank)
        if all(state in "ZX" or peer in recorded for peer, state in states.items()):
            return
        time.sleep(0.05)


def record_failure(run_dir: str, rank: int, err: BaseException) -> None:
    folder = Path(run_dir) / FAILURES_DIR
    folder.mkdir(parents=True, exist_ok=True)
    record = {
        "rank": rank,
        "time": time.time(),
        "error": f"{type(err).__name__}: {err}",
        "traceback": "".join(traceback.format_exception(err)),
        "refused": isinstance(err, Refused),
        "gone_peers": _gone_peers(folder, rank),
    }
    write_atomic(folder / f"rank{rank}.json", json.dumps(record))


def record_unflushed(run_dir: str, rank: int, steps: list[StepRow]) -> None:
    """This rank's records of the steps after the last log step (its own loss, not reduced):
    whole or absent, though torch elastic may kill the rank as it writes them (a peer died)."""
    folder = Path(run_dir) / FAILURES_DIR
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / f"steps-rank{rank}.json", json.dumps([s.to_json() for s in steps]))


def forget_failure(run_dir: str, rank: int) -> None:
    for name in (f"rank{rank}.json", f"steps-rank{rank}.json"):
        (Path(run_dir) / FAILURES_DIR / name).unlink(missing_ok=True)


def recorded_failures(run_dir: str) -> dict[int, dict[str, Any]]:
    """rank -> its failure record: error, traceback, the time it was recorded."""
    records = [json.loads(p.read_text()) for p in (Path(run_dir) / FAILURES_DIR).glob("rank*.json")]
    return {r["rank"]: r for r in records}


def first_failure(run_dir: str) -> Failure | None:
    """The earliest recorded failure, or None if no rank recorded one. A refusal (Refused)
    comes without its traceback, which is no news beside its message: that stays in the
    rank's record here."""
    records = recorded_failures(run_dir).values()
    if not records:
        return None
    first = min(records, key=lambda r: r["time"])
    trace = None if first.get("refused") else first.get("traceback")
    return Failure(first["rank"], first["error"], trace)


def read_unflushed(run_dir: str) -> dict[int, list[StepRow]]:
    """rank -> the steps it wrote as it failed (record_unflushed)."""
    folder = Path(run_dir) / FAILURES_DIR
    return {
        int(p.stem.removeprefix("steps-rank")): [
            StepRow.from_json(row) for row in json.loads(p.read_text())
        ]
        for p in folder.glob("steps-rank*.json")
    }
