"""The planner's memory prediction against real runs on this host: peak within 10% per rank,
params / grads / optimizer / activations within 15%. A few layouts run by default, the rest
of the set with -m slow; benchmarks/planner_accuracy.py prints the whole table.

FSDP is not in the asserted set: on gloo its measured peak moves by whole gathered blocks
between identical runs (five runs: 118-143 MiB without checkpointing, rank 1 either 118.2
or 133-143; 92-120 with full checkpointing), so even a median of five runs crosses the bar;
benchmarks/planner_accuracy.py reports its spread."""

from __future__ import annotations

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


@pytest.mark.parametrize(("name", "ckpt"), CASES)
def test_predicted_memory_per_rank_is_within_the_bars(meshrun, name, ckpt):
    run = meshrun(*LAYOUTS[name], f"parallel.activation_checkpointing={ckpt}", "train.steps=4",
                  "metrics.baseline=false")  # fmt: skip
    assert run.returncode == 0, run.output
    results = run.results
    pairs = list(zip(results["memory_per_rank"], results["memory_predicted"], strict=True))
    assert len(pairs) == results["world_size"]
    for measured, predicted in pairs:
        rank = measured["rank"]
        assert predicted["peak"] == pytest.approx(measured["peak"], rel=0.10), (rank, pairs)
        for category in CATEGORIES:
            assert predicted[category] == pytest.approx(measured[category], rel=0.15), (
                rank, category, pairs)  # fmt: skip
