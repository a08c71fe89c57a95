"""The planner's memory prediction against real runs on this host: peak within 10% per rank,
params / grads / optimizer / activations within 15%. A few layouts run by default, the rest
of the set with -m slow; benchmarks/planner_accuracy.py prints the whole table.

FSDP on gloo is measured five times: identical runs peak whole gathered blocks apart (one
config: 118-142 MiB in seven runs), so its bars apply to each rank's median run."""

from __future__ import annotations

import statistics

import pytest

CATEGORIES = ("params", "grads", "optimizer", "activations")
LAYOUTS = {
    "single": ("parallel=single",),
    "ddp": ("parallel=ddp",),
    "tp2": ("parallel=tp2",),
    "pp2-1f1b": ("parallel=pp2", "parallel.schedule=1f1b"),
    "pp2-gpipe": ("parallel=pp2", "parallel.schedule=gpipe"),
    "tp2_pp2": ("parallel=tp2_pp2",),
}
# By default the layouts whose measured peak repeats to the byte. Under TP the buffers that
# gloo's async collectives hold move the peak by up to ~11 MiB between runs (tp2 with full
# checkpointing measured 70.0 and 77.2 MiB against 69.2 predicted), and once in a loaded CI
# run DDP with full checkpointing peaked one gradient-size buffer higher (183.4 against the
# usual 154.9 MiB: a bucket rebuild's transient copy), so those run with -m slow.
FAST = {("single", "none"), ("single", "full"), ("pp2-gpipe", "none"), ("pp2-1f1b", "full")}
CASES = [
    pytest.param(name, ckpt, marks=() if (name, ckpt) in FAST else pytest.mark.slow,
                 id=f"{name}-ckpt_{ckpt}")
    for name in LAYOUTS
    for ckpt in ("none", "full")
]  # fmt: skip


def assert_within_bars(measured_per_rank: list[dict], predicted_per_rank: list[dict]) -> None:
    pairs = list(zip(measured_per_rank, predicted_per_rank, strict=True))
    for rank, (measured, predicted) in enumerate(pairs):
        assert predicted["peak"] == pytest.approx(measured["peak"], rel=0.10), (rank, pairs)
        for category in CATEGORIES:
            assert predicted[category] == pytest.approx(measured[category], rel=0.15), (
                rank, category, pairs)  # fmt: skip


def accuracy_run(meshrun, *overrides: str) -> dict:
    run = meshrun(*overrides, "train.steps=4", "metrics.baseline=false")
    assert run.returncode == 0, run.output
    results = run.results
    assert len(results["memory_per_rank"]) == results["world_size"]
    return results


@pytest.mark.parametrize(("name", "ckpt"), CASES)
def test_predicted_memory_per_rank_is_within_the_bars(meshrun, name, ckpt):
    results = accuracy_run(meshrun, *LAYOUTS[name], f"parallel.activation_checkpointing={ckpt}")
    assert_within_bars(results["memory_per_rank"], results["memory_predicted"])


FSDP_RUNS = 5


@pytest.mark.slow
@pytest.mark.parametrize("ckpt", ["none", "full"])
def test_fsdp_prediction_is_within_the_bars_of_the_median_run(meshrun, ckpt):
    """The gathered and reduce-scattered block buffers outlive their use by a varying time
    (most likely gloo's worker threads dropping the collectives' tensors at racing moments),
    which moves the peak of identical runs by whole blocks."""
    runs = [accuracy_run(meshrun, "parallel=fsdp", f"parallel.activation_checkpointing={ckpt}")
            for _ in range(FSDP_RUNS)]  # fmt: skip
    median = [
        {key: statistics.median(r["memory_per_rank"][rank][key] for r in runs)
         for key in ("peak", *CATEGORIES)}
        for rank in range(runs[0]["world_size"])
    ]  # fmt: skip
    assert_within_bars(median, runs[0]["memory_predicted"])
