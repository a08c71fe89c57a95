"""meshrun's real launcher (`dispatch.launch`: torch elastic, or torchft's replica groups) in
a process of its own, whose ranks fork from its forkserver as a `meshrun` command's do.

Launched from the pytest process, every rank is spawned, and imports torch and the rank's code
again (~2.7 CPU-s a rank, measured): that process's forkserver is the rank pool's, and its
environment (PYTEST_CURRENT_TEST) and working directory change from test to test, which the
launcher takes, rightly, as a reason to spawn (driver/launch/local.py). The host's working
directory and environment never change: its first launch starts the launcher's forkserver
and every later launch forks its ranks from it, as a sweep's runs do in one `meshrun -m`.

`host.launch` has `dispatch.launch`'s signature: the launcher runs whole in the host, only
the call crosses (the config there, rank 0's return or the launcher's exception back, with
what the launcher printed, printed here for capsys). The ranks print to the host's log
(`SCRATCH/launch-host-<pid>.log`). A launch past its deadline, or interrupted, kills the
host, its forkserver and its ranks (one process group); the next launch starts a fresh host.
Tests that hand their ranks an environment of their own (`marked_env`) launch in-process:
the host's is fixed.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch.multiprocessing as mp

from meshrun.core.paths import REPO_ROOT
from meshrun.driver.launch import TRAIN, RankEntry
from meshrun.driver.launch.dispatch import launch
from tests.helpers import SCRATCH
from tests.ranks import JOB_TIMEOUT_S


def _exit_with_parent() -> None:
    """The pytest process gone (killed outright, its exit hooks never run): the host ends,
    with its launcher's forkserver and ranks."""
    parent = mp.parent_process()
    if parent is not None:
        parent.join()
        os.killpg(0, signal.SIGKILL)


def _serve(conn: Connection, env: dict[str, str]) -> None:
    os.setsid()  # its forkserver and ranks in its process group, to be killed with it
    os.environ.clear()
    os.environ.update(env)
    SCRATCH.mkdir(parents=True, exist_ok=True)
    with open(SCRATCH / f"launch-host-{os.getpid()}.log", "a") as out:
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
    threading.Thread(target=_exit_with_parent, name="exit-with-parent", daemon=True).start()
    while True:
        try:
            cfg, entry = conn.recv()
        except EOFError:
            return
        printed, warned = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(warned):
            try:
                outcome = ("returned", launch(cfg, entry))
            except BaseException as exc:  # the launcher's: RankFailure, RunInterrupted, ...
                outcome = ("raised", exc)
        try:
            conn.send((*outcome, printed.getvalue(), warned.getvalue()))
        except Exception:  # an exception that does not pickle: its traceback instead
            error = RuntimeError("".join(traceback.format_exception(outcome[1])))
            conn.send(("raised", error, printed.getvalue(), warned.getvalue()))


class LaunchHost:
    def __init__(self) -> None:
        self._process: Any = None
        self._conn: Connection | None = None

    @property
    def pid(self) -> int | None:
        """The host's process id (its process group's too), while it is up."""
        return None if self._process is None else self._process.pid

    def start(self) -> None:
        """The host, if not up: started from the repository root (its ranks import `tests`),
        with this process's environment less pytest's per-test variable."""
        if self._process is not None:
            return
        ctx = mp.get_context("spawn")
        self._conn, theirs = ctx.Pipe()
        env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
        self._process = ctx.Process(target=_serve, args=(theirs, env), name="launch-host")
        with contextlib.chdir(REPO_ROOT):
            self._process.start()
        theirs.close()

    def close(self) -> None:
        """The host, its forkserver and every rank they started, killed and waited for."""
        process, self._process = self._process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.join(10)
        self._conn.close()
        self._conn = None

    def launch(self, cfg: Any, entry: RankEntry = TRAIN, timeout: float = JOB_TIMEOUT_S) -> Any:
        """`dispatch.launch(cfg, entry)` in the host: rank 0's return value, or the launcher's
        exception raised here."""
        self.start()
        deadline = time.monotonic() + timeout
        try:
            self._conn.send((cfg, entry))
            while not self._conn.poll(1.0):
                if not self._process.is_alive():
                    raise RuntimeError(f"the launch host died ({self._process.exitcode})")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the launch ran past its {timeout:.0f} s")
            outcome, value, printed, warned = self._conn.recv()
        except BaseException:  # the deadline, the host's death, or pytest-timeout's interrupt
            self.close()
            raise
        sys.stdout.write(printed)
        sys.stderr.write(warned)
        if outcome == "raised":
            raise value
        return value
