"""GPU paths: CUDA device selection, CUDA allocator memory stats, nccl, hardware detection,
MFU, CP's block attention, MoE's grouped GEMM and Liger's fused cross-entropy. Skipped where
no CUDA device is visible."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.backends.cuda import (
    SDPAParams,
    can_use_cudnn_attention,
    can_use_efficient_attention,
    can_use_flash_attention,
)
from torch.nn.attention import SDPBackend, sdpa_kernel

from meshrun.core.attention_kernels import fused_kernel
from meshrun.core.config import MoEConfig
from meshrun.models import moe
from meshrun.models.attention import attention_site, causal_sdpa, sdpa_kv
from meshrun.models.expert_compute import NATIVE_MAJORS, expert_compute, use_grouped_mm
from meshrun.models.hf_experts import gate_and_up_by_rank
from meshrun.rank.parallel.block_attention import attend, attend_grads
from meshrun.rank.parallel.loss import IGNORE_INDEX, apply_chunked_loss, micro_batch_loss
from tests.test_loss_kernel import _Head

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


PAIR_KERNELS = [  # (kernel, dtype, K/V heads of 4, rows): efficient's 80 pads its lse
    ("flash", torch.bfloat16, 2, 80),
    ("efficient", torch.float32, 4, 80),
    ("efficient", torch.bfloat16, 4, 80),
    ("cudnn", torch.bfloat16, 4, 128),
    ("explicit", torch.float32, 4, 80),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("kernel", "dtype", "kv_heads", "rows"), PAIR_KERNELS)
def test_each_cp_chunk_pair_kernel_on_cuda_equals_sdpa(kernel, dtype, kv_heads, rows, causal):
    """A CP chunk pair's attention, log-sum-exp and backward through each CUDA kernel
    (rank/parallel/block_attention.py) equal fp32 SDPA's, to the kernel's dtype; the explicit
    path stays fp32 under bf16 autocast."""
    site = attention_site(torch.zeros(1, device="cuda"), dtype, training=True)
    if kernel != "explicit" and kernel not in site.enabled:
        pytest.skip(f"{kernel} is not enabled in this torch")
    gen = torch.Generator(device="cuda").manual_seed(4)
    q, k, v, dout = (
        torch.randn(2, h, rows, 64, device="cuda", generator=gen)
        for h in (4, kv_heads, kv_heads, 4)
    )
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*full, is_causal=causal, scale=0.2, enable_gqa=True)
    want.backward(dout)
    scores = (q @ k.repeat_interleave(4 // kv_heads, 1).transpose(-2, -1) * 0.2).masked_fill(
        torch.ones(rows, rows, dtype=torch.bool, device="cuda").triu(1) & causal, float("-inf")
    )
    inputs = [t.to(dtype) for t in (dout, q, k, v)]
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        out, lse = attend(kernel, *inputs[1:], causal, 0.2)
        grads = attend_grads(kernel, (*inputs, out.to(dtype), lse.contiguous()), causal, 0.2)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)
    torch.testing.assert_close(lse, scores.logsumexp(-1), rtol=tol, atol=tol)
    for got, x in zip(grads, full, strict=True):
        torch.testing.assert_close(got.float(), x.grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 100, 128, 200, 256])
def test_the_kernel_rules_agree_with_torchs_own_checks_on_this_gpu(dtype, head_dim):
    """core/attention_kernels.py against torch's can_use_* on this device: flash and
    efficient everywhere, cuDNN where meshrun's rule takes the head dim (to 128)."""
    q = torch.zeros(2, 64, 4, head_dim, device="cuda", dtype=dtype).transpose(1, 2)
    q.requires_grad_()  # a model's layout: [b, h, s, d] over [b, s, h, d] memory
    site = attention_site(q, dtype, training=True)
    params = SDPAParams(q, q, q, None, 0.0, True, False)
    torchs = {
        "flash": can_use_flash_attention(params),
        "efficient": can_use_efficient_attention(params),
        "cudnn": can_use_cudnn_attention(params),
    }
    for kernel, usable in torchs.items():
        if kernel == "cudnn" and not (head_dim <= 128 and head_dim % 8 == 0):
            continue
        ours = fused_kernel(dataclasses.replace(site, enabled=frozenset({kernel}))) == kernel
        assert ours == (usable and kernel in site.enabled), (kernel, site)


