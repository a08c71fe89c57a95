"""Every collective meshrun calls has its tensors where its group's backend takes them
(rank/control_collectives.py). A walk over meshrun's source finds each call of a collective
(torch.distributed's, DTensor's redistribution, torchft Manager's all-reduce, DCP's) and
requires that it is the helper's, or one reviewed here with why it may stay as it is: the
bulk collectives run on what the model computed, on the rank's device. The helper's choice
of device is a function of the backend's name and the rank's device; two real gloo ranks
run its collectives."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import meshrun
from meshrun.rank.control_collectives import (
    backend_device,
    control_all_gather,
    control_all_reduce,
    control_barrier,
    group_device,
)
from meshrun.rank.mesh import init_distributed

SRC = Path(meshrun.__file__).parent
HELPER = "rank/control_collectives.py"

DIST_COLLECTIVES = frozenset(
    {
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_gather_single",
        "all_reduce",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "batch_isend_irecv",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "irecv",
        "isend",
        "monitored_barrier",
        "recv",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_single",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        "send",
    }
)
# a ProcessGroup's and torchft Manager's all-reduce, DTensor's redistribution
METHOD_COLLECTIVES = frozenset({"allreduce", "allgather", "redistribute", "full_tensor"})
ALIASES = frozenset({"ALL_GATHER", "REDUCE_SCATTER"})  # core/collective_names.py
DCP_COLLECTIVES = frozenset({"save", "async_save", "load"})

ACTIVATIONS = "activations and their gradients, on the rank's device, which its backend takes"
GRADIENTS = "gradients, on the rank's device, which its backend takes"
OBJECTS = (
    "an object collective: torch pickles onto the group's own device "
    "(distributed_c10d.all_gather_object/broadcast_object_list: _get_object_coll_device)"
)
CHECKPOINT_GROUP = "over the checkpointer's own gloo group (process_group=self.group), CPU-capable"
COMM_BUFFERS = "meshrun-comm's measured buffers, on the device of its backend (device_type)"
CALIBRATION_BUFFERS = (
    "calibration's timed buffers on the timed device; its group is cpu:gloo,cuda:nccl "
    "(tools/plan/calibrate.py), a backend for each device"
)

# (file under src/meshrun, enclosing function, call) -> why its tensors may stay where they are
REVIEWED = {
    ("models/exchange.py", "_all_to_all", "dist.all_to_all_single"): ACTIVATIONS,
    ("models/export.py", "export_checkpoint", "dcp.load"): "no_dist=True: no collective",
    ("models/moe.py", "GroupRegion.forward", "dist.all_reduce"): ACTIVATIONS,
    ("models/moe.py", "GroupRegion.backward", "dist.all_reduce"): ACTIVATIONS,
    ("models/moe.py", "MoEFeedForward._aux_loss", "dist.all_reduce"): (
        "a sequence's expert counts under CP, made from the router's picks on its device"
    ),
    ("models/expert_compute.py", "dispatched", "dist.all_to_all_single"): (
        "the experts' counts, placed on the activations' device (torch.as_tensor(device=...))"
    ),
    ("rank/parallel/balance.py", "balance_stages", "dist.all_gather_object"): OBJECTS,
    ("rank/train/auto_interval.py", "AutoInterval.measured", "dist.broadcast_object_list"): (
        OBJECTS
    ),
    ("rank/parallel/context_attention.py", "post_shift", "dist.batch_isend_irecv"): ACTIVATIONS,
    ("rank/parallel/context_attention.py", "_AllGatherAttention.backward", "REDUCE_SCATTER"): (
        ACTIVATIONS
    ),
    ("rank/parallel/context_attention.py", "_gather", "ALL_GATHER"): ACTIVATIONS,
    ("rank/parallel/pipeline.py", "_post", "dist.batch_isend_irecv"): ACTIVATIONS,
    ("rank/parallel/tensor.py", "ShareInput._apply.share", ".redistribute"): ACTIVATIONS,
    ("rank/parallel/tensor.py", "sequence_shard", ".redistribute"): ACTIVATIONS,
    ("rank/parallel/tied.py", "TiedWeights.sum_grads", ".redistribute"): GRADIENTS,
    ("rank/parallel/tied.py", "TiedWeights.sum_grads", "dist.all_reduce"): GRADIENTS,
    ("rank/report.py", "gathered", "dist.all_gather_object"): OBJECTS,
    ("rank/train/checkpoint.py", "Checkpointer.save", "dcp.async_save"): CHECKPOINT_GROUP,
    ("rank/train/checkpoint.py", "Checkpointer.save", "dcp.save"): CHECKPOINT_GROUP,
    ("rank/train/checkpoint.py", "Checkpointer._load", "dcp.load"): CHECKPOINT_GROUP,
    ("rank/train/checkpoint.py", "Checkpointer._decided", "dist.broadcast_object_list"): (
        f"{OBJECTS}; {CHECKPOINT_GROUP}"
    ),
    ("rank/train/optim.py", "LocalGrads.norm", ".redistribute"): GRADIENTS,
    ("rank/train/optim_states.py", "placed_like", ".redistribute"): GRADIENTS,
    ("rank/train/optim.py", "LocalGrads.norm", "dist.all_reduce"): (
        "the gradients' sums of squares, on their device every step: on the host they would "
        "sync every step, where the guard decides on the device (rank/train/guard.py)"
    ),
    ("rank/train/replicas.py", "Replicas.average", ".allreduce"): (
        "gradients on the model's device: torchft's ProcessGroupNCCL takes CUDA, its "
        "ProcessGroupGloo registers gloo for the CPU and CUDA (torchft/process_group.py)"
    ),
    ("tools/comm/collectives.py", "build_case", "dist.all_reduce"): COMM_BUFFERS,
    ("tools/comm/collectives.py", "build_case", "dist.broadcast"): COMM_BUFFERS,
    ("tools/comm/collectives.py", "build_case", "ALL_GATHER"): COMM_BUFFERS,
    ("tools/comm/collectives.py", "build_case", "REDUCE_SCATTER"): COMM_BUFFERS,
    ("tools/comm/collectives.py", "build_case", "dist.all_to_all_single"): COMM_BUFFERS,
    ("tools/comm/collectives.py", "build_case.sendrecv", "dist.batch_isend_irecv"): COMM_BUFFERS,
    ("tools/plan/block_collectives.py", "_collective", "dist.all_reduce"): CALIBRATION_BUFFERS,
    ("tools/plan/block_collectives.py", "_collective", "ALL_GATHER"): CALIBRATION_BUFFERS,
    ("tools/plan/block_collectives.py", "_collective", "dist.all_to_all_single"): (
        CALIBRATION_BUFFERS
    ),
    ("tools/plan/block_collectives.py", "_collective", "REDUCE_SCATTER"): CALIBRATION_BUFFERS,
}

Site = tuple[str, str, str]


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return node.id if isinstance(node, ast.Name) else ""


def _callee(call: ast.Call) -> str | None:
    """How a call of a collective reads (`dist.all_reduce`, `.allreduce`, `ALL_GATHER`)."""
    func = call.func
    if isinstance(func, ast.Name):
        return func.id if func.id in ALIASES else None
    if not isinstance(func, ast.Attribute):
        return None
    base = _dotted(func.value)
    if base in ("dist", "torch.distributed") and func.attr in DIST_COLLECTIVES:
        return f"dist.{func.attr}"
    if base == "dcp" and func.attr in DCP_COLLECTIVES:
        return f"dcp.{func.attr}"
    return f".{func.attr}" if func.attr in METHOD_COLLECTIVES else None


SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _calls_in(node: ast.AST, path: str, scope: tuple[str, ...], found: dict) -> None:
    """Every collective called under `node`, keyed by its enclosing function (a lambda's or
    nested function's call by the function it is in)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Call) and (callee := _callee(child)):
            site = (path, ".".join(scope) or "<module>", callee)
            found.setdefault(site, []).append(child.lineno)
        inner = (*scope, child.name) if isinstance(child, SCOPES) else scope
        _calls_in(child, path, inner, found)


def _modules() -> dict[str, ast.Module]:
    return {
        path.relative_to(SRC).as_posix(): ast.parse(path.read_text())
        for path in sorted(SRC.rglob("*.py"))
    }


def collective_calls() -> dict[Site, list[int]]:
    """(file, enclosing function, call) -> its lines, for every collective meshrun calls."""
    found: dict[Site, list[int]] = {}
    for path, tree in _modules().items():
        _calls_in(tree, path, (), found)
    return found


def test_every_collective_goes_through_the_helper_or_is_reviewed():
    unreviewed = [
        f"{path}:{lines[0]} {scope}: {callee}"
        for (path, scope, callee), lines in collective_calls().items()
        if path != HELPER and (path, scope, callee) not in REVIEWED
    ]
    assert not unreviewed, (
        "collectives neither through rank/control_collectives.py nor reviewed here: "
        + "; ".join(unreviewed)
    )


def test_every_reviewed_collective_is_still_called():
    assert not set(REVIEWED) - set(collective_calls())


def test_torch_distributed_is_imported_as_dist_only():
    """The walk knows a collective by `dist.`: none imported by its own name, or under
    another alias."""
    wrong = []
    for path, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                "torch.distributed"
            ):
                wrong += [f"{path}: {a.name}" for a in node.names if a.name in DIST_COLLECTIVES]
            if isinstance(node, ast.Import):
                wrong += [
                    f"{path}: {a.name} as {a.asname}"
                    for a in node.names
                    if a.name == "torch.distributed" and a.asname not in (None, "dist")
                ]
    assert not wrong


