"""model=hf/auto: a user's own transformers checkpoint from one override. The architecture and
config come from model.pretrained's config.json (sizes no preset has), explicit model.config
keys win over them, the run trains it under any layout from transformers' own first loss and
exports what transformers loads; a family meshrun cannot cut, or no directory, is refused
before anything starts. Real transformers checkpoints (save_pretrained of tiny models)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from meshrun.core.errors import ConfigError
from meshrun.driver.experiment import run_experiment
from meshrun.models.hf import model_class
from meshrun.rank.train.data import HeldoutBatches, build_streams
from meshrun.tools.plan import command as plan_command
from tests.cli import run_console
from tests.helpers import resolved_config, transformers_first_loss
from tests.ranks import config_in

transformers = pytest.importorskip("transformers")

STEPS = 2
COMMON = (
    "model=hf/auto",
    f"train.steps={STEPS}",
    "train.untimed_steps=1",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.seq_len=32",
    "train.seed=3",
    "metrics.baseline=off",
)
# Sizes no preset has: 300 tokens, untied, GQA.
QWEN2 = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
# Heads and kv heads divided by tp=2, 4 layers by 2 pipeline stages; untied (a pipeline puts
# embedding and head on different stages).
MISTRAL = {
    "vocab_size": 200,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}


def saved(directory: Path, architecture: str, fields: dict) -> torch.nn.Module:
    """A checkpoint as a user has one: transformers' own init, save_pretrained."""
    cls = model_class(architecture)
    torch.manual_seed(7)
    model = cls(cls.config_class(**fields))
    model.save_pretrained(directory)
    return model


def test_a_qwen2_of_sizes_no_preset_has_composes_and_trains_from_one_override(
    meshrun_here, tmp_path
):
    model = saved(tmp_path / "my-qwen", "Qwen2ForCausalLM", QWEN2)
    given = (*COMMON, f"model.pretrained={tmp_path / 'my-qwen'}", "parallel=single")
    cfg = resolved_config(*given)
    assert cfg.model.architecture == "Qwen2ForCausalLM"
    assert cfg.model.config == {k: v for k, v in QWEN2.items() if k != "tie_word_embeddings"}
    assert (cfg.model.name, cfg.name) == ("hf/my-qwen", "hf/my-qwen_single")

    run = meshrun_here(*given)
    assert run.returncode == 0, run.output
    read = (
        f"Qwen2ForCausalLM read from {tmp_path / 'my-qwen' / 'config.json'} (hidden 64, "
        "2 layers, 4 heads / 2 kv, ffn 96, vocab 300, untied)"
    )
    results = run.results
    assert results["model"] == "hf/my-qwen" and results["model_read"] == read
    assert run.stored()[0]["model_read"] == read
    assert "Qwen2ForCausalLM read from" in run.output  # the note before, the summary after
    assert results["losses"][0] == pytest.approx(transformers_first_loss(cfg, model), rel=1e-5)


def test_explicit_config_keys_win_unless_they_change_the_checkpoint_shapes(tmp_path):
    saved(tmp_path / "ckpt", "Qwen2ForCausalLM", QWEN2)
    given = (*COMMON, f"model.pretrained={tmp_path / 'ckpt'}")
    cfg = resolved_config(*given, "+model.config.rms_norm_eps=1e-5")
    assert cfg.model.config["rms_norm_eps"] == 1e-5 and cfg.model.config["vocab_size"] == 300
    with pytest.raises(ConfigError) as caught:
        resolved_config(*given, "+model.config.intermediate_size=128")
    assert caught.value.key == "model.config.intermediate_size"
    assert "(model.pretrained's weights) to [128, 64]" in str(caught.value)


