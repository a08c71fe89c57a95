"""The sbatch script launcher=slurm submits, as submitit writes it from the config: every
launcher key reaches its sbatch flag (no cluster needed to check that)."""

from __future__ import annotations

import dataclasses
import os
import signal

import cloudpickle
import pytest

from meshrun.core.errors import ConfigError
from meshrun.driver.launch import TRAIN, slurm_task
from meshrun.driver.launch.slurm_jobs import executor
from meshrun.driver.launch.slurm_replicas import SlurmReplicaGroups, group_cause
from meshrun.driver.launch.slurm_rules import replica_job_shape
from meshrun.driver.launch.slurm_task import SlurmTask
from tests.helpers import compose_config


def sbatch_script(*overrides: str) -> str:
    cfg = compose_config("launcher=slurm", *overrides)
    return executor(cfg)._make_submission_file_text("COMMAND", "0")


def test_every_launcher_key_becomes_its_sbatch_flag():
    script = sbatch_script(
        "launcher.nnodes=2",
        "launcher.nproc_per_node=4",
        "launcher.partition=gpu",
        "launcher.account=lab",
        "launcher.qos=high",
        "launcher.gpus_per_node=4",
        "launcher.cpus_per_task=8",
        "launcher.mem_gb=64",
        "launcher.time_min=90",
        "launcher.constraint=a100",
        "launcher.exclusive=true",
        "launcher.setup=['module load cuda/12.4']",
        "+launcher.sbatch_extra.mail-type=END",
    )
    flags = {line.split()[1] for line in script.splitlines() if line.startswith("#SBATCH")}
    assert {
        "--nodes=2",
        "--ntasks-per-node=4",
        "--partition=gpu",
        "--account=lab",
        "--qos=high",
        "--gpus-per-node=4",
        "--cpus-per-task=8",
        "--mem=65536M",
        "--time=90",
        "--constraint=a100",
        "--exclusive",
        "--mail-type=END",
    } <= flags
    setup, srun = script.index("module load cuda/12.4"), script.index("srun ")
    assert setup < srun
    assert "--kill-on-bad-exit=1" in script[srun:]


def test_unset_keys_leave_the_cluster_defaults():
    script = sbatch_script("launcher.nproc_per_node=2")
    for flag in (
        "--partition",
        "--account",
        "--qos",
        "--gpus-per-node",
        "--mem=",
        "--cpus-per-task",
        "--constraint",
        "--exclusive",
    ):
        assert flag not in script


def test_job_logs_go_under_the_run_dir(tmp_path):
    script = sbatch_script("launcher.nproc_per_node=2", f"run_dir={tmp_path}")
    assert f"--output={tmp_path}/slurm/%j/%j_0_log.out" in script
    assert f"--error {tmp_path}/slurm/%j/%j_%t_log.err" in script


def test_a_task_notes_slurms_warning_from_the_moment_it_is_unpickled():
    """SLURM may warn (SIGUSR2) while a task still imports torch: unpickling the task (the
    first thing submitit does in it) makes the signal a note instead of the task's death."""
    before = signal.getsignal(signal.SIGUSR2)
    try:
        task = cloudpickle.loads(cloudpickle.dumps(SlurmTask()))
        os.kill(os.getpid(), signal.SIGUSR2)
        assert isinstance(task, SlurmTask) and slurm_task._warned == [signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, before)
        slurm_task._warned.clear()


def test_a_replica_group_job_is_submitted_without_requeue_and_sized_to_its_group():
    """torchft under SLURM: one job a replica group (the run's nodes divided among them, or a
    group smaller than a node on one), never requeued by SLURM (the driver starts it again,
    healed from a live group, not from a checkpoint)."""
    assert replica_job_shape(nnodes=4, nproc_per_node=8, replicas=2) == (2, 8)
    assert replica_job_shape(nnodes=2, nproc_per_node=1, replicas=2) == (1, 1)
    assert replica_job_shape(nnodes=1, nproc_per_node=8, replicas=4) == (1, 2)
    with pytest.raises(ConfigError, match="one SLURM job of 3 ranks"):
        replica_job_shape(nnodes=3, nproc_per_node=2, replicas=2)
    cfg = compose_config(
        "launcher=slurm",
        "launcher.nnodes=2",
        "launcher.nproc_per_node=2",
        "parallel=hsdp",
        "parallel.dp_replicate=2",
        "parallel.dp_shard=2",
        "parallel.fault_tolerance=torchft",
        "launcher.lighthouse_host=10.0.0.1",
    )
    groups = SlurmReplicaGroups(cfg, TRAIN)
    script = executor(dataclasses.replace(cfg, launcher=groups.job_launcher))
    flags = {
        line.split()[1]
        for line in script._make_submission_file_text("C", "0").splitlines()
        if line.startswith("#SBATCH")
    }
    assert {"--nodes=1", "--ntasks-per-node=2", "--no-requeue"} <= flags
    assert groups.lighthouse_host == "10.0.0.1"


# sacct -n -P -o JobID,State,ExitCode of two real two-task jobs under srun --kill-on-bad-exit
# (scripts/slurm-cluster.sh): task 1 SIGKILLed, task 1 exiting 1.
KILLED_JOB = "144|FAILED|15:0\n144.batch|FAILED|15:0\n144.0|CANCELLED|0:15\n"
RAISED_JOB = "145|FAILED|15:0\n145.batch|FAILED|15:0\n145.0|FAILED|1:0\n"


def test_a_replica_jobs_cause_is_a_kill_where_a_signal_ended_its_step_else_its_record():
    group = range(2, 4)  # replica 1 of groups of 2 ranks
    record = {"rank": 3, "time": 1.0, "error": "ValueError: bad"}
    consequence = {"rank": 2, "time": 2.0, "error": "RuntimeError: connection closed"}
    assert group_cause(KILLED_JOB, "144", group, {}) == (
        2,
        "killed (SLURM job 144 CANCELLED, signal 15)",
    )
    # a rank killed while its peer recorded the lost connection: the unrecorded one is the cause
    assert group_cause(KILLED_JOB, "144", group, {2: consequence})[0] == 3
    assert group_cause(RAISED_JOB, "145", group, {3: record, 2: consequence}) == (
        3,
        "ValueError: bad",
    )
    assert group_cause(RAISED_JOB, "145", group, {9: record}) == (
        2,
        "exit code 1 (SLURM job 145 FAILED)",
    )
    assert group_cause("146|NODE_FAIL|0:0\n", "146", group, {})[1].startswith(
        "killed (SLURM job 146 NODE_FAIL"
    )
