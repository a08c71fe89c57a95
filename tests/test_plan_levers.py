"""The planner counts issue 63's memory levers: the optimizer states' bytes a parameter by
train.optimizer_states, FSDP2's offloaded state and the blocks' offloaded activations moved
from a GPU to its node's host memory (nothing moves on a CPU), a node's offloaded bytes
against the profile's host_memory_gib (exit 2 naming the key), and the copies over the
device's host link and the optimizer's step on the host in the step time."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.speed_vs_published import cluster_config
from meshrun.core.errors import ConfigError
from meshrun.core.hardware import HostFacts
from meshrun.driver.resolve import resolve
from meshrun.models import param_counts
from meshrun.plan.candidate import evaluate
from meshrun.plan.host_time import HOST_ADAMW_GBS
from meshrun.plan.memory import OPTIMIZER_STATE_BYTES, predict_stages
from meshrun.plan.speed import predict_speed
from tests.helpers import compose_config, resolved_config
from tests.test_plan import meshrun_plan

GiB = 2**30
LLAMA_7B = (
    "model=llama-7b",
    "hardware=a100-80g",
    "train.seq_len=2048",
    "train.micro_batch_size=1",
    "train.global_batch_size=64",
)


def _params(cfg) -> int:
    return param_counts(cfg.model, cfg.train.seq_len)[0]


def _gpu(*overrides: str, **parallel):
    return cluster_config(*LLAMA_7B, *overrides, nodes=1, dp_shard=8, **parallel)


@pytest.mark.parametrize("mode", ["bf16", "8bit"])
def test_optimizer_states_bytes_a_parameter(mode):
    fp32 = predict_stages(resolved_config("model=small", "parallel=fsdp"))[0]
    lighter = predict_stages(
        resolved_config("model=small", "parallel=fsdp", f"train.optimizer_states={mode}")
    )[0]
    assert lighter.optimizer / fp32.optimizer == pytest.approx(
        OPTIMIZER_STATE_BYTES[mode] / 8, rel=1e-6
    )
    assert dataclasses.replace(lighter, optimizer=fp32.optimizer) == fp32


def test_fsdp_offload_moves_the_sharded_state_to_the_host_on_a_gpu_only():
    """On an A100 the device keeps no parameters, gradients or optimizer state (FSDP2's
    gathered units stay, activations unchanged); the node's host gets the 8 ranks' 16 bytes
    a parameter. On a CPU, whose host is its device, the prediction does not change."""
    on_device, offloaded = _gpu(), _gpu("parallel.fsdp.offload=cpu")
    [kept], [moved] = predict_stages(on_device), predict_stages(offloaded)
    assert (moved.params, moved.grads, moved.optimizer) == (0, 0, 0)
    assert moved.activations == kept.activations
    host = evaluate(offloaded).host
    assert host.per_node == 8 * (kept.params + kept.grads + kept.optimizer)
    assert host.per_node == pytest.approx(16 * _params(on_device), rel=1e-3)
    cpu = resolved_config("model=small", "parallel=fsdp")
    cpu_offloaded = resolved_config("model=small", "parallel=fsdp", "parallel.fsdp.offload=cpu")
    assert predict_stages(cpu_offloaded) == predict_stages(cpu)
    assert evaluate(cpu_offloaded).host is None


def test_activation_offload_leaves_one_blocks_saved_tensors_on_the_device():
    kept = predict_stages(_gpu())[0]
    moved = predict_stages(_gpu("parallel.activation_offload=cpu"))[0]
    layers = compose_config(*LLAMA_7B).model.n_layers
    assert kept.activations > moved.activations > kept.activations / layers
    host = evaluate(_gpu("parallel.activation_offload=cpu")).host
    assert host.per_node == 8 * (kept.activations - moved.activations)


def test_a_nodes_offload_beyond_its_host_memory_exits_2_naming_the_key():
    cfg = compose_config(
        *LLAMA_7B,
        "parallel=fsdp",
        "launcher=slurm",  # checked on the profile's box: no GPU here
        "launcher.nproc_per_node=8",
        "parallel.fsdp.offload=cpu",
        "hardware.host_memory_gib=100",  # 8 ranks' 16 bytes of 6.7B parameters: 100.4 GiB
    )
    with pytest.raises(ConfigError) as caught:
        resolve(cfg, HostFacts.detect())
    assert caught.value.key == "parallel.fsdp.offload"
    assert "100.4 GiB in host memory" in str(caught.value)
    assert "parallel.fsdp.offload=none" in str(caught.value)


def test_offload_costs_its_copies_and_the_host_optimizer_step():
    """FSDP2's offload: the optimizer steps on the host (28 bytes a sharded parameter at
    HOST_ADAMW_GBS); its copies hide behind the compute as its collectives do. Activation
    offload's copies (out in forward, back in backward, on the compute stream) are exposed:
    twice the offloaded bytes over the device's host link (PCIe 4's ~25 GB/s on an A100)."""
    base = predict_speed(_gpu())
    state = predict_speed(_gpu("parallel.fsdp.offload=cpu"))
    sharded = _params(_gpu()) / 8
    assert state.breakdown["optimizer"] == pytest.approx(
        sharded * 28 / (HOST_ADAMW_GBS * 1e9), rel=0.01
    )
    assert state.step_time_s > base.step_time_s
    act_cfg = _gpu("parallel.activation_offload=cpu")
    act = predict_speed(act_cfg)
    kept, moved = predict_stages(_gpu())[0], predict_stages(act_cfg)[0]
    m = act_cfg.train.global_batch_size // 8  # micro-batches of 1 a rank a step
    expected = m * 2 * (kept.activations - moved.activations) / 25e9
    assert act.breakdown["host_copies"] == pytest.approx(expected, rel=1e-6)
    assert act.step_time_s == pytest.approx(base.step_time_s + expected, rel=1e-6)


def test_the_plan_offloads_where_nothing_else_fits(tmp_path):
    """Issue 63's check: llama-13b on 2 A6000s at 2 x 4,096 tokens, where no layout fits on
    the devices alone (the closest needed 110.8 GiB a rank), plans a fitting row with FSDP2's
    state on the host, its copies and host optimizer step in its predicted speed; a layout
    that fits without offload is planned without it."""
    _, plan = meshrun_plan(
        tmp_path,
        "model=llama-13b",
        "hardware=a6000",
        "world_size=2",
        "train.seq_len=4096",
        "train.micro_batch_size=2",
    )
    best = plan["layouts"][0]
    assert best["fits"] and best["layout"].startswith("fsdp2(offload)")
    assert "parallel.fsdp.offload=cpu" in best["overrides"]
    assert best["host_bytes_per_node"] > 13e9 * 16 * 0.9  # the whole state, over 2 ranks
    assert best["speed"]["step_parts"]["optimizer"] > 0
    _, small = meshrun_plan(
        tmp_path / "small", "model=llama-1b", "hardware=a100-80g", "world_size=8"
    )
    assert all("offload" not in row["layout"] for row in small["layouts"] if row["fits"])
    fixed, given = meshrun_plan(  # levers the user gives stay as given
        tmp_path / "fixed", "model=llama-13b", "hardware=a6000", "world_size=2",
        "train.seq_len=4096", "train.micro_batch_size=2", "parallel.fsdp.offload=none",
        "train.optimizer_states=fp32", "parallel.activation_offload=none",
    )  # fmt: skip
    assert not any(row["fits"] for row in given["layouts"]), fixed.output


def test_one_gpu_offloads_fsdp2s_state_over_a_shard_of_one(tmp_path):
    """Issue 63's check: llama-7b on one A6000 (the field notes' card: DDP did not fit)
    plans a fitting row, FSDP2 over its one rank with the state on the host (ZeRO-Offload's
    single-GPU case), the copies and the host's optimizer step in its predicted speed."""
    _, plan = meshrun_plan(tmp_path, "model=llama-7b", "hardware=a6000", "world_size=1")
    best = plan["layouts"][0]
    assert best["fits"] and best["layout"].startswith("fsdp1(offload)")
    assert "parallel.fsdp.offload=cpu" in best["overrides"]
    assert best["host_bytes_per_node"] > 6.7e9 * 16 * 0.9  # the whole state
    assert best["speed"]["step_parts"]["optimizer"] > 0


def test_a_152k_vocabulary_moe_fits_the_eight_gpus_its_peer_trains_it_on(tmp_path):
    """Issue 63's held-out case: Qwen3-30B-A3B at micro-batch 4 x 4,096 on 8 x 80 GB, which a
    peer publishes; with the whole fp32 logits fsdp8 x ep8 needed 86.6 GiB a rank. Without
    them it fits, no lever needed (the loss's activations were most of it)."""
    run = (
        "model=qwen3-30b-a3b", "hardware=h100-80g", "world_size=8", "train.seq_len=4096",
        "train.micro_batch_size=4", "parallel.dp_shard=8", "parallel.ep=8",
        "parallel.fsdp.offload=none", "train.optimizer_states=fp32",
        "parallel.activation_offload=none",
    )  # fmt: skip
    _, plan = meshrun_plan(tmp_path, *run)
    best = plan["layouts"][0]
    assert best["fits"] and best["layout"].startswith("fsdp8 x ep8"), best["layout"]
    _, full = meshrun_plan(tmp_path / "full", *run, "train.loss=full")
    assert not any(row["fits"] for row in full["layouts"])
