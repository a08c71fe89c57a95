"""The run's small control collectives (flags, timings, votes, metric reductions) on the
device their group's backend takes: NCCL reduces CUDA tensors only
(torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp, `check_gpu_single_tensor`: "Tensors must
be CUDA and dense"), and a group that registered a backend for CUDA alone refuses a CPU
tensor before any backend sees it (c10d's ProcessGroup: "No backend type associated with
device type cpu"), as torchft's ProcessGroupNCCL does; gloo and MPI take CPU tensors. Each
value is placed there, reduced, and handed back where the caller keeps it, in its dtype
(NCCL reduces float64: ProcessGroupNCCL.cpp's `ncclDataType` maps kDouble to ncclDouble).

The bulk collectives (gradients, activations, a pipeline's transfers) run on the tensors the
model computed, on the rank's device, which every backend the run uses takes;
tests/test_control_collectives.py walks every collective call in meshrun and names those, each
with why it may stay as it is."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torchft import Manager

# The device type each backend's tensors live on.
BACKEND_DEVICES = {"nccl": "cuda", "gloo": "cpu", "mpi": "cpu"}


def backend_device(backend: str, accelerator: torch.device) -> torch.device:
    """Where `backend` (dist.get_backend's name) takes a collective's tensors: NCCL on this
    rank's CUDA device `accelerator`, gloo and MPI on the CPU. A group of several backends
    ("cpu:gloo,cuda:nccl") uses its CPU one where it has one, as torch's object
    collectives do (distributed_c10d._get_object_coll_device)."""
    if ":" in backend:
        by_device = dict(pair.split(":", 1) for pair in backend.split(","))
        backend = by_device.get("cpu", next(iter(by_device.values())))
    if backend not in BACKEND_DEVICES:
        raise ValueError(f"no device known for the {backend!r} backend's collectives")
    if BACKEND_DEVICES[backend] == "cpu":
        return torch.device("cpu")
    if accelerator.type != "cuda":
        raise ValueError(f"the {backend!r} backend takes CUDA tensors; this rank has {accelerator}")
    return accelerator


def current_accelerator() -> torch.device:
    """This process's current CUDA device (rank/mesh.select_device set it), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device `group`'s (default: the world's) collectives take tensors on."""
    return backend_device(dist.get_backend(group), current_accelerator())


def control_all_reduce(
    values: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    op: dist.ReduceOp = dist.ReduceOp.SUM,
) -> torch.Tensor:
    """`values` reduced over `group`, in place where they are; returned."""
    placed = values.to(group_device(group))
    dist.all_reduce(placed, op=op, group=group)
    return _returned(values, placed)


def control_all_gather(
    values: torch.Tensor, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Every rank's `values`, stacked [rank, ...], where `values` are."""
    placed = values.to(group_device(group))
    gathered = [torch.empty_like(placed) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, placed, group=group)
    return torch.stack(gathered).to(values.device)


def control_barrier(group: dist.ProcessGroup | None = None) -> None:
    """dist.barrier, on NCCL on this rank's device: NCCL's barrier all-reduces a tensor it
    allocates on `device_ids[0]`, else on a device it guesses, with a warning
    (distributed_c10d.barrier)."""
    device = group_device(group)
    dist.barrier(group=group, device_ids=[device.index] if device.type == "cuda" else None)


def replicas_all_reduce(
    manager: Manager, device: torch.device, values: torch.Tensor, op: dist.ReduceOp
) -> torch.Tensor:
    """torchft's all-reduce of `values` over the replica groups, on `device`, the one its
    process group takes (torchft/process_group.py: ProcessGroupNCCL registers NCCL for CUDA
    alone, ProcessGroupGloo gloo for the CPU), in place where they are; returned. torchft's
    Manager.allreduce raises nothing: a failure (a CPU tensor on its NCCL group too) goes to
    `report_error`, leaves the values as they were and fails the next commit, so a value on
    the wrong device would silently stay this group's own."""
    placed = values.to(device)
    manager.allreduce(placed, reduce_op=op).wait()
    return _returned(values, placed)


def _returned(values: torch.Tensor, placed: torch.Tensor) -> torch.Tensor:
    """`values`, holding what `placed` (their copy on a group's device, or themselves) holds."""
    if placed is not values:
        values.copy_(placed)
    return values
