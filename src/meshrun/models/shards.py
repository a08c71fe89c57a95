"""A parameter filled with its rank's share of a full tensor, and only that share.

Layouts shard on the meta device (rank/parallel), so when a parameter gets its values it
may already be a DTensor (TP, FSDP2, both) holding one box of the full tensor. `fill` asks
its source for exactly that box: a tensor drawn whole (a seeded init) is sliced, a checkpoint
(checkpoint_files.Saved) reads just those bytes from disk. Sources compose: `Transposed` for
weights a checkpoint stores [in, out], `Reordered` for rows a layout regroups (GPT-2's fused
q|k|v per TP rank, LLaMA's rotary pairs). Vocabulary rows past the source (vocab.py's
padding) are zero.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from typing import Protocol

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX

Box = tuple[slice, ...]


class Source(Protocol):
    """A full tensor that can be read a box at a time (a torch.Tensor is one)."""

    @property
    def shape(self) -> torch.Size: ...

    def __getitem__(self, box: Box) -> torch.Tensor: ...


class Transposed:
    """A 2-D source read as its transpose."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.shape = torch.Size(reversed(source.shape))

    def __getitem__(self, box: Box) -> torch.Tensor:
        return self.source[box[::-1]].T


class Reordered:
    """Row i of this is row `order[i]` of the source; a box reads each run of consecutive
    source rows it needs once."""

    def __init__(self, source: Source, order: torch.Tensor) -> None:
        self.source = source
        self.order = order
        self.shape = source.shape

    def __getitem__(self, box: Box) -> torch.Tensor:
        rows, positions = self.order[box[0]].sort()
        if len(rows) == 0:
            return self.source[box]
        starts = [0, *(torch.nonzero(rows.diff() != 1).flatten() + 1).tolist(), len(rows)]
        runs = [
            self.source[(slice(int(rows[a]), int(rows[b - 1]) + 1), *box[1:])]
            for a, b in itertools.pairwise(starts)
        ]
        block = torch.cat(runs)
        values = torch.empty_like(block)
        values[positions] = block
        return values


class Stacked:
    """The sources (of one shape) stacked on a new dim 0: a box reads its rows' sources."""

    def __init__(self, sources: list[Source]) -> None:
        self.sources = sources
        self.shape = torch.Size((len(sources), *sources[0].shape))

    def __getitem__(self, box: Box) -> torch.Tensor:
        return torch.stack([source[box[1:]] for source in self.sources[box[0]]])


class Concatenated:
    """The sources concatenated along `dim`: a box reads the part of each that it overlaps."""

    def __init__(self, sources: list[Source], dim: int) -> None:
        self.sources = sources
        self.dim = dim
        sizes = [source.shape[dim] for source in sources]
        self.starts = [0, *itertools.accumulate(sizes)]
        shape = list(sources[0].shape)
        shape[dim] = self.starts[-1]
        self.shape = torch.Size(shape)

    def __getitem__(self, box: Box) -> torch.Tensor:
        dim, wanted = self.dim, box[self.dim]
        parts = []
        for source, start, stop in zip(self.sources, self.starts, self.starts[1:], strict=False):
            low, high = max(wanted.start, start), min(wanted.stop, stop)
            if low < high:
                parts.append(
                    source[(*box[:dim], slice(low - start, high - start), *box[dim + 1 :])]
                )
        if not parts:  # an empty box: the first part's, for its dtype
            return self.sources[0][(*box[:dim], slice(0, 0), *box[dim + 1 :])]
        return torch.cat(parts, dim=dim)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor`: a DTensor's local shard, any other tensor itself; of a
    weight FSDP2 all-gathers in float8 (torchao's WeightWithDynamicFloat8CastTensor, a
    wrapper without storage of its own: train.float8), the tensor it wraps. Both looked up,
    not imported (held_box says why)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(tensor, dtensor.DTensor):
        tensor = tensor.to_local()
    float8 = sys.modules.get("torchao.float8.fsdp_utils")
    if float8 is not None and isinstance(tensor, float8.WeightWithDynamicFloat8CastTensor):
        return tensor._tensor
    return tensor


def stored_view(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` as DCP saves and loads it: a weight FSDP2 all-gathers in float8 (a DTensor
    over torchao's wrapper, local_tensor) as a DTensor of the same layout over the tensor
    the wrapper holds, sharing its storage. The wrapper has no storage of its own: DCP wrote
    whatever that held (1e37 where the weights were 0.02). Any other tensor as it is."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    float8 = sys.modules.get("torchao.float8.fsdp_utils")
    if float8 is None or dtensor is None or not isinstance(tensor, dtensor.DTensor):
        return tensor
    if not isinstance(tensor._local_tensor, float8.WeightWithDynamicFloat8CastTensor):
        return tensor
    return dtensor.DTensor.from_local(
        tensor._local_tensor._tensor,
        tensor.device_mesh,
        tensor.placements,
        run_check=False,
        shape=tensor.shape,
        stride=tensor.stride(),
    )


def held_box(param: torch.Tensor) -> tuple[torch.Tensor, Box]:
    """(the tensor this rank writes, which box of the full tensor it holds). DTensor is looked
    up, not imported: a process that never made one (the driver validating a config) is spared
    its import, a second of every `meshrun` start."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is None or not isinstance(param, dtensor.DTensor):
        return param, tuple(slice(0, n) for n in param.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: PLC0415

    # the planner fills fake parameters (plan/traced.py); the mesh's coordinates stay real
    with unset_fake_temporarily():
        shape, offset = compute_local_shape_and_global_offset(
            param.shape, param.device_mesh, param.placements
        )
    return param.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


@torch.no_grad()
def fill(param: torch.Tensor, values: Source) -> None:
    """This rank's box of `values` into `param`; rows past them (vocabulary padding) zero."""
    local, box = held_box(param)
    rows = values.shape[0] if values.shape else 0
    if not box:  # a scalar
        local.copy_(values[()])
        return
    start, stop = box[0].start, min(box[0].stop, rows)
    if stop - start < local.shape[0]:
        local.zero_()
    if stop > start:
        local[: stop - start].copy_(values[(slice(start, stop), *box[1:])])


# A module's {name: the name of the tensor it copies}: a pipeline's last stage holding a tied
# head without the embedding (rank/parallel/tied.py) sets it
COPIES = "tensor_copies"


def named_tensors(module: nn.Module, buffers: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters (and buffers) by the names the model gave them: activation checkpointing's
    wrapper, applied before the weights are filled, adds a prefix that init seeds and
    checkpoint keys must not see; a copy of a tied tensor goes by the tensor's own name, so
    it is seeded, read and its optimizer state kept as the tensor is."""
    copies = getattr(module, COPIES, {})
    tensors = [*module.named_parameters(), *(module.named_buffers() if buffers else ())]
    for name, tensor in tensors:
        own = model_name(name)
        yield copies.get(own, own), tensor


def model_name(name: str) -> str:
    """A parameter's name as the model gave it, whatever wrapped its modules since."""
    return name.replace(_CHECKPOINT_PREFIX, "")
