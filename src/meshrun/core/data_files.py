"""The token files the data sources read, as the rules and the ranks both see them.

data=hf's cache directory, written once by the driver (driver/prepare_data.py) and only
memory-mapped by the ranks (rank/train/hf_data.py), holds every document's tokens, each
followed by the separator, as one flat array (`tokens.bin`), the token offset where each
document starts (`offsets.npy`, one more entry than documents: the end) and `meta.json`. Its
held-out split is the last documents, so no document is in both splits; data=text's is the
last bytes of its file. Each split is cut into non-overlapping windows on its own.
"""

from __future__ import annotations

import json
import math
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

TOKENS_FILE = "tokens.bin"
OFFSETS_FILE = "offsets.npy"
META_FILE = "meta.json"


class TokenCache:
    """A prepared cache directory: its meta, its document offsets, its tokens (mapped lazily,
    so that pickling a window stream to a DataLoader worker never copies them)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.meta: dict[str, Any] = json.loads((self.path / META_FILE).read_text())

    @cached_property
    def offsets(self) -> np.ndarray:
        return np.load(self.path / OFFSETS_FILE)

    @cached_property
    def tokens(self) -> np.ndarray:
        return np.memmap(self.path / TOKENS_FILE, dtype=self.meta["dtype"], mode="r")

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "meta": self.meta}  # the maps reopen in the new process

    def spans(self, heldout_fraction: float) -> tuple[range, range]:
        """Token spans of the training and the held-out documents (the last
        ceil(fraction x documents) of them)."""
        n_docs = len(self.offsets) - 1
        first_heldout = n_docs - math.ceil(n_docs * heldout_fraction)
        cut, end = int(self.offsets[first_heldout]), int(self.offsets[-1])
        return range(0, cut), range(cut, end)


def n_windows(span: range, length: int) -> int:
    return len(span) // length


def text_spans(n_bytes: int, heldout_fraction: float) -> tuple[range, range]:
    """Byte spans of data=text's training part and held-out part (the last
    ceil(fraction x bytes))."""
    cut = n_bytes - math.ceil(n_bytes * heldout_fraction)
    return range(0, cut), range(cut, n_bytes)