def test_fp32_gqa_reaches_a_fused_kernel_and_bf16_keeps_its_kv_heads():
    """SDPA with the math kernel off: fp32 GQA runs (its K/V heads repeated for the
    memory-efficient kernel), bf16 GQA runs on flash with its K/V heads as they are."""
    q = torch.randn(2, 8, 256, 64, device="cuda")
    k, v = torch.randn(2, 2, 256, 64, device="cuda"), torch.randn(2, 2, 256, 64, device="cuda")
    fused = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with sdpa_kernel(fused):
        torch.testing.assert_close(causal_sdpa(q, k, v), want, rtol=1e-4, atol=1e-4)
        assert sdpa_kv(q, k, v)[0].shape[1] == 8
        half = [t.bfloat16() for t in (q, k, v)]
        assert sdpa_kv(*half)[0].shape[1] == 2
        torch.testing.assert_close(causal_sdpa(*half).float(), want, rtol=3e-2, atol=3e-2)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in NATIVE_MAJORS,
    reason="needs an sm90 or sm100 GPU (torch._grouped_mm's native kernel)",
)
def test_an_moe_block_under_bf16_autocast_takes_the_grouped_gemm_without_a_host_sync():
    """fp32 weights under bf16 autocast (single, DDP, TP): the experts take the grouped GEMM,
    which agrees with the loop forward and backward (an expert without tokens too, its
    gradient zero), and neither the router nor the experts read the device back
    (torch.cuda.set_sync_debug_mode("error") raises at a sync)."""
    torch.manual_seed(5)
    cfg = MoEConfig(experts=8, top_k=2, load_balance="bias")
    block = moe.MoEFeedForward(cfg, 64, 128, None, 0).cuda()
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.05)
    block.expert_bias[7] = -100.0  # never picked
    x, probe = torch.randn(2, 2, 96, 64, device="cuda").unbind(0)
    with torch.autocast("cuda", torch.bfloat16):
        assert use_grouped_mm(x, block.experts.w2)
    results = []
    for grouped in (True, False):
        block.zero_grad()
        block.experts.grouped_mm = grouped
        inputs = x.clone().requires_grad_()
        torch.cuda.set_sync_debug_mode("error" if grouped else "default")
        try:
            with torch.autocast("cuda", torch.bfloat16):
                out = block(inputs)
            out.float().backward(probe)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        results.append([out, inputs.grad, *(p.grad for p in block.experts.parameters())])
    for got, want in zip(*results, strict=True):  # bf16's rounding, accumulated another way
        assert (got.float() - want.float()).norm() <= 2e-2 * want.float().norm()
    assert not results[0][2][7].any()


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


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in NATIVE_MAJORS,
    reason="needs an sm90 or sm100 GPU (torch._grouped_mm's native kernel)",
)
def test_the_grouped_gemm_takes_transformers_fused_gate_up_through_its_trade():
    """transformers' experts under etp (models/hf_experts.gate_and_up_by_rank) on the native
    kernel, whose operands must be row-major with rows of 16 bytes
    (check_valid_strides_and_return_transposed, ATen/native/cuda/GroupedBlas.cpp): the
    traded products (one TP rank: NCCL's all-to-all to itself) agree with the loop over the
    whole experts forward and backward, under bf16 autocast."""
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(7)
        counts = [5, 0, 3, 8]
        x = torch.randn(sum(counts), 64, device="cuda")
        w1, w3, w2 = (torch.randn(4, *s, device="cuda") / 8 for s in ((64, 32), (64, 32), (32, 64)))
        trade = functools.partial(gate_and_up_by_rank, group=dist.group.WORLD)
        fused = torch.cat([w1, w3], dim=2)
        results = []
        for weights, grouped, traded in (
            ((fused, None, w2), True, trade),
            ((w1, w3, w2), False, None),
        ):
            inputs = x.clone().requires_grad_()
            with torch.autocast("cuda", torch.bfloat16):
                assert use_grouped_mm(inputs, w2) or not grouped
                out = expert_compute(
                    inputs, weights, torch.tensor(counts, device="cuda"), grouped, traded
                )
            out.float().sum().backward()
            results.append((out.float(), inputs.grad))
        for got, want in zip(*results, strict=True):
            assert (got - want).norm() <= 2e-2 * want.norm()
    finally:
        dist.destroy_process_group()


