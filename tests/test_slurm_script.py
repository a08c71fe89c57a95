"""The sbatch script launcher=slurm submits, as submitit writes it from the config: every
launcher key reaches its sbatch flag (no cluster needed to check that)."""

from __future__ import annotations

import os
import signal

import cloudpickle

from meshrun.driver.launch import slurm_task
from meshrun.driver.launch.slurm import executor
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
