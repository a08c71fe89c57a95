"""Hugging Face transformers models (model=hf/...) under meshrun's layouts: meshrun's view of
the model computes exactly transformers' own forward; every kind of layout trains it like one
device; weights load from a local save_pretrained directory; config mistakes are refused
with the key and the valid choices before anything runs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from meshrun.core.errors import ConfigError
from meshrun.core.hardware import HostFacts
from meshrun.driver.experiment import measure
from meshrun.driver.resolve import resolve
from meshrun.models import build_model, model_shape
from meshrun.models.hf import build_hf, hf_config, model_class
from meshrun.models.shards import named_tensors
from meshrun.rank.parallel.checkpointing import apply_activation_checkpointing
from tests.helpers import compose_config, transformers_first_loss
from tests.ranks import config_in, losses
from tests.test_layouts import MICRO4  # TP without a pipeline: 2 micro-batches
from tests.tiers import tiered

STEPS = 4
COMMON = (
    "model=hf/tiny-llama",
    f"train.steps={STEPS}",
    "train.untimed_steps=1",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.seq_len=64",
    "train.seed=3",
    "metrics.baseline=off",
)
# In CI one layout of each kind: sharded data parallel, a pipeline, CP, and TP with SP under
# FSDP on GPT-2's shipped plan (its Conv1D, positions sharded, vocabulary tied and padded);
# TP in a pipeline in the pretrained read below. The rest with -m slow (make test-all).
FAST = {"fsdp", "pp2_interleaved_split_by_measured_cost", "cp2_allgather"}
GPT2_FAST: set[str] = set()
LAYOUTS = {
    "ddp": ("parallel=ddp",),
    "fsdp": ("parallel=fsdp",),
    "hsdp": ("parallel=hsdp", "launcher.nproc_per_node=4"),
    "tp2": ("parallel=tp2", MICRO4),
    "tp2_sequence_parallel": ("parallel=tp2", "parallel.sequence_parallel=true", MICRO4),
    "pp2_1f1b": ("parallel=pp2",),
    "pp2_gpipe": ("parallel=pp2", "parallel.schedule=gpipe"),
    "pp2_interleaved": ("parallel=pp2_interleaved",),
    # stages cut by the measured cost of transformers' decoder layers
    "pp2_interleaved_split_by_measured_cost": (
        "parallel=pp2_interleaved",
        "parallel.pp_layers=auto",
    ),
    "tp2_pp2_sequence_parallel": ("parallel=tp2_pp2", "parallel.sequence_parallel=true"),
    "dp2_tp2_pp2": ("parallel=dp2_tp2_pp2",),
    "fsdp_selective_checkpointing": (
        "parallel=fsdp",
        "parallel.activation_checkpointing=selective",
    ),
    # transformers' SDPA attention reached by CP's function mode; GQA K/V gathered
    "cp2_allgather": ("parallel=cp2", "parallel.cp_method=allgather", MICRO4),
    "tp2_cp2_sequence_parallel": ("parallel=tp2_cp2", MICRO4),
}


GPT2_COMMON = (*(o for o in COMMON if not o.startswith("model=")), "model=hf/tiny-gpt2")
GPT2_LAYOUTS = {
    "ddp": ("parallel=ddp",),
    "fsdp": ("parallel=fsdp",),
    "tp2": ("parallel=tp2", MICRO4),
    "tp2_sequence_parallel": ("parallel=tp2", "parallel.sequence_parallel=true", MICRO4),
    "fsdp2_tp2_sequence_parallel": (
        "parallel=fsdp2_tp2",
        "parallel.sequence_parallel=true",
        MICRO4,
    ),
    # learned positions looked up at a CP rank's global ones
    "cp2_ring": ("parallel=cp2", MICRO4),
    # the tied head a copy on the last stage, read and seeded as the embedding
    "tp2_pp2": ("parallel=tp2_pp2",),
}


def transformers_equivalent(model, architecture: str) -> torch.nn.Module:
    """The transformers model itself with meshrun's view's weights."""
    equivalent = model_class(architecture)._from_config(model.config, attn_implementation="sdpa")
    ours = {
        model.source_name(n): p.T if n in model.transposed else p
        for n, p in model.named_parameters()
    }
    missing, _ = equivalent.load_state_dict(ours, strict=False)
    assert set(missing) <= {"lm_head.weight"} if model.tied else not missing
    return equivalent


# Small shapes of a preset, with a sliding window of 8 over the test's 32 tokens
SMALL = (
    "++model.config.hidden_size=64", "++model.config.intermediate_size=128",
    "++model.config.num_hidden_layers=4", "++model.config.num_attention_heads=8",
    "++model.config.num_key_value_heads=4", "++model.config.vocab_size=256",
)  # fmt: skip
WINDOWED = {
    # every layer's window (Mistral)
    "mistral": ("model=hf/mistral-7b", *SMALL, "++model.config.sliding_window=8"),
    # layers 2 and 3 windowed, by the config's layer_types (Qwen2's max_window_layers)
    "qwen2": (
        "model=hf/qwen2.5-0.5b", *SMALL, "++model.config.sliding_window=8",
        "++model.config.use_sliding_window=true", "++model.config.max_window_layers=2",
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "architecture", "vocab"),
    [
        (("model=hf/tiny-llama",), "LlamaForCausalLM", 256),
        (("model=hf/tiny-gpt2",), "GPT2LMHeadModel", 509),
        (WINDOWED["mistral"], "MistralForCausalLM", 256),
        (WINDOWED["qwen2"], "Qwen2ForCausalLM", 256),
    ],
    ids=("llama", "gpt2", "mistral-sliding-window", "qwen2-sliding-window-layers"),
)
def test_meshrun_view_computes_transformers_own_forward(overrides, architecture, vocab):
    """Its layers called by meshrun give transformers' logits, its sliding windows applied as
    transformers' own forward applies them."""
    model = build_hf(compose_config(*overrides).model, "cpu")
    model.init_weights(seed=0)
    tokens = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(tokens)
        theirs = transformers_equivalent(model, architecture)(input_ids=tokens).logits
    assert ours.shape == (2, 32, vocab)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("preset", ["tiny", "hf/tiny-llama", "hf/tiny-gpt2"])
