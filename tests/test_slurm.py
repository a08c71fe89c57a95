"""launcher=slurm and torchrun across nodes, against the real two-node cluster that
scripts/slurm-cluster.sh starts on this machine (nodes meshrun-node1 and -2, each a network
namespace with its own address). Without a cluster these tests skip, unless
MESHRUN_REQUIRE_SLURM=1 (CI) turns the skip into a failure."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshrun.core.paths import REPO_ROOT
from meshrun.driver.experiment import measure
from tests.cli import run_meshrun
from tests.ranks import config_in, losses
from tests.test_torchrun import check_ddp_recorded_once, torchrun

CLUSTER_SCRIPT = REPO_ROOT / "scripts" / "slurm-cluster.sh"
NODES = {"meshrun-node1", "meshrun-node2"}
TINY = ["model=tiny", "train.steps=6", "launcher=slurm", "launcher.threads_per_rank=1"]
DP2_ONE_PER_NODE = ["parallel=ddp", "launcher.nnodes=2", "launcher.nproc_per_node=1"]
FORMAT = ["JobID", "State", "Submit", "Start", "End", "NodeList"]

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(420)]


@pytest.fixture(scope="module", autouse=True)
def slurm_cluster() -> None:
    try:
        status = subprocess.run(
            [str(CLUSTER_SCRIPT), "status"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        up, detail = status.returncode == 0, status.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as err:
        up, detail = False, str(err)
    if up:
        return
    reason = f"no SLURM cluster ({detail}); start one with scripts/slurm-cluster.sh start"
    if os.environ.get("MESHRUN_REQUIRE_SLURM") == "1":
        pytest.fail(f"MESHRUN_REQUIRE_SLURM=1 but {reason}")
    pytest.skip(reason)


def sacct(job_id: str) -> dict[str, str]:
    """The job's own accounting line (not its steps), once SLURM has finished it: the
    driver may see the ranks' results a moment before SLURM ends the job."""
    fields = ["job_id", "state", "submit", "start", "end", "nodes"]
    deadline = time.monotonic() + 60
    while True:
        out = subprocess.run(
            ["sacct", "-j", job_id, "-X", "-n", "-P", "-o", ",".join(FORMAT)],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout.strip()
        job = dict(zip(fields, out.splitlines()[0].split("|"), strict=True)) if out else {}
        if job.get("state") not in (None, "PENDING", "RUNNING", "COMPLETING"):
            return job
        assert time.monotonic() < deadline, f"job {job_id} not finished: {job}"
        time.sleep(0.5)


def queue_state(job_id: str) -> str:
    """The job's state as the controller has it now (squeue; sacct may lag)."""
    return subprocess.run(
        ["squeue", "-h", "-j", job_id, "-o", "%T"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout.strip()


def rank_nodes(folder: Path, job_id: str) -> set[str]:
    """The nodes the job's ranks ran on, in their own words (submitit's first log line:
    `JobEnvironment(job_id=.., hostname=meshrun-node2, ..., global_rank=1(2))`). Not sacct's
    NodeList: read as the job ends, it once named meshrun-node1 alone for a job whose two
    ranks had logged node1 and node2."""
    logs = folder.glob(f"**/slurm/{job_id}/{job_id}_*_log.out")
    return {m.group(1) for log in logs for m in re.finditer(r"hostname=([\w-]+)", log.read_text())}


def job_ids(folder: Path) -> list[str]:
    """The SLURM jobs whose submitit folders lie below `folder` (run dir or sweep dir)."""
    return sorted((p.parent.name for p in folder.glob("**/slurm/*/*_submission.sh")), key=int)


def test_dp2_with_one_rank_per_node_lands_in_the_store_with_speedup_and_memory(meshrun):
    run = meshrun(*TINY, *DP2_ONE_PER_NODE)
    assert run.returncode == 0, run.output
    results = run.results
    assert results["status"] == "completed"
    assert results["world_size"] == 2
    assert results["layout_name"] == "ddp2"
    assert results["speedup"] is not None and results["speedup"] > 0
    assert len(results["peak_memory_bytes"]) == 2
    assert all(peak > 0 for peak in results["peak_memory_bytes"])
    [stored] = [r for r in run.stored() if r["role"] == "run"]
    assert stored["status"] == "completed"
    assert stored["speedup"] == results["speedup"]
    assert stored["peak_memory_max_bytes"] == max(results["peak_memory_bytes"])
    # One rank on each node, and each rank's output and errors under the run dir.
    # one job: rank 0 trained the baseline between the run's steps, on its node
    [job_id] = job_ids(run.run_dir)
    # 6 steps, 2 untimed: 4 rounds
    assert results["baseline_mode"] == "fresh" and results["speedup_rounds"] == 4
    assert rank_nodes(run.run_dir, job_id) == NODES
    logs = run.run_dir / "slurm" / job_id
    assert f"logs: {logs}" in run.output
    for rank in (0, 1):
        assert (logs / f"{job_id}_{rank}_log.out").exists()
        assert (logs / f"{job_id}_{rank}_log.err").exists()


def test_sweep_submits_both_jobs_before_either_finishes(tmp_path):
    sweep_dir = tmp_path / "sweep"
    run = run_meshrun(
        tmp_path / "unused",
        tmp_path / "meshrun.db",
        f"hydra.sweep.dir={sweep_dir}",
        *TINY,
        *DP2_ONE_PER_NODE,
        "metrics.baseline=off",
        "train.micro_batch_size=1,2",
        timeout=400,
        entrypoint=(sys.executable, "-m", "meshrun.driver.cli", "--multirun"),
    )
    assert run.returncode == 0, run.output
    ids = job_ids(sweep_dir)
    assert len(ids) == 2
    jobs = [sacct(job_id) for job_id in ids]
    assert all(job["state"] == "COMPLETED" for job in jobs), jobs
    # SLURM's own clock: the second job was submitted before the first one ended.
    assert max(job["submit"] for job in jobs) < min(job["end"] for job in jobs), jobs
    stored = run.stored()
    assert sorted(r["micro_batch_size"] for r in stored) == [1, 2]
    assert all(r["status"] == "completed" and r["world_size"] == 2 for r in stored)


def test_wait_false_returns_the_job_id_and_collect_records_it_later(meshrun):
    run = meshrun(*TINY, "parallel=single", "launcher.wait=false", "metrics.baseline=off")
    assert run.returncode == 0, run.output
    [job_id] = job_ids(run.run_dir)
    assert f"submitted SLURM job {job_id}" in run.output
    assert queue_state(job_id) in ("PENDING", "CONFIGURING", "RUNNING")  # not waited for
    assert not run.store_path.exists() or run.stored() == []
    collect = subprocess.run(
        [sys.executable, "-m", "meshrun.driver.collect", str(run.run_dir)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert collect.returncode == 0, collect.stdout + collect.stderr
    [stored] = run.stored()
    assert stored["status"] == "completed"
    assert stored["run_id"] == json.loads((run.run_dir / "results.json").read_text())["run_id"]
    again = subprocess.run(
        [sys.executable, "-m", "meshrun.driver.collect", str(run.run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert again.returncode == 0
    assert "nothing to collect" in again.stdout


def test_a_failing_rank_is_recorded_as_failed_with_its_error(meshrun):
    run = meshrun(*TINY, *DP2_ONE_PER_NODE, "debug.fail_rank=1", "debug.fail_step=2")
    assert run.returncode == 1, run.output
    results = run.results
    assert results["status"] == "failed"
    assert results["failed_rank"] == 1
    assert "injected failure on rank 1 at step 2" in results["error"]
    assert "/slurm/" in results["error"]  # where the failing rank's log is
    [stored] = run.stored()
    assert stored["status"] == "failed"
    assert stored["error"] == results["error"]


@pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="needs meshrun[ft]")
def test_a_killed_torchft_replica_job_is_submitted_again_and_rejoins(meshrun):
    """parallel.fault_tolerance=torchft under SLURM: each replica group its own job, the
    lighthouse in the driver on this (login) host. Replica 1's rank is SIGKILLed before step
    8: its job ends, replica 0's trains on alone, the driver submits replica 1 again, which
    loads replica 0's state over the nodes' network and trains beside it to the end."""
    run = meshrun(
        *TINY,
        *DP2_ONE_PER_NODE,
        "parallel.fault_tolerance=torchft",
        "train.steps=80",
        "train.seq_len=32",
        "train.log_every=5",
        "metrics.baseline=off",
        "debug.fail_rank=1",
        "debug.fail_mode=kill",
        "debug.fail_step=8",
        "debug.slow_step_s=0.1",
        "parallel.replica_restart_delay_s=1",
    )
    assert run.returncode == 0, run.output
    results = run.results
    assert results["status"] == "completed"
    [failure] = results["replica_failures"]
    assert (failure["replica"], failure["rank"], failure["attempt"]) == (1, 1, 0)
    assert failure["error"].startswith("killed (SLURM job ")
    replica_0, replica_1, replica_1_again = job_ids(run.run_dir)
    assert f"killed (SLURM job {replica_1} " in failure["error"]
    assert sacct(replica_0)["state"] == sacct(replica_1_again)["state"] == "COMPLETED"
    steps = [json.loads(line) for line in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in steps] == list(range(80))
    alone = [step for step, replicas in results["fewer_replica_steps"] if replicas == 1]
    assert alone[0] == 8 and alone == list(range(8, 8 + len(alone)))
    assert all(row["replicas"] == 2 for row in steps[alone[-1] + 1 :]), "replica 1 rejoined"


def test_trials_run_as_jobs_pinned_to_the_first_trials_nodes(meshrun):
    """plan.trials under SLURM: a job a trial, one after another; the second on the nodes the
    first ran on (sbatch --nodelist), so both are measured on the same hardware. (The run
    after them is a SLURM run as any other; trials_only keeps CI to the trials' jobs.)"""
    run = meshrun(
        *TINY,
        "launcher.nnodes=2",
        "launcher.nproc_per_node=1",
        "parallel=auto",
        "plan.trials=2",
        "plan.trials_only=true",
        "train.untimed_steps=1",
        "plan.trial_steps=2",
    )
    assert run.returncode == 0, run.output
    stored = run.stored()
    rows = sorted((r for r in stored if r["role"] == "trial"), key=lambda r: int(r["slurm_job_id"]))
    [verdict] = [r for r in stored if r["role"] == "trials"]  # trials_only's own record
    assert len(rows) == 2 and {r["trial_of"] for r in rows} == {verdict["run_id"]}
    scripts = [next(Path(r["run_dir"]).glob("slurm/*/*_submission.sh")).read_text() for r in rows]
    assert "--nodelist" not in scripts[0]
    assert "#SBATCH --nodelist=meshrun-node1,meshrun-node2" in scripts[1]
    for trial in rows:
        [job_id] = job_ids(Path(trial["run_dir"]))
        assert trial["slurm_job_id"] == job_id
        assert rank_nodes(Path(trial["run_dir"]), job_id) == NODES
        assert sorted(trial["host_per_rank"]) == sorted(NODES)
        assert trial["status"] == "completed" and trial["steps_completed"] == 3
    assert "fastest measured: trial" in run.output
    assert "not side by side" not in run.output


@pytest.mark.waits  # rank 0's 5 s timeout, then sacct's view of the job's end
def test_a_hanging_rank_ends_the_job_and_the_run_is_recorded(meshrun):
    """Rank 1 hangs: rank 0's collective times out, srun kills rank 1, which leaves no result;
    submitit learns from sacct that the job is over, so the driver does not wait forever."""
    run = meshrun(
        *TINY,
        *DP2_ONE_PER_NODE,
        "debug.fail_rank=1",
        "debug.fail_mode=hang",
        "debug.fail_step=2",
        "backend.timeout_s=5",
    )
    assert run.returncode == 1, run.output
    results = run.results
    assert results["status"] == "failed"
    assert results["failed_rank"] == 0
    assert "Timed out" in results["error"]
    [job_id] = job_ids(run.run_dir)
    assert sacct(job_id)["state"] == "FAILED"
    [stored] = run.stored()
    assert stored["status"] == "failed"


def test_partition_that_does_not_exist_is_a_config_error(meshrun):
    run = meshrun(*TINY, "launcher.partition=nope")
    assert run.returncode == 2
    assert "launcher.partition='nope': no such partition. Valid: debug" in run.output
    assert job_ids(run.run_dir) == []


def test_torchrun_across_two_nodes_runs_ddp(tmp_path):
    """Two torchrun agents, one per node (placed by srun), meet at a c10d rendezvous on the
    first node's address; the ranks train DDP across the two network namespaces."""
    command = [
        "srun",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        "--time=5",
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=meshrun-node1:29431",
        f"--rdzv-id={tmp_path.name}",
    ]
    proc = torchrun(tmp_path, "parallel=ddp", "launcher.nproc_per_node=1", command=command)
    check_ddp_recorded_once(tmp_path, proc)


def test_comm_benchmark_runs_one_rank_per_node_through_slurm(tmp_path):
    """meshrun-comm goes through the same SLURM launcher as training."""
    run = run_meshrun(
        tmp_path / "comm",
        tmp_path / "meshrun.db",
        "launcher=slurm",
        "launcher.nnodes=2",
        "launcher.nproc_per_node=1",
        "backend=gloo",
        "comm.ops=[all_reduce,sendrecv]",
        "comm.max_bytes=65536",
        "comm.warmup_iters=2",
        "comm.iters=5",
        entrypoint=(sys.executable, "-m", "meshrun.tools.comm.main"),
        defaults=("logger=none",),
    )
    assert run.returncode == 0, run.output
    report = json.loads((run.run_dir / "comm.json").read_text())
    assert report["status"] == "completed" and report["world_size"] == 2
    assert report["wrong"] == 0 and {r["op"] for r in report["rows"]} == {"all_reduce", "sendrecv"}
    [job_id] = job_ids(run.run_dir)
    assert rank_nodes(run.run_dir, job_id) == NODES


REQUEUE_SETTLE_S = 3  # seconds a requeued job stays held: past the second of its requeue


@pytest.mark.waits  # steps of over 1 s (debug.slow_step_s), a 1 min limit, SLURM's holds
def test_a_run_longer_than_its_time_limit_finishes_through_requeues(tmp_path, rank_pool):
    """Time limit 1 min, a run of more than 65 s (65 steps of over 1 s): SLURM's SIGUSR2
    before the limit makes every rank save and rank 0 requeue the job, which resumes from the
    checkpoint; the driver sees one run, completed, with the losses of an uninterrupted run.
    SLURM holds a requeued job for two minutes (BeginTime); the test releases it a few seconds
    after, as an idle cluster would: not within the second of the requeue, when the nodes
    still hold the old allocation's revoked credential (slurmd compares whole seconds) and
    kill the new start ("Job credential revoked")."""
    train = [
        "model=tiny",
        "train.steps=65",
        "train.log_every=5",
        "train.untimed_steps=1",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "train.seq_len=32",
        "launcher.threads_per_rank=1",
        "metrics.baseline=off",
        "parallel=ddp",
    ]
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "meshrun.driver.cli",
        f"hydra.run.dir={run_dir}",
        f"store.path={tmp_path}/meshrun.db",
        "logger=none",
        "train.progress_bar=false",
        *train,
        "launcher=slurm",
        "launcher.nnodes=2",
        "launcher.nproc_per_node=1",
        "launcher.time_min=1",
        "launcher.signal_delay_s=5",
        "debug.slow_step_s=1",
        "checkpoint.every_steps=10",
    ]
    started = time.monotonic()
    proc = subprocess.Popen(
        command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    timeline = []
    held_since: dict[str, float] = {}
    while proc.poll() is None:
        assert time.monotonic() - started < 400, "the requeued run did not finish"
        for job_id in job_ids(run_dir):
            squeue = ["squeue", "-h", "-j", job_id, "-o", "%T %r"]
            state = subprocess.run(
                squeue, capture_output=True, text=True, timeout=30, check=False
            ).stdout.split()
            if state != ["PENDING", "BeginTime"]:
                held_since.pop(job_id, None)
                continue
            since = held_since.setdefault(job_id, time.monotonic())
            if time.monotonic() - since >= REQUEUE_SETTLE_S:
                subprocess.run(
                    ["scontrol", "update", f"JobId={job_id}", "StartTime=now"],
                    check=True,
                    timeout=30,
                )
                timeline.append(f"{time.monotonic() - started:.0f} s: requeued, released")
        time.sleep(1)
    output = proc.communicate()[0]
    timeline.append(f"{time.monotonic() - started:.0f} s: done")
    print("\n".join(timeline))
    assert proc.returncode == 0, output
    results = json.loads((run_dir / "results.json").read_text())
    assert results["status"] == "completed" and results["requeues"] >= 1, timeline
    assert 0 < results["resumed_from_step"] < 65
    reference = measure(config_in(tmp_path / "whole", *train), "run", rank_pool.launch)
    assert results["losses"] == losses(reference)
