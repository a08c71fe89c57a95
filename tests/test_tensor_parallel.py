"""The collectives meshrun's TP plan issues (rank/parallel/tensor.py): a block's column-wise
matrices share its input, so backward reduces their summed input gradient once a sub-block,
as Megatron's f operator does: q, k, v and gate, up each reducing their own would be five
collectives a block where two do."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

from meshrun.models import build_model
from meshrun.rank.parallel.checkpointing import apply_activation_checkpointing
from meshrun.rank.parallel.tensor import apply_tp
from tests.helpers import resolved_config

LAYERS = 4  # model=tiny's


def _tp_model(sequence_parallel: bool) -> torch.nn.Module:
    """model=tiny over 2 TP ranks (a process group up)."""
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    cfg = resolved_config("model=tiny")
    model = build_model(cfg.model, 16, torch.device("cpu"), vocab_multiple=2)
    model.init_weights(0)
    apply_tp(model, mesh, sequence_parallel)
    return model


def _collectives(sequence_parallel: bool) -> dict[str, dict[str, int]]:
    """Each kind of collective a forward and a backward of model=tiny over 2 TP ranks
    issues, and which of the all-reduces carry a block's activations."""
    dist.init_process_group("gloo")
    try:
        model = _tp_model(sequence_parallel)
        tokens = torch.arange(32).view(2, 16)
        counts = {}
        for phase in ("forward", "backward"):
            with CommDebugMode() as comm:
                if phase == "forward":
                    loss = model(tokens).float().square().mean()
                else:
                    loss.backward()
            counts[phase] = {
                str(op).rsplit(".", 1)[-1]: n for op, n in comm.get_comm_counts().items()
            }
        return counts
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2_sp"])
def test_each_sub_block_reduces_its_input_gradient_once(rank_pool, sequence_parallel):
    for counts in rank_pool.run(_collectives, sequence_parallel, world_size=2):
        forward, backward = counts["forward"], counts["backward"]
        if not sequence_parallel:
            # attention's and the MLP's outputs, and the embedding's
            assert forward == {"all_reduce": 2 * LAYERS + 1, "all_gather_into_tensor": 1}, counts
            # q|k|v's and gate|up's summed input gradients, and the head's input
            assert backward == {"all_reduce": 2 * LAYERS + 1}, counts
        else:
            # forward: each sub-block's input gathered and its output reduce-scattered (the
            # embedding's too), the head's input and logits gathered; backward the other way
            # round: no activation all-reduced
            assert forward == {
                "all_gather_into_tensor": 2 * LAYERS + 2,
                "reduce_scatter_tensor": 2 * LAYERS + 1,
            }, counts
            assert backward == {
                "all_gather_into_tensor": 2 * LAYERS + 1,
                "reduce_scatter_tensor": 2 * LAYERS + 1,
            }, counts


class _FunctionalCollectives(TorchDispatchMode):
    """Counts the functional collectives run inside (CommDebugMode's module tracker does not
    follow a checkpoint's recompute); an output SAC hands back from its cache runs none."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional":
            self.counts[func._opname] += 1
        return func(*args, **(kwargs or {}))


def _backward_reduce_scatters(checkpointing: str) -> int:
    dist.init_process_group("gloo")
    try:
        model = _tp_model(sequence_parallel=True)
        apply_activation_checkpointing(model, checkpointing)
        loss = model(torch.arange(32).view(2, 16)).float().square().mean()
        with _FunctionalCollectives() as backward:
            loss.backward()
        return backward.counts["reduce_scatter_tensor"]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("checkpointing", ["none", "selective", "op"])
def test_selective_checkpointing_runs_no_reduce_scatter_again_in_backward(rank_pool, checkpointing):
    """SAC keeps SP's reduce-scattered outputs (as torchtitan does): a block's recompute in
    backward reduces nothing again; backward's reduce-scatters are the input gradients'."""
    for count in rank_pool.run(_backward_reduce_scatters, checkpointing, world_size=2):
        assert count == 2 * LAYERS + 1, checkpointing
