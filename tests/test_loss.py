"""train.loss (issue 63): the loss without the whole fp32 logits. `chunked` computes the
same loss and gradients as `full` whatever the chunks (uneven ones, a padded vocabulary, a
tied head, meshrun's decoder and every transformers family meshrun runs); `auto` takes
vocab_parallel under TP, chunked elsewhere and full where neither can run, saying why; an
explicit loss the layout cannot run exits 2 naming train.loss; meshrun-verify passes each
layout's auto loss against one device, and chunked against full on one device."""

from __future__ import annotations

import copy

import pytest
import torch

from meshrun.core.errors import ConfigError
from meshrun.core.hardware import HostFacts
from meshrun.core.torch_floor import release
from meshrun.driver.resolve import resolve
from meshrun.models import build_model
from meshrun.models import loss as loss_choice
from meshrun.models.loss import ZERO_BUBBLE_TAKES_FUNCTIONS, loss_method
from meshrun.rank.parallel.loss import apply_chunked_loss, micro_batch_loss
from tests.helpers import compose_config, resolved_config
from tests.test_custom_model import NAMED
from tests.test_verify import report, verify_run

SEQ = 16
# meshrun's decoder (tied, a vocabulary padded to a multiple of 3) and transformers' families
MODELS = {
    "tiny tied, padded": ("model=tiny", "model.tie_embeddings=true"),
    "hf/tiny-llama": ("model=hf/tiny-llama",),
    "hf/tiny-gpt2": ("model=hf/tiny-gpt2",),  # tied, Conv1D blocks
    "hf/tiny-mixtral": ("model=hf/tiny-mixtral",),
    "hf/tiny-qwen2-moe": ("model=hf/tiny-qwen2-moe",),
}


@pytest.mark.parametrize("name", MODELS)
def test_chunked_loss_and_gradients_are_the_full_ones_over_uneven_chunks(name, monkeypatch):
    cfg = compose_config(*MODELS[name]).model
    full = build_model(cfg, SEQ, "cpu", vocab_multiple=3)
    full.init_weights(0)
    chunked = copy.deepcopy(full)
    apply_chunked_loss(chunked)
    vocab = full.vocab_size
    # 7 tokens a chunk: 48 tokens in 6 whole chunks and a short one
    monkeypatch.setattr(loss_choice, "CHUNK_LOGITS", 7 * vocab)
    tokens = torch.randint(vocab, (3, SEQ), generator=torch.Generator().manual_seed(0))
    targets = torch.randint(vocab, (3, SEQ), generator=torch.Generator().manual_seed(1))
    want = micro_batch_loss(full, tokens, targets, "full")
    got = micro_batch_loss(chunked, tokens, targets, "chunked")
    assert got.ndim == 0
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    want.backward()
    got.backward()
    for (param, a), b in zip(full.named_parameters(), chunked.parameters(), strict=True):
        gap = (b.grad - a.grad).abs().max()
        assert torch.allclose(b.grad, a.grad, rtol=1e-4, atol=1e-6), f"{param}: {gap}"
    assert chunked(tokens).shape == (3, SEQ, vocab)  # without targets: the logits


