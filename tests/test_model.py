"""The transformer family: sizes of the presets, layout-independent init, GQA, causality."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from omegaconf import OmegaConf
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils.checkpoint import CheckpointPolicy

from meshrun.core.config import LlamaModelConfig
from meshrun.core.model_shape import ffn_dim
from meshrun.core.paths import CONF_DIR
from meshrun.models import build_model, count_params
from meshrun.rank.parallel.checkpointing import (
    _every_other_matmul,
    _save_matmuls,
    apply_activation_checkpointing,
)

SEQ = 16

# Published sizes of the models each preset reproduces (parameters, not counting GPT's
# learned position embeddings, which a RoPE model has none of).
PUBLISHED_PARAMS = {
    "gpt2-124m": 124e6,
    "llama-1b": 1.24e9,
    "llama-7b": 6.74e9,
    "llama-13b": 13.0e9,
    "gpt3-175b": 175e9,
    "mixtral-8x7b": 46.7e9,
    "qwen3-30b-a3b": 30.5e9,
}
# meshrun's own decoder's presets (conf/model/custom.yaml is a user's module, hf/ transformers')
PRESETS = sorted(
    p.stem for p in (CONF_DIR / "model").glob("*.yaml") if "/schema/model/meshrun@" in p.read_text()
)


def load_model_config(name: str) -> LlamaModelConfig:
    raw = OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml")
    del raw["defaults"]  # the schema it names is the one merged here
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(LlamaModelConfig), raw))


@pytest.fixture(scope="module")
def tiny() -> LlamaModelConfig:
    cfg = load_model_config("tiny")
    assert cfg.n_kv_heads is not None and cfg.n_kv_heads < cfg.n_heads, "tiny should use GQA"
    return cfg


def cpu_model(cfg: LlamaModelConfig, seed: int = 0):
    model = build_model(cfg, SEQ, "cpu")
    model.init_weights(seed)
    return model


def state(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def random_tokens(cfg: LlamaModelConfig, batch: int = 2, seq: int = SEQ, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=gen)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_builds_on_meta_without_allocating(name):
    model = build_model(load_model_config(name), 2048, "meta")
    assert all(p.is_meta for p in model.parameters())
    assert all(b.is_meta for b in model.buffers())


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMS))
def test_preset_parameter_count_is_close_to_published_size(name):
    total, _ = count_params(build_model(load_model_config(name), 2048, "meta"))
    published = PUBLISHED_PARAMS[name]
    assert abs(total - published) / published < 0.02, f"{name}: {total:,} vs {published:,.0f}"


def test_count_params_matches_a_hand_count(tiny):
    head_dim = tiny.dim // tiny.n_heads
    kv_dim = tiny.n_kv_heads * head_dim
    per_layer = (
        2 * tiny.dim * tiny.dim  # wq, wo
        + 2 * tiny.dim * kv_dim  # wk, wv
        + 3 * tiny.dim * ffn_dim(tiny)  # w1, w3, w2
        + 2 * tiny.dim  # two RMSNorms
    )
    embedding = tiny.vocab_size * tiny.dim
    expected = tiny.n_layers * per_layer + 2 * embedding + tiny.dim
    assert count_params(build_model(tiny, SEQ, "meta")) == (expected, expected - embedding)


def test_count_params_counts_a_tied_embedding_once_and_as_a_matmul(tiny):
    untied = dataclasses.replace(tiny, tie_embeddings=False)
    tied = dataclasses.replace(tiny, tie_embeddings=True)
    untied_total, untied_matmul = count_params(build_model(untied, SEQ, "meta"))
    tied_total, tied_matmul = count_params(build_model(tied, SEQ, "meta"))
    embedding = tiny.vocab_size * tiny.dim
    assert untied_total == tied_total + embedding
    assert untied_matmul == untied_total - embedding  # the lookup table is no matmul
    assert tied_matmul == tied_total  # tied: the table is also the output head


def test_tied_embeddings_share_one_tensor_with_the_output_head(tiny):
    model = cpu_model(dataclasses.replace(tiny, tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight


def test_ffn_dim_defaults_to_two_thirds_of_4x_rounded_up_to_multiple_of(tiny):
    assert tiny.ffn_dim is None
    hidden = ffn_dim(tiny)
    assert hidden % tiny.multiple_of == 0
    assert 8 * tiny.dim / 3 <= hidden < 8 * tiny.dim / 3 + tiny.multiple_of
    assert ffn_dim(dataclasses.replace(tiny, ffn_dim=100)) == 100


def test_init_is_identical_on_meta_and_cpu(tiny):
    direct = cpu_model(tiny, seed=3)
    deferred = build_model(tiny, SEQ, "meta")
    deferred.to_empty(device="cpu")
    deferred.init_weights(3)
    expected = state(direct)
    got = state(deferred)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    tokens = random_tokens(tiny)
    assert torch.equal(direct(tokens), deferred(tokens))


def test_init_with_the_same_seed_is_deterministic(tiny):
    first, second = state(cpu_model(tiny, seed=7)), state(cpu_model(tiny, seed=7))
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_init_with_a_different_seed_gives_different_weights(tiny):
    a, b = state(cpu_model(tiny, seed=0)), state(cpu_model(tiny, seed=1))
    random_params = [name for name in a if not name.endswith("norm.weight")]
    assert random_params
    for name in random_params:
        assert not torch.equal(a[name], b[name]), name


def test_init_draws_each_parameter_from_its_own_stream(tiny):
    weights = state(cpu_model(tiny))
    assert not torch.equal(
        weights["layers.0.attention.wq.weight"], weights["layers.1.attention.wq.weight"]
    )
    assert not torch.equal(
        weights["layers.0.attention.wk.weight"], weights["layers.0.attention.wv.weight"]
    )


def test_init_sets_norms_to_one_and_scales_residual_projections_by_depth(tiny):
    cfg = dataclasses.replace(tiny, dim=256, n_heads=4, n_kv_heads=2, vocab_size=1024)
    weights = state(cpu_model(cfg))
    assert all((weights[n] == 1).all() for n in weights if n.endswith("norm.weight"))
    depth_scale = 1 / math.sqrt(2 * cfg.n_layers)
    assert weights["tok_embeddings.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert weights["layers.0.attention.wo.weight"].std().item() == pytest.approx(
        0.02 * depth_scale, rel=0.05
    )
    assert weights["layers.1.feed_forward.w2.weight"].std().item() == pytest.approx(
        0.02 * depth_scale, rel=0.05
    )


def test_init_does_not_depend_on_which_layers_a_stage_keeps(tiny):
    cfg = dataclasses.replace(tiny, n_layers=4)
    full = state(cpu_model(cfg, seed=5))
    stage = build_model(cfg, SEQ, "cpu")
    for index in ("0", "1"):  # a second pipeline stage owns layers 2 and 3
        del stage.layers[index]
    stage.init_weights(5)
    kept = state(stage)
    assert {n for n in kept if n.startswith("layers.")} == {
        n for n in full if n.startswith(("layers.2.", "layers.3."))
    }
    for name, value in kept.items():
        assert torch.equal(value, full[name]), name


def test_forward_returns_logits_of_shape_batch_seq_vocab(tiny):
    model = cpu_model(tiny)
    tokens = random_tokens(tiny, batch=3, seq=SEQ)
    logits = model(tokens)
    assert logits.shape == (3, SEQ, tiny.vocab_size)
    assert torch.isfinite(logits).all()
    assert model(tokens[:, :5]).shape == (3, 5, tiny.vocab_size)


def test_forward_runs_without_gqa_and_with_one_kv_head(tiny):
    for kv in (None, 1):
        cfg = dataclasses.replace(tiny, n_kv_heads=kv)
        logits = cpu_model(cfg)(random_tokens(cfg))
        assert logits.shape == (2, SEQ, cfg.vocab_size)
        assert torch.isfinite(logits).all()


def rope_by_hand(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate consecutive (even, odd) pairs as complex numbers by position * frequency."""
    _, seq, _, head_dim = x.shape
    freqs = theta ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.arange(seq, dtype=torch.float64)[:, None] * freqs
    rotation = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    pairs = torch.view_as_complex(x.double().reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * rotation).flatten(-2).to(x.dtype)


