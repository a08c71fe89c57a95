"""Every transformers family model=hf/auto trains, from a directory its own save_pretrained
wrote: meshrun reads the checkpoint as transformers stores it (MoE experts one by one on
disk, fused 3-D in the model: models/hf_files.py) into transformers' own forward, trains it
under a data-parallel, an FSDP and a model-parallel layout (ep for a mixture of experts, TP
for a dense model, a pipeline where meshrun does not apply the family's TP plan), and exports
what transformers reloads with the trained weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from meshrun.core.config import HFModelConfig
from meshrun.core.errors import ConfigError
from meshrun.driver.experiment import run_experiment
from meshrun.models.checkpoint_files import SAFETENSORS, SavedTensors
from meshrun.models.hf import build_hf, model_class
from meshrun.models.hf_files import conversions, saved_sources
from meshrun.validate.model import read_pretrained
from tests.helpers import resolved_config
from tests.ranks import config_in
from tests.test_hf_auto import COMMON, STEPS, heldout_loss, saved
from tests.test_layouts import MICRO4
from tests.test_verify import STEPS as VERIFY_STEPS
from tests.test_verify import report, verify_run
from tests.tiers import tiered

transformers = pytest.importorskip("transformers")

# The families meshrun computes transformers' forward of, MoE ones first: their checkpoints
# store experts one by one. The others hf/auto accepts fail for their forward, not their
# checkpoints (docs/models.md, "Which families").
MOE = (
    "MixtralForCausalLM",  # block_sparse_moe.experts.{i}.w1/w3/w2 on disk
    "Qwen2MoeForCausalLM",  # a gated shared expert beside the routed ones
    "Qwen3MoeForCausalLM",
    "MiniMaxForCausalLM",
    "AfmoeForCausalLM",
    "ExaoneMoeForCausalLM",
    "FlexOlmoForCausalLM",
    "HYV3ForCausalLM",
    "Kolibri1ForCausalLM",
    "MiniMaxM2ForCausalLM",
    "MiniMaxM3VLForCausalLM",  # a clamped SwiGLU: ep by its own forward, etp refused
    "AriaTextForCausalLM",  # experts stored [E, in, out] (is_transposed)
    "DeepseekV2ForCausalLM",
    "Dots1ForCausalLM",
    "Ernie4_5_MoeForCausalLM",
    "Glm4MoeForCausalLM",  # a router's correction bias: a buffer its checkpoints hold
    "Glm4MoeLiteForCausalLM",
    "MiniCPM5MoeForCausalLM",
    "SolarOpenForCausalLM",
)
DENSE = (
    "LlamaForCausalLM",
    "GPT2LMHeadModel",  # meshrun's shipped plan: Conv1D stored transposed, learned positions
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "Apertus1p5TextForCausalLM",
    "ApertusForCausalLM",
    "ArceeForCausalLM",
    "Ernie4_5ForCausalLM",
    "Exaone4ForCausalLM",
    "GemmaForCausalLM",
    "Glm4ForCausalLM",
    "GlmForCausalLM",
    "GraniteForCausalLM",
    "HeliumForCausalLM",
    "HyperCLOVAXForCausalLM",
    "Ministral3ForCausalLM",
    "MinistralForCausalLM",
    "Olmo2ForCausalLM",
    "OlmoForCausalLM",
    "OlmoHybridForCausalLM",
    "Phi3ForCausalLM",
    "SeedOssForCausalLM",
    "SmolLM3ForCausalLM",
    "Starcoder2ForCausalLM",
)
FAMILIES = (*MOE, *DENSE)
# The sizes of a tiny model, each kept where the family's config has the field: 4 experts
# (ep=2 holds 2 a rank), 4 heads over 2 kv heads (tp=2), 2 layers, untied (pp=2 later).
TINY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 128,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "moe_num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_k": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 0,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "n_group": 1,
    "topk_group": 1,
    "n_embd": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 128,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def tiny_fields(architecture: str) -> dict:
    """TINY's sizes that are fields of the family's config."""
    defaults = model_class(architecture).config_class().to_dict()
    return {key: value for key, value in TINY.items() if key in defaults}


def write(directory: Path, architecture: str) -> torch.nn.Module:
    return saved(directory, architecture, tiny_fields(architecture)).eval()


def read_back(directory: Path) -> torch.nn.Module:
    """meshrun's view of the directory as model=hf/auto reads it and a rank builds it: on
    meta, then materialised, then its weights loaded."""
    cfg, _ = read_pretrained(
        HFModelConfig(name="hf/auto", architecture="auto", pretrained=str(directory))
    )
    model = build_hf(cfg, "meta").to_empty(device="cpu")
    model.load_pretrained(str(directory))
    return model.eval()


# In CI: Qwen3-MoE (experts one by one on disk), Mixtral (renamed too) and GPT-2 (meshrun's
# own plan); every family with -m slow.
READ_FAST = {"Qwen3MoeForCausalLM", "MixtralForCausalLM", "GPT2LMHeadModel"}


@pytest.mark.parametrize("architecture", tiered(FAMILIES, READ_FAST))
def test_meshrun_reads_each_familys_save_pretrained_directory_into_its_own_forward(
    tmp_path, architecture
):
    theirs = write(tmp_path / "ckpt", architecture)
    ours = read_back(tmp_path / "ckpt")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(input_ids=tokens).logits)


def test_a_stored_buffer_is_read_and_a_computed_one_computed(tmp_path):
    """Glm4-MoE's routers' correction biases (buffers its checkpoints hold, set here as
    training would) are read; Gemma's embedding scale (a buffer transformers computes) is
    computed: on meta neither exists."""
    glm = write(tmp_path / "glm", "Glm4MoeForCausalLM")
    with torch.no_grad():
        for layer in glm.model.layers:
            layer.mlp.gate.e_score_correction_bias.uniform_(-1, 1)
    glm.save_pretrained(tmp_path / "glm")
    gemma = write(tmp_path / "gemma", "GemmaForCausalLM")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    for theirs, directory in ((glm, tmp_path / "glm"), (gemma, tmp_path / "gemma")):
        with torch.no_grad():
            ours = read_back(directory)(tokens)
            torch.testing.assert_close(ours, theirs(input_ids=tokens).logits)


def test_a_rank_reads_only_its_experts_bytes_gate_and_up_in_transformers_order(tmp_path):
    """Qwen3-MoE's experts on disk one by one: the fused [E, 2f, h] gate_up_proj's box of
    experts 2-3 (an ep rank's) reads those experts' gate and up alone; a box of rows across
    the gate | up boundary (an FSDP shard of one expert's) the rows it holds."""
    model = write(tmp_path / "ckpt", "Qwen3MoeForCausalLM")
    name = "model.layers.1.mlp.experts.gate_up_proj"
    fused = dict(model.named_parameters())[name].detach()
    with safe_open(tmp_path / "ckpt" / SAFETENSORS, "pt") as f:
        stored = set(f.keys())
    assert name not in stored and "model.layers.1.mlp.experts.3.up_proj.weight" in stored
    _, rows, width = fused.shape
    for box in (
        (slice(2, 4), slice(0, rows), slice(0, width)),
        (slice(1, 2), slice(rows // 2 - 3, rows // 2 + 5), slice(0, width)),
    ):
        saved = SavedTensors(tmp_path / "ckpt")
        sources = saved_sources(saved, conversions(model), [name], "model")
        assert sources[name].shape == fused.shape
        got = sources[name][box]
        torch.testing.assert_close(got, fused[box], rtol=0, atol=0)
        assert saved.bytes_read == got.numel() * got.element_size()


def model_parallel(architecture: str) -> tuple[str, ...]:
    """ep for a mixture of experts meshrun splits, TP where meshrun applies the family's TP
    plan (colwise and rowwise entries), else a pipeline."""
    if architecture in MOE:
        return ("parallel=ep2",)
    cfg = HFModelConfig(name="hf/x", architecture=architecture, config=tiny_fields(architecture))
    try:
        build_hf(cfg, "meta").tp_plan()
    except ValueError:
        return ("parallel=pp2",)
    return ("parallel=tp2", MICRO4)


LAYOUTS = ("ddp", "fsdp", "model-parallel")
CASES = [(architecture, layout) for architecture in FAMILIES for layout in LAYOUTS]
# In CI the case: a Qwen3-MoE's experts split over two ranks; the matrix with -m slow
TRAIN_FAST = {("Qwen3MoeForCausalLM", "model-parallel")}


@pytest.mark.parametrize("case", tiered(CASES, TRAIN_FAST), ids="-".join)
def test_each_family_trains_from_its_directory_and_exports_what_transformers_reloads(
    tmp_path, rank_pool, case
):
    """The export's loss on the run's held-out batch is the run's own after the last step,
    and not the saved model's (it trained)."""
    architecture, layout = case
    model = write(tmp_path / "ckpt", architecture)
    pretrained = f"model.pretrained={tmp_path / 'ckpt'}"
    given = model_parallel(architecture) if layout == "model-parallel" else (f"parallel={layout}",)
    cfg = config_in(
        tmp_path / "run",
        *COMMON,
        pretrained,
        *given,
        "checkpoint.export=hf",
        f"train.eval.every_steps={STEPS}",
        "train.eval.batches=1",
    )
    record = run_experiment(cfg, rank_pool.launch)
    assert record.status == "completed", record.error
    assert record.checkpoints.export_path is not None  # the export failed: its warning says why
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        record.checkpoints.export_path
    ).eval()
    assert type(exported).__name__ == architecture
    assert heldout_loss(cfg, exported) == pytest.approx(record.evaluation.eval_loss, rel=1e-5)
    assert heldout_loss(cfg, model) != pytest.approx(record.evaluation.eval_loss, rel=1e-3)


# A shape no preset or case above has: 6 experts, 3 a token (ep=2: 3 a rank, which FSDP's 2
# shards of them split 2 + 1), a gated shared expert, heads of 24, 300 tokens, 3 layers.
HELD_OUT = {
    "vocab_size": 300,
    "hidden_size": 96,
    "intermediate_size": 80,
    "moe_intermediate_size": 40,
    "shared_expert_intermediate_size": 56,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "num_experts": 6,
    "num_experts_per_tok": 3,
    "tie_word_embeddings": False,
}
HELD_OUT_LAYOUTS = {
    "ep": ("parallel=ep2",),  # 2 ranks: the experts split in two, the rest FSDP's
    "fsdp x ep": ("parallel=ep2", "launcher.nproc_per_node=4"),  # each half over 2 more
}


# In CI fsdp x ep (ep alone: Qwen3-MoE's case above); ep with -m slow
@pytest.mark.parametrize("layout", tiered(HELD_OUT_LAYOUTS, {"fsdp x ep"}))
def test_a_held_out_moe_checkpoint_trains_from_its_directory_like_one_device(
    tmp_path, on_pool, capsys, layout
):
    """meshrun-verify: the layout's losses and grad norms against one device's, each from
    the directory (issue 56's check)."""
    saved(tmp_path / "held-out", "Qwen2MoeForCausalLM", HELD_OUT)
    pretrained = f"model.pretrained={tmp_path / 'held-out'}"
    code = verify_run(tmp_path, "model=hf/auto", pretrained, *HELD_OUT_LAYOUTS[layout])
    assert code == 0, capsys.readouterr().out
    result = report(tmp_path)
    assert result["passed"] and result["max_loss_deviation"] < result["tolerance"]
    assert len(result["steps"]) == VERIFY_STEPS


def test_a_checkpoint_meshrun_cannot_read_a_shard_at_a_time_is_refused_before_launch(tmp_path):
    """LaraMini's checkpoints store one in_proj that transformers splits in four on load."""
    write(tmp_path / "lara", "LaraMiniForCausalLM")
    with pytest.raises(ConfigError) as caught:
        resolved_config("model=hf/auto", f"model.pretrained={tmp_path / 'lara'}")
    assert caught.value.key == "model.pretrained"
    assert "as ['linear_attn.in_proj'], converted by Split on load" in str(caught.value)


def test_experts_with_a_gate_of_their_own_split_over_ep_train_like_one_device(
    tmp_path, on_pool, capsys
):
    """MiniMax-M3's experts clamp gate and up (their own _apply_gate): under ep each rank
    computes its experts' rows by the family's own forward (hf_experts._own_forward), and
    meshrun-verify finds the layout's losses and grad norms one device's; etp, which would
    split the clamped SwiGLU's hidden width, is refused."""
    write(tmp_path / "m3", "MiniMaxM3VLForCausalLM")
    pretrained = f"model.pretrained={tmp_path / 'm3'}"
    code = verify_run(tmp_path, "model=hf/auto", pretrained, "parallel=ep2")
    assert code == 0, capsys.readouterr().out
    result = report(tmp_path)
    assert result["passed"] and len(result["steps"]) == VERIFY_STEPS
    with pytest.raises(ConfigError) as caught:
        resolved_config(*COMMON, pretrained, "parallel=tp2_ep2", "parallel.etp=2")
    assert caught.value.key == "parallel.etp"
    assert "a function of their own (_apply_gate)" in str(caught.value)
