"""One rank of `meshrun-comm`: time each collective over sizes and data types, the way
nccl-tests does, and count wrong values.

Every buffer is filled with small integers that depend on rank and position, so each op's
exact result is known without a reference run: sums, products and extremes of such values
are exact in every dtype (avg to one rounding). The first op runs on fresh buffers and is
checked; after `warmup_iters` more, the timed loop issues `iters` back-to-back ops and
synchronises once. The time
reported is the mean over ranks of each rank's mean per op (nccl-tests' default, `-a 1`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from meshrun.core.collective_names import ALL_GATHER, REDUCE_SCATTER
from meshrun.core.run_files.failures import record_failure
from meshrun.driver.tool_config import CommConfig, comm_from_dict
from meshrun.rank import flight_recorder
from meshrun.rank.control_collectives import control_all_reduce, control_barrier
from meshrun.rank.faults import fault_injector
from meshrun.rank.mesh import end_distributed, init_distributed, select_device
from meshrun.rank.watchdog import Watchdog
from meshrun.tools.comm.busbw import algbw_gbs, busbw_gbs, element_count, sizes

DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int32": torch.int32,
    "int64": torch.int64,
    "int8": torch.int8,
    "uint8": torch.uint8,
}
REDOPS = {
    "sum": dist.ReduceOp.SUM,
    "prod": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "avg": dist.ReduceOp.AVG,
}
REDUCING = frozenset({"all_reduce", "reduce_scatter"})
PEER_OPS = frozenset({"sendrecv"})  # need a second rank


def device_type(backend: str) -> str:
    """nccl measures GPU memory; gloo (and mpi) host memory, also on a GPU box, where gloo's
    CUDA path lacks some collectives and stages through the host anyway."""
    return "cuda" if backend == "nccl" else "cpu"


def fill(rank: int, count: int, dtype: torch.dtype, device: torch.device, offset: int = 0):
    """Values 1..5 that differ by rank and position: every reduction of them is exact."""
    values = (torch.arange(offset, offset + count, device=device) + rank) % 5 + 1
    return values.to(dtype)


def reduce_values(parts: list[torch.Tensor], redop: str) -> torch.Tensor:
    """The exact reduction, in float64 or int64 (whose cast back wraps like the ranks' ints)."""
    stacked = torch.stack([p.double() if p.is_floating_point() else p.long() for p in parts])
    if redop == "avg":
        return stacked.mean(0)
    return {"sum": stacked.sum, "prod": stacked.prod, "min": stacked.amin, "max": stacked.amax}[
        redop
    ](0)


@dataclass
class Case:
    """One measurement: `run` issues the op once; after it on fresh buffers, `output` must
    hold `expected()`."""

    run: Callable[[], None]
    output: torch.Tensor
    expected: Callable[[], torch.Tensor]


def build_case(op: str, count: int, dtype: torch.dtype, redop: str, device: torch.device) -> Case:
    rank, n = dist.get_rank(), dist.get_world_size()
    red = REDOPS[redop]
    chunk = count // n

    def inputs(r: int, length: int = count, offset: int = 0) -> torch.Tensor:
        return fill(r, length, dtype, device, offset)

    if op == "all_reduce":
        buf = inputs(rank)
        return Case(
            lambda: dist.all_reduce(buf, op=red),
            buf,
            lambda: reduce_values([inputs(r) for r in range(n)], redop),
        )
    if op == "broadcast":
        buf = inputs(rank)
        return Case(lambda: dist.broadcast(buf, src=0), buf, lambda: inputs(0))
    if op == "all_gather":
        src, out = inputs(rank, chunk), torch.empty(count, dtype=dtype, device=device)
        return Case(
            lambda: ALL_GATHER(out, src),
            out,
            lambda: torch.cat([inputs(r, chunk) for r in range(n)]),
        )
    if op == "reduce_scatter":
        src, out = inputs(rank), torch.empty(chunk, dtype=dtype, device=device)
        return Case(
            lambda: REDUCE_SCATTER(out, src, op=red),
            out,
            lambda: reduce_values([inputs(r, chunk, rank * chunk) for r in range(n)], redop),
        )
    if op == "all_to_all":
        src, out = inputs(rank), torch.empty(count, dtype=dtype, device=device)
        return Case(
            lambda: dist.all_to_all_single(out, src),
            out,
            lambda: torch.cat([inputs(s, chunk, rank * chunk) for s in range(n)]),
        )
    if op == "sendrecv":  # a ring: send to the next rank, receive from the previous one
        src, out = inputs(rank), torch.empty(count, dtype=dtype, device=device)
        peers = (rank + 1) % n, (rank - 1) % n
        ops = [dist.P2POp(dist.isend, src, peers[0]), dist.P2POp(dist.irecv, out, peers[1])]

        def sendrecv() -> None:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        return Case(sendrecv, out, lambda: inputs((rank - 1) % n))
    raise ValueError(f"unknown collective {op!r}")


def wrong_values(output: torch.Tensor, expected: torch.Tensor) -> int:
    if output.is_floating_point():
        tolerance = 2 * torch.finfo(output.dtype).eps
        ok = torch.isclose(output.double(), expected.double(), rtol=tolerance, atol=0)
    else:
        ok = output == expected.to(output.dtype)
    return int((~ok).sum())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_per_op(run: Callable[[], None], iters: int, device: torch.device) -> float:
    """Seconds per op, from `iters` back-to-back ops with one sync (CUDA events on GPU)."""
    control_barrier()
    _synchronize(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    started = time.perf_counter()
    for _ in range(iters):
        run()
    return (time.perf_counter() - started) / iters


def measurements(comm: CommConfig, world_size: int) -> list[tuple[str, str, int, int]]:
    """(op, dtype, size in bytes, element count) of every measurement, in order."""
    plan = []
    for dtype in comm.dtypes:
        element_size = torch.empty((), dtype=DTYPES[dtype]).element_size()
        for op in comm.ops:
            if op in PEER_OPS and world_size < 2:
                continue
            for size in sizes(comm.min_bytes, comm.max_bytes, comm.step_factor):
                count = element_count(op, size, element_size, world_size)
                if count:
                    plan.append((op, dtype, count * element_size, count))
    return plan


def run_comm_rank(cfg_dict: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Rank 0 returns one row per measurement; the others None."""
    cfg = comm_from_dict(cfg_dict)
    rank = int(os.environ.get("RANK", "0"))
    os.environ.update(flight_recorder.rank_env(cfg.backend, cfg.run_dir, os.environ))
    if cfg.launcher.threads_per_rank:
        torch.set_num_threads(cfg.launcher.threads_per_rank)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = select_device(device_type(cfg.backend.name), local_rank)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    watchdog = Watchdog(cfg.run_dir, rank, world_size, cfg.backend.timeout_s)
    try:
        flight_recorder.enable(cfg.backend.name, cfg.run_dir)
        init_distributed(cfg.backend.name, cfg.backend.timeout_s)
        return _benchmark(cfg.comm, device, watchdog, fault_injector(cfg.debug, rank))
    except Exception as err:
        record_failure(cfg.run_dir, rank, err)
        raise
    finally:
        watchdog.stop()
        end_distributed()


def _benchmark(
    comm: CommConfig,
    device: torch.device,
    watchdog: Watchdog,
    fault: Callable[[int], None] | None,
) -> list[dict[str, Any]] | None:
    n = dist.get_world_size()
    rows = []
    for index, (op, dtype, size, count) in enumerate(measurements(comm, n)):
        watchdog.at(index)
        if fault is not None:
            fault(index)
        label = f"{op} of {size} B {dtype}"
        case = build_case(op, count, DTYPES[dtype], comm.redop, device)
        with watchdog.inside(index, label, one_collective=True):  # NCCL's setup happens here
            case.run()
            _synchronize(device)
        wrong = wrong_values(case.output, case.expected()) if comm.check else 0
        with watchdog.inside(index, label):
            for _ in range(comm.warmup_iters):
                case.run()
            seconds = time_per_op(case.run, comm.iters, device)
            totals = torch.tensor([seconds, wrong], dtype=torch.float64, device=device)
            control_all_reduce(totals)
        seconds, wrong = totals[0].item() / n, int(totals[1].item())
        redop = comm.redop if op in REDUCING else "none"
        rows.append(
            {
                "op": op,
                "size_bytes": size,
                "count": count,
                "dtype": dtype,
                "redop": redop,
                "root": 0 if op == "broadcast" else None,
                "time_us": seconds * 1e6,
                "algbw_gbs": algbw_gbs(size, seconds),
                "busbw_gbs": busbw_gbs(op, size, seconds, n),
                "wrong": wrong,
            }
        )
    return rows if dist.get_rank() == 0 else None
