"""parallel.fault_tolerance=torchft, a replica's side: this process is one data-parallel
replica, a world of its own, joined to the others each step by torchft's Manager through the
driver's lighthouse (driver/launch/replicas.py). A step begins with a quorum of the live
replicas (one that lags, as a restarted one does, first loads a live peer's state: model,
optimizer, schedule, data position, spike window); the gradients are averaged over the
quorum's replicas; the step commits only where every participant's collectives succeeded,
else it is trained again. The quorum is synchronous: a step trains on weights every
participant holds, so its step number and loss are the run's."""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

REPLICA_ENV = "MESHRUN_REPLICA"  # "<id>/<replicas>/<attempt>", set by the driver
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own name for the lighthouse's address

# torchft logs each quorum and commit (and, on CPU, that it cannot reset NCCL's flight
# recorder) through the root logger's handlers; its errors reach meshrun as failed commits
for _name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
    logging.getLogger(_name).setLevel(logging.ERROR)


class ReplicaLagged(RuntimeError):
    """The other replicas committed a step this one did not."""


@dataclass(frozen=True)
class ReplicaPlace:
    """Which replica this process is, of how many, and its start (0: the first)."""

    id: int
    replicas: int
    attempt: int

    @classmethod
    def from_env(cls) -> ReplicaPlace | None:
        value = os.environ.get(REPLICA_ENV)
        if value is None:
            return None
        replica, replicas, attempt = map(int, value.split("/"))
        return cls(replica, replicas, attempt)

    def env(self) -> str:
        return f"{self.id}/{self.replicas}/{self.attempt}"


class Replicas:
    """This replica's Manager; `state`/`load` are what a lagging peer is sent and loads."""

    def __init__(
        self,
        place: ReplicaPlace,
        backend: str,
        timeout_s: float,
        state: Callable[[], dict[str, Any]],
        load: Callable[[dict[str, Any]], None],
    ) -> None:
        # torchft: hundreds of milliseconds of imports that only these runs pay
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL  # noqa: PLC0415

        # torchft's streaming load of a peer's state hands torch a read-only buffer it owns
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        self.place, self.timeout_s = place, timeout_s
        timeout = timedelta(seconds=timeout_s)
        # the replica's own store (a world of one rank hosts it), on a free port
        self._store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
        group = ProcessGroupNCCL if backend == "nccl" else ProcessGroupGloo
        self.manager = Manager(
            pg=group(timeout=timeout),
            load_state_dict=load,
            state_dict=state,
            min_replica_size=1,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=0,
            world_size=1,
            store_addr="localhost",
            store_port=self._store.port,
            lighthouse_addr=os.environ[LIGHTHOUSE_ENV],
            replica_id=f"replica{place.id}",
            init_sync=False,  # every replica initialises the same weights from the seed
        )
        self.participants: dict[int, int] = {}  # committed step -> replicas that trained it
        self.retries: Counter[int] = Counter()  # step -> times trained again (a peer failed)
        self._joined: int | None = None  # the first quorum's step, until the first step

    def start(self, step: int) -> int:
        """The first quorum; the step the replicas train first. `step`: this replica's own
        (0, or the checkpoint's it resumed); a restarted one's is its live peers'."""
        if step:
            self.manager.load_state_dict({"step": step, "batches_committed": 0})
        self._joined = self.quorum()
        # At the run's start the replicas wait for each other (their processes start seconds
        # apart): the first steps are all replicas', not the fastest starter's alone.
        deadline = time.monotonic() + self.timeout_s
        while self.place.attempt == 0 and self.manager.num_participants() < self.place.replicas:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"replica {self.place.id}: {self.manager.num_participants()} of "
                    f"{self.place.replicas} replicas joined in {self.timeout_s:g} s "
                    "(backend.timeout_s)"
                )
            time.sleep(0.05)
            self._joined = self.quorum()
        return self._joined

    def begin(self, step: int) -> None:
        """Each step's quorum (the first step's was `start`'s). Where the peers went on
        without this replica (its step failed where theirs committed), it has loaded their
        state, but not the loop's records of it: it fails, and restarts as a restarted
        replica joins."""
        agreed = self._joined if self._joined is not None else self.quorum()
        self._joined = None
        if agreed != step:
            raise ReplicaLagged(
                f"replica {self.place.id} is at step {step}, its peers at {agreed}: restarted "
                "to join them"
            )

    def take(self, step: int) -> dict[str, int]:
        """The step's record of the quorum: how many replicas trained it, how often again."""
        fields = {"replicas": self.participants.pop(step)}
        if retries := self.retries.pop(step, 0):
            fields["retried"] = retries
        return fields

    def wrap(self, module: nn.Module) -> nn.Module:
        """torchft's DDP: the gradients averaged over the quorum's replicas."""
        from torchft import DistributedDataParallel  # noqa: PLC0415

        return DistributedDataParallel(self.manager, module)

    def quorum(self) -> int:
        """The step the live replicas train next (this one's state loaded from a peer's first,
        where it lagged)."""
        self.manager.start_quorum()
        return self.manager.current_step()

    def agreed(self, step: int, loss: torch.Tensor) -> bool:
        """Whether the step may be applied: every participant's collectives succeeded.
        `loss` becomes the mean of the quorum's replicas' (in place)."""
        self.manager.allreduce(loss).wait()
        replicas = self.manager.num_participants()
        if self.manager.should_commit():
            self.participants[step] = replicas
            return True
        self.retries[step] += 1
        return False

    def rolled_back(self, step: int) -> None:
        """train.guard.spike's rollback to `step`: the replicas' step count with it."""
        self.manager.load_state_dict(
            {"step": step, "batches_committed": self.manager.batches_committed()}
        )

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
