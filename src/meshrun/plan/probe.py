"""This host's matmul FLOP/s per rank: the CPU 'peak' the planner divides by, since CPUs
publish none. Taken with as many concurrent matmul streams as the layout puts ranks on the
host, each on the rank's threads: ranks share cores, caches and memory bandwidth (on small VMs
two busy processes each get well under one idle core's rate), and a rank's steps run at the
shared rate, not the idle one."""

from __future__ import annotations

import functools
import threading
import time

import torch


@functools.cache
def host_matmul_flops(threads: int, ranks: int = 1, size: int = 1024, repeats: int = 10) -> float:
    """From the slowest stream's best time per matmul: the best of `repeats`, so that a
    passing disturbance of the host does not count as its rate."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.randn(size, size), torch.randn(size, size)
    best = [float("inf")] * ranks
    start = threading.Barrier(ranks)

    def stream(index: int) -> None:
        a @ b  # warm the kernels and threads
        start.wait()
        for _ in range(repeats):
            started = time.perf_counter()
            a @ b
            best[index] = min(best[index], time.perf_counter() - started)

    try:
        workers = [threading.Thread(target=stream, args=(i,)) for i in range(ranks)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        torch.set_num_threads(previous)
    return 2 * size**3 / max(best)
