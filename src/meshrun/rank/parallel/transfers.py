"""A pipeline stage's point-to-point transfers as meshrun posts and waits on them: gloo's
flight recorder keeps no send or receive, so where a pipeline over gloo hangs this is the
record of which transfer each rank waited on. A ring of the last `ENTRIES` (send or receive,
activations or gradients, micro-batch, peer, shape, dtype, bytes, when posted and when done),
written into the rank's flight-recorder dump (rank/flight_recorder.py) and read by
core/run_files/flight_records.py. Appending one is a few attribute reads: no sync, no I/O."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass

import torch.distributed as dist

ENTRIES = 64


@dataclass
class Transfer:
    op: str  # "send" | "recv"
    what: str  # "activations" | "gradients"
    microbatch: int
    peer: int  # the peer's global rank
    shape: list[int]
    dtype: str
    bytes: int
    posted_s: float  # epoch seconds
    done_s: float | None = None  # a send's completion is the schedule's, not seen here


_ring: deque[Transfer] = deque(maxlen=ENTRIES)


def posted(op: str, what: str, microbatch: int, ops: list[dist.P2POp]) -> list[Transfer]:
    now = time.time()
    transfers = [
        Transfer(
            op,
            what,
            microbatch,
            p2p.peer,
            list(p2p.tensor.shape),
            str(p2p.tensor.dtype).removeprefix("torch."),
            p2p.tensor.numel() * p2p.tensor.element_size(),
            now,
        )
        for p2p in ops
    ]
    _ring.extend(transfers)
    return transfers


def done(transfers: list[Transfer]) -> None:
    now = time.time()
    for transfer in transfers:
        transfer.done_s = now


def forget() -> None:
    """A new run in this process (a pool's worker, torchrun's rank 0 after its baseline)."""
    _ring.clear()


def recorded() -> list[dict]:
    """This process's transfers, oldest first, as the dump writes them."""
    return [asdict(t) for t in _ring]