CUDA_1 = torch.device("cuda", 1)


@pytest.mark.parametrize(
    ("backend", "accelerator", "device"),
    [
        ("nccl", CUDA_1, CUDA_1),
        ("gloo", CUDA_1, torch.device("cpu")),
        ("gloo", torch.device("cpu"), torch.device("cpu")),
        ("mpi", CUDA_1, torch.device("cpu")),
        ("cpu:gloo,cuda:nccl", CUDA_1, torch.device("cpu")),
        ("cuda:nccl", CUDA_1, CUDA_1),
    ],
)
def test_a_backends_collectives_take_tensors_on_its_device(backend, accelerator, device):
    assert backend_device(backend, accelerator) == device


@pytest.mark.parametrize(
    ("backend", "accelerator"), [("nccl", torch.device("cpu")), ("ucc", torch.device("cpu"))]
)
def test_a_device_a_backend_cannot_take_is_refused(backend, accelerator):
    with pytest.raises(ValueError, match=backend):
        backend_device(backend, accelerator)


# equal in float64, not in float32: a reduction that passed through float32 would lose it
FINE = 1e-12


def _control_collectives(_) -> dict[str, object]:
    init_distributed("gloo", 30.0)
    rank = dist.get_rank()
    summed = torch.tensor([1.0 + rank * FINE, float(rank)], dtype=torch.float64)
    returned = control_all_reduce(summed, op=dist.ReduceOp.SUM)
    gathered = control_all_gather(torch.tensor([float(rank), 0.5], dtype=torch.float64))
    control_barrier()
    return {
        "in place": returned is summed,
        "summed": summed.tolist(),
        "gathered": gathered.tolist(),
        "dtype": str(gathered.dtype),
        "device": str(group_device()),
    }


def test_control_collectives_reduce_in_place_keeping_float64(rank_pool):
    for result in rank_pool.run(_control_collectives, None, world_size=2):
        assert result == {
            "in place": True,
            "summed": [2.0 + FINE, 1.0],
            "gathered": [[0.0, 0.5], [1.0, 0.5]],
            "dtype": "torch.float64",
            "device": "cpu",
        }