NEEDS_LIGER = pytest.mark.skipif(
    importlib.util.find_spec("liger_kernel") is None,
    reason="needs liger-kernel (meshrun[liger]; scripts/gpu_wheels.py carries it)",
)


def _chunked_on_cuda(kernel: str, vocab: int, hidden: int, tokens: int, dtype: torch.dtype):
    """(the loss and the gradients (the input's, the head's), the peak bytes they took) of a
    chunked loss by `kernel`, over a head with a bias and a padded vocabulary, a seventh of
    the targets ignored, backward from twice the loss (Liger scales what it kept)."""
    torch.manual_seed(0)
    part = _Head(hidden, vocab).to("cuda", dtype)
    apply_chunked_loss(part, kernel)
    leaf = torch.randn(1, tokens, hidden, device="cuda", dtype=dtype, requires_grad=True)
    targets = torch.randint(vocab, (1, tokens), device="cuda")
    targets[:, ::7] = IGNORE_INDEX
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = micro_batch_loss(part, leaf, targets, "chunked")
    (2.0 * loss).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    return [loss, leaf.grad, *(p.grad for p in part.parameters())], peak


@NEEDS_LIGER
def test_liger_computes_torchs_chunked_loss_and_gradients_on_cuda():
    """train.loss_kernel=liger on CUDA: Liger's fused linear cross-entropy gives torch's
    chunked loss and gradients, in fp32 to 1e-4 of their norms; with bf16 parameters (as
    FSDP2 casts them) as far from the fp32 result as torch's chunks in bf16 are, within
    twice (each sums its chunks' bf16 gradients in its own order: 8 chunks of Liger's, one
    of torch's), or 1e-3."""
    shape = (8192, 1024, 2048)  # vocabulary, hidden, tokens
    names = ("loss", "input", "weight", "bias")

    def gaps(kernel: str, dtype: torch.dtype) -> dict[str, float]:
        got, _ = _chunked_on_cuda(kernel, *shape, dtype)
        pairs = zip(names, truth, got, strict=True)
        return {
            name: ((value.float() - want).norm() / want.norm()).item()
            for name, want, value in pairs
        }

    truth, _ = _chunked_on_cuda("torch", *shape, torch.float32)
    fp32 = gaps("liger", torch.float32)
    assert max(fp32.values()) <= 1e-4, fp32
    liger, torchs = gaps("liger", torch.bfloat16), gaps("torch", torch.bfloat16)
    assert all(liger[n] <= max(2 * torchs[n], 1e-3) for n in names), (liger, torchs)


@NEEDS_LIGER
def test_liger_chunked_loss_peaks_under_half_of_torchs_chunks_on_cuda():
    """65,536 logits a token over a hidden width of 256, fp32: Liger's chunk is 16 tokens of
    them (models/loss.liger_chunk_tokens), its gradient written in place; torch's 256
    tokens in three copies."""
    shape = (65536, 256, 4096)
    _, torch_peak = _chunked_on_cuda("torch", *shape, torch.float32)
    _, liger_peak = _chunked_on_cuda("liger", *shape, torch.float32)
    assert liger_peak < 0.5 * torch_peak, f"Liger's peak {liger_peak:,} B, torch's {torch_peak:,}"
