"""AdamW with lighter moments (train.optimizer_states): `bf16` (4 bytes a parameter instead
of fp32's 8) and torchao's `8bit` (~2).

Both keep the parameters as they are (fp32 master weights) and compute each update in fp32;
only the stored moments shrink. bf16 moments are written back with stochastic rounding:
rounded to nearest, an update smaller than half a bf16 step (2^-9 of the value: Adam's
second moment at beta2 = 0.95 moves 5% of its distance a step, often less than that) would
be lost every step and the moment stall (Zamirai et al. 2020, "Revisiting BFloat16
Training"). The rounding draws from a generator of its own, so no other draw of the run (a
dropout, the data) depends on the optimizer's layout.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from meshrun.models.shards import local_tensor
from meshrun.rank.library_warnings import TORCHAO_IMPORT, quiet_loggers

# torchao's AdamW8bit quantizes a state tensor of at least this many elements, a multiple of
# its block (torchao/optim/adam.py, _new_buffer: bitsandbytes' threshold); smaller ones fp32.
BLOCK = 256
MIN_QUANTIZED = 4096


def is_quantized(state: torch.Tensor) -> bool:
    """Whether an optimizer state is a tensor subclass over other tensors (torchao's 8-bit:
    codes and a scale a block of the local shard), which DCP can neither save nor reshard."""
    return is_traceable_wrapper_subclass(local_tensor(state))


def dense_state(state: torch.Tensor) -> torch.Tensor:
    """An optimizer state as a checkpoint holds it: a quantized one dequantized to an fp32
    tensor of its layout (a requantized copy of the same blocks gives the same codes back;
    another layout's blocks, the nearest codes of its own), any other itself."""
    if not is_quantized(state):
        return state
    values = local_tensor(state).dequantize()
    if not isinstance(state, DTensor):
        return values
    return DTensor.from_local(
        values,
        state.device_mesh,
        state.placements,
        run_check=False,
        shape=state.shape,
        stride=state.stride(),
    )


def zero_local_grads(optimizer: torch.optim.Optimizer) -> None:
    """Every gradient zeroed through its local tensor, in one foreach op (which refuses
    DTensors beside plain tensors: TP's replicated norms)."""
    grads = [
        local_tensor(p.grad)
        for group in optimizer.param_groups
        for p in group["params"]
        if p.grad is not None
    ]
    torch._foreach_zero_(grads)


def _bf16_stochastic(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`x` (fp32) rounded to bf16 at random, up or down in magnitude with the probability of
    its distance to each: 16 random low bits added to its bit pattern, then cut off (a carry
    rounds away from zero; sign and magnitude are separate bits)."""
    noise = torch.randint(
        0, 1 << 16, x.shape, device=x.device, dtype=torch.int32, generator=generator
    )
    return ((x.view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)


class Bf16AdamW(torch.optim.Optimizer):
    """AdamW whose two moments are bf16 tensors of the parameter's layout (DTensors where the
    parameter is one, for DCP), stepped on local tensors as LocalAdamW steps (optim.py)."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, seed: int):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": 0.0})
        rank = dist.get_rank() if dist.is_initialized() else 0
        self._seed = seed * 1_000_003 + rank
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self._seed)
        return self._generators[device]

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group, beta1, beta2)

    def _update(self, p: torch.Tensor, group: dict, beta1: float, beta2: float) -> None:
        state = self.state[p]
        if not state:
            # a tensor of a Python number, as torch's AdamW's non-capturable step
            # (torch/optim/adam.py, _init_group): on the planner's fake tensors a constant
            # still, which `float` below reads (zeros' is data, which a trace cannot read)
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16)
        param, grad = local_tensor(p), local_tensor(placed_like(p.grad, p)).float()
        m, v = local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"])
        state["step"] += 1
        step = float(state["step"])  # a CPU tensor: no device sync
        m32 = m.float().lerp_(grad, 1 - beta1)
        v32 = v.float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        lr = group["lr"]
        param.mul_(1 - lr * group["weight_decay"])
        denom = (v32.sqrt() / (1 - beta2**step) ** 0.5).add_(group["eps"])
        param.addcdiv_(m32, denom, value=-lr / (1 - beta1**step))
        generator = self._generator(param.device)
        m.copy_(_bf16_stochastic(m32, generator))
        v.copy_(_bf16_stochastic(v32, generator))

    def zero_grad(self, set_to_none: bool = True) -> None:
        if set_to_none:
            super().zero_grad(set_to_none=True)
        else:
            zero_local_grads(self)


def placed_as_params(optimizer: torch.optim.Optimizer) -> None:
    """Each DTensor gradient placed as its parameter is: under sequence parallelism a norm's
    weight is replicated and its gradient Partial (each TP rank's tokens' share), which
    torchao's compiled update would take as it is (its `to_local`, its pointwise ops on a
    Partial beside the Replicate moments): 3.6e-3 off one device's grad norm by step 5. The
    sum over the TP ranks that DTensor's own optimizer ops would make, made first (as
    rank/train/optim.LocalAdamW does)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is not None:
                param.grad = placed_like(param.grad, param)


def placed_like(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """`grad` laid out as `param` is (a Partial one summed over its mesh dim, a sharded one
    gathered where the parameter is replicated): what DTensor's own ops would do inside an
    update, done before it."""
    if not (isinstance(grad, DTensor) and isinstance(param, DTensor)):
        return grad
    if grad.placements == param.placements:
        return grad
    return grad.redistribute(param.device_mesh, param.placements)


def adamw_8bit() -> type[torch.optim.Optimizer]:
    """torchao's AdamW8bit, with the LR a float as torch's optimizers keep it (the schedule,
    the checkpoint's manifest and the records read floats); handed to torchao's compiled
    update as a tensor, so a new LR compiles nothing. Imported here: torchao is optional
    (validate/optimizer.py refuses `8bit` without it)."""
    with quiet_loggers(TORCHAO_IMPORT):
        from torchao.optim import AdamW8bit  # noqa: PLC0415 (meshrun[float8])
    # torch's compiled-graph cache cannot key torchao's state subclass (the update is then
    # compiled in each process, not read from the cache): said at every run's first step,
    # nothing a user can act on.
    warnings.filterwarnings("ignore", "OptimState8bit does not implement _stable_hash_for")

    class LocalAdamW8bit(AdamW8bit):
        def add_param_group(self, param_group: dict) -> None:
            torch.optim.Optimizer.add_param_group(self, param_group)

        def step(self, closure=None):
            placed_as_params(self)
            lrs = [group["lr"] for group in self.param_groups]
            for group, lr in zip(self.param_groups, lrs, strict=True):
                group["lr"] = torch.tensor(lr, dtype=torch.float32)
            try:
                return super().step(closure)
            finally:
                for group, lr in zip(self.param_groups, lrs, strict=True):
                    group["lr"] = lr

        def zero_grad(self, set_to_none: bool = True) -> None:
            if set_to_none:
                super().zero_grad(set_to_none=True)
            else:
                zero_local_grads(self)

    return LocalAdamW8bit
