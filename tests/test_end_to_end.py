"""The main job end to end: plain `meshrun` (the quick start: DDP of the small model on 2 CPU
ranks) measures its single-device baseline beside the run, reports a speedup with
its spread, and every sink holds the same numbers; a stored baseline is reused only where
asked and where it was measured alike."""

from __future__ import annotations

import json
import shutil
import sqlite3
from contextlib import closing

import pytest

from meshrun.core.hardware import fingerprint_key
from tests.cli import run_meshrun
from tests.wandb_records import read_offline_run

SMALL_DDP = (
    "train.steps=8",
    "train.untimed_steps=2",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.seq_len=128",
    "logger=wandb",
    "logger.mode=offline",
)
SECRET = "meshrun-test-secret-0123456789abcdef0123456789abcdef"


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    run = run_meshrun(tmp / "run", tmp / "meshrun.db", *SMALL_DDP, env={"WANDB_API_KEY": SECRET})
    assert run.returncode == 0, run.output
    return run


def test_ddp_reports_speedup_against_measured_baseline(ddp_run):
    results = ddp_run.results
    assert results["status"] == "completed"
    assert results["world_size"] == 2
    assert (results["model"], results["parallel"]) == ("small", "ddp")  # the defaults
    assert results["layout"] == {"pp": 1, "dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 1}
    assert results["scaling"] == "weak"
    assert results["baseline_tokens_per_s"] > 0
    assert results["speedup"] == pytest.approx(
        results["tokens_per_s"] / results["baseline_tokens_per_s"]
    )
    assert results["scaling_efficiency"] == pytest.approx(results["speedup"] / 2)
    # measured beside the run: one baseline step after each of the 6 timed steps, paired
    assert results["baseline_mode"] == "fresh"
    assert results["speedup_rounds"] == 6 == len(results["step_times"])
    assert results["speedup_p10"] <= results["speedup_p90"]
    assert results["speedup_noise"] >= 0 and results["step_time_cv"] >= 0
    assert 0 <= results["host_other_cpu_share"] <= 1
    assert results["fingerprint"]["torch"] and results["fingerprint"]["threads_per_rank"] == 1
    assert len(results["peak_memory_bytes"]) == 2
    assert results["peak_memory_max_bytes"] == max(results["peak_memory_bytes"])
    # small has 7.5M params: fp32 params + grads + AdamW state alone are 16 B/param
    assert results["peak_memory_max_bytes"] > 16 * 7.4e6
    assert "weak scaling" in ddp_run.output and "speedup" in ddp_run.output


def test_run_again_line_repeats_the_command_less_hydras_keys(ddp_run):
    again = ddp_run.results["overrides"]
    assert f"run again: meshrun {again}\n" in ddp_run.output
    layout = ["parallel=ddp", "parallel.dp_replicate=2", "train.micro_batch_size=2"]
    assert again.split()[-3:] == layout  # the resolved degrees, the micro-batch once
    assert all(o in again.split() for o in SMALL_DDP if "micro_batch" not in o)
    assert "hydra." not in again and SECRET not in again


def test_baseline_and_run_are_both_in_the_store(ddp_run):
    rows = {row["role"]: row for row in ddp_run.stored()}
    assert set(rows) == {"baseline", "run"}
    baseline, run = rows["baseline"], rows["run"]
    assert baseline["world_size"] == 1 and baseline["parallel"] == "single"
    assert baseline["global_batch_size"] == 4  # weak scaling: one rank's share
    assert len(baseline["step_times"]) == 6 and len(baseline["losses"]) == 6
    assert baseline["fingerprint_key"] == run["fingerprint_key"]  # the same host, rank 0
    assert run["baseline_run_id"] == baseline["run_id"]
    assert run["speedup"] == ddp_run.results["speedup"]
    assert run["baseline_tokens_per_s"] == baseline["tokens_per_s"]


def test_wandb_offline_run_holds_config_steps_and_summary(ddp_run):
    wandb_run = read_offline_run(ddp_run.run_dir)
    summary, results = wandb_run["summary"], ddp_run.results
    for key in ("tokens_per_s", "speedup", "scaling_efficiency", "peak_memory_max_bytes"):
        assert summary[key] == pytest.approx(results[key]), key
    assert "mfu" in summary  # None on CPU: no published peak to divide by
    assert wandb_run["config"]["parallel"]["name"] == "ddp"
    steps = [h for h in wandb_run["history"] if "train/loss" in h]
    assert [h["train/loss"] for h in steps] == pytest.approx(results["losses"])
    assert [h["train/grad_norm"] for h in steps] == pytest.approx(results["grad_norms"])
    assert {h["train/lr"] for h in steps} == {3e-4}  # train.lr, the constant schedule


def test_wandb_key_never_lands_in_outputs(ddp_run):
    for path in [*ddp_run.run_dir.rglob("*"), ddp_run.store_path]:
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    assert SECRET not in ddp_run.output


@pytest.mark.slow
def test_second_run_reuses_the_stored_baseline_where_asked(ddp_run, meshrun_here, tmp_path):
    store = shutil.copy(ddp_run.store_path, tmp_path / "copy.db")
    again = meshrun_here(*SMALL_DDP[:-2], "metrics.baseline=stored", store_path=store)
    assert again.returncode == 0, again.output
    assert not (again.run_dir / "baseline").exists()
    baseline = next(r for r in ddp_run.stored() if r["role"] == "baseline")
    results = again.results
    assert results["baseline_run_id"] == baseline["run_id"]
    assert results["baseline_mode"] == "stored" and results["baseline_age_s"] >= 0
    assert results["speedup_rounds"] is None  # nothing alternated
    assert "(stored, measured" in again.output


@pytest.mark.slow
def test_a_stored_baseline_of_another_torch_is_not_reused(ddp_run, meshrun_here, tmp_path):
    """Its fingerprint differs (as with another CUDA, NCCL, device or thread count): the
    run measures its own, beside it."""
    store = shutil.copy(ddp_run.store_path, tmp_path / "copy.db")
    with closing(sqlite3.connect(store)) as db, db:
        [(run_id, text)] = db.execute(
            "SELECT run_id, results_json FROM runs WHERE role = 'baseline'"
        ).fetchall()
        stored = json.loads(text)
        stored["fingerprint"]["torch"] = "2.0.0"
        stored["fingerprint_key"] = fingerprint_key(stored["fingerprint"])
        db.execute(
            "UPDATE runs SET results_json = ?, fingerprint_key = ? WHERE run_id = ?",
            (json.dumps(stored), stored["fingerprint_key"], run_id),
        )
    again = meshrun_here(*SMALL_DDP[:-2], "metrics.baseline=stored", store_path=store)
    assert again.returncode == 0, again.output
    assert again.results["baseline_mode"] == "fresh"
    assert again.results["baseline_run_id"] != run_id


@pytest.mark.slow
def test_single_device_is_its_own_baseline_whatever_the_store_holds(
    ddp_run, meshrun_here, tmp_path
):
    """A stored baseline of the same key (the quick start's baseline) is not the run itself:
    a single device's speedup is 1.0 by definition."""
    store = shutil.copy(ddp_run.store_path, tmp_path / "copy.db")
    single = (
        "parallel=single",
        "launcher.threads_per_rank=1",
        "train.steps=8",
        "train.untimed_steps=2",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "train.seq_len=128",
    )
    run = meshrun_here(*single, "metrics.baseline=stored", store_path=store)
    assert run.returncode == 0, run.output
    assert run.results["speedup"] == 1.0 and run.results["baseline_mode"] == "own"
    assert run.results["scaling_efficiency"] == 1.0