def test_weights_are_the_same_when_checkpointing_wraps_the_blocks_first(preset):
    """The rank wraps the blocks on meta, then fills the weights: the wrapper's name prefix
    must not change them (it did for transformers' norms: drawn at random, not set to one)."""
    cfg = compose_config(f"model={preset}", "train.seq_len=32").model
    plain, wrapped = build_model(cfg, 32, "cpu"), build_model(cfg, 32, "meta")
    apply_activation_checkpointing(wrapped, "selective")
    wrapped.to_empty(device="cpu")
    for model in (plain, wrapped):
        model.init_weights(seed=0)
    want = dict(named_tensors(plain))
    got = dict(named_tensors(wrapped))
    assert got.keys() == want.keys()
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, want[name], rtol=0, atol=0, msg=name)


def test_shape_and_plans_come_from_the_transformers_config():
    cfg = compose_config("model=hf/llama-3.1-8b").model
    shape = model_shape(cfg)
    assert (shape.dim, shape.n_layers, shape.n_heads, shape.n_kv_heads) == (4096, 32, 32, 8)
    assert (shape.ffn_dim, shape.vocab_size, shape.tied, shape.mlp_matrices) == (
        14336,
        128256,
        False,
        3,
    )
    gpt2 = model_shape(compose_config("model=hf/gpt2").model)
    assert (gpt2.ffn_dim, gpt2.vocab_size, gpt2.tied, gpt2.mlp_matrices) == (3072, 50257, True, 2)
    meta = build_model(cfg, 128, "meta")
    assert len(meta.layers) == 32 and sum(p.numel() for p in meta.parameters()) == 8_030_261_248
    plan = meta.tp_plan()
    assert plan["layers.*.self_attn.q_proj"] == "colwise"
    assert plan["layers.*.mlp.down_proj"] == "rowwise"
    assert plan["layers.*.self_attn"] == plan["layers.*.mlp"] == "gather_input"
    assert plan["layers.*.input_layernorm"] == "sequence_parallel"
    assert compose_config("model=hf/llama-3.2-1b").model.config["tie_word_embeddings"] is True


