"""The Launcher protocol: what the driver asks of whatever starts a run's ranks, so that
`meshrun`, `meshrun-comm` and `meshrun-collect` name no launcher. Each implementation is
registered under its `launcher.name` (driver/launch/registry.py), which conf/launcher/<name>.yaml
sets along with the launcher's own schema."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from meshrun.core.config import ExperimentConfig, LauncherConfig
from meshrun.core.replica_place import ReplicaPlace
from meshrun.driver.launch.rank_entry import RankEntry
from meshrun.driver.tool_config import CommRunConfig

LaunchedConfig = ExperimentConfig | CommRunConfig


@runtime_checkable
class Launcher(Protocol):
    """Starts the ranks of one run and brings back rank 0's return value.

    `ranks_here`: the ranks run on this host, so its devices are the run's (False: on the
    hardware profile's box, e.g. a cluster's nodes seen from a login host). A failure is a
    RankFailure naming the rank that failed first (launch/__init__.py); Ctrl-C or SIGTERM
    stops the ranks (`run` cancels what it started) and raises."""

    name: str
    schema: type[LauncherConfig]
    ranks_here: bool

    def check(self, cfg: LaunchedConfig) -> LauncherConfig:
        """The launcher's own rules once the layout placed the ranks (ConfigError, exit 2,
        before any process starts); its config with what it resolves filled in."""
        ...

    def waits(self, launcher: LauncherConfig, in_sweep: bool) -> bool:
        """Whether the driver waits for the ranks; False: it submits them (a `Submitter`)
        and leaves, and `meshrun-collect` or the sweep's end records the run."""
        ...

    def run(self, cfg: LaunchedConfig, entry: RankEntry) -> Any:
        """Starts the ranks on `entry`, waits for them: rank 0's return value."""
        ...


class LauncherHere:
    """What a launcher whose ranks run on this host and are waited for shares (local, the
    ranks torchrun started): no rules of its own beyond the common ones; `run` is its own."""

    ranks_here = True

    def check(self, cfg: LaunchedConfig) -> LauncherConfig:
        return cfg.launcher

    def waits(self, launcher: LauncherConfig, in_sweep: bool) -> bool:
        return True


@runtime_checkable
class Submitter(Launcher, Protocol):
    """A launcher whose ranks outlive the driver (a batch job): started, waited for and
    cancelled apart, by the id `submit` returns."""

    def submit(self, cfg: LaunchedConfig, entry: RankEntry) -> str: ...

    def wait(self, cfg: LaunchedConfig, job_id: str) -> Any:
        """Rank 0's return value once the job is done; RankFailure if a rank failed."""
        ...

    def cancel(self, cfg: LaunchedConfig, job_id: str) -> None: ...


# How a replica group's failure begins where a rank of it was killed by a signal (or SLURM
# ended its job from outside): the group is started again (driver/launch/replicas.py).
KILLED = "killed ("


@dataclass(frozen=True)
class GroupEnd:
    """How a replica group ended: its rank 0's return value, or its root cause (the run's
    rank that caused it, the error: `KILLED...` for a signal)."""

    value: Any = None
    failure: tuple[int, str] | None = None


class ReplicaGroup(Protocol):
    def ended(self) -> GroupEnd | None:
        """None while it runs."""
        ...

    def stop(self) -> None:
        """Its ranks stopped (a stop signal first: a run that checkpoints saves)."""
        ...


class ReplicaGroups(Protocol):
    """How a launcher starts one replica group's ranks, `env` in their environment."""

    # the host name or address by which the groups' ranks reach this driver's lighthouse
    lighthouse_host: str
    poll_interval_s: float

    def start(self, place: ReplicaPlace, env: dict[str, str]) -> ReplicaGroup: ...


@runtime_checkable
class ReplicaLauncher(Launcher, Protocol):
    """A launcher that can start parallel.fault_tolerance=torchft's replica groups, each a
    world of its own, apart (driver/launch/replicas.py restarts a lost one)."""

    def replica_groups(self, cfg: ExperimentConfig, entry: RankEntry) -> ReplicaGroups: ...
