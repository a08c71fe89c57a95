"""torch.nn.DataParallel's replicas (one CUDA device each, so only their thread runs here):
they compute in the run's autocast dtype."""

from __future__ import annotations

import threading

import torch
from torch import nn

from meshrun.rank.parallel.dataparallel import under_callers_autocast


def _in_replica_thread(replica: nn.Module, x: torch.Tensor) -> torch.dtype:
    """The dtype `replica` computes in where torch's parallel_apply runs it: a new thread
    under `torch.amp.autocast(device_type, enabled=True)`, no dtype given
    (torch/nn/parallel/parallel_apply.py, `_worker`)."""
    dtypes: list[torch.dtype] = []

    def worker() -> None:
        with torch.amp.autocast("cpu", enabled=True):
            dtypes.append(replica(x).dtype)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    return dtypes[0]


def test_a_replica_thread_computes_in_the_runs_autocast_dtype_not_the_threads_default():
    """Autocast's dtype is thread-local: a new thread has the device's default (CUDA's fp16
    where a run asked for bf16). CPU's default is bf16, so the run here asks for fp16."""
    x = torch.randn(2, 8)
    assert torch.get_autocast_dtype("cpu") == torch.bfloat16  # the default a thread starts with
    with torch.autocast("cpu", dtype=torch.float16):
        bare = _in_replica_thread(nn.Linear(8, 8), x)
        wrapped = _in_replica_thread(under_callers_autocast([nn.Linear(8, 8)], "cpu")[0], x)
    assert bare == torch.bfloat16  # what torch's thread alone computes in
    assert wrapped == torch.float16


def test_replicas_outside_autocast_run_as_they_are():
    replicas = [nn.Linear(2, 2), nn.Linear(2, 2)]
    assert under_callers_autocast(replicas, "cpu") == replicas
