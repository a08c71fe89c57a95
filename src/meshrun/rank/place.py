"""This rank process's place in the run: its world (a torchft replica group's, or the run's),
its rank, device, mesh and watchdog, which every part of the rank reads."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from meshrun.core.config import RunConfig
from meshrun.core.layout import Layout, dp_rank
from meshrun.core.replica_place import ReplicaPlace
from meshrun.rank.watchdog import Watchdog


def place_in_run(cfg: RunConfig, replica: ReplicaPlace | None) -> tuple[Layout, int]:
    """This process's world (a torchft replica group's: the run's layout without
    dp_replicate) and its rank in the run, which names its files and records (a replica
    group's world rank is RANK)."""
    layout = Layout.of(cfg.parallel)
    rank = int(os.environ.get("RANK", "0"))
    if replica is None:
        return layout, rank
    group = dataclasses.replace(layout, dp_replicate=1)
    return group, replica.id * group.world_size + rank


@dataclass(frozen=True)
class Rank:
    """This process's place in the run, as every step of it needs it."""

    cfg: RunConfig
    layout: Layout
    rank: int
    device: torch.device
    mesh: DeviceMesh | None
    watchdog: Watchdog | None
    replica: ReplicaPlace | None = None  # parallel.fault_tolerance=torchft

    @property
    def world_rank(self) -> int:
        """The rank in its process group's world: a torchft replica group's own."""
        return self.rank % self.layout.world_size

    def data_share(self) -> tuple[int, int]:
        """Which share of each global batch this rank trains on, of how many."""
        share = dp_rank(self.layout, self.world_rank), self.layout.dp_size
        if self.replica is None:
            return share
        return self.replica.id * share[1] + share[0], self.replica.replicas * share[1]


def restarted(at: Rank) -> bool:
    """A torchft replica started again: the failure it injected happened once."""
    return at.replica is not None and at.replica.attempt > 0