@pytest.mark.parametrize(
    ("overrides", "method", "why"),
    [
        (("parallel=single",), "chunked", "the head and the loss over chunks of tokens"),
        (("parallel=pp2",), "chunked", "the head and the loss over chunks of tokens"),
        (("parallel=tp2",), "vocab_parallel", "TP: the logits stay sharded over the vocabulary"),
        (
            ("parallel=tp2", "parallel.tp_plan=tests.plans:wrong_wo_sharding"),
            "full",
            "a user's parallel.tp_plan lays out the head itself",
        ),
        (
            ("parallel=dataparallel", "parallel.dataparallel_devices=1"),
            "full",
            "DataParallel gathers its replicas' logits on one device",
        ),
        ((*NAMED, "model.head=null"), "full", "the model's head is not named (model.head)"),
        (
            (*NAMED, "parallel=tp2"),  # tests.user_model:tp_plan, a callable, no head entry
            "full",
            "the model's TP plan leaves its head whole (no `head` entry for model.head)",
        ),
        (
            (*NAMED, "parallel=tp2", "model.tp_plan={blocks.*.up:colwise,head:head}"),
            "vocab_parallel",
            "TP: the logits stay sharded over the vocabulary",
        ),
        (("train.loss=full",), "full", None),
    ],
    ids=str,
)
def test_auto_takes_the_loss_the_layout_can_run_and_says_why(overrides, method, why):
    assert loss_method(compose_config("model=tiny", *overrides)) == (method, why)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (("parallel=tp2", "train.loss=chunked"), "TP shards the head over the vocabulary"),
        ((*NAMED, "model.head=null", "train.loss=chunked"), "the model's head is not named"),
        (("parallel=single", "train.loss=vocab_parallel"), "only under TP (parallel.tp > 1)"),
    ],
    ids=str,
)
def test_a_loss_the_layout_cannot_run_exits_2_naming_train_loss(overrides, fragment):
    with pytest.raises(ConfigError) as caught:
        resolve(compose_config("model=tiny", *overrides), HostFacts.detect())
    assert caught.value.key == "train.loss"
    assert fragment in str(caught.value)
    assert "Valid: auto" in str(caught.value)


def test_the_zero_bubble_schedule_takes_the_chunked_loss_from_torch_2_13():
    """Below 2.13 refused, naming torch's lines (the torch floor's subset runs this on 2.11);
    from 2.13 it resolves, and tests/test_combinations.py's pair verifies it (-m slow)."""
    zero_bubble = ("parallel=pp2_interleaved", "parallel.schedule=interleaved_zb")
    cfg = compose_config("model=tiny", *zero_bubble, "train.loss=chunked")
    if release(torch.__version__) >= ZERO_BUBBLE_TAKES_FUNCTIONS:
        assert resolve(cfg, HostFacts.detect()).config.train.loss == "chunked"
        return
    with pytest.raises(ConfigError) as caught:
        resolve(cfg, HostFacts.detect())
    assert caught.value.key == "train.loss"
    assert "_backward.py:262" in str(caught.value) and "__init__.py:103" in str(caught.value)


def test_verify_passes_chunked_against_the_full_loss_on_one_device(tmp_path, on_pool):
    """A micro-batch of 8 x 64 tokens over a 65,536-token head: two chunks (3 steps)."""
    big = ("model.vocab_size=65536", "train.micro_batch_size=8", "train.global_batch_size=8")
    run = (*big, "train.steps=3", "parallel=single", "verify.reference=full_loss")
    assert verify_run(tmp_path, *run) == 0
    got = report(tmp_path)
    assert (got["passed"], got["loss"], got["reference"]) == (True, "chunked", "full_loss")


def test_verify_refuses_the_full_loss_reference_for_a_full_loss(tmp_path):
    assert verify_run(tmp_path, "train.loss=full", "verify.reference=full_loss") == 2


LAYOUTS = {  # issue 63's checks: each layout's auto loss against one device's
    "tp2 sp": (("parallel=tp2", "parallel.sequence_parallel=true"), "vocab_parallel"),
    "fsdp": (("parallel=fsdp",), "chunked"),
    "pp2": (("parallel=pp2",), "chunked"),
    "tiny-moe ep2": (("model=tiny-moe", "parallel=ep2"), "chunked"),
}


@pytest.mark.parametrize(
    "layout", [pytest.param(k, marks=() if k == "tp2 sp" else pytest.mark.slow) for k in LAYOUTS]
)
def test_verify_passes_each_layouts_auto_loss(tmp_path, on_pool, layout):
    overrides, method = LAYOUTS[layout]
    assert verify_run(tmp_path, *overrides) == 0
    got = report(tmp_path)
    assert (got["passed"], got["loss"]) == (True, method)


def test_the_resolved_run_keeps_train_loss_as_written():
    """auto is decided where it is asked (models/loss.py), from the layout: the settings and
    the config the ranks get keep `auto`, so the baseline beside a TP run takes chunked."""
    cfg = resolved_config("model=tiny", "parallel=tp2")
    assert cfg.train.loss == "auto"
    assert loss_method(cfg)[0] == "vocab_parallel"