@pytest.fixture(scope="module")
def single_losses(tmp_path_factory, rank_pool) -> dict[tuple[str, ...], list[float]]:
    """Per common setting (model), the single-device losses, measured on first use."""
    cache: dict[tuple[str, ...], list[float]] = {}

    def of(common: tuple[str, ...]) -> list[float]:
        if common not in cache:
            cfg = config_in(tmp_path_factory.mktemp("single"), "parallel=single", *common)
            measured = measure(cfg, "run", rank_pool.launch)
            assert measured.ok, measured.meta.error
            cache[common] = losses(measured)
        return cache[common]

    return of


def check_like_one_device(experiment, single_losses, overrides, common) -> None:
    _, measured = experiment(*common, *overrides)
    assert measured.ok, measured.meta.error
    got, want = losses(measured), single_losses(common)
    assert len(got) == len(want) == STEPS
    for step, (loss, ref) in enumerate(zip(got, want, strict=True)):
        assert abs(loss - ref) <= 1e-4 * abs(ref), f"step {step}: {loss} vs {ref}"
    assert got[-1] < got[0]


@pytest.mark.parametrize("layout", tiered(LAYOUTS, FAST))
def test_every_kind_of_layout_trains_hf_llama_like_one_device(experiment, single_losses, layout):
    check_like_one_device(experiment, single_losses, LAYOUTS[layout], COMMON)


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(
            ("parallel=tp2", "parallel.sequence_parallel=true", MICRO4), marks=pytest.mark.slow
        ),
        pytest.param(("parallel=pp2",), marks=pytest.mark.slow),
    ],
    ids=("tp2_sequence_parallel", "pp2"),
)
def test_a_sliding_window_model_trains_like_one_device(experiment, single_losses, layout):
    """Qwen2's windowed layers (8 of 64 tokens) masked in each rank's attention: under SP
    over the whole sequence its attention gathers, in a pipeline on each stage's layers."""
    common = (*COMMON[1:], *WINDOWED["qwen2"])
    check_like_one_device(experiment, single_losses, layout, common)


@pytest.mark.parametrize("layout", tiered(GPT2_LAYOUTS, GPT2_FAST))
def test_gpt2_with_its_shipped_plan_trains_like_one_device(experiment, single_losses, layout):
    """Conv1D as Linear, q|k|v regrouped per TP rank, positions sharded under SP, 509 tokens
    padded, the head tied to the embedding."""
    check_like_one_device(experiment, single_losses, GPT2_LAYOUTS[layout], GPT2_COMMON)


def saved_hf(
    directory: Path, preset: str = "hf/tiny-llama", overrides: tuple[str, ...] = ()
) -> torch.nn.Module:
    """A checkpoint as a user has one: transformers' own init, save_pretrained (safetensors);
    `overrides` of the model's keys (`+model.config.<field>=...`)."""
    cfg = compose_config(f"model={preset}", *overrides).model
    torch.manual_seed(7)
    model = model_class(cfg.architecture)(hf_config(cfg))
    model.save_pretrained(directory)
    return model


PRETRAINED = {  # (common overrides, layout, ranks each tensor is split over)
    "tiny-llama single": (COMMON, ("parallel=single",), 1),
    "tiny-llama tp2_pp2": (COMMON, ("parallel=tp2_pp2",), 4),
    "tiny-llama fsdp": (COMMON, ("parallel=fsdp",), 2),
    # Conv1D weights stored transposed, q|k|v regrouped per TP rank, the vocabulary tied and
    # padded (509 tokens), FSDP's shards of TP's shards
    "tiny-gpt2 fsdp2_tp2": (GPT2_COMMON, ("parallel=fsdp2_tp2",), 4),
    # the last stage's tied head read from the embedding's tensor (no lm_head saved)
    "tiny-llama tied tp2_pp2": (
        (*COMMON, "+model.config.tie_word_embeddings=true"),
        ("parallel=tp2_pp2",),
        4,
    ),
}


# In CI the sharded read of a pipeline of TP stages, untied and tied; with -m slow a whole
# read, FSDP's, and GPT-2's transposed, regrouped and tied weights under FSDP x TP.
PRETRAINED_FAST = {"tiny-llama tied tp2_pp2"}


