"""Seeded initial values: the same seed gives the same weights whatever the device or layout.

Each parameter draws from its own generator seeded by (seed, its full name), so values do not
depend on creation order, on which layers a pipeline stage keeps, or on the device (draws
happen on CPU in float32, then are copied)."""

from __future__ import annotations

import torch


def stable_hash(name: str) -> int:
    """Python's hash() is salted per process; ranks need the same number for the same name."""
    value = 0
    for char in name.encode():
        value = (value * 131 + char) % 2_147_483_647
    return value


def seeded_normal(seed: int, name: str, shape: torch.Size, std: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + stable_hash(name))
    return torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
