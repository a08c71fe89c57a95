"""launcher=slurm's rules: the sbatch resources first, then that this host reaches a SLURM
controller and the partition exists, all before anything is submitted (the driver's resolve
step runs them, as SlurmLauncher.check)."""

from __future__ import annotations

import dataclasses
import functools
import re
import shutil
import subprocess

from meshrun.core.config import ExperimentConfig, SlurmLauncherConfig
from meshrun.core.errors import fail, positive
from meshrun.driver.tool_config import CommRunConfig

SBATCH_FLAG = re.compile(r"^[a-z][a-z0-9-]*$")
# sbatch flags the launcher sets from its own keys; sbatch_extra must not set them again.
OWN_FLAGS = {
    "partition": "partition",
    "account": "account",
    "qos": "qos",
    "nodes": "nnodes",
    "ntasks-per-node": "nproc_per_node",
    "gpus-per-node": "gpus_per_node",
    "cpus-per-task": "cpus_per_task",
    "mem": "mem_gb",
    "time": "time_min",
    "constraint": "constraint",
    "exclusive": "exclusive",
    "output": "(the run dir's slurm/ folder)",
    "error": "(the run dir's slurm/ folder)",
}
SINFO_TIMEOUT_S = 30


def check_slurm(cfg: ExperimentConfig | CommRunConfig) -> SlurmLauncherConfig:
    """The launcher with `gpus_per_node` resolved, and each rank's CPU threads where unset
    (its task's CPUs); raises ConfigError on a bad value."""
    launcher = cfg.launcher
    if not isinstance(launcher, SlurmLauncherConfig):
        fail("launcher", launcher.name, "the SLURM rules apply to launcher=slurm only", "slurm")
    positive("launcher.time_min", launcher.time_min)
    positive("launcher.cpus_per_task", launcher.cpus_per_task, allow_none=True)
    positive("launcher.mem_gb", launcher.mem_gb, allow_none=True)
    gpus = _gpus_per_node(cfg)
    for key in launcher.sbatch_extra:
        _check_extra_flag(key)
    if isinstance(cfg, ExperimentConfig) and cfg.parallel.fault_tolerance == "torchft":
        _check_replica_jobs(cfg, launcher)
    _check_cluster(launcher.partition)
    threads = launcher.threads_per_rank or launcher.cpus_per_task
    return dataclasses.replace(launcher, gpus_per_node=gpus, threads_per_rank=threads)


def _gpus_per_node(cfg: ExperimentConfig | CommRunConfig) -> int:
    launcher, on_cuda = cfg.launcher, cfg.hardware.device_type == "cuda"
    tasks = launcher.nproc_per_node
    if launcher.gpus_per_node is None:
        return tasks if on_cuda else 0
    if launcher.gpus_per_node < 0:
        fail("launcher.gpus_per_node", launcher.gpus_per_node, "must not be negative", ">= 0")
    if on_cuda and launcher.gpus_per_node < tasks:
        fail(
            "launcher.gpus_per_node",
            launcher.gpus_per_node,
            f"each of the {tasks} tasks (ranks) per node needs its own GPU",
            f">= {tasks}, or null for one per task",
        )
    return launcher.gpus_per_node


def _check_replica_jobs(cfg: ExperimentConfig, launcher: SlurmLauncherConfig) -> None:
    """torchft's replica groups are one job each, restarted by this driver, which runs their
    lighthouse for the run's length: it waits for them."""
    if not launcher.wait:
        fail(
            "launcher.wait",
            launcher.wait,
            "torchft's replica groups (parallel.fault_tolerance=torchft) are restarted by the "
            "driver, which runs their lighthouse: it waits for the run",
            "launcher.wait=true",
        )
    replica_job_shape(launcher.nnodes, launcher.nproc_per_node or 1, cfg.parallel.dp_replicate)


def replica_job_shape(nnodes: int, nproc_per_node: int, replicas: int) -> tuple[int, int]:
    """(nodes, tasks a node) of one replica group's job: the run's nodes divided among the
    groups, or, where a group is smaller than a node, a group's ranks on one node."""
    group = nnodes * nproc_per_node // replicas
    if group % nproc_per_node == 0:
        return group // nproc_per_node, nproc_per_node
    if nproc_per_node % group == 0:
        return 1, group
    fail(
        "launcher.nproc_per_node",
        nproc_per_node,
        f"each of the {replicas} torchft replica groups is one SLURM job of {group} ranks, "
        "which neither fill whole nodes nor share one",
        f"a multiple or a divisor of {group}",
    )


def _check_extra_flag(key: str) -> None:
    if not SBATCH_FLAG.match(key):
        fail(
            "launcher.sbatch_extra",
            key,
            "not an sbatch flag name",
            "long flag names without dashes in front, e.g. mail-type",
        )
    if key in OWN_FLAGS:
        fail(
            "launcher.sbatch_extra",
            key,
            "is set by the launcher itself",
            f"launcher.{OWN_FLAGS[key]}",
        )


def _check_cluster(partition: str | None) -> None:
    if shutil.which("sbatch") is None:
        fail(
            "launcher",
            "slurm",
            "no SLURM client on this host (sbatch is not on PATH)",
            "launcher=local, or run meshrun where sbatch works (a login node)",
        )
    listed = _partitions()
    if partition is not None and partition not in listed:
        fail("launcher.partition", partition, "no such partition", " | ".join(listed))


@functools.cache
def _partitions() -> list[str]:
    """Asked once per process: the planner validates many candidate layouts."""
    try:
        listed = subprocess.run(
            ["sinfo", "--noheader", "--format=%R"],
            check=True,
            capture_output=True,
            text=True,
            timeout=SINFO_TIMEOUT_S,
        ).stdout.split()
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as err:
        stderr = getattr(err, "stderr", None) or "no answer"
        fail(
            "launcher",
            "slurm",
            f"the SLURM controller does not answer (sinfo: {str(stderr).strip()})",
            "a reachable cluster (check with `scontrol ping`)",
        )
    return listed
