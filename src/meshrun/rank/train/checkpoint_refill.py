"""What DCP's resharding leaves to meshrun when a checkpoint saved under another tp is loaded:
tensors whose rows depend on tp are read whole and refilled in this layout's form. The
vocabulary padded to a multiple of the saved tp (models/vocab.py): its rows past the
vocabulary dropped. Rows a part orders by tp (`row_orders_for`: GPT-2's fused q|k|v
regrouped per TP rank): saved row order[i] of the saved tp is this tp's row i. Optimizer
states follow their parameter's rows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from meshrun.models.shards import Reordered, Source
from meshrun.models.vocab import VOCAB_MODULES


@dataclass(frozen=True)
class Refill:
    """The whole tensor DCP loads the saved values into, and the source this rank's share is
    filled from."""

    whole: torch.Tensor
    source: Callable[[torch.Tensor], Source]


def refills(
    tensors: dict[str, torch.Tensor],
    parts: list[nn.Module],
    saved: tuple[int, int],
    ours: tuple[int, int],
    vocab: int,
) -> dict[str, Refill]:
    """key -> its refill, for the state tensors (`tensors`, by the checkpoint's keys) of the
    model `parts` that a checkpoint of (vocabulary rows, tp) `saved` holds otherwise than
    this layout's `ours`; `vocab` the model's own vocabulary."""
    (saved_rows, saved_tp), (rows, tp) = saved, ours
    found: dict[str, Refill] = {}
    if saved_rows and saved_rows != rows:
        for key, tensor in tensors.items():
            if _is_vocab(key) and tensor.ndim:
                whole = torch.empty(saved_rows, *tensor.shape[1:], dtype=tensor.dtype)
                found[key] = Refill(whole, lambda whole: whole[:vocab])
    if saved_tp != tp:
        before, now = _row_orders(parts, saved_tp), _row_orders(parts, tp)
        for key, tensor in tensors.items():
            name = _param_name(key)
            if name in before and tensor.ndim:
                order = before[name].argsort()[now[name]]
                whole = torch.empty(tensor.shape, dtype=tensor.dtype)
                found[key] = Refill(whole, lambda whole, order=order: Reordered(whole, order))
    return found


def _row_orders(parts: list[nn.Module], tp: int) -> dict[str, torch.Tensor]:
    """Each part's rows under `tp` (the identity where a part regroups nothing)."""
    orders = {}
    for part in parts:
        of = getattr(part, "row_orders_for", None)
        if of is not None:
            orders.update(of(tp))
    return orders


def _param_name(key: str) -> str:
    """The parameter a state tensor's key is of: model.<name>, optim.<name>.<state>."""
    kind, name = key.split(".", 1)
    return name if kind == "model" else name.rsplit(".", 1)[0]


def _is_vocab(key: str) -> bool:
    """A tensor of the embedding or the head, or an optimizer state of one."""
    name = key.split(".", 1)[1]
    return name.split(".", 1)[0] in VOCAB_MODULES