def attention_by_hand(attn, x: torch.Tensor, theta: float, expand) -> torch.Tensor:
    batch, seq, _ = x.shape
    d = attn.head_dim
    q = attn.wq(x).view(batch, seq, attn.n_heads, d)
    k = attn.wk(x).view(batch, seq, attn.n_kv_heads, d)
    v = attn.wv(x).view(batch, seq, attn.n_kv_heads, d)
    q, k = rope_by_hand(q, theta), rope_by_hand(k, theta)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [batch, heads, seq, d]
    group = attn.n_heads // attn.n_kv_heads
    k, v = expand(k, group), expand(v, group)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    weights = scores.masked_fill(future, float("-inf")).softmax(-1)
    return attn.wo((weights @ v).transpose(1, 2).reshape(batch, seq, -1))


@torch.no_grad()
def test_gqa_attention_matches_causal_attention_by_hand(tiny):
    model = cpu_model(tiny)
    attn = model.layers["0"].attention
    assert attn.n_kv_heads < attn.n_heads
    x = torch.randn(2, SEQ, tiny.dim, generator=torch.Generator().manual_seed(0))
    got = attn(x, model.rope_cos, model.rope_sin)

    def interleave(t, group):  # query head h reads kv head h // group
        return t.repeat_interleave(group, dim=1)

    def tile(t, group):  # the wrong grouping: query head h reads kv head h % n_kv
        return t.repeat(1, group, 1, 1)

    torch.testing.assert_close(got, attention_by_hand(attn, x, tiny.rope_theta, interleave))
    assert not torch.allclose(got, attention_by_hand(attn, x, tiny.rope_theta, tile), atol=1e-4)


