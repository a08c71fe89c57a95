"""A tied embedding and head under a pipeline (Megatron's embedding group): the first stage
holds the embedding, the last a copy of its weight as the head. The copy goes by the
embedding's name (models/shards.named_tensors), so it is seeded or read to the same values
and its optimizer state is checkpointed under the same key; after each step's backward the
two gradients are summed over the pair of ranks, so that one update keeps both equal, and
the copy's gradient is left out of the global norm (one tensor, counted once).

Both ends are sharded alike by any layout: TP splits the embedding and the head over the
vocabulary (dim 0, tensor.py), FSDP2 dim 0 again; so the pair of ranks at the same (dp, cp,
tp) coordinate hold the same box of the weight and sum their local gradients directly."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from meshrun.models.shards import COPIES, local_tensor

EMBEDDING, HEAD = "tok_embeddings.weight", "output.weight"


def mark_head_copy(stage: nn.Module) -> None:
    """A last stage's tied head, cut from its embedding: its weight is the embedding's copy."""
    setattr(stage, COPIES, {HEAD: EMBEDDING})


def holds_copy(part: nn.Module) -> bool:
    return HEAD in getattr(part, COPIES, {})


@dataclass
class TiedWeights:
    """This rank's end of the tied weight (the embedding's or the head's), and the group of
    the two ranks holding the ends."""

    param: nn.Parameter
    is_copy: bool
    group: dist.ProcessGroup

    def sum_grads(self) -> None:
        """Both ends' gradients summed, each laid out as its weight first: TP's embedding
        computes a replicated gradient for its vocabulary-sharded weight (the optimizer would
        redistribute it anyway), the head a sharded one."""
        grad, param = self.param.grad, self.param
        if isinstance(grad, DTensor) and grad.placements != param.placements:
            grad = param.grad = grad.redistribute(param.device_mesh, param.placements)
        dist.all_reduce(local_tensor(grad), group=self.group)


def tied_weights(parts: list[nn.Module], mesh: DeviceMesh) -> TiedWeights | None:
    """The tied end among a pipeline rank's materialised parts, if it holds one: the first
    stage's embedding of a tied model, or the last stage's head copy. Every pipeline rank
    calls it (a group of the ends is made by every rank)."""
    if not parts[0].tied:
        return None
    group = _ends_group(mesh)
    for part in parts:
        if holds_copy(part):
            return TiedWeights(part.output.weight, True, group)
        if part.tok_embeddings is not None and part.output is None:
            return TiedWeights(part.tok_embeddings.weight, False, group)
    return None


def _ends_group(mesh: DeviceMesh) -> dist.ProcessGroup | None:
    """This rank's pair of pipeline ends (its pipeline's first and last rank): the pp group
    itself for two stages, else one of the pairs' groups, which every rank makes (as the
    mesh's own groups are made, on any backend); None on a middle stage."""
    if mesh["pp"].size() == 2:
        return mesh["pp"].get_group()
    ranks = mesh.mesh  # pp is the outermost dim (core/layout.MESH_DIMS)
    firsts, lasts = ranks[0].flatten().tolist(), ranks[-1].flatten().tolist()
    mine, _ = dist.new_subgroups_by_enumeration([*map(list, zip(firsts, lasts, strict=True))])
    return mine