@pytest.mark.parametrize("case", tiered(PRETRAINED, PRETRAINED_FAST))
def test_pretrained_weights_give_transformers_own_first_loss_each_rank_reading_its_share(
    experiment, tmp_path, case
):
    common, layout, split = PRETRAINED[case]
    preset = next(o for o in common if o.startswith("model=")).removeprefix("model=")
    model_keys = tuple(o for o in common if o.startswith("+model."))
    saved = saved_hf(tmp_path / "ckpt", preset, model_keys)
    cfg, measured = experiment(*layout, *common, f"model.pretrained={tmp_path / 'ckpt'}")
    assert measured.ok, measured.meta.error
    assert losses(measured)[0] == pytest.approx(transformers_first_loss(cfg, saved), rel=1e-5)
    tensors = load_file(tmp_path / "ckpt" / "model.safetensors")
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    read = measured.report.pretrained_read_bytes_per_rank
    assert sum(read) >= total  # every byte by some rank
    # a pipeline's last stage reads a tied head from the embedding's tensor: twice read
    embedding = saved.get_input_embeddings().weight
    tied_copy = saved.config.tie_word_embeddings and cfg.parallel.pp > 1
    shares = total + (embedding.numel() * embedding.element_size() if tied_copy else 0)
    # each rank its share (the norms TP replicates are 1-2% more); a whole copy would be 1.0
    assert max(read) <= 1.02 * shares / split, [r / total for r in read]


@pytest.mark.parametrize(
    ("overrides", "key", "fragment"),
    [
        (
            ["+model.config.num_hiden_layers=2"],
            "model.config.num_hiden_layers",
            "model.config.num_hidden_layers (nearest)",
        ),
        (["model.architecture=LlamaForCasualLM"], "model.architecture", "LlamaForCausalLM"),
        (["model.pretrained=/nonexistent"], "model.pretrained", "no config.json there"),
        (
            ["parallel=tp2", "model.config.num_key_value_heads=1"],
            "parallel.tp",
            "model.n_kv_heads (1) is not divisible by tp",
        ),
    ],
    ids=str,
)
def test_hf_config_mistakes_are_refused_before_launch(overrides, key, fragment):
    with pytest.raises(ConfigError) as caught:
        resolve(compose_config("model=hf/tiny-llama", *overrides), HostFacts.detect())
    assert caught.value.key == key
    assert fragment in str(caught.value)


@pytest.mark.parametrize(
    ("overrides", "key", "fragment"),
    [
        (
            ("model=hf/mistral-7b", "model.config.sliding_window=64", "parallel=cp2"),
            "parallel.cp",
            "sliding window (model.config.sliding_window=64) is one over train.seq_len=128",
        ),
        (
            ("model=hf/tiny-gpt2", "model.config.n_positions=32"),
            "train.seq_len",
            "longer than the learned position table (32 positions)",
        ),
    ],
    ids=("sliding-window-under-cp", "positions"),
)
def test_a_sequence_the_model_cannot_attend_over_is_refused(overrides, key, fragment):
    with pytest.raises(ConfigError) as caught:
        resolve(compose_config(*overrides, "train.seq_len=128"), HostFacts.detect())
    assert caught.value.key == key and fragment in str(caught.value)


def test_a_checkpoint_of_another_shape_is_refused(tmp_path):
    saved_hf(tmp_path / "ckpt")
    cfg = compose_config(
        "model=hf/tiny-llama",
        "model.config.num_hidden_layers=2",
        f"model.pretrained={tmp_path / 'ckpt'}",
    )
    with pytest.raises(ConfigError, match=r"its config.json has num_hidden_layers=4, the preset 2"):
        resolve(cfg, HostFacts.detect())


def test_a_directory_without_weights_or_of_another_architecture_is_refused(tmp_path):
    saved_hf(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "model.safetensors").unlink()
    cfg = compose_config("model=hf/tiny-llama", f"model.pretrained={tmp_path / 'ckpt'}")
    with pytest.raises(ConfigError, match=r"no \.safetensors weights there"):
        resolve(cfg, HostFacts.detect())
    saved_hf(tmp_path / "ckpt")
    cfg = compose_config(
        "model=hf/tiny-llama",
        "model.architecture=MistralForCausalLM",
        f"model.pretrained={tmp_path / 'ckpt'}",
    )
    with pytest.raises(ConfigError, match=r"holds \['LlamaForCausalLM'\], the preset is Mistral"):
        resolve(cfg, HostFacts.detect())
