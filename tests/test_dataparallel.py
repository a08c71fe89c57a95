"""torch.nn.DataParallel (one CUDA device a replica, so only a replica's thread runs here):
the replicas compute in the run's autocast dtype, and the plan predicts each device."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from meshrun.plan import predict
from meshrun.plan.memory import chunk_sizes
from meshrun.plan.traced import traced_memory
from meshrun.rank.parallel.dataparallel import under_callers_autocast
from tests.helpers import compose_config


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


COMMON = (
    "hardware=h100-80g",
    "model=tiny",
    "train.micro_batch_size=4",
    "train.global_batch_size=8",
)


def _dataparallel(devices: int, *overrides: str):
    return compose_config(
        "parallel=dataparallel", f"parallel.dataparallel_devices={devices}", *COMMON, *overrides
    )


def test_torchs_scatter_chunks_a_micro_batch_over_the_devices():
    assert chunk_sizes(8, 2) == [4, 4]
    assert chunk_sizes(5, 4) == [2, 2, 1, 0]  # Tensor.chunk: fewer chunks than devices
    assert chunk_sizes(4, 3) == [2, 2, 0]


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_plan_predicts_each_device_as_the_record_measures_it(precision):
    """One prediction a device (the record's memory_per_rank is one a device too): the first
    holds the model state, its share and the gathered outputs' loss; the replica none of the
    state and less than a single device computing the whole micro-batch. The trace of a
    model without formulas spreads its devices alike."""
    cfg = _dataparallel(2, f"train.precision={precision}")
    [single] = predict.memory(
        compose_config("parallel=single", *COMMON, f"train.precision={precision}")
    )
    first, replica = predict.memory(cfg)
    assert first.params + first.grads + first.optimizer == single.params * 4
    assert replica.params == replica.grads == replica.optimizer == 0
    assert replica.peak < first.peak < single.peak
    assert predict.stage_memory(cfg) == [first]  # what the planner fits: the fullest device
    traced = traced_memory(cfg)
    for by_formula, by_trace in zip([first, replica], traced, strict=True):
        assert by_trace.activations == pytest.approx(by_formula.activations, rel=0.1)


def test_a_device_without_a_share_of_the_micro_batch_is_predicted_empty():
    devices = predict.memory(_dataparallel(3, "train.micro_batch_size=2", "train.precision=fp32"))
    assert [d.peak > 0 for d in devices] == [True, True, False]
