"""launcher=slurm's torchft replica groups (driver/launch/replicas.py): one SLURM job a group,
as torchft's own SLURM runner does, so that SLURM ending one group's job (a rank killed, a node
lost, a preemption) leaves the others' running. This driver, on the login host, runs the
lighthouse; a lost group is submitted again as a new job and loads a live group's state.
The jobs are not requeued by SLURM (--no-requeue): a requeued job would resume from a checkpoint,
behind its live peers."""

from __future__ import annotations

import dataclasses
import re
import socket
import subprocess
import time
from dataclasses import asdict, dataclass

import submitit

from meshrun.core.config import ExperimentConfig, SlurmLauncherConfig
from meshrun.core.layout import Layout
from meshrun.core.replica_place import ReplicaPlace
from meshrun.core.run_files.failures import recorded_failures
from meshrun.driver.launch import RankEntry
from meshrun.driver.launch.launcher import KILLED, GroupEnd
from meshrun.driver.launch.slurm_jobs import SACCT_TIMEOUT_S, executor, submit_with
from meshrun.driver.launch.slurm_rules import replica_job_shape
from meshrun.driver.launch.slurm_task import SlurmTask

# How often a group's job is looked up in sacct itself (submitit's cache waits longer as a
# job ages): a lost group is seen within this.
CHECK_EVERY_S = 2.0
# The states SLURM gives a job or step that it ended from outside (a signal, a lost node, the
# OOM killer, a preemption, the time limit): the group is started again.
ENDED_FROM_OUTSIDE = {"CANCELLED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT"}
SLURMCTLD_PORT = 6817


def group_cause(sacct_lines: str, job_id: str, group: range, recorded: dict) -> tuple[int, str]:
    """A failed group's root cause, from its job's accounting (`sacct -P -o
    JobID,State,ExitCode`) and its ranks' records: a step SLURM ended from outside, or whose
    tasks a signal ended (srun's --kill-on-bad-exit then ends the others: "CANCELLED 0:15"),
    is a kill (the first rank without a record of its own); a rank's exception ends the step
    "FAILED 1:0", and its record names it."""
    rows = [line.split("|") for line in sacct_lines.splitlines() if line.count("|") == 2]
    by_id = {row[0]: (row[1].split()[0], row[2]) for row in rows}
    state, exit_code = by_id.get(f"{job_id}.0") or by_id.get(job_id) or ("UNKNOWN", "0:0")
    returned, by_signal = (int(part) for part in exit_code.split(":"))
    own = {rank: recorded[rank] for rank in group if rank in recorded}
    if by_signal or state in ENDED_FROM_OUTSIDE:
        rank = next((r for r in group if r not in own), group[0])
        how = f"signal {by_signal}" if by_signal else "no signal"
        return rank, f"{KILLED}SLURM job {job_id} {state}, {how})"
    if own:
        first = min(own.values(), key=lambda r: r["time"])
        return first["rank"], first["error"]
    return group[0], f"exit code {returned} (SLURM job {job_id} {state})"


def lighthouse_host(launcher: SlurmLauncherConfig) -> str:
    """`launcher.lighthouse_host`, else the address this host reaches the SLURM controller
    from: the network the nodes reach the controller on, too."""
    if launcher.lighthouse_host:
        return launcher.lighthouse_host
    config = subprocess.run(
        ["scontrol", "show", "config"],
        capture_output=True,
        text=True,
        timeout=SACCT_TIMEOUT_S,
        check=False,
    ).stdout
    found = re.search(r"^SlurmctldHost\[0\]\s*=\s*([^\s(]+)(?:\(([^)]+)\))?", config, re.M)
    if found is None:
        return socket.getfqdn()
    controller = socket.gethostbyname(found.group(2) or found.group(1))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((controller, SLURMCTLD_PORT))  # no packet: it only picks the route
        return probe.getsockname()[0]


@dataclass
class _SlurmGroup:
    run_dir: str
    group: range  # the group's ranks in the run
    job: submitit.Job
    checked: float = 0.0

    def ended(self) -> GroupEnd | None:
        now = time.monotonic()
        force = now - self.checked >= CHECK_EVERY_S
        if force:
            self.checked = now
        if not self.job.done(force_check=force):
            return None
        tasks = [self.job.task(t) for t in range(len(self.group))]
        written = all(task.paths.result_pickle.exists() for task in tasks)
        # submitit waits for a finished job's missing results (a shared file system's lag):
        # only where SLURM says it completed (a killed task writes none)
        if (written or self.job.state == "COMPLETED") and self.job.exception() is None:
            return GroupEnd(value=tasks[0].result())
        lines = subprocess.run(
            ["sacct", "-j", self.job.job_id, "-n", "-P", "-o", "JobID,State,ExitCode"],
            capture_output=True,
            text=True,
            timeout=SACCT_TIMEOUT_S,
            check=False,
        ).stdout
        cause = group_cause(lines, self.job.job_id, self.group, recorded_failures(self.run_dir))
        return GroupEnd(failure=cause)

    def stop(self) -> None:
        self.job.cancel(check=False)


class SlurmReplicaGroups:
    def __init__(self, cfg: ExperimentConfig, entry: RankEntry) -> None:
        launcher = cfg.launcher
        if not isinstance(launcher, SlurmLauncherConfig):
            raise TypeError(f"launcher={launcher.name} is not a SLURM launcher")
        self.cfg, self.entry = cfg, entry
        replicas = cfg.parallel.dp_replicate
        nodes, tasks = replica_job_shape(launcher.nnodes, launcher.nproc_per_node, replicas)
        self.size = Layout.of(cfg.parallel).world_size // replicas
        self.job_launcher = dataclasses.replace(
            launcher,
            nnodes=nodes,
            nproc_per_node=tasks,
            sbatch_extra={**launcher.sbatch_extra, "no-requeue": True},
        )
        self.lighthouse_host = lighthouse_host(launcher)
        self.poll_interval_s = 0.5

    def start(self, place: ReplicaPlace, env: dict[str, str]) -> _SlurmGroup:
        job_cfg = dataclasses.replace(self.cfg, launcher=self.job_launcher)
        ex = executor(job_cfg)
        ex.update_parameters(job_name=f"meshrun-{self.cfg.name}-replica{place.id}")
        job = submit_with(ex, job_cfg, SlurmTask(), asdict(self.cfg), self.entry, env)
        first = place.id * self.size
        return _SlurmGroup(self.cfg.run_dir, range(first, first + self.size), job)
