"""Single-process torch.nn.DataParallel: scatters each batch over several CUDA devices and
gathers outputs on the first. Kept as the baseline that DDP was built to beat.

Its replicas run in threads of their own, each under `torch.amp.autocast(device_type,
enabled=autocast_enabled)` with no dtype (torch/nn/parallel/parallel_apply.py, `_worker`):
autocast's dtype is thread-local, and a new thread has the device's default, fp16 on CUDA,
so a bf16 run's replicas computed in fp16, with no loss scaling. Here each replica enters
its caller's autocast, dtype included, inside its thread."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


class UnderAutocast(nn.Module):
    """`replica` run under autocast to `dtype`, whichever thread calls it."""

    def __init__(self, replica: nn.Module, device_type: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.replica, self.device_type, self.dtype = replica, device_type, dtype

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.replica(*args, **kwargs)


def under_callers_autocast(replicas: Sequence[nn.Module], device_type: str) -> list[nn.Module]:
    """The replicas under the autocast of the calling thread (the run's), where it has one."""
    if not torch.is_autocast_enabled(device_type):
        return list(replicas)
    dtype = torch.get_autocast_dtype(device_type)
    return [UnderAutocast(replica, device_type, dtype) for replica in replicas]


class RunDtypeDataParallel(nn.DataParallel):
    """DataParallel whose replicas compute in the dtype of the autocast it was called in."""

    def parallel_apply(
        self, replicas: Sequence[nn.Module], inputs: Sequence[Any], kwargs: Any
    ) -> list[Any]:
        wrapped = under_callers_autocast(replicas, self.src_device_obj.type)
        return super().parallel_apply(wrapped, inputs, kwargs)


def apply_dataparallel(model: nn.Module, n_devices: int) -> nn.Module:
    return RunDtypeDataParallel(model, device_ids=list(range(n_devices)))
