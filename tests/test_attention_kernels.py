"""Which attention kernel runs (core/attention_kernels.py, torch 2.13's sdp_utils.cpp rules)
and what follows from it: K/V heads repeated before SDPA where no fused kernel takes GQA
(models/attention.py: meshrun's LLaMA and transformers' models), the ops and layouts of
each kernel a CP chunk pair calls (rank/parallel/block_attention.py, against torch's own
meta kernels), and what the planner counts (plan/memory.py). The CUDA kernels themselves
run in tests/test_gpu.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from benchmarks.speed_vs_published import cluster_config
from meshrun.core.attention_kernels import AttentionSite, block_kernel, expands_kv_heads
from meshrun.core.layout import Layout
from meshrun.models import attention, build_model
from meshrun.models.hf import build_hf
from meshrun.plan.comm_time import attention_widths
from meshrun.plan.memory import attention_kept, predict_stages
from meshrun.plan.shapes import Dims
from meshrun.plan.stage_time import formula_cost
from meshrun.rank.parallel.block_attention import _cudnn_lse_extra_dims, attend, attend_grads
from tests.helpers import compose_config

H100 = (9, 0)


def cuda(dtype: str, head_dim: int = 128, capability=H100, **fields) -> AttentionSite:
    return AttentionSite("cuda", dtype, head_dim, capability, **fields)


@pytest.mark.parametrize(
    ("site", "kernel"),
    [
        (AttentionSite("cpu", "float32", 64), "cpu_flash"),
        (AttentionSite("cpu", "bfloat16", 64), "cpu_flash"),
        (cuda("bfloat16"), "flash"),
        (cuda("float16", capability=(8, 0)), "flash"),
        (cuda("float32"), "efficient"),  # flash has no fp32
        (cuda("float16", 64, (7, 5)), "efficient"),  # flash from sm80
        (cuda("bfloat16", 64, (7, 5)), "explicit"),  # no kernel takes bf16 below sm80
        (cuda("bfloat16", 200, (8, 6)), "efficient"),  # flash trains no d in (192, 224] there
        (cuda("bfloat16", 200, (8, 6), training=False), "flash"),
        (cuda("bfloat16", 100), "explicit"),  # flash's op unpadded and efficient want d % 8
        (cuda("float32", 6), "explicit"),  # efficient wants d % 4 in fp32 from sm80
        (cuda("float32", 6, (7, 0)), "efficient"),  # and any d in fp32 on sm70
        (cuda("bfloat16", enabled=frozenset({"efficient", "cudnn"})), "efficient"),
        (cuda("bfloat16", enabled=frozenset({"cudnn"})), "cudnn"),
        (cuda("bfloat16", 256, enabled=frozenset({"cudnn"})), "explicit"),  # cuDNN to d 128
        (cuda("float32", enabled=frozenset({"flash", "cudnn"})), "explicit"),
        (AttentionSite("mps", "float32", 64), "explicit"),
    ],
)
def test_a_chunk_pair_runs_the_kernel_torchs_order_reaches_first(site, kernel):
    assert block_kernel(site) == kernel


@pytest.mark.parametrize(
    ("site", "expands"),
    [
        (AttentionSite("cpu", "float32", 64), False),  # the CPU flash kernel takes GQA
        (cuda("bfloat16"), False),  # flash takes GQA
        (cuda("bfloat16", 100), False),  # SDPA pads flash's head dim itself
        (cuda("float32"), True),  # efficient takes no GQA: the math kernel's s x s scores
        (cuda("float16", 64, (7, 5)), True),
        (cuda("bfloat16", enabled=frozenset({"efficient", "cudnn"})), True),
        (cuda("bfloat16", 200, (8, 9)), True),
        (cuda("bfloat16", 200, (8, 9), training=False), False),
    ],
)
def test_gqa_repeats_kv_heads_where_flash_cannot_take_them(site, expands):
    assert expands_kv_heads(site) is expands


class _SdpaCalls(TorchFunctionMode):
    """The K/V heads and enable_gqa of every SDPA call inside."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, int, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k = args[0], args[1]
            self.calls.append((q.shape[1], k.shape[1], kwargs.get("enable_gqa", False)))
        return func(*args, **kwargs)


def _logits_and_sdpa_calls(model: torch.nn.Module, tokens: torch.Tensor):
    with _SdpaCalls() as calls:
        logits = model(tokens)
    return getattr(logits, "logits", logits), calls.calls


@pytest.mark.parametrize("model_name", ["tiny", "hf/tiny-llama"])
def test_gqa_models_hand_sdpa_repeated_kv_heads_where_the_rules_say(monkeypatch, model_name):
    """meshrun's LLaMA and a transformers Llama (8 heads, 4 K/V heads): as they are on a CPU;
    repeated to 8, the same logits, where the site is CUDA fp32's."""
    cfg = compose_config(f"model={model_name}").model
    build = build_hf if model_name.startswith("hf/") else (lambda c, d: build_model(c, 16, d))
    model = build(cfg, "cpu")
    model.init_weights(0)
    tokens = torch.arange(32).view(2, 16) % 256
    plain, calls = _logits_and_sdpa_calls(model, tokens)
    assert {call[:2] for call in calls} == {(8, 4)}
    site = cuda("float32", 8)
    monkeypatch.setattr(attention, "attention_site", lambda q, dtype, training: site)
    expanded, calls = _logits_and_sdpa_calls(model, tokens)
    assert {call[:2] for call in calls} == {(8, 8)}
    torch.testing.assert_close(expanded, plain, rtol=1e-5, atol=1e-5)


