"""GPU paths: CUDA device selection, CUDA allocator memory stats, nccl, hardware detection,
MFU, CP's block attention and MoE's grouped GEMM. Skipped where no CUDA device is visible."""

from __future__ import annotations

import pytest
import torch

from meshrun.models.moe import expert_compute, grouped_mm_native
from meshrun.rank.parallel.context_attention import _attend, _attend_grads

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA_RUN = ("model=small", "train.steps=6", "train.untimed_steps=2", "train.precision=bf16")


def test_single_gpu_run_measures_cuda_memory_and_mfu(meshrun):
    run = meshrun("parallel=single", *CUDA_RUN)
    assert run.returncode == 0, run.output
    results = run.results
    assert results["device_type"] == "cuda"
    assert results["backend"] == "nccl"
    assert results["peak_memory_max_bytes"] > 16 * 7.4e6  # params + grads + AdamW, fp32
    if not results["hardware"].startswith("unknown"):
        assert 0 < results["mfu"] < 1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_ddp_over_nccl_matches_single_gpu_losses(meshrun):
    common = (
        "model=tiny",
        "train.steps=6",
        "train.untimed_steps=1",
        "metrics.baseline=off",
        "train.precision=fp32",  # auto would be bf16 on sm80+; TF32 rounds each matmul's inputs
        "train.tf32=false",
    )
    single = meshrun("parallel=single", *common)
    ddp = meshrun("parallel=ddp", "launcher.nproc_per_node=2", *common)
    assert single.returncode == ddp.returncode == 0, single.output + ddp.output
    assert ddp.results["backend"] == "nccl"
    assert ddp.results["losses"] == pytest.approx(single.results["losses"], rel=1e-4)


def test_cuda_memory_breakdown_carries_allocator_figures_beside_the_prediction(meshrun):
    run = meshrun("parallel=single", *CUDA_RUN)
    assert run.returncode == 0, run.output
    [measured] = run.results["memory_per_rank"]
    [predicted] = run.results["memory_predicted"]
    assert measured["reserved"] >= measured["allocated"] == measured["peak"]
    for category in ("params", "grads", "optimizer"):
        assert measured[category] == pytest.approx(predicted[category], rel=1e-3)
    assert measured["activations"] > 0
    print(f"CUDA breakdown measured {measured}\npredicted {predicted}")


def test_compiled_blocks_train_the_uncompiled_losses_on_cuda(meshrun):
    """train.compile through inductor's Triton backend; fused AdamW on the device."""
    common = (
        "parallel=single",
        "model=tiny",
        "train.steps=4",
        "train.untimed_steps=1",
        "train.precision=fp32",
        "train.tf32=false",  # full fp32: inductor's fusions then differ from eager by ~1e-7
        "metrics.baseline=off",
    )
    eager = meshrun(*common)
    compiled = meshrun(*common, "train.compile=true")
    assert eager.returncode == compiled.returncode == 0, eager.output + compiled.output
    assert compiled.results["losses"] == pytest.approx(eager.results["losses"], rel=1e-4)
    assert compiled.results["compile_s"] > 0
    assert eager.results["compile_s"] is None


@pytest.mark.parametrize("causal", [False, True])
def test_ring_block_attention_on_cuda_equals_sdpa(causal):
    """The ring's block attention and its backward on CUDA (the explicit path, no fused CPU
    kernel there) equal SDPA's, in fp32."""
    gen = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = (
        torch.randn(2, 4, 64, 32, device="cuda", generator=gen, requires_grad=True)
        for _ in range(3)
    )
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.2)
    dout = torch.randn(want.shape, device="cuda", generator=gen)
    want.backward(dout)
    with torch.no_grad():
        out, lse = _attend(q, k, v, causal, 0.2)
        grads = _attend_grads((dout, q, k, v, out, lse), causal, 0.2)
    assert (out - want).abs().max() < 1e-4
    for got, x in zip(grads, (q, k, v), strict=True):
        assert (got - x.grad).abs().max() < 1e-4


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs an sm90+ GPU (torch._grouped_mm's native kernel)",
)
def test_experts_grouped_gemm_on_cuda_equals_the_loop_and_is_chosen():
    """MoE experts in bf16 on sm90+: the grouped GEMM meshrun picks there agrees with the
    per-expert loop, forward and backward."""
    assert grouped_mm_native(torch.device("cuda"), torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(96, 64, device="cuda", generator=gen)
    weights = [torch.randn(4, 64, 128, device="cuda", generator=gen) * 0.05 for _ in range(2)]
    weights.append(torch.randn(4, 128, 64, device="cuda", generator=gen) * 0.05)
    counts = torch.tensor([16, 0, 48, 32], device="cuda")
    grad = torch.randn(96, 64, device="cuda", generator=gen).bfloat16()
    results = []
    for grouped in (True, False):
        inputs = [t.bfloat16().requires_grad_() for t in (x, *weights)]
        out = expert_compute(inputs[0], tuple(inputs[1:]), counts, grouped)
        out.backward(grad)
        results.append([out, *(t.grad for t in inputs)])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_cuda_run_traces_kernels_and_writes_allocator_snapshots(meshrun):
    """debug.profile_steps on CUDA: the trace holds kernels and the split is the device's;
    debug.memory_snapshot leaves the peak step's allocator history, and an out-of-memory
    error its own, named in the message."""
    run = meshrun(
        "parallel=single", *CUDA_RUN, "debug.profile_steps=[3,4]", "debug.memory_snapshot=true"
    )
    assert run.returncode == 0, run.output
    [profile] = run.results["profile"]
    assert profile["compute_s"] > 0 and profile["top_ops"]
    assert (run.run_dir / "memory_snapshot" / "rank0.peak.pickle").stat().st_size > 0
    oom = meshrun(
        "parallel=single", "model=llama-1b", "train.steps=2", "train.untimed_steps=1",
        "train.global_batch_size=512", "train.micro_batch_size=512", "plan.allow_oom=true",
        "debug.memory_snapshot=true",
    )  # fmt: skip
    assert oom.returncode == 1
    assert (oom.run_dir / "memory_snapshot" / "rank0.oom.pickle").exists()
    assert "memory_viz" in oom.results["error"]
