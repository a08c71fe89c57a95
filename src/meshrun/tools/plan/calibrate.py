"""`meshrun-plan calibrate [overrides]`: measure on this host what the speed model otherwise
takes from a datasheet or one matmul probe, for the experiment the overrides describe, with
as many ranks as its plan (world_size, or the host's default) all busy at once, each in a
process of its own with the threads a run's rank gets:

    matmul      the block's linears at the run's micro-batch tokens: forward, input- and
                weight-gradient GEMMs, FLOPs over seconds (each the mean of a few, the
                ranks computing at once); on a CPU the rate is then the one they reach
                inside a step of one block of the run's widths (matmul_in_step.py)
    attention   causal SDPA forward and backward at the run's heads and sequence
    memory      a large elementwise add's bytes a second
    ops         one small op's eager dispatch (what a step pays per kernel however small),
                and the aten ops one block's forward and backward dispatch (counted)
    wrappers    what a block costs the host more under TP's DTensors (with and without
                sequence parallelism) and FSDP2's hooks, the ranks one mesh, less their
                collectives alone; under each checkpointing policy (wrapper_overhead.py)
    links       `meshrun-comm` over the same ranks (a process of its own): the bus
                bandwidth of all-reduce, all-gather and reduce-scatter each (FSDP2 and SP
                move their bytes by the latter two) at every size from 4 KiB to 16 MiB, a
                4 KiB all-reduce's time per ring hop
    checkpoints the node's write rate to the checkpoint dir (checkpoint.dir, else beside
                the store), every rank a synced file at once, and a rank's staging of its
                state into host memory as DCP's async_save stages it (storage.py)

The profile goes beside the results store (core/calibration.py); plans and runs on this
host with as many ranks of as many threads use it (plan.calibration) and say so.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import queue
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from meshrun.core.calibration import Calibration, calibration_path, write_calibration
from meshrun.core.config import LlamaModelConfig
from meshrun.core.errors import ConfigError, fail
from meshrun.core.hardware import HostFacts, fingerprint_key, host_fingerprint, rank_threads
from meshrun.driver.measured import utc_now
from meshrun.driver.sinks.console import console, print_error, print_note
from meshrun.driver.tool_config import PlanCommandConfig
from meshrun.models import model_kind, model_shape
from meshrun.plan.compute import block_linears
from meshrun.plan.shapes import Dims
from meshrun.rank.device import set_fp32_matmul
from meshrun.rank.mesh import end_distributed
from meshrun.tools.plan.command import command_keys, prepared
from meshrun.tools.plan.matmul_in_step import in_step_block, matmul_in_a_step
from meshrun.tools.plan.small_block import ops_per_layer, small_block
from meshrun.tools.plan.storage import staging_rate, storage_dir, write_rate
from meshrun.tools.plan.wrapper_overhead import (
    CHECKPOINTING,
    CONTEXT,
    WRAPPERS,
    wrapper_overheads,
)

REPEATS = 3
RANK_TIMEOUT_S = 600
COMM_MAX_BYTES = 16 * 2**20
COMM_MIN_BYTES = 4096
LINK_OPS = ("all_reduce", "all_gather", "reduce_scatter")


@dataclasses.dataclass(frozen=True)
class Workload:
    """What each rank process times: the shapes of one micro-batch of the run."""

    threads: int
    device: str  # cpu, or cuda (rank r on device r)
    dtype: str
    linears: list[tuple[int, int, int]]  # (rows, out, in)
    attention: tuple[int, int, int, int]  # (batch, heads, seq, head_dim)
    model: LlamaModelConfig | None = None  # a small block of the run's kind: the wrappers'
    block: LlamaModelConfig | None = None  # one block of the run's sizes: matmuls in a step
    tf32: bool = True  # float32 on CUDA: TF32 matmuls, as the run's ranks allow (train.tf32)


def calibrate(
    cfg: PlanCommandConfig, host: HostFacts, given: frozenset[str] = frozenset()
) -> Calibration:
    """Measures and returns the profile (not written), at the sequence, batch and precision
    given (`given`: the keys set) or a plan's defaults."""
    box = prepared(cfg, host, given)[0]
    if box.nodes > 1:
        fail("world_size", box.world, "calibrate measures this host's ranks", "one node's ranks")
    threads = rank_threads(cfg.launcher, box.per_node, host)
    if not model_shape(cfg.model).formula:
        fail(
            "model",
            cfg.model.name,
            "calibrate times the model's matmuls and attention at its widths, and a custom "
            "module declares none",
            "a preset of about its widths (e.g. model=small): the profile serves every run on "
            "this host with as many ranks, whatever its model",
        )
    d = Dims.of(cfg.model)
    tokens = cfg.train.micro_batch_size * cfg.train.seq_len
    cuda = cfg.hardware.device_type == "cuda"
    workload = Workload(
        threads=threads,
        device="cuda" if cuda else "cpu",
        dtype="float32" if cfg.train.precision == "fp32" else "bfloat16",
        tf32=cfg.train.tf32,
        linears=block_linears(d, tokens, 1),
        attention=(cfg.train.micro_batch_size, d.a, cfg.train.seq_len, d.hq // d.a),
        model=small_block(model_kind(cfg.model).decoder(cfg.model)),
        block=None if cuda else in_step_block(d),
    )
    rates = _in_rank_processes(workload, box.per_node)
    curves, link_latency = _links(box.per_node, threads, "nccl" if cuda else "gloo")
    checkpoints = storage_dir(cfg)
    link_bw = {op: curve[-1][1] for op, curve in curves.items()}  # at the largest size
    return Calibration(
        fingerprint_key=fingerprint_key(host_fingerprint(threads)),
        created_at=utc_now(),
        device_type=cfg.hardware.device_type,
        ranks=box.per_node,
        threads_per_rank=threads,
        precision=cfg.train.precision,
        model=cfg.model.name,
        tokens=tokens,
        matmul_flops=min(r["matmul_flops"] for r in rates),
        matmul_alone_flops=min(r["matmul_alone_flops"] for r in rates),
        attention_flops=min(r["attention_flops"] for r in rates),
        memory_bw=min(r["memory_bw"] for r in rates),
        op_seconds=max(r["op_seconds"] for r in rates),
        ops_per_layer=ops_per_layer(cfg.model),
        **{
            f"{wrapper}_layer_overhead": max(r["wrappers"][wrapper] for r in rates)
            for wrapper in WRAPPERS
        },
        checkpoint_layer_overhead={
            policy: max(r["wrappers"][policy] for r in rates) for policy in CHECKPOINTING
        },
        context_layer_overhead={
            method: max(r["wrappers"][method] for r in rates)
            for method in CONTEXT
            if method in rates[0]["wrappers"]
        },
        link_bw_gbs=link_bw.get("all_reduce"),
        link_latency_us=link_latency,
        link_bw_by_op=link_bw,
        link_curves=curves,
        shapes=rates[0]["shapes"],
        storage_gbs=write_rate(checkpoints, box.per_node),
        storage_dir=str(checkpoints.absolute()),
        staging_gbs=staging_rate(box.per_node, cuda),
    )


def _in_rank_processes(workload: Workload, ranks: int) -> list[dict[str, Any]]:
    """Every rank's rates, measured at once (the slowest rank's is the run's). A rank that
    dies ends the others (their barrier times out otherwise); none outlives the call."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(ranks, timeout=RANK_TIMEOUT_S), ctx.Queue()
    store = tempfile.TemporaryDirectory()
    group = _Group(f"file://{store.name}/store", ranks)
    procs = [
        ctx.Process(target=_rank, args=(workload, rank, group, barrier, results))
        for rank in range(ranks)
    ]
    for proc in procs:
        proc.start()
    rates: list[dict[str, Any]] = []
    deadline = time.monotonic() + RANK_TIMEOUT_S
    try:
        while len(rates) < ranks:
            try:
                rates.append(results.get(timeout=1))
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    why = f"exit code {dead[0]}" if dead else f"no result in {RANK_TIMEOUT_S} s"
                    raise RuntimeError(f"a calibration rank failed ({why})") from None
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        store.cleanup()
    return rates


@dataclasses.dataclass(frozen=True)
class _Group:
    """The process group the ranks form to measure the wrappers on a mesh of all of them."""

    init_method: str
    world_size: int


def _rank(workload: Workload, rank: int, group: _Group, barrier: Any, results: Any) -> None:
    torch.set_num_threads(workload.threads)
    device = torch.device(workload.device, rank) if workload.device == "cuda" else None
    if device is not None:
        torch.cuda.set_device(device)  # the mesh's device: this rank's, not the first GPU
        if workload.dtype == "float32":
            set_fp32_matmul(device, "fp32", workload.tf32)
    dtype = getattr(torch, workload.dtype)
    new = {"dtype": dtype, "device": device}
    barrier.wait()
    flops = seconds = 0.0
    shapes = []
    for rows, out, inp in workload.linears:
        for m, n, k in ((rows, out, inp), (rows, inp, out), (out, inp, rows)):
            a, b = torch.randn(m, k, **new), torch.randn(k, n, **new)
            took = _timed(lambda a=a, b=b: a @ b, device)
            flops, seconds = flops + 2 * m * n * k, seconds + took
            shapes.append({"m": m, "n": n, "k": k, "flops_per_s": 2 * m * n * k / took})
    alone = flops / seconds
    barrier.wait()
    in_step = matmul_in_a_step(workload.block, workload.attention) if workload.block else None
    barrier.wait()
    attention = _attention_rate(workload.attention, new, device)
    barrier.wait()
    size = 16 * 2**20
    x, y, z = (torch.randn(size, device=device) for _ in range(3))
    memory = 3 * 4 * size / _timed(lambda: torch.add(x, y, out=z), device)
    barrier.wait()
    small = torch.ones(8, device=device)
    calls = 2000
    op = _timed(lambda: [torch.add(small, small) for _ in range(calls)], device) / calls
    barrier.wait()
    wrappers = _wrappers(workload.model, device, rank, group) if workload.model else {}
    results.put(
        {
            "matmul_flops": in_step or alone,
            "matmul_alone_flops": alone,
            "attention_flops": attention,
            "memory_bw": memory,
            "op_seconds": op,
            "wrappers": wrappers,
            "shapes": shapes,
        }
    )


def _wrappers(
    model: LlamaModelConfig, device: torch.device | None, rank: int, group: _Group
) -> dict[str, float]:
    backend = "cpu:gloo,cuda:nccl" if device is not None else "gloo"
    timeout = datetime.timedelta(seconds=RANK_TIMEOUT_S)
    dist.init_process_group(
        backend,
        init_method=group.init_method,
        rank=rank,
        world_size=group.world_size,
        timeout=timeout,
    )
    try:
        return wrapper_overheads(model, device)
    finally:
        end_distributed()


def _attention_rate(
    shape: tuple[int, int, int, int], new: dict[str, Any], device: torch.device | None
) -> float:
    """Counted FLOPs (half of 4·b·s²·h forward, 2.5x that backward) a second, causal."""
    batch, heads, seq, head_dim = shape
    q, k, v = (
        torch.randn(batch, heads, seq, head_dim, **new, requires_grad=True) for _ in range(3)
    )

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    forward = 2 * batch * seq * seq * heads * head_dim
    return forward * 3.5 / _timed(step, device)


def _timed(run: Callable[[], Any], device: torch.device | None) -> float:
    """Seconds a call, the mean of REPEATS after one warm-up: the other ranks run theirs at
    the same time, and a rank's steps pay the shared rate (a best-of would find a moment
    when the others paused)."""
    sync = torch.cuda.synchronize if device is not None else (lambda: None)
    run()
    sync()
    started = time.perf_counter()
    for _ in range(REPEATS):
        run()
    sync()
    return (time.perf_counter() - started) / REPEATS


def _links(
    ranks: int, threads: int, backend: str
) -> tuple[dict[str, list[list[float]]], float | None]:
    """meshrun-comm over `ranks` ranks: each of LINK_OPS' bus bandwidth at every size
    ([bytes, GB/s], smallest first), the smallest all-reduce's time per ring hop (2(n-1) of
    them); none for one rank."""
    if ranks < 2:
        return {}, None
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            sys.executable,
            "-m",
            "meshrun.tools.comm",
            f"hydra.run.dir={tmp}",
            f"backend={backend}",
            "logger=none",
            f"comm.ops=[{','.join(LINK_OPS)}]",
            f"comm.min_bytes={COMM_MIN_BYTES}",
            f"comm.max_bytes={COMM_MAX_BYTES}",
            "comm.record=false",
            f"launcher.nproc_per_node={ranks}",
            f"launcher.threads_per_rank={threads}",
        ]
        subprocess.run(command, check=True, capture_output=True, timeout=600)
        rows = json.loads((Path(tmp) / "comm.json").read_text())["rows"]
    curves = {
        op: sorted([r["size_bytes"], r["busbw_gbs"]] for r in rows if r["op"] == op)
        for op in LINK_OPS
    }
    smallest = min((r for r in rows if r["op"] == "all_reduce"), key=lambda r: r["size_bytes"])
    return curves, smallest["time_us"] / (2 * (ranks - 1))


def run(dict_cfg: DictConfig) -> int:
    cfg: PlanCommandConfig = OmegaConf.to_object(dict_cfg)
    try:
        calibration = calibrate(cfg, HostFacts.detect(), command_keys())
    except ConfigError as err:
        print_error("config error", str(err))
        return 2
    path = calibration_path(cfg.store.path)
    write_calibration(calibration, path)
    print_note(f"calibrated: {calibration.describe()}")
    said = f"profile: {path} (plans and runs with plan.calibration=auto use it)"
    console.print(said, soft_wrap=True, highlight=False)
    return 0
