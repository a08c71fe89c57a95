"""Which linears of a model train in float8 (train.float8): torchtitan's filter
(torchtitan/components/quantization/utils.py `module_filter_fn`: both dims multiples of 16,
the float8 tensor cores' requirement, and no name in the skip list; its Llama configs skip
`output`, its MoE ones `router.gate`), on any of meshrun's models. Never the output head (its
logits feed the loss: torchtitan keeps it in high precision), the embedding (a lookup, no
linear) or an MoE router (meshrun's reads its weight in fp32: models/moe.py; transformers'
are no nn.Linear). A user's module (model=custom) whose head is not named: its last linear
to the vocabulary (in module order) is taken as the head. A pure function of the module, on
meta as well: the ranks convert by it (rank/parallel/float8.py), the driver counts by it for
the record."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from meshrun.models.custom import CustomLM
from meshrun.models.moe import MoEFeedForward

DIM_MULTIPLE = 16  # torch._scaled_mm: each dim of a float8 operand a multiple of 16


def _head(model: nn.Module) -> nn.Module | None:
    """The output head (None on a pipeline stage without it); of a user's module that names
    none (model.head: only a whole module, a pipeline needs it named), its last linear to
    the vocabulary."""
    if not (isinstance(model, CustomLM) and model.cfg.head is None):
        return getattr(model, "output", None)
    vocab = model.vocab_size
    to_vocab = [m for m in model.modules() if isinstance(m, nn.Linear) and m.out_features == vocab]
    return to_vocab[-1] if to_vocab else None


def float8_linears(model: nn.Module, skip: Sequence[str] = ()) -> dict[str, nn.Linear]:
    """The linears of `model` (meshrun's parts: `output`, `vocab_size`) that train in float8,
    by name; `skip`: name fragments kept in high precision."""
    head = _head(model)
    routers = {id(m.gate) for m in model.modules() if isinstance(m, MoEFeedForward)}
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and module is not head
        and id(module) not in routers
        and module.in_features % DIM_MULTIPLE == 0
        and module.out_features % DIM_MULTIPLE == 0
        and not any(fragment in name for fragment in skip)
    }