# TP x PP with -m slow: the layouts are those of every transformers model (test_hf_models.py)
@pytest.mark.parametrize("layout", ["fsdp", pytest.param("tp2_pp2", marks=pytest.mark.slow)])
def test_another_family_trains_under_any_layout_and_exports_what_transformers_loads(
    tmp_path, rank_pool, layout
):
    """A Mistral (no preset) under FSDP and under TP x PP from the one override: transformers'
    own first loss, and its export loads in transformers with the trained weights (its loss
    on the held-out batch is the run's evaluation after the last step)."""
    model = saved(tmp_path / "ckpt", "MistralForCausalLM", MISTRAL)
    cfg = config_in(
        tmp_path / "run",
        *COMMON,
        f"model.pretrained={tmp_path / 'ckpt'}",
        f"parallel={layout}",
        "checkpoint.export=hf",
        f"train.eval.every_steps={STEPS}",
        "train.eval.batches=1",
    )
    record = run_experiment(cfg, rank_pool.launch)
    assert record.status == "completed", record.error
    assert record.model_read.startswith("MistralForCausalLM read from")
    assert record.series.losses[0] == pytest.approx(transformers_first_loss(cfg, model), rel=1e-5)
    exported = transformers.AutoModelForCausalLM.from_pretrained(record.checkpoints.export_path)
    assert type(exported).__name__ == "MistralForCausalLM"
    assert heldout_loss(cfg, exported) == pytest.approx(record.evaluation.eval_loss, rel=1e-5)
    assert heldout_loss(cfg, model) != pytest.approx(
        record.evaluation.eval_loss, rel=1e-3
    )  # trained


def heldout_loss(cfg, model: torch.nn.Module) -> float:
    """A transformers model's loss on the run's held-out batch (one, whole)."""
    t = cfg.train
    _, heldout = build_streams(cfg.data, None, model.config.vocab_size, t.seed, t.seq_len)
    [(inputs, targets)] = HeldoutBatches(
        heldout, 1, t.global_batch_size, t.seq_len, 0, 1, torch.device("cpu")
    )
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item()


def test_a_family_meshrun_cannot_cut_is_refused_with_those_it_can(meshrun_here, tmp_path):
    """OPT has no base_model_pp_plan and meshrun ships none: exit 2 before any process."""
    from meshrun.models.hf import supported_architectures  # noqa: PLC0415 (new with hf/auto)

    opt = {"vocab_size": 128, "hidden_size": 32, "ffn_dim": 64, "num_hidden_layers": 2}
    saved(tmp_path / "opt", "OPTForCausalLM", {**opt, "num_attention_heads": 2})
    run = meshrun_here("model=hf/auto", f"model.pretrained={tmp_path / 'opt'}")
    assert run.returncode == 2, run.output
    assert f"model.pretrained='{tmp_path / 'opt'}': holds OPTForCausalLM" in run.output
    supported = supported_architectures()
    assert {"GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM"} <= set(supported)
    assert not {"OPTForCausalLM", "GPTNeoXForCausalLM"} & set(supported)  # Neo-X: a dropout
    assert f"Valid: a checkpoint of {' | '.join(supported)}." in run.output
    assert not (run.run_dir / "results.json").exists()


@pytest.mark.parametrize(
    ("given", "fragment"),
    [
        ((), "model.pretrained=None: model=hf/auto reads its architecture and config"),
        (("model.pretrained={tmp}",), "no config.json there"),
    ],
    ids=["no-pretrained", "no-config-json"],
)
def test_hf_auto_without_a_checkpoint_is_refused(meshrun_here, tmp_path, given, fragment):
    run = meshrun_here("model=hf/auto", *(g.format(tmp=tmp_path) for g in given))
    assert run.returncode == 2, run.output
    assert fragment in run.output


def test_meshrun_plan_reads_it_too_and_its_commands_name_the_checkpoint(tmp_path):
    saved(tmp_path / "my-qwen", "Qwen2ForCausalLM", QWEN2)
    pretrained = f"model.pretrained={tmp_path / 'my-qwen'}"
    override = "+model.config.rms_norm_eps=1e-5"  # over config.json's: no preset to match
    run = run_console(
        plan_command.main,
        tmp_path / "plan",
        None,
        "model=hf/auto",
        pretrained,
        override,
        defaults=(),
    )
    assert run.returncode == 0, run.output
    assert "of 0 layouts" not in run.output and "no layout" not in run.output
    assert "meshrun-plan: hf/my-qwen on" in run.output
    assert f"meshrun model=hf/auto {pretrained} hardware=" in run.output