@torch.no_grad()
def test_changing_a_future_token_does_not_change_earlier_logits(tiny):
    model = cpu_model(tiny)
    tokens = random_tokens(tiny, batch=1)
    changed = tokens.clone()
    position = SEQ // 2
    changed[0, position] = (tokens[0, position] + 1) % tiny.vocab_size
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(after[:, :position], before[:, :position], rtol=0, atol=1e-6)
    assert not torch.allclose(after[:, position:], before[:, position:])


def test_a_tied_head_stays_tied_when_materialised_from_meta(tiny):
    model = build_model(dataclasses.replace(tiny, tie_embeddings=True), SEQ, "meta")
    model.to_empty(device="cpu")
    assert model.output.weight is model.tok_embeddings.weight
    assert len(list(model.parameters())) == len(list(cpu_model(tiny).parameters())) - 1


@pytest.mark.parametrize("tied", [False, True])
def test_vocabulary_padded_for_tp_gives_the_unpadded_logits(tiny, tied):
    """250 tokens padded for tp=4: 252 rows, the extra ones zero; logits cut to 250."""
    cfg = dataclasses.replace(tiny, vocab_size=250, tie_embeddings=tied)
    plain, padded = (build_model(cfg, SEQ, "cpu", vocab_multiple=m) for m in (1, 4))
    for model in (plain, padded):
        model.init_weights(seed=0)
    assert padded.tok_embeddings.weight.shape == (252, cfg.dim)
    assert (padded.output.weight is padded.tok_embeddings.weight) == tied
    assert torch.all(padded.output.weight[250:] == 0)
    tokens = random_tokens(cfg)
    with torch.no_grad():
        torch.testing.assert_close(padded(tokens), plain(tokens), rtol=0, atol=0)


def test_checkpointing_every_nth_block_wraps_the_nth_blocks_of_the_whole_model(tiny):
    """parallel.checkpoint_every=2: blocks 1 and 3 of tiny's 4 (the 2nd and the 4th), by
    their global index, so a pipeline stage holding blocks 2-3 wraps block 3."""
    model = build_model(tiny, SEQ, "meta")
    apply_activation_checkpointing(model, "full", every=2)
    wrapped = {name for name, block in model.layers.items() if isinstance(block, CheckpointWrapper)}
    assert wrapped == {"1", "3"}
    stage = build_model(tiny, SEQ, "meta")  # a second pipeline stage's blocks
    for name in ("0", "1"):
        del stage.layers[name]
    apply_activation_checkpointing(stage, "full", every=2)
    assert [isinstance(stage.layers[n], CheckpointWrapper) for n in ("2", "3")] == [False, True]


def test_op_checkpointing_keeps_every_other_matmul_and_recomputes_as_it_decided():
    """torchtitan's op-level policy: of a block's forward matmuls the 1st, 3rd, ... kept,
    attention's output always; its recompute counts afresh and decides the same."""
    policy = _every_other_matmul()
    mm, sdpa = (
        torch.ops.aten.mm.default,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    )
    ops = [mm, mm, mm, sdpa, mm, torch.ops.aten.silu.default, mm, mm, mm]
    save = CheckpointPolicy.MUST_SAVE

    def decisions(recompute: bool) -> list[bool]:
        ctx = type("Ctx", (), {"is_recompute": recompute})()
        return [policy(ctx, op) == save for op in ops]

    forward = decisions(False)
    assert forward == [True, False, True, True, False, False, True, False, True]
    assert decisions(True) == forward


@pytest.mark.parametrize("mode", ["selective", "op"])
def test_both_sac_policies_keep_every_attention_kernel_sp_reduce_scatter_and_top_k(mode):
    """torchtitan's list where it applies to meshrun: cuDNN's attention beside flash's,
    efficient's and the CPU's, sequence parallelism's reduce-scatter, the router's top-k."""
    policy = _save_matmuls if mode == "selective" else _every_other_matmul()
    ctx = type("Ctx", (), {"is_recompute": False})()
    aten = torch.ops.aten
    for op in (
        aten._scaled_dot_product_cudnn_attention.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_flash_attention_for_cpu.default,
        torch.ops._c10d_functional.reduce_scatter_tensor.default,
        aten.topk.default,
    ):
        assert policy(ctx, op) == CheckpointPolicy.MUST_SAVE, op


@pytest.mark.parametrize("mode", ["selective", "op"])
def test_selective_checkpointing_leaves_the_gradients_as_they_are(tiny, mode):
    plain, checkpointed = cpu_model(tiny), cpu_model(tiny)
    apply_activation_checkpointing(checkpointed, mode)
    tokens = random_tokens(tiny)
    for model in (plain, checkpointed):
        model(tokens).float().logsumexp(-1).mean().backward()
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)
