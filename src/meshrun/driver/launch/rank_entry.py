"""The function every rank runs, as the driver names it to a launcher."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RankEntry:
    """The function every rank runs (a plain config dict in, rank 0's measurements out),
    named rather than imported: the driver never loads what only ranks run (torch's
    distributed stack: a second at every `meshrun` start), and a forkserver preloads `module`
    once for all of a driver's ranks. Pickles as its two names, so a SLURM task or a spawned
    rank imports it itself."""

    module: str
    function: str

    def __post_init__(self) -> None:
        # torch elastic names its workers' entrypoint by these, as it would a function
        object.__setattr__(self, "__name__", self.function)
        object.__setattr__(self, "__qualname__", self.function)

    def __call__(self, cfg_dict: dict[str, Any]) -> Any:
        return getattr(importlib.import_module(self.module), self.function)(cfg_dict)


TRAIN = RankEntry("meshrun.rank.worker", "run_rank")
