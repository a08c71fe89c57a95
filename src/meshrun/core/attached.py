"""Attach mode: whether this process was started by torchrun (or any launcher that sets RANK and
WORLD_SIZE) as one rank of a run, and how many nodes that run spans."""

from __future__ import annotations

import os


def attached_rank() -> int | None:
    """This process's rank when started by torchrun, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"])
    return None


def attached_nodes() -> int:
    """How many nodes torchrun started ranks on (its --nnodes)."""
    return int(os.environ["WORLD_SIZE"]) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
