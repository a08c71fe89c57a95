"""Offload to host memory (issue 63): parallel.fsdp.offload=cpu (FSDP2's CPUOffloadPolicy)
and parallel.activation_offload=cpu (each block's saved tensors through saved-tensor hooks)
train exactly as the run without them, under FSDP2, HSDP, TP and a pipeline. On a CPU the
host is the device, so what these prove is the mechanics and the numbers; the transfer's
cost needs a GPU. Real gloo ranks on the session's pool."""

from __future__ import annotations

import pytest
import torch

from benchmarks.speed_vs_published import cluster_config
from meshrun.models import build_model
from meshrun.plan.memory import predict_stages
from meshrun.rank.parallel.activation_offload import apply_activation_offload
from meshrun.rank.parallel.checkpointing import apply_activation_checkpointing
from tests.helpers import resolved_config
from tests.ranks import assert_steps_match, measured_in
from tests.test_verify import verify_run

COMMON = (
    "model=tiny",
    "train.steps=3",
    "train.untimed_steps=1",
    "train.global_batch_size=8",
    "train.seq_len=32",
    "metrics.baseline=off",
)
BATCH, SEQ = 2, 32


def _grads(checkpointing: str, offload: bool) -> tuple[dict[str, torch.Tensor], int]:
    """One forward and backward of model=tiny on one process: its gradients, and the bytes
    the hooks moved to the host."""
    cfg = resolved_config("model=tiny")
    model = build_model(cfg.model, SEQ, "cpu")
    model.init_weights(0)
    apply_activation_checkpointing(model, checkpointing)
    host = apply_activation_offload(model, torch.device("cpu")) if offload else None
    tokens = torch.randint(0, cfg.model.vocab_size, (BATCH, SEQ), generator=torch.Generator())
    model(tokens).float().logsumexp(-1).mean().backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return grads, host.moved if host else 0


@pytest.mark.parametrize("checkpointing", ["none", "full", "selective"])
def test_activation_offload_keeps_the_gradients_and_moves_what_blocks_save(checkpointing):
    """The gradients are bit for bit those without offload. A checkpointed block saves only
    its input, which is exactly what goes to the host (one fp32 [batch, seq, dim] a block:
    RoPE's tables and the weights are leaves, left where they are); selective
    checkpointing's kept outputs are torch's own cache, not saved tensors, and stay on the
    device. Without checkpointing, every saved activation goes, several times that."""
    want, _ = _grads(checkpointing, offload=False)
    got, moved = _grads(checkpointing, offload=True)
    for name, grad in want.items():
        assert torch.equal(got[name], grad), name
    cfg = resolved_config("model=tiny")
    block_input = BATCH * SEQ * cfg.model.dim * 4
    if checkpointing != "none":
        assert moved == cfg.model.n_layers * block_input
    else:
        assert moved > 4 * cfg.model.n_layers * block_input


def test_the_planned_offloaded_bytes_are_what_the_hooks_move():
    """The planner's offloaded activations (on a GPU profile: the difference the offload
    makes, plus the one block it leaves on the device) within 2% of what the hooks copy
    (model=tiny, 2 x 32 tokens, fp32: 1,443,840 bytes measured, 1,452,032 planned)."""

    def planned(**parallel):
        tiny = ("model=tiny", "hardware=a100-80g", "train.precision=fp32")
        batch = (f"train.micro_batch_size={BATCH}", f"train.global_batch_size={BATCH}")
        cfg = cluster_config(*tiny, f"train.seq_len={SEQ}", *batch, nodes=1, per_node=1, **parallel)
        return cfg, predict_stages(cfg)[0].activations

    (cfg, kept), (_, left) = planned(), planned(activation_offload="cpu")
    layers = cfg.model.n_layers
    host = kept - left
    _, moved = _grads("none", offload=True)
    assert host * layers / (layers - 1) == pytest.approx(moved, rel=0.02)


LAYOUTS = {
    "fsdp": ("parallel=fsdp",),
    "single": ("parallel=single",),  # FSDP2 over one rank, for its offload alone
    "tp2": ("parallel=tp2",),
    "pp2": ("parallel=pp2",),
    "hsdp": ("parallel=hsdp", "launcher.nproc_per_node=4"),
    "fsdp2_tp2": ("parallel=fsdp2_tp2",),
    "pp2_fsdp2": ("parallel=pp2", "parallel.dp_shard=2", "launcher.nproc_per_node=4"),
    "fsdp2_cp2": ("parallel=fsdp2_cp2",),
    "ep2": ("parallel=ep2", "model=tiny-moe", "launcher.nproc_per_node=4"),  # experts' units
}


FAST = ("fsdp", "single")


@pytest.mark.parametrize(
    "layout",
    [
        "fsdp",
        "single",
        *(pytest.param(name, marks=pytest.mark.slow) for name in LAYOUTS if name not in FAST),
    ],
)
def test_fsdp_offload_trains_as_on_the_device(tmp_path, rank_pool, layout):
    """FSDP2 with its parameters, gradients and optimizer step on the host: the same losses
    and global gradient norms (clipped across host-resident DTensor gradients) as without."""
    on_device = measured_in(tmp_path / "device", rank_pool, *COMMON, *LAYOUTS[layout]).steps
    offloaded = measured_in(
        tmp_path / "host", rank_pool, *COMMON, *LAYOUTS[layout], "parallel.fsdp.offload=cpu"
    ).steps
    assert_steps_match(offloaded, on_device, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        ("parallel=fsdp", "parallel.fsdp.offload=cpu"),  # issue 63's check
        ("parallel=tp2", "parallel.activation_offload=cpu"),  # TP's saved DTensors
        (
            "parallel=fsdp",
            "parallel.activation_offload=cpu",
            "parallel.activation_checkpointing=full",
        ),
        ("parallel=pp2", "parallel.activation_offload=cpu"),
    ],
    ids=" ".join,
)
def test_offload_verifies_against_one_device(tmp_path, on_pool, capsys, overrides):
    assert verify_run(tmp_path, *overrides) == 0
    assert "PASS" in capsys.readouterr().out
