"""User TP plans for tests (`parallel.tp_plan=tests.plans:<function>`), imported by the ranks."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial
from torch.distributed.tensor.parallel import RowwiseParallel

from meshrun.rank.parallel.tensor import apply_tp


def wrong_wo_sharding(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """The built-in plan with one mistake: the attention output projection `wo` is row-wise
    but its output is left Partial, so the per-rank partial sums are never all-reduced. Shapes
    still fit, so it trains without an error, just wrongly (a column-wise `wo` would not: its
    input is head-sharded, and the matmul fails at once)."""
    mistake = {"attention.wo": RowwiseParallel(output_layouts=Partial())}
    apply_tp(model, tp_mesh, sequence_parallel, block_overrides=mistake)
