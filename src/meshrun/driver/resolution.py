"""What a composed config leaves to the box, filled in for `facts`' box: hardware=auto's
profile, backend=auto's backend, the -1 degree, the ranks per node and their CPU threads,
the global batch and precision left to the box, a resume's checkpoint dir. Each step asks
validate's rules first, so a config is filled only where it is legal; the rules themselves
return nothing (validate/)."""

from __future__ import annotations

import dataclasses
import functools
import math
import os

from meshrun.core.checkpoints import find_resume, read_manifest, resumed_checkpoint
from meshrun.core.config import (
    BackendConfig,
    ExperimentConfig,
    HardwareConfig,
    LauncherConfig,
    ParallelConfig,
)
from meshrun.core.hardware import HostFacts, backend_name, rank_threads, resolve_hardware
from meshrun.core.layout import MESH_DIMS, Layout, dataparallel_devices
from meshrun.driver.box_defaults import with_batch, with_loss_kernel, with_precision
from meshrun.driver.launch.registry import launcher_checked
from meshrun.plan.candidate import Legal
from meshrun.validate import check_backend, check_experiment, check_layout, check_run
from meshrun.validate.launcher import CPU_DEFAULT_RANKS, check_placement
from meshrun.validate.layout import check_batch, check_dataparallel, check_fill, check_layout_keys


def resolved_config(cfg: ExperimentConfig, facts: HostFacts) -> ExperimentConfig:
    """`cfg` filled for `facts`' box and checked whole; ConfigError where it is not legal."""
    return resolved_run(resolved_layout(cfg, facts))


def resolved_layout(cfg: ExperimentConfig, facts: HostFacts) -> ExperimentConfig:
    """Backend, hardware, degrees and ranks filled, and with them the global batch and
    precision left to the box; the layout's rules checked: enough to predict memory."""
    check_experiment(cfg)
    hardware = resolve_hardware(cfg.hardware, facts)
    backend = backend_for(cfg, hardware, facts)
    parallel, launcher = placed_layout(dataclasses.replace(cfg, hardware=hardware), facts)
    resolved = dataclasses.replace(
        cfg, backend=backend, hardware=hardware, parallel=parallel, launcher=launcher
    )
    resolved = with_precision(with_batch(resolved, Layout.of(parallel).dp_size), hardware, facts)
    resolved = with_loss_kernel(resolved, hardware)
    check_layout(resolved, facts)
    return resolved


def resolved_run(resolved: ExperimentConfig) -> ExperimentConfig:
    """The rest of the rules, on a config from `resolved_layout`; a resume's checkpoint dir;
    the launcher's own rules, with what it resolves (driver/launch/)."""
    check_run(resolved)
    return launcher_checked(with_resume(resolved))


def backend_for(cfg: ExperimentConfig, hardware: HardwareConfig, facts: HostFacts) -> BackendConfig:
    """backend=auto's backend for `hardware` (resolved), checked usable on this host."""
    check_backend(cfg, hardware, facts)
    return dataclasses.replace(cfg.backend, name=backend_name(cfg.backend, hardware))


def legal(cfg: ExperimentConfig, facts: HostFacts) -> ExperimentConfig:
    """The layout's rules and the batch's, as a run checks them on the profile's box (not
    the launcher's host checks: a plan needs no SLURM client); raises ConfigError."""
    resolved = resolved_layout(cfg, facts)
    check_batch(resolved)
    return resolved


def legal_on(facts: HostFacts) -> Legal:
    """`legal` on `facts`' box, as the planner asks it of each layout it weighs."""
    return functools.partial(legal, facts=facts)


def with_resume(cfg: ExperimentConfig) -> ExperimentConfig:
    """A resume's checkpoint dir and path as core/checkpoints.resumed_checkpoint gives them."""
    path = find_resume(cfg.checkpoint, cfg.run_dir)
    if path is None:
        return cfg
    checkpoint = resumed_checkpoint(cfg.checkpoint, cfg.run_dir, path, read_manifest(path))
    return dataclasses.replace(cfg, checkpoint=checkpoint)


def placed_layout(cfg: ExperimentConfig, facts: HostFacts) -> tuple[ParallelConfig, LauncherConfig]:
    """The layout with its -1 degree filled and its ranks placed on the launcher's nodes."""
    p, launcher = cfg.parallel, cfg.launcher
    check_layout_keys(cfg)
    if p.data_parallel == "dataparallel":
        return _dataparallel(cfg, facts)
    # A CPU profile on a GPU host runs on the CPU: its GPUs neither size nor limit the world.
    gpus = facts.cuda_devices if cfg.hardware.device_type == "cuda" else []
    ranks = (
        launcher.nproc_per_node or (len(gpus) if gpus else CPU_DEFAULT_RANKS)
    ) * launcher.nnodes
    filled = fill_degree(p, ranks, "launcher.nproc_per_node")
    world = Layout.of(filled).world_size
    what = f"layout {Layout.of(filled).describe()} of parallel={p.name}"
    shared = backend_name(cfg.backend, cfg.hardware) == "gloo"
    return filled, place_ranks(launcher, world, len(gpus), facts, what, shared)


def fill_degree(p: ParallelConfig, world: int, key: str) -> ParallelConfig:
    """`p` with its -1 degree (if any) filled with what the others leave of `world` ranks, as
    a run and a plan alike fill it; `key` is what sized the world, named if it cannot be
    split."""
    check_fill(p, world, key)
    degrees = {dim: getattr(p, dim) for dim in MESH_DIMS}
    fill = [dim for dim, n in degrees.items() if n == -1]
    if not fill:
        return p
    fixed = math.prod(n for n in degrees.values() if n != -1)
    return dataclasses.replace(p, **{fill[0]: world // fixed})


def place_ranks(
    launcher: LauncherConfig,
    world: int,
    gpus: int,
    facts: HostFacts,
    what: str,
    shared: bool = False,
) -> LauncherConfig:
    """`world` ranks over `launcher.nnodes` nodes (`what` names who asks for them), each
    rank's CPU threads filled in; `shared`: ranks may share a GPU (gloo)."""
    check_placement(launcher, world, gpus, what, shared)
    nproc = world // launcher.nnodes
    threads = rank_threads(launcher, nproc, facts)
    return dataclasses.replace(launcher, nproc_per_node=nproc, threads_per_rank=threads)


def _dataparallel(cfg: ExperimentConfig, facts: HostFacts) -> tuple[ParallelConfig, LauncherConfig]:
    """torch.nn.DataParallel: one process over the host's devices, with all its cores."""
    check_dataparallel(cfg, facts)
    devices = dataparallel_devices(cfg.parallel, len(facts.cuda_devices))
    threads = cfg.launcher.threads_per_rank or os.cpu_count() or 1
    return (
        dataclasses.replace(cfg.parallel, dataparallel_devices=devices),
        dataclasses.replace(cfg.launcher, nproc_per_node=1, threads_per_rank=threads),
    )
