"""Pipeline specifics: how layers are cut into stages, the bubble measured beside the theory,
and 1F1B holding fewer micro-batches of activations than GPipe."""

from __future__ import annotations

import pytest

from meshrun.core.config import LlamaModelConfig
from meshrun.core.stages import (
    balanced_layer_counts,
    local_stage_ids,
    stage_layer_counts,
    theoretical_bubble,
)
from meshrun.driver.experiment import record
from meshrun.driver.sinks.console import print_summary
from meshrun.driver.sinks.store import ResultsStore
from meshrun.models import build_model
from meshrun.rank.metrics.bubble import bubble_per_rank
from meshrun.rank.parallel.pipeline import cut_stage


def test_even_split_puts_extra_layers_on_later_stages():
    assert stage_layer_counts(8, 2, None) == [4, 4]
    assert stage_layer_counts(7, 3, None) == [2, 2, 3]
    assert stage_layer_counts(6, 4, [1, 2, 2, 1]) == [1, 2, 2, 1]


def test_balanced_split_minimises_the_slowest_stage():
    assert balanced_layer_counts(4, [1.0, 1.0], 0.0, 0.0) == [2, 2]
    assert balanced_layer_counts(5, [1.0, 1.0], 0.0, 0.0) == stage_layer_counts(5, 2, None)
    assert balanced_layer_counts(8, [1.0, 1.0], 0.1, 2.5) == [5, 3]  # 5.1 vs 5.5
    assert balanced_layer_counts(4, [1.0, 1.0], 0.0, 9.0) == [3, 1]  # every stage keeps one
    assert balanced_layer_counts(6, [2.0, 1.0], 0.0, 0.0) == [2, 4]  # a slower first rank
    assert balanced_layer_counts(12, [1.0] * 4, 0.5, 3.0) == [3, 4, 4, 1]


def test_interleaved_ranks_own_looped_stages():
    assert local_stage_ids(0, 2, 2) == [0, 2]
    assert local_stage_ids(1, 4, 2) == [1, 5]


def test_cut_stage_keeps_layer_names_and_ends_only_where_they_belong():
    full = build_model(
        LlamaModelConfig(name="t", dim=32, n_layers=5, n_heads=4, vocab_size=64), 16, "meta"
    )
    first, middle, last = (cut_stage(full, s, [2, 2, 1]) for s in range(3))
    assert list(first.layers) == ["0", "1"] and first.tok_embeddings is not None
    assert first.output is None and first.norm is None
    assert list(middle.layers) == ["2", "3"] and middle.tok_embeddings is None
    assert list(last.layers) == ["4"] and last.output is not None and last.norm is not None


@pytest.mark.parametrize(
    ("pp", "m", "v", "expected"), [(2, 1, 1, 1 / 2), (4, 8, 1, 3 / 11), (2, 4, 2, 1 / 9)]
)
def test_theoretical_bubble(pp, m, v, expected):
    assert theoretical_bubble(pp, m, v) == pytest.approx(expected)


PP_SMALL = (
    "model=small",
    "parallel=pp2",
    "train.global_batch_size=8",
    "train.steps=4",
    "train.untimed_steps=2",
    "metrics.baseline=off",
)


def test_bubble_is_measured_and_recorded_beside_the_theory(experiment, capsys):
    cfg, measured = experiment(
        "model=tiny",
        "parallel=pp2",
        "parallel.schedule=gpipe",
        "train.global_batch_size=8",
        "train.micro_batch_size=4",
        "train.steps=5",
        "metrics.baseline=off",
    )
    assert measured.ok, measured.meta.error
    store = ResultsStore(cfg.store.path)
    results = record(cfg, measured, None, store)  # results.json and the store row
    assert results.pipeline.pp_schedule == "gpipe" and results.pipeline.n_microbatches == 2
    assert results.pipeline.bubble_theoretical == pytest.approx(1 / 3)
    assert len(results.pipeline.bubble_per_rank) == 2
    assert 0 < results.pipeline.bubble_measured < 1
    [row] = store.runs()
    assert row["bubble_measured"] == results.pipeline.bubble_measured
    print_summary(results)
    assert "bubble (gpipe, m=2)" in capsys.readouterr().out


