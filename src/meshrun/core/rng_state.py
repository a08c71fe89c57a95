"""A checkpoint's RNG states: each rank's torch generators in `rng/rank-<5 digits>.pt`, a
dict of ByteTensors (`cpu`: torch.get_rng_state(), `cuda`: the rank's device's, where it
used one), written by torch.save. They are read with torch.load(weights_only=True), whose
unpickler builds tensors and plain containers only (torch/_weights_only_unpickler.py): a
file that pickles anything else, such as a callable that would run on load, is refused
unread, as is one that is not such a dict. meshrun has written this dict since its RNG
states were first checkpointed, so every checkpoint it wrote reads this way."""

from __future__ import annotations

import pickle
import re
from pathlib import Path

import torch

from meshrun.core.errors import Refused

RNG_DIR = "rng"
GENERATORS = ("cpu", "cuda")


class RngStateRefused(Refused):
    """An RNG state file that is not one meshrun wrote: refused before anything in it ran."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(
            f"{path}: refused unread: it {why}, where meshrun writes each rank's RNG states "
            "as tensors only",
            f"resume from a checkpoint you trust, or from this one with {path.parent} "
            "deleted (its weights without the RNG states: the run then draws other random "
            "numbers)",
        )


def rng_file(checkpoint: Path, rank: int) -> Path:
    return checkpoint / RNG_DIR / f"rank-{rank:05d}.pt"


def read_rng_state(path: Path) -> dict[str, torch.Tensor]:
    """The generators' states in `path`; RngStateRefused (naming the file, what it holds
    and how to go on) where it holds anything else."""
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:  # a global the weights-only unpickler refused
        named = re.search(r"Unsupported global: GLOBAL (\S+)", str(err))
        held = f"a pickled {named.group(1)}" if named else "pickled objects other than tensors"
        raise RngStateRefused(path, f"holds {held}, which loading would run") from None
    except (RuntimeError, EOFError) as err:  # not a torch.save file, or cut short
        raise RngStateRefused(path, f"is no torch.save file ({err})") from None
    if not _is_state(state):
        raise RngStateRefused(path, "is not a dict of RNG state tensors")
    return state


def _is_state(state: object) -> bool:
    return (
        isinstance(state, dict)
        and "cpu" in state
        and set(state) <= set(GENERATORS)
        and all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in state.values())
    )
