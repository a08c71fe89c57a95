"""`meshrun-comm`: time collectives like nccl-tests, on any backend, through the training
launchers, and check their results.

The per-rank function (`collectives.run_comm_rank`) is started by the same launch path as a
training run's `worker.run_rank`: torch elastic here, torchrun when started by it, and any
launcher in `LAUNCHERS` (which takes the config and the per-rank function). Rank 0's rows come
back to this driver, which prints the tables and records comm.json, a `comm_runs` row and W&B.
`meshrun-comm -m backend=gloo,nccl` compares backends in one sweep.
"""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime, timezone
from typing import Any

os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # before anything touches CUDA

from omegaconf import DictConfig, OmegaConf

from meshrun.core.attached import attached_rank
from meshrun.core.config import CommRunConfig
from meshrun.core.errors import ConfigError, choice, fail, positive
from meshrun.core.hardware import HostFacts, resolve_hardware
from meshrun.driver.command import hydra_command
from meshrun.driver.launch import RankFailure
from meshrun.driver.launch.local import launch_local
from meshrun.driver.launch.slurm import launch_slurm
from meshrun.driver.launch.torchrun import launch_attached
from meshrun.driver.sinks.console import console, print_error
from meshrun.rank.watchdog import clear_records, with_diagnosis
from meshrun.tools.comm.busbw import OPS
from meshrun.tools.comm.collectives import DTYPES, REDOPS, device_type, measurements, run_comm_rank
from meshrun.tools.comm.report import print_tables, record, summarize, write_json
from meshrun.validate import resolve_backend
from meshrun.validate.slurm import check_slurm

Launch = Callable[[CommRunConfig, Callable[[dict[str, Any]], Any]], Any]
LAUNCHERS: dict[str, Launch] = {"local": launch_local, "slurm": launch_slurm}
CPU_DEFAULT_RANKS = 2


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
        fail("comm.redop", "avg", f"avg needs floating-point dtypes, not {integers}",
             "sum | prod | min | max, or float dtypes only")  # fmt: skip
    for key in ("min_bytes", "max_bytes", "iters"):
        positive(f"comm.{key}", getattr(c, key))
    if c.max_bytes < c.min_bytes:
        fail("comm.max_bytes", c.max_bytes, f"below comm.min_bytes ({c.min_bytes})",
             f">= {c.min_bytes}")  # fmt: skip
    if c.step_factor < 2:
        fail("comm.step_factor", c.step_factor, "sizes would never grow", "an integer >= 2")
    if c.warmup_iters < 0:
        fail("comm.warmup_iters", c.warmup_iters, "must not be negative", "an integer >= 0")
    hardware = resolve_hardware(cfg.hardware, facts)
    backend = resolve_backend(cfg, hardware, facts)
    launcher = _resolve_launcher(cfg, backend.name, facts)
    world = launcher.nproc_per_node * launcher.nnodes
    plan = measurements(c, world)
    if not plan:
        fail("comm.max_bytes", c.max_bytes, f"no size holds one element per rank ({world})",
             "larger sizes")  # fmt: skip
    d = cfg.debug
    if d.fail_rank is not None and not 0 <= d.fail_rank < world:
        fail("debug.fail_rank", d.fail_rank, f"no such rank in a run of {world}",
             f"0..{world - 1}, or null")  # fmt: skip
    if not 0 <= d.fail_step < len(plan):
        fail("debug.fail_step", d.fail_step, f"outside the {len(plan)} measurements",
             f"0..{len(plan) - 1}")  # fmt: skip
    name = cfg.name or f"comm_{backend.name}_{world}"
    return dataclasses.replace(
        cfg, backend=backend, hardware=hardware, launcher=launcher, name=name
    )


def _resolve_launcher(cfg: CommRunConfig, backend: str, facts: HostFacts):
    launcher = cfg.launcher
    choice("launcher.name", launcher.name, tuple(LAUNCHERS))
    if launcher.name == "local" and launcher.nnodes != 1:
        fail("launcher.nnodes", launcher.nnodes, "launcher=local runs on one node", "1")
    positive("launcher.nproc_per_node", launcher.nproc_per_node, allow_none=True)
    positive("launcher.threads_per_rank", launcher.threads_per_rank, allow_none=True)
    gpus = len(facts.cuda_devices)
    attached = attached_rank() is not None
    started = os.environ["WORLD_SIZE"] if attached else None
    local = int(os.environ.get("LOCAL_WORLD_SIZE", started or 0)) if attached else None
    nproc = (
        launcher.nproc_per_node
        or local
        or (gpus if device_type(backend) == "cuda" else CPU_DEFAULT_RANKS)
    )
    if started and int(started) != nproc * launcher.nnodes:
        fail("WORLD_SIZE", started, f"torchrun started {started} ranks, the config asks for "
             f"{nproc * launcher.nnodes}", "launcher.nproc_per_node=null")  # fmt: skip
    if launcher.name == "slurm":  # the cluster's nodes, not this login host, hold the devices
        sized = dataclasses.replace(launcher, nproc_per_node=launcher.nproc_per_node or 1)
        checked = check_slurm(dataclasses.replace(cfg, launcher=sized))
        threads = launcher.threads_per_rank or checked.cpus_per_task or 1
        return dataclasses.replace(checked, threads_per_rank=threads)
    if device_type(backend) == "cuda" and nproc > gpus:
        fail("launcher.nproc_per_node", nproc, f"only {gpus} CUDA devices are visible",
             f"at most {gpus}")  # fmt: skip
    threads = launcher.threads_per_rank
    if device_type(backend) == "cpu" and threads is None:
        threads = max(1, facts.cpu_count // nproc)
    return dataclasses.replace(launcher, nproc_per_node=nproc, threads_per_rank=threads)


def _launch(cfg: CommRunConfig) -> list[dict[str, Any]]:
    if attached_rank() == 0:
        return launch_attached(cfg, run_comm_rank)
    return LAUNCHERS[cfg.launcher.name](cfg, run_comm_rank)


def measure(cfg: CommRunConfig) -> dict[str, Any]:
    """Launch the ranks and assemble the report (a failed run too: status, error, rank)."""
    report: dict[str, Any] = {
        "run_id": uuid.uuid4().hex[:12],
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "status": "completed", "error": None, "failed_rank": None, "name": cfg.name,
        "backend": cfg.backend.name, "launcher": cfg.launcher.name,
        "world_size": cfg.launcher.nproc_per_node * cfg.launcher.nnodes,
        "device_type": device_type(cfg.backend.name), "hardware": cfg.hardware.name,
        "ops": ",".join(cfg.comm.ops), "dtypes": ",".join(cfg.comm.dtypes),
        "max_bytes": cfg.comm.max_bytes, "run_dir": cfg.run_dir,
    }  # fmt: skip
    if attached_rank() is None:  # under torchrun the peers may have written theirs already
        clear_records(cfg.run_dir)
    started = time.perf_counter()
    rows: list[dict[str, Any]] = []
    try:
        rows = _launch(cfg)
    except RankFailure as failure:
        error = with_diagnosis(str(failure), cfg.run_dir, failure.rank)
        report.update(status="failed", error=error, failed_rank=failure.rank)
    report["duration_s"] = round(time.perf_counter() - started, 3)
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
        run_comm_rank(asdict(cfg))
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