def test_a_cpu_tensor_tells_the_rules_its_device_dtype_and_head_dim():
    q = torch.zeros(1, 2, 4, 16)
    site = attention.attention_site(q, attention.sdpa_dtype(q), training=True)
    assert site == AttentionSite("cpu", "float32", 16, (0, 0), frozenset(), True)


def _meta(heads: int, dtype: torch.dtype, rows: int = 6) -> torch.Tensor:
    return torch.empty(2, heads, rows, 16, device="meta", dtype=dtype)


@pytest.mark.parametrize(
    ("kernel", "dtype", "kv_heads"),
    [
        ("flash", torch.bfloat16, 2),  # GQA in the kernel: its backward sums the groups
        ("efficient", torch.float32, 4),
        ("efficient", torch.bfloat16, 4),
        ("cudnn", torch.bfloat16, 4),
    ],
)
def test_each_cuda_kernels_op_is_called_as_torchs_meta_kernel_takes_it(kernel, dtype, kv_heads):
    """A chunk pair's forward and backward through torch's own op schemas and meta kernels:
    out and log-sum-exp [b, h, s] in fp32 for the merge (efficient's padded one cut back,
    cuDNN's [b, h, s, 1] flattened), gradients in the inputs' dtype and shapes."""
    q, k = _meta(4, dtype), _meta(kv_heads, dtype)
    out, lse = attend(kernel, q, k, k, True, 0.25)
    assert (out.shape, out.dtype, lse.shape, lse.dtype) == (
        q.shape,
        torch.float32,
        q.shape[:3],
        torch.float32,
    )
    grads = attend_grads(kernel, (q, q, k, k, out.to(dtype), lse.contiguous()), True, 0.25)
    assert [(g.shape, g.dtype) for g in grads] == [(q.shape, dtype)] + [(k.shape, dtype)] * 2


def test_cudnns_log_sum_exp_keeps_a_unit_dim_in_this_torch():
    assert _cudnn_lse_extra_dims() == 1  # torch 2.13's meta kernel: [b, h, s, 1]


def _cuda_run(*overrides: str, **parallel):
    cfg = cluster_config("model=tiny", "hardware=h100-80g", "train.seq_len=512", *overrides,
                         nodes=1, per_node=2, **parallel)  # fmt: skip
    layout = Layout.of(cfg.parallel)
    return cfg, layout, Dims.of_layout(cfg.model, layout)


def test_the_planner_counts_repeated_kv_heads_where_sdpa_gets_them():
    """tiny (8 heads, 4 K/V heads) on CUDA: fp32 attention keeps K/V at 8 heads, as an MHA
    model would; bf16 (flash takes GQA) at 4."""
    fp32, layout, d = _cuda_run("train.precision=fp32", dp_shard=2)
    assert attention_kept(fp32, layout, d).kv == d.hq == 2 * d.hk
    bf16, _, _ = _cuda_run("train.precision=bf16", dp_shard=2)
    assert attention_kept(bf16, layout, d).kv == d.hk
    mha = dataclasses.replace(fp32, model=dataclasses.replace(fp32.model, n_kv_heads=8))
    kept = [predict_stages(c)[0].activations for c in (fp32, mha)]
    assert kept[0] == pytest.approx(kept[1], rel=0.01)  # less the K/V matmuls' own outputs


def test_the_planner_counts_an_explicit_chunk_pairs_scores_and_fused_kernels_none():
    """cp2 ring on CUDA: fused kernels hold no scores; a head dim no kernel takes (9, fp32)
    leaves the pair's scores, 3 x heads x c/2 fp32 a token (c = 512/4 tokens a chunk)."""
    fused_cfg, layout, d = _cuda_run("train.precision=fp32", cp=2)
    assert attention_kept(fused_cfg, layout, d).scores == 0
    odd, layout, d = _cuda_run("train.precision=fp32", "model.dim=72", cp=2)
    assert attention_kept(odd, layout, d).scores == 3 * 8 * 128 / 2 * 4


def test_the_planner_moves_kv_as_cp_holds_them():
    """CP's K/V traffic: bf16 on CUDA as it is (flash); fp32 on CUDA repeated to 8 heads;
    bf16 on a CPU in fp32 (its kernel computes in fp32)."""
    for overrides, want in (
        (("train.precision=bf16",), (64, 32, 2)),
        (("train.precision=fp32",), (64, 64, 4)),
        (("train.precision=bf16", "hardware=cpu"), (64, 32, 4)),
    ):
        cfg, layout, _ = _cuda_run(*overrides, cp=2)
        assert attention_widths(cfg, layout, formula_cost(cfg, layout)) == want, overrides
