"""Meshrun's own LLaMA and transformers' LlamaForCausalLM are one model: a Hugging Face
checkpoint loaded into meshrun's (q and k permuted from halves to pairs) gives transformers'
logits, on a pipeline stage and under a padded vocabulary too; meshrun's exported back loads
in transformers with the same logits; a checkpoint meshrun's cannot hold, or of other sizes
than the preset, is refused before launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from meshrun.core.config import LlamaModelConfig
from meshrun.core.errors import ConfigError
from meshrun.core.hardware import HostFacts
from meshrun.driver.resolve import resolve
from meshrun.models import convert
from meshrun.models.checkpoint_files import SAFETENSORS_INDEX, SavedTensors
from meshrun.models.llama import Transformer, build_llama
from meshrun.rank.parallel.pipeline import cut_stage
from tests.helpers import compose_config, transformers_first_loss
from tests.ranks import losses

SEQ = 32
# conf/model/tiny.yaml as a LlamaConfig (ffn_dim: 8/3 * 64 rounded up to 32).
TINY = {
    "hidden_size": 64,
    "intermediate_size": 192,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 256,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 512,
}
SMALL = {**TINY, "intermediate_size": 128, "num_hidden_layers": 2, "rope_theta": 500000.0}


def saved_llama(directory: Path, **config) -> LlamaForCausalLM:
    """transformers' own init, saved; norms perturbed (swapping two would show), q and k
    scaled up: at std 0.02 attention is near uniform, and the rotary barely matters."""
    torch.manual_seed(7)
    model = LlamaForCausalLM(LlamaConfig(**config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(10)
    model.save_pretrained(directory)
    return model.eval()


def meta_llama(directory: Path, vocab_multiple: int = 1) -> Transformer:
    """Meshrun's LLaMA of the checkpoint's sizes, on meta."""
    fields = convert.llama_config_from_hf(json.loads((directory / "config.json").read_text()))
    return build_llama(LlamaModelConfig(name="from-hf", **fields), SEQ, "meta", vocab_multiple)


def loaded_llama(directory: Path, vocab_multiple: int = 1) -> Transformer:
    """As parallelize materialises it: built on meta, emptied onto the CPU, then loaded."""
    model = meta_llama(directory, vocab_multiple)
    model.to_empty(device="cpu")
    model.load_pretrained(str(directory))
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(("vocab_multiple", "tie"), [(1, False), (3, False), (3, True)])
def test_a_loaded_hf_checkpoint_gives_transformers_logits(
    tmp_path, monkeypatch, vocab_multiple, tie
):
    hf = saved_llama(tmp_path, **SMALL, tie_word_embeddings=tie)
    model = loaded_llama(tmp_path, vocab_multiple)
    assert model.output.weight.shape[0] == (258 if vocab_multiple == 3 else 256)
    assert (model.output.weight is model.tok_embeddings.weight) == tie
    with torch.no_grad():
        ours, theirs = model(tokens()), hf(input_ids=tokens()).logits
    assert ours.shape == theirs.shape == (2, SEQ, 256)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    # The permutation is what makes them agree: without it the rotary pairs differ.
    monkeypatch.setattr(convert, "interleave", lambda w, head_dim: w)
    with torch.no_grad():
        unpermuted = loaded_llama(tmp_path, vocab_multiple)(tokens())
    assert (unpermuted - theirs).abs().max() > 1e-2


def test_heads_wider_than_dim_over_heads_give_transformers_logits(tmp_path):
    """model.head_dim (Qwen3's 128 at dim 2048 and 32 heads): here 8 heads of 16 at dim 64."""
    hf = saved_llama(tmp_path, **SMALL, head_dim=16)
    model = loaded_llama(tmp_path)
    assert model.cfg.head_dim == 16
    assert model.layers["0"].attention.wq.weight.shape == (128, 64)
    with torch.no_grad():
        torch.testing.assert_close(
            model(tokens()), hf(input_ids=tokens()).logits, rtol=0, atol=1e-4
        )


def test_a_pipeline_stage_reads_only_its_tensors_of_a_sharded_checkpoint(tmp_path, monkeypatch):
    hf = saved_llama(tmp_path / "one", **SMALL)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / SAFETENSORS_INDEX).exists()
    read = []
    original = SavedTensors.__getitem__
    monkeypatch.setattr(SavedTensors, "__getitem__", lambda s, k: read.append(k) or original(s, k))
    stage = cut_stage(meta_llama(tmp_path / "sharded"), 1, [1, 1]).to_empty(device="cpu")
    stage.load_pretrained(str(tmp_path / "sharded"))
    assert all(k.startswith(("model.layers.1.", "model.norm.", "lm_head.")) for k in read)
    assert len(read) == len(list(stage.parameters())) == 9 + 2  # one block, the norm, the head
    with torch.no_grad():
        out = hf(input_ids=tokens(), output_hidden_states=True)
        torch.testing.assert_close(stage(out.hidden_states[1]), out.logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize(("vocab_multiple", "tie"), [(1, False), (3, True)])
def test_an_exported_model_loads_in_transformers_with_the_same_logits(
    tmp_path, vocab_multiple, tie
):
    cfg = LlamaModelConfig(
        name="tiny",
        dim=64,
        n_layers=2,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=256,
        multiple_of=32,
        rope_theta=500000.0,
        tie_embeddings=tie,
    )
    model = build_llama(cfg, SEQ, "cpu", vocab_multiple)
    model.init_weights(seed=3)
    convert.export_hf(model, tmp_path)
    hf = LlamaForCausalLM.from_pretrained(tmp_path).eval()
    assert hf.config.tie_word_embeddings == tie and hf.config.rope_parameters["rope_theta"] == 5e5
    with torch.no_grad():
        ours, theirs = model(tokens()), hf(input_ids=tokens()).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
    back = loaded_llama(tmp_path, vocab_multiple)
    for (name, param), (_, again) in zip(
        model.named_parameters(), back.named_parameters(), strict=True
    ):
        assert torch.equal(param, again), name


def test_what_meshrun_llama_cannot_hold_is_named():
    base = {**TINY, "architectures": ["LlamaForCausalLM"]}
    assert convert.llama_config_from_hf({**base, "rope_theta": 5e5})["rope_theta"] == 5e5
    assert convert.llama_config_from_hf(base)["n_kv_heads"] == 4
    linear = {"rope_scaling": {"type": "linear", "factor": 2.0}}  # a transformers 4 config
    for wrong, fragment in [
        ({"attention_bias": True}, "no biases"),
        ({"hidden_act": "gelu"}, "'gelu'"),
        (linear, "'linear'"),
    ]:
        with pytest.raises(ValueError, match=fragment):
            convert.llama_config_from_hf({**base, **wrong})


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        (
            {"hidden_size": 32},
            "its config.json has hidden_size=32, the preset model.dim=64. Valid: model.dim=32",
        ),
        ({"rms_norm_eps": 1e-6}, "Valid: model.norm_eps=1e-06"),
        ({"rope_parameters": LLAMA3_ROPE}, "rope_type='llama3'"),
    ],
    ids=["hidden_size", "rms_norm_eps", "llama3_rope"],
)
def test_a_checkpoint_unlike_the_preset_is_refused_before_launch(tmp_path, config, fragment):
    saved_llama(tmp_path, **{**TINY, **config})
    cfg = compose_config("model=tiny", f"model.pretrained={tmp_path}")
    with pytest.raises(ConfigError) as caught:
        resolve(cfg, HostFacts.detect())
    assert caught.value.key == "model.pretrained"
    assert fragment in str(caught.value)


def test_pretrained_weights_give_transformers_first_loss_through_the_driver(experiment, tmp_path):
    saved = saved_llama(tmp_path / "ckpt", **TINY)
    cfg, measured = experiment(
        "model=tiny",
        f"model.pretrained={tmp_path / 'ckpt'}",
        "parallel=single",
        "train.steps=2",
        "train.untimed_steps=1",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "train.seq_len=64",
        "metrics.baseline=off",
    )
    assert measured.ok, measured.meta.error
    assert losses(measured)[0] == pytest.approx(transformers_first_loss(cfg, saved), rel=1e-5)
