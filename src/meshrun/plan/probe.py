"""This host's matmul FLOP/s: the CPU 'peak' the planner divides by, since CPUs publish none."""

from __future__ import annotations

import functools
import time

import torch


@functools.cache
def host_matmul_flops(threads: int, size: int = 1024, repeats: int = 5) -> float:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b  # warm the kernels and threads
        started = time.perf_counter()
        for _ in range(repeats):
            a @ b
        seconds = (time.perf_counter() - started) / repeats
    finally:
        torch.set_num_threads(previous)
    return 2 * size**3 / seconds
