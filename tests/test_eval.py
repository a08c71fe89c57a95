"""Held-out evaluation (train.eval): the same loss under every layout as on one device, no
effect on training, a separate timing, held-out samples that training never sees, and the
results it leaves (metrics.jsonl, the record, the console). Real gloo processes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from meshrun.core.config import DataConfig
from meshrun.core.record import RunRecord
from meshrun.driver.experiment import measure
from meshrun.driver.prepare_data import prepare_data
from meshrun.driver.results import eval_fields
from meshrun.driver.sinks.console import console, print_summary
from meshrun.rank.train.data import (
    HELDOUT_FIRST_SAMPLE,
    HeldoutBatches,
    LocalBatches,
    SyntheticTokens,
    build_streams,
)
from tests.helpers import compose_config
from tests.ranks import config_in, losses
from tests.tiers import tiered

CPU = torch.device("cpu")
STEPS, EVERY = 4, 2
COMMON = (
    "model=tiny",
    f"train.steps={STEPS}",
    "train.untimed_steps=1",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.seq_len=32",
    "train.precision=fp32",
    "train.seed=5",
    "train.log_every=3",
    "train.eval.batches=2",
    "metrics.baseline=off",
)
EVAL = (f"train.eval.every_steps={EVERY}",)
LAYOUTS = {
    "single": ("parallel=single",),
    "ddp": ("parallel=ddp",),
    "fsdp": ("parallel=fsdp",),
    "tp2": ("parallel=tp2",),
    "pp2_1f1b": ("parallel=pp2",),
    "pp2_gpipe": ("parallel=pp2", "parallel.schedule=gpipe"),
    "tp2_pp2": ("parallel=tp2_pp2",),
}


@pytest.fixture(scope="module")
def run(tmp_path_factory, rank_pool):
    """A layout's run, with or without evaluation, measured once for the module."""
    done = {}

    def measured(layout: str, evaluate: bool = True):
        if (layout, evaluate) not in done:
            tmp = tmp_path_factory.mktemp(layout)
            cfg = config_in(tmp, *LAYOUTS[layout], *COMMON, *(EVAL if evaluate else ()))
            result = measure(cfg, "run", rank_pool.launch)
            assert result.ok, result.meta.error
            done[layout, evaluate] = result
        return done[layout, evaluate]

    return measured


def evaluations(measured) -> dict[int, float]:
    return {r.step: r.eval_loss for r in measured.steps if r.eval_loss is not None}


# In CI sharded data parallel and a pipeline (the loss on the last stage only); with -m slow
# replicated (ddp), TP, GPipe and TP x PP.
EVAL_FAST = {"fsdp", "pp2_1f1b"}


@pytest.mark.parametrize("layout", tiered([n for n in LAYOUTS if n != "single"], EVAL_FAST))
def test_eval_loss_under_each_layout_is_the_single_device_one(run, layout):
    got, want = evaluations(run(layout)), evaluations(run("single"))
    assert list(got) == list(want) == [EVERY - 1, STEPS - 1]  # every 2 steps and the last
    for step, loss in got.items():
        assert abs(loss - want[step]) <= 1e-4 * want[step], f"step {step}: {loss} vs {want[step]}"


@pytest.mark.parametrize("layout", ["fsdp", "pp2_1f1b"])
def test_evaluating_leaves_the_training_losses_bit_for_bit(run, layout):
    assert losses(run(layout)) == losses(run(layout, evaluate=False))
    assert [r.grad_norm for r in run(layout).steps] == [
        r.grad_norm for r in run(layout, evaluate=False).steps
    ]


def test_eval_time_is_reported_beside_the_step_times(run):
    steps = run("pp2_1f1b").steps
    evaluated = [r for r in steps if r.eval_loss is not None]
    assert all(r.eval_time_s > 0 for r in evaluated)
    assert all(r.eval_perplexity == pytest.approx(math.exp(r.eval_loss)) for r in evaluated)
    assert all(r.step_time_s is not None for r in steps[1:])  # every timed step still timed


