"""How a local launch's rank processes start: forkserver (torch imported once, in the server)
or spawn where a forkserver would start them in another environment or directory."""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal

from meshrun.driver.launch.rank_entry import RankEntry

# What the driver's own libraries set in its environment as it runs, which its ranks do not
# read: torch elastic's launch settings (it sets each rank's itself), W&B's service address.
DRIVER_ONLY_ENV = ("TORCHELASTIC_", "WANDB_")
# The environment and working directory this process's forkserver was started in (once).
_forkserver_started_in: list[tuple[dict[str, str], str]] = []


def start_method(configured: str) -> str:
    """forkserver's ranks start from the server's environment and working directory, those
    of this driver's first launch: a later launch after either changed (a sweep job's
    hydra.job.env_set, a test's monkeypatch), or one in a process whose server something
    else started, spawns its ranks instead."""
    if configured != "forkserver":
        return configured
    env = {k: v for k, v in os.environ.items() if not k.startswith(DRIVER_ONLY_ENV)}
    here = (env, os.getcwd())
    if not _forkserver_started_in:
        if multiprocessing.forkserver._forkserver._forkserver_pid is not None:
            return "spawn"  # started by another user of multiprocessing, in unknown conditions
        _forkserver_started_in.append(here)
        atexit.register(_stop_forkserver)
    return configured if _forkserver_started_in[0] == here else "spawn"


def rank_start_method(configured: str, entry: RankEntry) -> str:
    """`start_method`'s choice for `entry`'s ranks; a forkserver preloads the entry's module
    (torch with it) once, for every rank it forks (a torchft replica's restart included)."""
    method = start_method(configured)
    if method == "forkserver":
        multiprocessing.set_forkserver_preload([entry.module])
    return method


def _stop_forkserver() -> None:
    """At exit, the forkserver ended and waited for. It has reaped the ranks, so their CPU
    time becomes this process's children's (`time meshrun`, a benchmark's rusage); left to
    exit on its own, the server and the ranks' CPU with it are orphaned, and counted nowhere.
    Killed, not asked to stop: it has nothing to finish, and its interpreter's teardown (torch
    preloaded) would add a second to every command's exit."""
    pid = multiprocessing.forkserver._forkserver._forkserver_pid
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError, ChildProcessError):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
