"""The experiment's W&B run while its ranks train: a thread of the driver opens it when the
launch begins and follows rank 0's metrics.jsonl, logging each log step's records within a
second of rank 0 writing them, so that the dashboard shows the run as it trains. The driver
hands the run on to be finished (memory table, summary) once the run is recorded."""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path

from meshrun.core.run_files.metrics import StepRow
from meshrun.driver.sinks.wandb_sink import WandbRun

POLL_S = 1.0


class NewRecords:
    """The records appended to a JSON-lines file since the last call, whole lines only. A
    replaced file (a new inode: a resumed run's rank 0 rewrites it without the steps it trains
    again) is read from its start; the W&B run skips the steps it has logged."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._inode: int | None = None
        self._offset = 0

    def __call__(self) -> list[StepRow]:
        try:
            f = self.path.open("rb")
        except FileNotFoundError:
            return []
        with f:
            stat = os.fstat(f.fileno())  # of the file opened: a replace may come after
            if stat.st_ino != self._inode:
                self._inode, self._offset = stat.st_ino, 0
            f.seek(self._offset)
            data = f.read(stat.st_size - self._offset)
        whole = data[: data.rfind(b"\n") + 1]
        self._offset += len(whole)
        return [StepRow.from_json(json.loads(line)) for line in whole.splitlines() if line]


class LiveRun:
    """A W&B run fed from a thread: `open_run` (seconds: W&B's import and service) runs there
    too, so the launch does not wait for it. A failure ends the following; `stop` raises it,
    where the caller turns it into a warning."""

    def __init__(
        self, open_run: Callable[[], WandbRun], metrics: Path, poll_s: float = POLL_S
    ) -> None:
        self._open_run, self._records, self._poll_s = open_run, NewRecords(metrics), poll_s
        self._stopping = threading.Event()
        self._run: WandbRun | None = None
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._follow, name="meshrun-wandb", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        try:
            self._run = self._open_run()
            while not self._stopping.wait(self._poll_s):
                self._run.log_steps(self._records())
            self._run.log_steps(self._records())
        except Exception as err:  # wandb raises anything from OSError to its own errors
            self._error = err
            if self._run is not None:
                with contextlib.suppress(Exception):
                    self._run.close(exit_code=1)

    def stop(self) -> WandbRun:
        """The run, once every record the file holds now is logged."""
        self._stopping.set()
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._run is not None
        return self._run
