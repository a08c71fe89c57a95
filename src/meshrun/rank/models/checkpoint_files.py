"""The weights of a save_pretrained directory (model.safetensors, or shards listed by
model.safetensors.index.json), read one tensor at a time: safetensors maps the file, so a
pipeline stage reads only its own tensors and nothing else is loaded."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


class SavedTensors:
    def __init__(self, directory: str | Path) -> None:
        self.root = Path(directory)
        index = self.root / SAFETENSORS_INDEX
        if index.exists():
            self.files: dict[str, str] = json.loads(index.read_text())["weight_map"]
        else:
            with safe_open(self.root / SAFETENSORS, "pt") as f:
                self.files = dict.fromkeys(f.keys(), SAFETENSORS)

    def __getitem__(self, key: str) -> torch.Tensor:
        with safe_open(self.root / self.files[key], "pt") as f:
            return f.get_tensor(key)
