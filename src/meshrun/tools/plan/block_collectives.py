"""The collectives a wrapped block issues, and calls of each to time alone. A block's host cost
under a wrapper is measured on the calibration's real ranks (wrapper_overhead.py),
collectives included; the planner costs those collectives by the link (plan/comm_time.py),
so what they take alone on the same ranks, at the same sizes, comes off the measured cost,
once.

They are read from one step under a dispatch mode that lets DTensor run first (as torch's
CommDebugMode does) and so sees the functional collectives it issues under TP and SP, and
c10d's own that FSDP2 and context parallelism issue (a ring's sends); a functional
collective's c10d call inside it is not seen again (the mode is off while it handles an
op)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from meshrun.core.collective_names import ALL_GATHER, REDUCE_SCATTER
from meshrun.rank.parallel.context_attention import post_shift

_functional, _c10d = torch.ops._c10d_functional, torch.ops.c10d
# op -> (kind, the argument holding what each rank puts in)
COLLECTIVES = {
    _functional.all_reduce: ("all_reduce", 0),
    _functional.all_gather_into_tensor: ("all_gather", 0),
    _functional.reduce_scatter_tensor: ("reduce_scatter", 0),
    _c10d.allreduce_: ("all_reduce", 0),  # a list of tensors
    _c10d._allgather_base_: ("all_gather", 1),  # (output, input, ...)
    _c10d._reduce_scatter_base_: ("reduce_scatter", 1),
    _c10d.alltoall_base_: ("all_to_all", 1),  # (output, input, ...)
    _c10d.send: ("shift", 0),  # a ring's step: each send has its receive, not counted again
}
CALLS = 10  # a collective's time alone: the mean of this many, the fastest round's

Collective = tuple[str, int]  # (kind, elements each rank puts in)


class _Collectives(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.found: Counter[Collective] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # a DTensor's op: it runs, and issues its collectives here
        known = COLLECTIVES.get(func.overloadpacket)
        if known:
            kind, arg = known
            given = args[arg]
            numel = sum(t.numel() for t in given) if isinstance(given, list) else given.numel()
            self.found[kind, numel] += 1
        return func(*args, **(kwargs or {}))


def collectives_in(step: Callable[[], None]) -> Counter[Collective]:
    """The collectives one call of `step` issues, by kind and size."""
    with _Collectives() as mode:
        step()
    return mode.found


def collective_calls(
    collectives: Counter[Collective], device: torch.device | None
) -> dict[Collective, Callable[[], None]]:
    """Each collective's CALLS calls on the default group, in an order every rank shares (each
    rank times them at once: wrapper_overhead.py)."""
    world = dist.get_world_size()
    calls = {}
    for kind, numel in sorted(collectives):
        run = _collective(kind, numel, world, device)
        calls[kind, numel] = lambda run=run: [run() for _ in range(CALLS)]
    return calls


def _collective(
    kind: str, numel: int, world: int, device: torch.device | None
) -> Callable[[], None]:
    given = torch.ones(numel, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(given)
    if kind == "all_gather":
        gathered = torch.empty(numel * world, device=device)
        return lambda: ALL_GATHER(gathered, given)
    if kind == "all_to_all":
        exchanged = torch.empty_like(given)
        return lambda: dist.all_to_all_single(exchanged, given)
    if kind == "shift":

        def shift() -> None:  # posted and waited for, as the ring passes its K/V blocks on
            post_shift(given, dist.group.WORLD, 0)()

        return shift
    scattered = torch.empty(numel // world, device=device)
    return lambda: REDUCE_SCATTER(scattered, given)
