"""The seam between the driver's torchft launcher (driver/launch/replicas.py) and a replica
group's ranks (rank/train/replicas.py): which group a process is, of how many, its start, and
the two ways a restarted or lagging group ends that the driver tells from other failures."""

from __future__ import annotations

import os
from dataclasses import dataclass

REPLICA_ENV = "MESHRUN_REPLICA"  # "<id>/<replicas>/<attempt>", set by the driver
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"  # torchft's own name for the lighthouse's address
# set where the driver hosts a group's store (launcher=local), as torch elastic's agent does
AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"


class ReplicaLagged(RuntimeError):
    """The other replicas committed a step this one did not."""


class ReplicaAlone(RuntimeError):
    """A restarted replica found no live one to join: the others ended the run, or died."""


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
