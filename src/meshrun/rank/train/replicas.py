"""parallel.fault_tolerance=torchft, a replica's side: this process is one rank of a
data-parallel replica group, a world of its own (its layout the run's without dp_replicate),
joined to the other groups each step by torchft's Manager through the driver's lighthouse
(driver/launch/replicas.py). A step begins with a quorum of the live groups (one that lags,
as a restarted one does, first loads a live group's state, each rank its peer's of the same
place: model and optimizer shares, schedule, data position, spike window); after the
backward each rank's local gradients (its shards, where the group shards them) are averaged
with those of the same rank of the other groups, one all-reduce a dtype; the step commits only
where every participant's collectives succeeded, else it is trained again. The quorum is
synchronous: a step trains on weights every participant holds, so its step number and loss
are the run's."""

from __future__ import annotations

import logging
import math
import os
import time
import warnings
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from meshrun.core.replica_place import (
    AGENT_STORE,
    LIGHTHOUSE_ENV,
    ReplicaAlone,
    ReplicaLagged,
    ReplicaPlace,
)
from meshrun.core.run_files.metrics import replicas_ended
from meshrun.rank.control_collectives import (
    backend_device,
    current_accelerator,
    replicas_all_reduce,
)
from meshrun.rank.train.build import Training
from meshrun.rank.train.checkpoint import load_local_state, load_schedule, local_state
from meshrun.rank.train.data import LocalBatches
from meshrun.rank.train.guard import Spike, SpikeGuard

State = dict[str, Any]

# torchft logs each quorum and commit (and, on CPU, that it cannot reset NCCL's flight
# recorder) through the root logger's handlers; its errors reach meshrun as failed commits
TORCHFT_LOGGERS = ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors")


def healing(
    training: Training, batches: LocalBatches, spikes: SpikeGuard | None
) -> tuple[Callable[[], State], Callable[[State], None]]:
    """What the same rank of a lagging group is sent, and how it loads it: everything a step
    depends on (this rank's shares of the weights and the optimizer's state, the LR
    schedule, the data's position, the spike watch)."""
    model, optimizer, schedule = training.model, training.optimizer, training.schedule

    def state() -> State:
        return {
            "tensors": local_state(model, optimizer),
            "schedule": schedule.state_dict(),
            "data_offset": batches.offset,
            "spikes": spikes.state_dict() if spikes else None,
        }

    def load(given: State) -> None:
        load_local_state(model, optimizer, given["tensors"])
        load_schedule(optimizer, schedule, given["schedule"])
        batches.offset = given["data_offset"]
        if spikes is not None:
            spikes.load_state_dict(given["spikes"])

    return state, load


class Replicas:
    """This rank's Manager; `state`/`load` are what the same rank of a lagging group is sent
    and loads."""

    def __init__(
        self,
        run_dir: str,
        place: ReplicaPlace,
        group: tuple[int, int],
        backend: str,
        timeout_s: float,
        state: Callable[[], State],
        load: Callable[[State], None],
    ) -> None:
        """`group`: this rank's rank in its replica group and the group's size."""
        # torchft: hundreds of milliseconds of imports that only these runs pay
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL  # noqa: PLC0415

        # torchft's streaming load of a peer's state hands torch a read-only buffer it owns
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        for name in TORCHFT_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
        self.place, self.timeout_s = place, timeout_s
        self.ended = replicas_ended(run_dir)
        timeout = timedelta(seconds=timeout_s)
        group_rank, group_size = group
        # the group's store, which torchft's Manager joins: the driver's (launcher=local, as
        # torch elastic's agent hosts one), the process group's (its rank 0 hosts it), else,
        # a group of one rank in a SLURM job, this rank's own
        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        hosted = dist.is_initialized() or os.environ.get(AGENT_STORE) == str(True)
        self.store = None if hosted else dist.TCPStore(address, port, is_master=group_rank == 0)
        across = "nccl" if backend == "nccl" else "gloo"
        self.device = backend_device(across, current_accelerator())  # its group's tensors'
        self.manager = Manager(
            pg=(ProcessGroupNCCL if across == "nccl" else ProcessGroupGloo)(timeout=timeout),
            load_state_dict=load,
            state_dict=state,
            min_replica_size=1,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=group_rank,
            world_size=group_size,
            store_addr=address,
            store_port=port,
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
        # At the run's start the replicas wait for each other (their processes start seconds
        # apart): the first steps are all replicas', not the fastest starter's alone. A
        # restarted one waits for a live one to join (whose next step may be seconds away):
        # alone, it would train from the start.
        need = self.place.replicas if self.place.attempt == 0 else 2
        deadline = time.monotonic() + self.timeout_s
        self._joined = self.quorum()
        while self.manager.num_participants() < need:
            if self.place.attempt and self.ended.exists():
                raise ReplicaAlone(f"replica {self.place.id}: the others ended the run")
            if time.monotonic() > deadline:
                error = ReplicaAlone if self.place.attempt else TimeoutError
                raise error(
                    f"replica {self.place.id}: {self.manager.num_participants()} of "
                    f"{need} replicas joined in {self.timeout_s:g} s (backend.timeout_s)"
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

    def average(self, grads: list[torch.Tensor]) -> None:
        """This rank's local gradients averaged, in place, with the same rank's of the other
        groups in the quorum: flattened, one all-reduce for each dtype."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for grad in grads:
            by_dtype.setdefault(grad.dtype, []).append(grad)
        for same in by_dtype.values():
            flat = torch.cat([grad.flatten() for grad in same])
            self.manager.allreduce(flat).wait()
            for grad, part in zip(same, flat.split([g.numel() for g in same]), strict=True):
                grad.copy_(part.view_as(grad))

    def reduce(self, values: torch.Tensor, op: dist.ReduceOp) -> None:
        """`values` reduced in place over the quorum's groups (the same rank of each), on
        the device torchft's group takes; left as they are where a group failed meanwhile
        (torchft then fails the next commit)."""
        replicas_all_reduce(self.manager, self.device, values, op)

    def same_spike(self, spike: Spike | None) -> Spike | None:
        """The groups' spike judgements of a log step made one, the earliest spike any group
        found (a group that joined late judges against a window short of the steps before it
        joined): every group rolls back alike, or none. Where a group failed during the
        exchange, this group's own."""
        earliest = torch.tensor([float(spike.step) if spike else math.inf], dtype=torch.float64)
        self.reduce(earliest, dist.ReduceOp.MIN)
        if math.isinf(earliest.item()):
            return None
        step = int(earliest.item())
        found = spike is not None and spike.step == step
        figures = [spike.loss, spike.mean, spike.std, 1.0] if found else [0.0] * 4
        summed = torch.tensor(figures, dtype=torch.float64)  # the finders', averaged
        self.reduce(summed, dist.ReduceOp.SUM)
        loss, mean, std, finders = summed.tolist()
        if not finders:
            return spike
        return Spike(step, loss / finders, mean / finders, std / finders)

    def quorum(self) -> int:
        """The step the live replicas train next (this one's state loaded from a peer's first,
        where it lagged)."""
        self.manager.start_quorum()
        return self.manager.current_step()

    def agreed(self, step: int, loss: torch.Tensor) -> bool:
        """Whether the step may be applied: every participant's collectives succeeded.
        `loss` becomes the mean of the quorum's replicas' (in place)."""
        self.reduce(loss, dist.ReduceOp.AVG)
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
