"""nccl-tests' bandwidth arithmetic (its doc/PERFORMANCE.md), so figures compare one to one.

algbw = size / time, where size is the largest buffer a rank holds (the gathered output of
all_gather, the input of reduce_scatter). busbw = algbw x a factor per collective that turns
it into the traffic each link carries in the ring algorithm, comparable to the hardware's
peak bandwidth whatever the rank count.
"""

from __future__ import annotations

BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
}
OPS = tuple(BUS_FACTORS)
# Ops whose buffer is cut into one chunk per rank: the element count must divide evenly.
CHUNKED = frozenset({"all_gather", "reduce_scatter", "all_to_all"})


def bus_factor(op: str, world_size: int) -> float:
    return BUS_FACTORS[op](world_size)


def algbw_gbs(size_bytes: int, seconds: float) -> float:
    """GB/s in nccl-tests' unit (1e9 bytes)."""
    return size_bytes / seconds / 1e9


def busbw_gbs(op: str, size_bytes: int, seconds: float, world_size: int) -> float:
    return algbw_gbs(size_bytes, seconds) * bus_factor(op, world_size)


def sizes(min_bytes: int, max_bytes: int, step_factor: int) -> list[int]:
    """min, min*f, min*f^2, ... up to max (nccl-tests -b/-e/-f)."""
    out = []
    size = min_bytes
    while size <= max_bytes:
        out.append(size)
        size *= step_factor
    return out


def element_count(op: str, size_bytes: int, element_size: int, world_size: int) -> int:
    """Elements of the measured buffer; chunked ops round down to a multiple of the ranks
    (0: the size is too small for this op at this world size)."""
    count = size_bytes // element_size
    if op in CHUNKED:
        count -= count % world_size
    return count
