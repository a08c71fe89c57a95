"""The Launcher protocol: what the driver asks of whatever starts a run's ranks, so that
`meshrun`, `meshrun-comm` and `meshrun-collect` name no launcher. Each implementation is
registered under its `launcher.name` (driver/launch/registry.py), which conf/launcher/<name>.yaml
sets along with the launcher's own schema."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from meshrun.core.config import ExperimentConfig, LauncherConfig
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