def test_eval_loss_falls_on_hf_data_and_reaches_the_record(experiment, hf_corpus, tmp_path):
    _, measured = experiment(
        *hf_corpus.overrides(),
        f"data.cache_dir={tmp_path}",
        "parallel=single",
        "train.seq_len=32",
        "train.steps=12",
        "train.lr=3e-3",
        "train.seed=1",
        "train.eval.every_steps=4",
        "train.eval.batches=1",
        "metrics.baseline=off",
    )
    assert measured.ok, measured.meta.error
    curve = evaluations(measured)
    assert list(curve) == [3, 7, 11]
    assert curve[11] < 0.8 * curve[3]  # a tiny grammar is quickly learnt, held out too
    fields = eval_fields(measured.steps)
    assert fields["eval_losses"] == [[s, loss] for s, loss in curve.items()]
    assert fields["eval_loss"] == curve[11]
    assert fields["eval_perplexity"] == pytest.approx(math.exp(curve[11]))
    with console.capture() as captured:
        print_summary(RunRecord.from_dict({"status": "completed", **fields}))
    assert f"{curve[11]:.4f}" in captured.get() and "after 12 steps" in captured.get()


def test_synthetic_heldout_samples_lie_beyond_any_training_step():
    data = DataConfig(name="synthetic")
    train, heldout = build_streams(data, None, 256, seed=3, seq_len=8)
    got = next(iter(HeldoutBatches(heldout, 1, 4, 8, 0, 1, CPU)))[0]
    # held-out sample i is generator index 2**40 + i: training reaches it after 2**38 steps of 4
    want = SyntheticTokens(256, seed=3).batch(
        range(HELDOUT_FIRST_SAMPLE, HELDOUT_FIRST_SAMPLE + 4), 9, CPU
    )[:, :-1]
    assert torch.equal(got, want)
    assert not torch.equal(got, train.batch(range(4), 9, CPU)[:, :-1])


def test_text_trains_on_the_first_bytes_and_holds_out_the_last(tmp_path):
    corpus = tmp_path / "corpus.txt"
    trained_part, heldout_part = bytes(i % 128 for i in range(1900)), bytes(range(128, 228))
    corpus.write_bytes(trained_part + heldout_part)
    data = DataConfig(name="text", path=str(corpus), heldout_fraction=0.05)
    train, heldout = build_streams(data, None, 256, seed=0, seq_len=8)
    trained = LocalBatches(train, 8, 8, 0, 1, CPU)
    seen = torch.cat([torch.cat(trained.for_step(s)) for s in range(60)])  # wraps around the part
    assert seen.max() < 128  # never a held-out byte
    evaluated = torch.cat([torch.cat(b) for b in HeldoutBatches(heldout, 1, 8, 8, 0, 1, CPU)])
    assert evaluated.min() >= 128
    assert len(heldout.span) == 100


def test_hf_heldout_windows_are_documents_training_never_reads(hf_corpus, tmp_path):
    cfg = compose_config(
        *hf_corpus.overrides(),
        f"data.cache_dir={tmp_path}",
        "train.seq_len=32",
        "train.eval.every_steps=1",
        "train.eval.batches=1",
    )
    run = prepare_data(cfg)
    train, heldout = build_streams(run.data, run.resolved.data_cache, 384, seed=0, seq_len=32)
    offsets = train.cache.offsets

    def documents(stream, windows) -> set[int]:
        starts = np.array([stream.span.start + w * 33 for w in windows])
        first = np.searchsorted(offsets, starts, side="right") - 1
        last = np.searchsorted(offsets, starts + 32, side="right") - 1
        return {int(d) for a, b in zip(first, last, strict=True) for d in range(a, b + 1)}

    trained = documents(train, train.order.windows(range(3 * len(train))))  # three epochs
    evaluated = documents(heldout, heldout.order.windows(range(8)))
    assert trained and evaluated and not trained & evaluated
    rows = next(iter(HeldoutBatches(heldout, 1, 8, 32, 0, 1, CPU)))[0]
    first = torch.from_numpy(
        train.cache.tokens[heldout.span.start : heldout.span.start + 32].astype(np.int64)
    )
    assert torch.equal(rows[0], first)  # in order, from the first held-out token
