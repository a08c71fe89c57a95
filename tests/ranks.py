"""Multi-rank work in real gloo processes without the CLI.

`RankPool` keeps `size` worker processes alive for the whole test session, forked from a
server that imported torch once, instead of every rank of every run importing it. A job
runs one function on the first `world_size` workers at once, each with torchrun's env (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and a fresh MASTER_PORT), and returns every rank's return
value. The function creates and destroys its own process group (as `rank.worker.run_rank`).

Every job has a deadline. A rank that dies or misses the deadline tears the whole pool down
(its peers may be stuck in a collective), as does one that raises while a peer is still
running a few seconds later; the next job starts a fresh pool. A job whose ranks all
reported, some raising (a refusal every rank makes, a single rank's error), leaves the
workers free and the pool up. So a broken test fails, it never hangs the session or leaks a
process into the next test.

`pool.launch` has the driver's launcher signature (`launch_local`'s): pass it to
`meshrun.driver.experiment.measure` to run a resolved config exactly as `meshrun` does, minus
the CLI and torch elastic. Tests about failing or hanging ranks use the real launcher instead
(mostly in tests/launch_host.py's process), which is what proves that every rank is torn down.
"""

from __future__ import annotations

import contextlib
import gc
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from multiprocessing import forkserver
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from meshrun.core.paths import REPO_ROOT
from meshrun.core.run_files.failures import first_failure
from meshrun.core.run_files.metrics import StepRow
from meshrun.driver.experiment import measure
from meshrun.driver.launch import TRAIN, RankEntry, RankFailure
from meshrun.rank.mesh import end_distributed
from tests.helpers import resolved_config

JOB_TIMEOUT_S = 240.0
PEERS_GRACE_S = 5.0  # for a failed job's other ranks to report, before the pool is torn down


def _exit_with_parent() -> None:
    """A worker outlives a pytest process killed outright (its exit hooks never run): idle
    on its queue for ever, or spinning in a job whose peers are gone. Its parent's end ends
    it too."""
    parent = mp.parent_process()
    if parent is not None:
        parent.join()
        os._exit(1)


def _serve(index: int, jobs, results) -> None:
    """One worker: import torch once, then run jobs until told to stop (None). After each job
    its process groups end as a rank's do (rank/mesh.end_distributed: destroyed, DTensor's
    cache emptied, collected): they live in reference cycles, each holding gloo's threads and
    sockets (without this, 90 process groups and 276 gloo threads per worker by the end of a
    session), and ended at some later job's collection they would stop there instead. The
    libraries' objects are frozen out of the collection first, so that it walks only the
    jobs' own.
    torch.compile's code is dropped too: a later job's blocks would reuse an earlier one's
    (no compile to measure), up to dynamo's limit of entries a function, then run eagerly."""
    os.environ["OMP_NUM_THREADS"] = "1"
    threading.Thread(target=_exit_with_parent, name="exit-with-parent", daemon=True).start()
    gc.freeze()
    results.put(("ready", index, True, None))
    while (job := jobs.get()) is not None:
        job_id, fn, arg, env = job
        os.environ.update(env)
        torch.set_num_threads(1)  # run_rank sets the config's threads_per_rank
        try:
            value = (True, fn(arg))
        except BaseException:
            value = (False, traceback.format_exc())
        finally:
            end_distributed()  # the job's groups end with it, as a rank process's do
            torch._dynamo.reset()  # the next job compiles afresh, as a new rank process would
            gc.collect()
        results.put((job_id, index, *value))


class RankFailed(RuntimeError):
    def __init__(self, rank: int, error: str) -> None:
        self.rank, self.error = rank, error
        self.peers_done = False  # every other rank of the job reported too
        super().__init__(f"rank {rank} failed: {error}")