HEAVY_HEAD = (
    "model=tiny",
    "model.vocab_size=16384",
    "parallel=pp2",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.steps=3",
    "train.untimed_steps=1",
    "metrics.baseline=off",
)


@pytest.mark.slow
def test_pp_layers_auto_moves_layers_off_a_heavy_head_and_trains_as_its_split(experiment):
    """A 16k vocabulary's head and loss outweigh a `tiny` block many times over: the probe
    sees it and gives the last stage one layer; the record names the split (the overrides
    run it again) and the run's losses are those of that split written out."""
    cfg, auto = experiment(*HEAVY_HEAD, "parallel.pp_layers=auto")
    assert auto.ok, auto.meta.error
    assert auto.report.pp_split.counts == [3, 1]
    costs = auto.report.pp_split.stage_costs_s
    assert costs[1] > costs[0] > 0  # the head's stage stays the slower: one layer is its least
    results = record(cfg, auto, None, ResultsStore(cfg.store.path))
    assert results.pipeline.pp_layers == [3, 1] and "parallel.pp_layers=[3,1]" in results.overrides
    assert "layers=[3,1]" in results.layout_name
    assert (
        "auto chose [3, 1]" in results.pipeline.pp_split_note
        and "apart" in results.pipeline.pp_split_note
    )
    _, explicit = experiment(*HEAVY_HEAD, "parallel.pp_layers=[3,1]")
    assert explicit.ok and explicit.report.pp_split is None
    assert [s.loss for s in auto.steps] == [s.loss for s in explicit.steps]


@pytest.mark.slow
def test_1f1b_holds_fewer_activations_than_gpipe(experiment):
    """With 8 micro-batches, GPipe's first stage keeps all 8 micro-batches' activations
    until the backward starts; 1F1B keeps at most pp=2 of them."""
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        _, measured = experiment(
            *PP_SMALL, f"parallel.schedule={schedule}", "train.micro_batch_size=1"
        )
        assert measured.ok, measured.meta.error
        peaks[schedule] = measured.report.memory_per_rank[0]["peak"]  # rank 0: the first stage
    assert peaks["gpipe"] > peaks["1f1b"] + 20 * 2**20


def test_bubble_of_a_rank_is_its_median_step_against_the_longest_rank():
    """Step 2 was disturbed (rank 1 computed slowly, rank 0 waited): the median ignores it.
    Each step's pipeline time is the longest rank's span, not the rank's own."""
    busy = [[0.9, 0.9, 0.5], [0.8, 0.8, 1.2]]
    spans = [[1.0, 1.0, 1.4], [0.95, 0.9, 1.3]]
    assert bubble_per_rank(busy, spans) == pytest.approx([0.1, 0.2])


BALANCED_CASES = [("gpipe", 1), ("gpipe", 2), ("gpipe", 4), ("1f1b", 2), ("1f1b", 4), ("1f1b", 8)]


@pytest.mark.slow
@pytest.mark.alone  # beside another module's ranks the bubble read 0.26 for 0.20 (gpipe, m=4)
@pytest.mark.parametrize(("schedule", "microbatches"), BALANCED_CASES)
def test_measured_bubble_follows_theory_on_a_balanced_pipeline(meshrun, schedule, microbatches):
    """The compute-balanced pipeline of conf/experiment/pipeline_bubble.yaml: measured bubble
    within 25% of (p-1)/(m+p-1). gpipe with m=8 is left to benchmarks/pipeline_bubble.py: on
    2 shared cores its bubble spread over +8..+42% in nine runs of one config (the jitter of
    two ranks computing at once adds up over GPipe's 8 dependent hops), which a test cannot
    assert without failing at random."""
    run = meshrun(
        "experiment=pipeline_bubble",
        f"parallel.schedule={schedule}",
        f"train.micro_batch_size={64 // microbatches}",
        timeout=600,
    )
    assert run.returncode == 0, run.output
    results = run.results
    theory = results["bubble_theoretical"]
    assert abs(results["bubble_measured"] - theory) <= 0.25 * theory, results["bubble_per_rank"]
