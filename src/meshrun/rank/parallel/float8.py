"""train.float8 on a rank: the block linears (models/float8.py's filter) swapped for
torchao's Float8Linear on the meta model, before TP, compile and FSDP2, as torchtitan
converts (torchtitan/components/quantization/float8.py). Their weights stay parameters of
the run's precision (the state dict's keys and dtypes unchanged: a checkpoint resumes with
float8 on or off); only the matmuls cast their operands to float8 each step.

    tensorwise  under FSDP2 each weight is all-gathered in float8 (torchao's
                WeightWithDynamicFloat8CastTensor, `enable_fsdp_float8_all_gather`), its
                scale computed for every weight at once, one all-reduce of their amaxes,
                after each optimizer step and after any load of the weights
                (`precompute_float8_dynamic_scale_for_fsdp`); under TP the model's plan maps
                onto torchao's Float8ColwiseParallel / Float8RowwiseParallel, and a
                sub-block's shared input (tensor.py's ShareInput, PrepareFloat8ModuleInput's
                job) is cast to float8 before its all-gather: SP's all-gathers move float8
    rowwise,    everything distributed in high precision (torchtitan: float8 all-gather is
    .._gw_hp    tensorwise's only)

torchao's Float8Linear follows CUDA's autocast only (`torch.is_autocast_enabled()`, its
`get_autocast_gpu_dtype`: torchao/float8/float8_linear.py); `Float8Linear` here follows the
input's device's, so a CPU run casts its matmul inputs where a GPU's does.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle

from meshrun.core.config import Float8Config
from meshrun.models.float8 import float8_linears
from meshrun.rank.library_warnings import TORCHAO_IMPORT, quiet_loggers

with quiet_loggers(TORCHAO_IMPORT):
    from torchao.float8 import (
        Float8LinearConfig,
        convert_to_float8_training,
        precompute_float8_dynamic_scale_for_fsdp,
    )
    from torchao.float8.config import ScalingGranularity, e4m3_dtype
    from torchao.float8.float8_linear import Float8Linear as TorchaoFloat8Linear
    from torchao.float8.float8_ops import FLOAT8_OPS_TABLE
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
    )
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

# torchao's all-gather of a float8 tensor (float8_ops.py allgather_fp8: tensorwise TP's
# all-gathers of float8 inputs and output gradients) moves its float8 data as it is, which
# NCCL takes (torch/csrc/distributed/c10d/NCCLUtils.cpp's ncclDataType: float8 as
# ncclFloat8e4m3/e5m2, or ncclUint8 before NCCL's own) and gloo refuses ("Invalid scalar
# type": ProcessGroupGloo has no float8 type). On a CPU the same bytes move as uint8.
_ALL_GATHERS = [
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops.c10d_functional.all_gather_into_tensor.default,
]
_TORCHAO_ALL_GATHER = FLOAT8_OPS_TABLE[_ALL_GATHERS[0]]


def _all_gather_bytes_on_cpu(op: object, args: tuple, kwargs: dict | None = None) -> object:
    """torchao's float8 all-gather, whose data a CPU's gloo moves as bytes."""
    given = args[0]
    if given._data.device.type != "cpu":
        return _TORCHAO_ALL_GATHER(op, args, kwargs)
    data = given._data.contiguous()
    gathered = op(data.view(torch.uint8), *args[1:], **(kwargs or {}))
    gathered = torch.ops._c10d_functional.wait_tensor(gathered)
    return Float8TrainingTensor(
        gathered.view(data.dtype),
        given._scale,
        given._orig_dtype,
        given._linear_mm_config,
        given._gemm_input_role,
    )


for _op in _ALL_GATHERS:
    FLOAT8_OPS_TABLE[_op] = _all_gather_bytes_on_cpu


class Float8Linear(TorchaoFloat8Linear):
    """torchao's Float8Linear under the input's device's autocast (module docstring), and
    what tensor.py asks of a float8 linear under TP."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        device = input.device.type
        if torch.is_autocast_enabled(device):
            input = input.to(torch.get_autocast_dtype(device))
        return super().forward(input)

    @property
    def tensorwise(self) -> bool:
        """One scale a tensor for every operand: torchao's float8 TP styles' assumption."""
        casts = (self.config.cast_config_input, self.config.cast_config_weight)
        return all(c.scaling_granularity is ScalingGranularity.TENSORWISE for c in casts)

    def tp_style(self, style: str, **layouts: object) -> ParallelStyle | None:
        """torchao's float8 TP style for a `colwise` or `rowwise` entry where the recipe is
        tensorwise (its input cast before the all-gather, its output's gradient before the
        backward's): torchao/float8/float8_tensor_parallel.py; None: torch's own."""
        if not self.tensorwise:
            return None
        return {"colwise": Float8ColwiseParallel, "rowwise": Float8RowwiseParallel}[style](
            **layouts
        )

    def cast_input(self, x: DTensor) -> DTensor:
        """A sub-block's shared input cast to float8 as PrepareFloat8ModuleInput casts it
        (before its all-gather), for every float8 child to take as it is."""
        return hp_tensor_to_float8_dynamic(
            x, e4m3_dtype, self.linear_mm_config, gemm_input_role=GemmInputRole.INPUT
        )


def convert(model: nn.Module, cfg: Float8Config, under_fsdp: bool) -> None:
    """`model`'s float8 linears (models/float8.py) swapped in place, on meta. `under_fsdp`:
    the layout shards with FSDP2, whose all-gathers may move float8."""
    config = Float8LinearConfig.from_recipe_name(str(cfg.recipe))
    if under_fsdp and cfg.gathers_float8:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    names = set(float8_linears(model, cfg.skip))
    convert_to_float8_training(model, module_filter_fn=lambda _, fqn: fqn in names, config=config)
    for module in model.modules():
        if type(module) is TorchaoFloat8Linear:
            module.__class__ = Float8Linear  # the same module, under any device's autocast


@torch.no_grad()
def refresh_scales(parts: list[nn.Module]) -> None:
    """The float8 all-gather's scales of every weight from its current values, one
    all-reduce a part and mesh (a no-op without float8 all-gather): after each optimizer
    step and after the weights were loaded, as torchtitan's post-optimizer hook. torchao
    stacks every weight's amax into one DTensor, which needs them on one mesh: under TP with
    experts split over etp, an MoE router's linear is sharded by FSDP alone (its mesh
    dp_shard, the blocks' dp_shard x tp), so each mesh's linears go in a list of their own."""
    for part in parts:
        by_mesh: dict[object, list[nn.Module]] = {}
        for module in part.modules():
            if isinstance(module, TorchaoFloat8Linear) and isinstance(module.weight, DTensor):
                by_mesh.setdefault(module.weight.device_mesh, []).append(module)
        for linears in by_mesh.values():
            precompute_float8_dynamic_scale_for_fsdp(nn.ModuleList(linears))
