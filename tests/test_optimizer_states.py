"""train.optimizer_states (issue 63): bf16 moments take half of fp32's bytes and 8-bit ones
(torchao's AdamW8bit) about a quarter, train as fp32's do, under DDP and FSDP2, and go into
DCP checkpoints that resume under the same layout bit for bit and under another one. Real
gloo ranks on the session's pool; 8-bit's first steps compile torchao's update with inductor
(tens of seconds on CPU), so its runs are marked slow."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, distribute_tensor

from meshrun.core.checkpoints import complete
from meshrun.models import build_model
from meshrun.plan.memory import predict_stages
from meshrun.rank.mesh import end_distributed
from meshrun.rank.metrics.memory import ModelState
from meshrun.rank.train.checkpoint import _init_optimizer_state
from meshrun.rank.train.optim import build_optimizer
from meshrun.rank.train.optim_states import _bf16_stochastic, placed_as_params
from tests.helpers import resolved_config
from tests.ranks import losses, measured_in
from tests.test_verify import verify_run

STEPS, EVERY = 4, 2
COMMON = (
    "model=tiny",
    f"train.steps={STEPS}",
    "train.untimed_steps=2",  # the memory breakdown is taken in the second
    "train.global_batch_size=8",
    "train.seq_len=32",
    "train.seed=5",
    "metrics.baseline=off",
)


def _optimizer_bytes(measured) -> int:
    return measured.report.memory_per_rank[0]["optimizer"]


def test_bf16_stochastic_rounding_is_unbiased():
    """A value between two bf16 neighbours rounds to each as often as its distance says: the
    mean of many roundings is the value, where round-to-nearest loses the step entirely."""
    x = torch.full((200_000,), 1.0 + 2**-10)  # a quarter of the way to the next bf16
    rounded = _bf16_stochastic(x, torch.Generator().manual_seed(0)).float()
    assert set(rounded.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert abs(rounded.mean().item() - x[0].item()) < 2e-5
    assert x.to(torch.bfloat16).float().unique().tolist() == [1.0]


def test_states_bytes_per_mode():
    """model=small's moments in each mode: bf16 half of fp32's bytes, 8-bit at most 0.3x
    (a byte a value and an fp32 scale a block of 256; tensors under 4,096 elements stay
    fp32, as torchao leaves them), each within 1% of the planner's prediction. The 8-bit
    states are made as torchao's first step makes them, without the step (inductor's
    compile)."""
    pytest.importorskip("torchao")
    cfg = resolved_config("model=small")
    sizes = {}
    for mode in ("fp32", "bf16", "8bit"):
        model = build_model(cfg.model, 64, "cpu")
        optimizer = build_optimizer(model, replace(cfg.train, optimizer_states=mode))
        if mode == "8bit":
            for p in model.parameters():
                optimizer.state[p].update(
                    exp_avg=optimizer._new_buffer(p, True),
                    exp_avg_sq=optimizer._new_buffer(p, False),
                )
        else:
            _init_optimizer_state(optimizer)
        sizes[mode] = ModelState.of(list(model.parameters()), optimizer).optimizer
        planned = predict_stages(replace(cfg, train=replace(cfg.train, optimizer_states=mode)))
        assert sizes[mode] == pytest.approx(planned[0].optimizer, rel=0.01)  # the planner's
    assert sizes["bf16"] / sizes["fp32"] == pytest.approx(0.5, abs=1e-4)
    assert sizes["8bit"] / sizes["fp32"] <= 0.3


def test_bf16_states_train_as_fp32_under_fsdp_and_resume_under_ddp(tmp_path, rank_pool):
    """Under FSDP2 (DTensor moments) bf16 states take half of fp32's bytes and the losses
    stay within 1e-3 of fp32's; the checkpoint of step 2 resumes under DDP (resharded by
    DCP) and continues within 1e-5 of the uninterrupted run."""
    fp32 = measured_in(tmp_path / "fp32", rank_pool, *COMMON, "parallel=fsdp")
    whole = measured_in(
        tmp_path / "bf16",
        rank_pool,
        *COMMON,
        "parallel=fsdp",
        "train.optimizer_states=bf16",
        f"checkpoint.every_steps={EVERY}",
    )
    # (the step counts, 4 bytes a tensor in both, aside)
    assert _optimizer_bytes(whole) / _optimizer_bytes(fp32) == pytest.approx(0.5, rel=1e-3)
    for got, want in zip(losses(whole), losses(fp32), strict=True):
        assert abs(got - want) <= 1e-3 * want
    first = complete(tmp_path / "bf16" / "run" / "checkpoints")[0]
    resumed = measured_in(
        tmp_path / "resumed",
        rank_pool,
        *COMMON,
        "parallel=ddp",
        "train.optimizer_states=bf16",
        f"checkpoint.resume={first}",
        f"checkpoint.dir={tmp_path}/more",
    )
    for got, want in zip(losses(resumed), losses(whole)[EVERY:], strict=True):
        assert abs(got - want) <= 1e-5 * want


@pytest.mark.slow
def test_8bit_states_resume_under_the_same_and_another_layout(tmp_path, rank_pool):
    """torchao's 8-bit moments (a tensor subclass DCP cannot save) are checkpointed as fp32
    and quantized again on load: the resumed run's losses are within 1e-5 of the
    uninterrupted run's under the same layout (FSDP2: not bit for bit, a requantized block
    may round a value to its neighbouring code) and under DDP, whose blocks of 256 lie
    elsewhere in the tensors."""
    pytest.importorskip("torchao")
    eight = ("train.optimizer_states=8bit",)
    whole = measured_in(
        tmp_path / "whole",
        rank_pool,
        *COMMON,
        "parallel=fsdp",
        *eight,
        f"checkpoint.every_steps={EVERY}",
    )
    first = complete(tmp_path / "whole" / "run" / "checkpoints")[0]
    for layout, tolerance in (("fsdp", 1e-5), ("ddp", 1e-5)):
        resumed = measured_in(
            tmp_path / layout,
            rank_pool,
            *COMMON,
            f"parallel={layout}",
            *eight,
            f"checkpoint.resume={first}",
            f"checkpoint.dir={tmp_path}/{layout}-more",
        )
        for got, want in zip(losses(resumed), losses(whole)[EVERY:], strict=True):
            assert abs(got - want) <= tolerance * want, (layout, got, want)


@pytest.mark.slow
def test_8bit_states_verify_under_fsdp(tmp_path, on_pool, capsys):
    """meshrun-verify PASSes 8-bit states under FSDP2 against one device with them too
    (issue 63's check)."""
    pytest.importorskip("torchao")
    assert verify_run(tmp_path, "parallel=fsdp", "train.optimizer_states=8bit") == 0
    assert "PASS" in capsys.readouterr().out


def _placed(_) -> tuple[str, list[float]]:
    """A replicated weight whose gradient is Partial (each rank's tokens' share, as a norm's
    under SP): its placement and values once placed as the weight is."""
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    weight = nn.Parameter(distribute_tensor(torch.ones(3), mesh, [Replicate()]))
    share = torch.full((3,), float(dist.get_rank() + 1))
    weight.grad = DTensor.from_local(share, mesh, [Partial()], run_check=False)
    optimizer = torch.optim.SGD([weight], lr=0.1)
    placed_as_params(optimizer)
    grad = weight.grad
    said = (str(grad.placements[0]), grad.to_local().tolist())  # "R": Replicate
    end_distributed()  # its mesh out of DTensor's caches too, for the pool's next job
    return said


def test_a_partial_gradient_is_summed_before_torchaos_update(rank_pool):
    """optim_states.placed_as_params: the ranks' shares summed, as the replicated weight is
    (torchao's compiled update took the Partial as it was: 3.3e-3 off under SP)."""
    assert rank_pool.run(_placed, None, world_size=2) == [("R", [3.0] * 3)] * 2


@pytest.mark.slow
def test_8bit_states_verify_under_tp_with_sequence_parallelism(tmp_path, on_pool, capsys):
    """Under SP a norm's replicated weight has a Partial gradient (each TP rank's tokens'
    share), summed over the TP ranks before torchao's update (optim_states.placed_as_params):
    without it 3.3e-3 off one device's loss by step 5, beyond the reference's noise."""
    pytest.importorskip("torchao")
    overrides = ("parallel=tp2", "parallel.sequence_parallel=true", "train.optimizer_states=8bit")
    assert verify_run(tmp_path, *overrides) == 0
    assert "PASS" in capsys.readouterr().out


@pytest.mark.slow
def test_8bit_states_verify_under_tp_on_the_default_model(tmp_path, on_pool, capsys):
    """model=small's 384-wide rows split by tp2 (192 a rank) put torchao's blocks of 256
    around other values than one device's: 3.6e-4 from its grad norm in 10 steps, within
    the noise run's regrouped states (verify.noise_config: blocks of 128, 4.9e-4)."""
    pytest.importorskip("torchao")
    overrides = ("model=small", "parallel=tp2", "train.optimizer_states=8bit")
    assert verify_run(tmp_path, *overrides) == 0
    out = capsys.readouterr().out
    assert "its 8-bit states in blocks of half the size" in out and "PASS" in out


@pytest.mark.parametrize(
    "imported",
    [
        "from meshrun.rank.train.optim_states import adamw_8bit; adamw_8bit()",
        "import meshrun.rank.parallel.float8",
    ],
)
def test_importing_torchao_says_nothing_of_kernels_meshrun_does_not_use(imported: str):
    """torchao's import logs each CUDA or mxfp8 kernel library it cannot load (on this CPU
    build: 11 lines at a tp2 8-bit verify's start) and torch's pytree a deprecation for one of
    its Enums. A fresh process, as a rank is, with warnings logged as a user's script would."""
    code = f"import logging; logging.basicConfig(level=logging.WARNING); {imported}"
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "Failed to load" not in done.stderr, done.stderr
    assert "KernelPreference" not in done.stderr, done.stderr