class RankPool:
    def __init__(self, size: int) -> None:
        self.size = size
        self.procs: list = []
        self.jobs: list = []
        self.results = None
        self.counter = 0

    def _start(self) -> None:
        # Forked from a server that imported torch and the ranks' code once (not 8
        # interpreters importing them). The server imports its preload from its working
        # directory, the first entry of its sys.path: started from a test's tmp_path
        # (monkeypatch.chdir), it found no `tests`, swallowed the ImportError and preloaded
        # nothing, and every worker imported torch itself (2.7 CPU-s a worker, measured).
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["tests.rank_preload"])
        with contextlib.chdir(REPO_ROOT):
            forkserver.ensure_running()
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(self.size)]
        self.procs = [
            ctx.Process(target=_serve, args=(i, q, self.results), daemon=True)
            for i, q in enumerate(self.jobs)
        ]
        for proc in self.procs:
            proc.start()
        self._collect("ready", range(self.size), time.monotonic() + JOB_TIMEOUT_S)

    def start(self) -> None:
        """The workers (and multiprocessing's forkserver, which they fork from), if not up."""
        if not self.procs:
            self._start()

    def close(self) -> None:
        """Stop every worker (asked first, then killed) and wait for them to be gone."""
        procs, self.procs = self.procs, []
        for proc, jobs in zip(procs, self.jobs, strict=True):
            if proc.is_alive():
                with contextlib.suppress(Exception):
                    jobs.put_nowait(None)
        deadline = time.monotonic() + 5
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self.jobs, self.results = [], None

    def _collect(self, job_id, ranks, deadline: float) -> dict[int, Any]:
        """Every rank's value; after the first that raised, the others get PEERS_GRACE_S to
        report too (they raised as well, or finished): then the workers are all free and the
        pool stays up (`RankFailed.peers_done`); one still running may be stuck in a
        collective with the failed rank, and the pool is torn down."""
        waiting, got = set(ranks), {}
        failure: RankFailed | None = None
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                if failure is not None:
                    raise failure
                raise TimeoutError(f"ranks {sorted(waiting)} still running after the deadline")
            try:
                got_id, index, ok, value = self.results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [i for i in waiting if not self.procs[i].is_alive()]
                if dead:
                    code = self.procs[dead[0]].exitcode
                    raise RankFailed(dead[0], f"process died (exit code {code})") from None
                continue
            if got_id != job_id:
                continue
            waiting.discard(index)
            got[index] = value
            if not ok and failure is None:
                failure = RankFailed(index, value)
                deadline = min(deadline, time.monotonic() + PEERS_GRACE_S)
        if failure is not None:
            failure.peers_done = True
            raise failure
        return got

    def run(
        self,
        fn: Callable[[Any], Any],
        arg: Any,
        world_size: int,
        timeout: float = JOB_TIMEOUT_S,
        env: dict[str, str] | None = None,
    ) -> list[Any]:
        """`fn(arg)` on ranks 0..world_size-1 at once; every rank's return value."""
        if world_size > self.size:
            raise ValueError(f"the pool has {self.size} workers, not {world_size}")
        self.start()
        self.counter += 1
        job_id = self.counter
        # The job's store, hosted here as torch elastic's agent hosts it (the ranks connect
        # as its clients): bound on a port the kernel picks, which no other test's job can
        # take between a port's choice and its binding, as a port chosen beforehand could.
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        common = {
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.port),
            "TORCHELASTIC_USE_AGENT_STORE": str(True),
            "GROUP_RANK": "0",
            **(env or {}),
        }
        try:
            for rank in range(world_size):
                rank_env = {**common, "RANK": str(rank), "LOCAL_RANK": str(rank)}
                self.jobs[rank].put((job_id, fn, arg, rank_env))
            got = self._collect(job_id, range(world_size), time.monotonic() + timeout)
        except RankFailed as failed:  # every rank reported: the workers are free again
            if not failed.peers_done:
                self.close()
            raise
        except BaseException:  # the deadline, or pytest-timeout's interrupt
            self.close()
            raise
        return [got[rank] for rank in range(world_size)]

    def launch(self, cfg, entry: RankEntry = TRAIN) -> Any:
        """`dispatch.launch`'s signature: `entry` (training's run_rank, or meshrun-comm's) on
        every rank of a resolved config; rank 0's return. A failing rank is the driver's
        RankFailure, with the error the rank recorded."""
        try:
            return self.run(entry, asdict(cfg), cfg.launcher.nproc_per_node)[0]
        except RankFailed as failed:
            recorded = first_failure(cfg.run_dir) or (failed.rank, failed.error)
            raise RankFailure(*recorded) from None


def config_in(tmp, *overrides: str):
    """The resolved config of `meshrun <overrides>` with its run dir and store under `tmp`."""
    return resolved_config(f"run_dir={tmp}/run", f"store.path={tmp}/meshrun.db", *overrides)


def measured_in(tmp, rank_pool, *overrides: str):
    """`meshrun <overrides>` measured on the pool with its run dir under `tmp` (a test that
    resumes from it names the path), which must have succeeded."""
    measured = measure(config_in(tmp, *overrides), "run", rank_pool.launch)
    assert measured.ok, measured.meta.error
    return measured


def losses(measured) -> list[float]:
    """Per-step losses rank 0 logged (metrics.jsonl), as results.json lists them."""
    return [step.loss for step in measured.steps]


def assert_steps_match(got: list[StepRow], want: list[StepRow], rel: float = 1e-4) -> None:
    """Two runs' per-step records agree: loss and global gradient norm within `rel`."""
    assert len(got) == len(want)
    for mine, ref in zip(got, want, strict=True):
        for key in ("loss", "grad_norm"):
            value, expected = getattr(mine, key), getattr(ref, key)
            assert abs(value - expected) <= rel * abs(expected), (
                f"step {mine.step} {key}: {value} vs {expected}"
            )
