"""The default experiment on any number of ranks: train.global_batch_size null is derived
from the data-parallel size (8 rounded up to a multiple of micro x dp, so 1 to 4 ranks keep
8), resolved once for the driver, the planner and the ranks; the summary says so. A
data-parallel preset on one device says what it measures there."""

from __future__ import annotations

import shlex

import pytest

from meshrun.core.batch import derived_global_batch
from meshrun.core.errors import ConfigError
from meshrun.core.record import RunRecord
from meshrun.driver.experiment import record_skipped
from meshrun.driver.sinks.console import console, print_summary
from tests.helpers import compose_config, resolved_config
from tests.test_plan import meshrun_plan


@pytest.mark.parametrize(
    ("micro", "dp", "batch"),
    [(2, 1, 8), (2, 2, 8), (2, 4, 8), (2, 3, 12), (2, 6, 12), (2, 8, 16), (4, 3, 12), (1, 8, 8)],
)
def test_the_derived_batch_is_8_rounded_up_to_whole_micro_batches_on_every_rank(micro, dp, batch):
    assert derived_global_batch(micro, dp) == batch


@pytest.mark.parametrize(("ranks", "batch"), [(1, 8), (2, 8), (3, 12), (8, 16)])
def test_the_default_experiment_resolves_on_any_number_of_ranks(ranks, batch):
    cfg = resolved_config(f"launcher.nproc_per_node={ranks}")
    assert cfg.parallel.dp_replicate == ranks
    assert cfg.train.global_batch_size == batch
    assert cfg.resolved.batch_derived


def test_a_given_batch_is_kept_and_checked_as_before():
    assert not resolved_config("train.global_batch_size=8").resolved.batch_derived
    with pytest.raises(ConfigError) as caught:
        resolved_config("launcher.nproc_per_node=3", "train.global_batch_size=8")
    assert caught.value.key == "train.global_batch_size"
    assert "micro_batch_size (2) x data-parallel size (3) = 6" in str(caught.value)


def test_parallel_auto_derives_the_batch_over_every_rank():
    cfg = resolved_config("parallel=auto", "launcher.nproc_per_node=3", "model=tiny")
    assert cfg.train.global_batch_size % (cfg.train.micro_batch_size * 3) == 0
    assert cfg.resolved.batch_derived


def test_the_default_experiment_trains_on_3_ranks_with_the_derived_batch(meshrun_here):
    run = meshrun_here(
        "launcher.nproc_per_node=3",
        "model=tiny",
        "train.steps=3",
        "train.untimed_steps=2",
        "metrics.baseline=off",
    )
    assert run.returncode == 0, run.output
    r = run.results
    assert (r["status"], r["world_size"], r["global_batch_size"]) == ("completed", 3, 12)
    assert r["batch_derived"] == "micro 2 x dp 3 x 2 accumulation"
    assert (r["precision"], r["precision_auto"]) == ("fp32", "CPU")
    assert (r["loss"], r["loss_auto"]) == ("chunked", "the head and the loss over chunks of tokens")
    shown = flat(run.output)
    assert "loss chunked (auto: the head and the loss over chunks of tokens)" in shown
    assert "batch global 12 (derived: micro 2 x dp 3 x 2 accumulation), micro 2" in shown
    assert "precision fp32 (auto: CPU)" in shown


def test_meshrun_plan_derives_the_batch_a_run_of_the_box_would(tmp_path):
    _, three = meshrun_plan(tmp_path, "model=tiny", "launcher.nproc_per_node=3", "top=3")
    assert three["train"]["global_batch_size"] == 12
    assert three["train"]["precision"] == "fp32"
    for row in three["layouts"][:3]:  # each row's command runs that batch
        words = shlex.split(row["command"])[1:]
        assert resolved_config(*words).train.global_batch_size == 12, row["command"]
    _, micro_2 = meshrun_plan(
        tmp_path, "model=tiny", "launcher.nproc_per_node=3", "train.micro_batch_size=2"
    )
    ddp = next(e for e in micro_2["layouts"] if e["layout"] == "ddp3")
    assert "train.global_batch_size" not in ddp["command"]  # the run derives the same
    preset = ("parallel=tp2_pp2", "parallel.dp_replicate=-1", "launcher.nproc_per_node=8")
    _, given = meshrun_plan(tmp_path, "model=tiny", *preset)
    assert given["train"]["global_batch_size"] == 8  # its own dp, 2 (not the world's 8: 16)


def flat(table: str) -> str:
    """A summary table's text, its rows' wrapped cells joined: `key value` a row."""
    return " ".join(table.replace("│", " ").split())


def _summary(**fields) -> str:
    with console.capture() as captured:
        print_summary(RunRecord.from_dict({"status": "completed", **fields}))
    return flat(captured.get())


def test_the_summary_says_how_the_batch_and_precision_were_chosen():
    out = _summary(
        global_batch_size=12,
        micro_batch_size=2,
        batch_derived="micro 2 x dp 3 x 2 accumulation",
        precision="bf16",
        matmul_precision="bf16",
        precision_auto="sm90",
    )
    assert "batch global 12 (derived: micro 2 x dp 3 x 2 accumulation), micro 2" in out
    assert "precision bf16 (auto: sm90)" in out
    given = _summary(
        global_batch_size=8, micro_batch_size=2, precision="fp32", matmul_precision="tf32"
    )
    assert "batch global 8, micro 2" in given and "precision fp32 (matmuls in tf32)" in given


def test_a_data_parallel_preset_on_one_device_says_it_measures_one_device():
    one = {"world_size": 1, "baseline_mode": "own", "speedup": 1.0}
    out = _summary(parallel="ddp", **one)
    assert "one device parallel=ddp on 1 device runs the model alone" in out
    assert "speedup 1 by definition" in out
    assert "one device" not in _summary(parallel="single", **one)
    assert "one device" not in _summary(parallel="ddp", world_size=2, baseline_mode="fresh")


def test_a_skipped_sweep_point_records_the_batch_its_degrees_derive(tmp_path):
    """The report's maps sort the points of a grid by batch: a refused point has one too."""
    cfg = compose_config(
        "parallel=pp2",
        "train.micro_batch_size=3",
        f"run_dir={tmp_path / 'run'}",
        f"store.path={tmp_path / 'meshrun.db'}",
    )
    skipped = record_skipped(cfg, ConfigError("parallel.pp", 2, "refused", "anything else"))
    assert (skipped.status, skipped.global_batch_size) == ("skipped", 9)
    assert skipped.layout_name == "pp2(1f1b, m=3)"
