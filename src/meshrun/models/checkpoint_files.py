"""The weights of a save_pretrained directory (model.safetensors, or shards listed by
model.safetensors.index.json), read a box at a time: safetensors maps the file, so a rank
reads only the slices of the tensors it holds (shards.py) and nothing else is loaded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from meshrun.models.shards import Box

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


class SavedTensors:
    """The directory's tensors by name; `bytes_read` counts what the slices read held."""

    def __init__(self, directory: str | Path) -> None:
        self.root = Path(directory)
        self.bytes_read = 0
        self.opened: dict[str, Any] = {}  # a file's safe_open, its header parsed once
        index = self.root / SAFETENSORS_INDEX
        if index.exists():
            self.files: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:
            with safe_open(self.root / SAFETENSORS, "pt") as f:
                self.files = dict.fromkeys(f.keys(), SAFETENSORS)

    def __getitem__(self, key: str) -> Saved:
        return Saved(self, key)

    def read(self, key: str, box: Box) -> torch.Tensor:
        tensor = self._file(key).get_slice(key)[box]
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def shape(self, key: str) -> torch.Size:
        return torch.Size(self._file(key).get_slice(key).get_shape())

    def _file(self, key: str) -> Any:
        """The open file holding `key` (an MoE checkpoint has a tensor per expert: thousands
        of reads of a few files)."""
        name = self.files[key]
        if name not in self.opened:
            self.opened[name] = safe_open(self.root / name, "pt")
        return self.opened[name]


class Saved:
    """One saved tensor as a source: its shape from the header, its values on reading."""

    def __init__(self, saved: SavedTensors, key: str) -> None:
        self.saved = saved
        self.key = key
        self.shape = saved.shape(key)

    def __getitem__(self, box: Box) -> torch.Tensor:
        return self.saved.read(self.key, box)
