"""`meshrun-comm`: time collectives like nccl-tests, on any backend, through the training
launchers, and check their results.

The per-rank function (`collectives.run_comm_rank`) goes through the driver's path of a
training run: the launcher rules (validate/launcher.py), a new run id with the run dir
cleared (`new_run`), `driver.launch.dispatch.launch` (torch elastic here, rank 0 itself under
torchrun, submitit for SLURM) and `attempt` (a failed rank with its hang diagnosis). Rank 0's
rows come back here, printed as tables and recorded as comm.json, a `comm_runs` row and W&B.
`meshrun-comm -m backend=gloo,nccl` compares backends in one sweep.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import asdict
from typing import Any

os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # before anything touches CUDA

from omegaconf import DictConfig, OmegaConf

from meshrun.core.attached import attached_rank
from meshrun.core.errors import ConfigError, choice, fail, positive
from meshrun.core.hardware import HostFacts, resolve_hardware
from meshrun.driver.command import hydra_command
from meshrun.driver.experiment import attempt, new_run
from meshrun.driver.launch import RankEntry
from meshrun.driver.launch.dispatch import launch
from meshrun.driver.launch.registry import launcher_for
from meshrun.driver.measured import RunMeta
from meshrun.driver.resolution import backend_for, place_ranks
from meshrun.driver.sinks.console import console, print_error
from meshrun.driver.tool_config import CommRunConfig
from meshrun.tools.comm.busbw import OPS
from meshrun.tools.comm.collectives import DTYPES, REDOPS, device_type, measurements
from meshrun.tools.comm.report import print_tables, record, summarize, write_json
from meshrun.validate import check_logger
from meshrun.validate.launcher import (
    CPU_DEFAULT_RANKS,
    check_attached_world,
    check_debug,
    check_launcher,
    check_start_method,
)

COMM = RankEntry("meshrun.tools.comm.collectives", "run_comm_rank")


def validate_comm(cfg: CommRunConfig, facts: HostFacts) -> CommRunConfig:
    """The resolved config (backend, ranks, threads, name), or ConfigError before any rank."""
    c = cfg.comm
    if not c.ops:
        fail("comm.ops", c.ops, "nothing to measure", " | ".join(OPS))
    for op in c.ops:
        choice("comm.ops", op, OPS)
    if not c.dtypes:
        fail("comm.dtypes", c.dtypes, "nothing to measure", " | ".join(DTYPES))
    for dtype in c.dtypes:
        choice("comm.dtypes", dtype, tuple(DTYPES))
    choice("comm.redop", c.redop, tuple(REDOPS))
    integers = [d for d in c.dtypes if not DTYPES[d].is_floating_point]
    if c.redop == "avg" and integers:
        fail(
            "comm.redop",
            "avg",
            f"avg needs floating-point dtypes, not {integers}",
            "sum | prod | min | max, or float dtypes only",
        )
    for key in ("min_bytes", "max_bytes", "iters"):
        positive(f"comm.{key}", getattr(c, key))
    if c.max_bytes < c.min_bytes:
        fail(
            "comm.max_bytes",
            c.max_bytes,
            f"below comm.min_bytes ({c.min_bytes})",
            f">= {c.min_bytes}",
        )
    if c.step_factor < 2:
        fail("comm.step_factor", c.step_factor, "sizes would never grow", "an integer >= 2")
    if c.warmup_iters < 0:
        fail("comm.warmup_iters", c.warmup_iters, "must not be negative", "an integer >= 0")
    hardware = resolve_hardware(cfg.hardware, facts)
    backend = backend_for(cfg, hardware, facts)
    launcher = _resolve_launcher(cfg, backend.name, facts)
    world = launcher.nproc_per_node * launcher.nnodes
    plan = measurements(c, world)
    if not plan:
        fail(
            "comm.max_bytes",
            c.max_bytes,
            f"no size holds one element per rank ({world})",
            "larger sizes",
        )
    check_debug(cfg.debug, world, len(plan), "measurements")
    check_logger(cfg.logger)
    name = cfg.name or f"comm_{backend.name}_{world}"
    return dataclasses.replace(
        cfg, backend=backend, hardware=hardware, launcher=launcher, name=name
    )


def _resolve_launcher(cfg: CommRunConfig, backend: str, facts: HostFacts):
    launcher = cfg.launcher
    check_launcher(launcher)
    on_cuda = device_type(backend) == "cuda"
    check_start_method(launcher, on_cuda)
    own_rules = launcher_for(launcher.name)
    if not own_rules.ranks_here:  # the cluster's nodes, not this login host, hold the devices
        sized = dataclasses.replace(launcher, nproc_per_node=launcher.nproc_per_node or 1)
        checked = own_rules.check(dataclasses.replace(cfg, launcher=sized))
        return dataclasses.replace(checked, threads_per_rank=checked.threads_per_rank or 1)
    gpus = len(facts.cuda_devices) if on_cuda else 0
    started = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE"))
    local = int(started) if attached_rank() is not None and started else None
    nproc = launcher.nproc_per_node or local or (gpus if on_cuda else CPU_DEFAULT_RANKS)
    sized = dataclasses.replace(launcher, nproc_per_node=nproc)
    placed = place_ranks(sized, nproc * launcher.nnodes, gpus, facts, "meshrun-comm")
    check_attached_world(placed, "meshrun-comm")
    return own_rules.check(dataclasses.replace(cfg, launcher=placed))


def measure(cfg: CommRunConfig) -> dict[str, Any]:
    """Launch the ranks and assemble the report (a failed run too: status, error, rank)."""
    new_run(cfg.run_dir)
    meta, rows = attempt(RunMeta(), cfg.run_dir, time.time(), lambda: launch(cfg, COMM))
    report: dict[str, Any] = {
        "run_id": meta.run_id,
        "created_at": meta.created_at,
        "status": meta.status,
        "error": meta.error,
        "failed_rank": meta.failed_rank,
        "traceback": meta.traceback,
        "duration_s": meta.duration_s,
        "name": cfg.name,
        "backend": cfg.backend.name,
        "launcher": cfg.launcher.name,
        "world_size": cfg.launcher.nproc_per_node * cfg.launcher.nnodes,
        "device_type": device_type(cfg.backend.name),
        "hardware": cfg.hardware.name,
        "ops": ",".join(cfg.comm.ops),
        "dtypes": ",".join(cfg.comm.dtypes),
        "max_bytes": cfg.comm.max_bytes,
        "run_dir": cfg.run_dir,
    }
    rows = rows or []
    return report | summarize(rows) | {"rows": rows}


def run(dict_cfg: DictConfig) -> int:
    """0: measured, no wrong values; 1: a rank failed or results were wrong; 2: bad config."""
    cfg: CommRunConfig = OmegaConf.to_object(dict_cfg)
    rank = attached_rank()
    try:
        cfg = validate_comm(cfg, HostFacts.detect())
    except ConfigError as err:
        print_error("config error", str(err))
        return 2
    if rank not in (None, 0):
        COMM(asdict(cfg))
        return 0
    report = measure(cfg)
    write_json(report)
    if cfg.comm.record:
        record(report, cfg.store.path, cfg.logger, asdict(cfg))
    print_tables(report)
    if report["error"]:
        print_error("comm run failed", report["error"])
        return 1
    if report["wrong"]:
        print_error("wrong values", f"{report['wrong']} wrong values: see the #wrong column")
        return 1
    console.print(f"results: {cfg.run_dir}", soft_wrap=True)
    return 0


main = hydra_command("comm", run)


if __name__ == "__main__":
    main()
