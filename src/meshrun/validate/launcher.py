"""Rules of the launcher, shared by every command that starts ranks (`meshrun`,
`meshrun-comm`): how many ranks on how many nodes, attach mode under torchrun, CPU threads,
and fault injection. A launcher's own rules are its Launcher.check (driver/launch/)."""

from __future__ import annotations

import os

from meshrun.core.attached import attached_rank
from meshrun.core.config import (
    LAUNCHER_SCHEMAS,
    DebugConfig,
    LauncherConfig,
    LocalLauncherConfig,
)
from meshrun.core.errors import choice, fail, positive

CPU_DEFAULT_RANKS = 2


def check_launcher(launcher: LauncherConfig) -> None:
    if ":" not in launcher.name:  # else a user's, by its import path (driver/launch/registry)
        choice("launcher.name", launcher.name, tuple(LAUNCHER_SCHEMAS))
    positive("launcher.nnodes", launcher.nnodes)
    if launcher.name == "local" and launcher.nnodes != 1 and attached_rank() is None:
        fail(
            "launcher.nnodes",
            launcher.nnodes,
            "launcher=local runs on one node",
            "1; for several nodes launcher=slurm, or start meshrun with torchrun --nnodes",
        )
    positive("launcher.nproc_per_node", launcher.nproc_per_node, allow_none=True)
    positive("launcher.threads_per_rank", launcher.threads_per_rank, allow_none=True)


def check_start_method(launcher: LauncherConfig, on_cuda: bool) -> None:
    """Ranks forked from this driver cannot use CUDA: it has initialised CUDA by then
    (HostFacts.detect reads each device's properties: torch/cuda/__init__.py's
    get_device_properties calls _lazy_init, which in a forked child raises "Cannot
    re-initialize CUDA in forked subprocess"). A forkserver's ranks fork from a fresh server."""
    forked = isinstance(launcher, LocalLauncherConfig) and launcher.start_method == "fork"
    if forked and on_cuda and attached_rank() is None:
        fail(
            "launcher.start_method",
            "fork",
            "the driver has initialised CUDA (it read the devices), so ranks forked from it "
            "cannot use CUDA",
            "forkserver (the default) or spawn",
        )


def check_placement(
    launcher: LauncherConfig, world: int, gpus: int, what: str, shared: bool = False
) -> None:
    """`world` ranks over `launcher.nnodes` nodes (`what` names who asks for them); CUDA runs
    need a device per rank on a node, unless the ranks may share them (`shared`: gloo, which
    copes with two ranks on one GPU where NCCL refuses a duplicate device)."""
    nproc, nodes = launcher.nproc_per_node, launcher.nnodes
    if world % nodes:
        fail(
            "launcher.nnodes",
            nodes,
            f"{what} has {world} ranks, not a multiple of nnodes",
            f"a divisor of {world}",
        )
    if nproc is not None and nproc * nodes != world:
        fail(
            "launcher.nproc_per_node",
            nproc,
            f"{what} needs {world} ranks"
            + (f" ({world // nodes} on each of {nodes} nodes)" if nodes > 1 else ""),
            f"{world // nodes}, or null to follow the layout",
        )
    nproc = world // nodes
    if gpus and nproc > gpus and not shared:
        fail(
            "launcher.nproc_per_node",
            nproc,
            f"only {gpus} CUDA devices are visible",
            f"at most {gpus}, or backend=gloo (its ranks may share a GPU: slow, for checks)",
        )


def check_attached_world(launcher: LauncherConfig, what: str) -> None:
    """Under torchrun the ranks exist already: their number must be the run's."""
    if attached_rank() is None:
        return
    started = int(os.environ["WORLD_SIZE"])
    needed = launcher.nproc_per_node * launcher.nnodes
    if started != needed:
        fail(
            "WORLD_SIZE",
            started,
            f"torchrun started {started} ranks but {what} needs {needed}",
            f"torchrun --nnodes {launcher.nnodes} --nproc-per-node {launcher.nproc_per_node}, "
            "or another layout",
        )


def check_rank_of_run(key: str, rank: int | None, world: int) -> None:
    """A key naming one rank of the run (or none)."""
    if rank is not None and not 0 <= rank < world:
        fail(key, rank, f"no such rank in a run of {world}", f"0..{world - 1}, or null")


def check_debug(debug: DebugConfig, world: int, steps: int, unit: str = "steps") -> None:
    """Fault injection names a rank of the run and one of its `steps` (training steps, or
    meshrun-comm's measurements)."""
    check_rank_of_run("debug.fail_rank", debug.fail_rank, world)
    if debug.slow_step_s < 0:
        fail(
            "debug.slow_step_s",
            debug.slow_step_s,
            "is a pause after each step",
            "a number of seconds >= 0",
        )
    if not 0 <= debug.fail_step < steps:
        fail(
            "debug.fail_step",
            debug.fail_step,
            f"outside the {steps} {unit} of the run",
            f"0..{steps - 1}",
        )
