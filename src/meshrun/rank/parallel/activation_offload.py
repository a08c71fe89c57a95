"""parallel.activation_offload=cpu: what each block saves for backward kept in host memory.

Autograd's saved-tensor hooks are entered around each block's forward (a forward pre-hook
and a forward hook, so the block's names, and with them checkpoints and plans, stay as they
are): every tensor the block's ops save for backward is copied to host memory as it is saved
and back to the block's device when backward unpacks it (torch's `save_on_cpu`, pinned on
CUDA so the copies are asynchronous). Leaves (parameters, buffers) and views of them are
not copied: their owners keep them on the device anyway (FSDP2's gathered parameters are
freed by FSDP2 itself).

Registered on the block as it sits in the block list, around activation checkpointing's
wrapper where there is one: a checkpointed block saves only its input (non-reentrant
checkpointing saves it before its own hooks begin), which goes to the host too, and the
rest is recomputed in backward, as without offload. A tensor several ops save (the input
of q, k and v's projections) is copied once a block. `moved` counts the bytes copied out, a
step's being what the benchmark reports.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor


class HostActivations:
    """The hooks of one model part and the bytes they have copied to the host."""

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self.moved = 0
        self._entered: list[torch.autograd.graph.saved_tensors_hooks] = []
        self._copied: dict[tuple, tuple] = {}  # this block's, by tensor: each copied once

    @torch.no_grad()
    def pack(self, tensor: torch.Tensor) -> object:
        if _held_elsewhere(tensor):
            return tensor
        if isinstance(tensor, DTensor):  # TP's: its local tensor, and how to rebuild it
            spec = (tensor.device_mesh, tensor.placements, tensor.shape, tensor.stride())
            return spec, self.pack(tensor.to_local())
        key = (tensor.data_ptr(), tensor.size(), tensor.stride(), tensor.dtype)
        if key in self._copied:  # q, k and v's linears save the same input
            return self._copied[key][1]
        host = torch.empty(
            tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=self.pin_memory
        )
        host.copy_(tensor, non_blocking=self.pin_memory)
        self.moved += host.numel() * host.element_size()
        # the tensor held until the block's forward ends, so no other takes its address
        self._copied[key] = tensor, (tensor.device, host)
        return self._copied[key][1]

    def unpack(self, packed: object) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        where, inner = packed
        if isinstance(where, torch.device):
            return inner.to(where, non_blocking=self.pin_memory)
        mesh, placements, shape, stride = where
        local = self.unpack(inner)
        return DTensor.from_local(
            local, mesh, placements, run_check=False, shape=shape, stride=stride
        )

    def enter(self, module: nn.Module, args: tuple) -> None:
        hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)
        hooks.__enter__()
        self._entered.append(hooks)

    def exit(self, module: nn.Module, args: tuple, output: object) -> None:
        self._entered.pop().__exit__(None, None, None)
        self._copied.clear()  # the block's tensors released to autograd's ownership


def _held_elsewhere(tensor: torch.Tensor) -> bool:
    """A leaf or a view of one: a parameter (a linear saves its weight's transpose), a
    buffer (RoPE's tables), a pipeline stage's received input. Their owners keep them on
    the device whatever the block saves, so a copy would free nothing."""
    base = tensor if tensor._base is None else tensor._base
    return base.is_leaf


def apply_activation_offload(model: nn.Module, device: torch.device) -> HostActivations:
    """Every block of `model.layers` saving to host memory."""
    offload = HostActivations(pin_memory=device.type == "cuda")
    for block in model.layers.values():
        block.register_forward_pre_hook(offload.enter)
        block.register_forward_hook(offload.exit, always_call=True)
    return offload
