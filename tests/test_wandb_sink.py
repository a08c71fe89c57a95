"""W&B is a mirror of the run, never its keeper: when W&B fails for real, meshrun warns and
the run is still in the store and results.json. The W&B run shows the run as it trains. The
per-rank memory table takes the measured breakdown (and the prediction) where a run has
them, else the peaks."""

from __future__ import annotations

import pytest

from meshrun.core.choices import LoggerMode
from meshrun.core.config import LoggerConfig
from meshrun.core.errors import ConfigError
from meshrun.core.run_files.metrics import StepRow
from meshrun.driver.sinks.wandb_sink import WandbRun, memory_rows, resolve_mode, run_tags
from meshrun.validate import check_experiment
from tests.helpers import compose_config
from tests.wandb_records import read_offline_run, step_rows

TINY = (
    "model=tiny",
    "parallel=single",
    "train.steps=3",
    "train.untimed_steps=1",
    "train.seq_len=32",
    "logger=wandb",
    "logger.mode=offline",
)


def test_a_wandb_failure_warns_and_loses_nothing(tmp_path, meshrun_here):
    run_dir = tmp_path / "run0"  # meshrun_here's first run dir
    run_dir.mkdir()
    (run_dir / "wandb").write_text("a file where W&B needs its directory")
    run = meshrun_here(*TINY)
    assert run.returncode == 0, run.output
    assert "warning W&B logging failed (NotADirectoryError" in run.output
    assert run.results["status"] == "completed"
    [row] = run.stored()
    assert row["run_id"] == run.results["run_id"] and row["tokens_per_s"] > 0


def test_tags_name_layout_model_hardware_and_backend():
    results = {"layout_name": "fsdp2 x tp2", "model": "tiny", "hardware": "cpu", "backend": "gloo"}
    assert run_tags(results) == ["layout:fsdp2 x tp2", "model:tiny", "hardware:cpu", "backend:gloo"]
    assert run_tags({**results, "status": "skipped"})[-1] == "skipped"


def test_memory_table_without_a_breakdown_has_the_peaks():
    assert memory_rows({"peak_memory_bytes": [10, 20]}) == (["rank", "peak"], [[0, 10], [1, 20]])
    assert memory_rows({"peak_memory_bytes": None}) == (["rank", "peak"], [])


def test_memory_table_with_a_breakdown_and_prediction():
    measured = [
        {
            "rank": r,
            "peak": 100 + r,
            "params": 10,
            "grads": 10,
            "optimizer": 20,
            "activations": 50 + r,
            "other": 10,
        }
        for r in (0, 1)
    ]
    predicted = [{**m, "peak": 90} for m in measured]
    columns, rows = memory_rows({"memory_per_rank": measured, "memory_predicted": predicted})
    assert columns[:7] == ["rank", "peak", "params", "grads", "optimizer", "activations", "other"]
    assert "predicted_peak" in columns and "allocated" not in columns  # CPU: no CUDA columns
    assert [dict(zip(columns, row, strict=True))["activations"] for row in rows] == [50, 51]
    assert {dict(zip(columns, row, strict=True))["predicted_peak"] for row in rows} == {90}


def test_an_offline_run_reads_back_whole_as_soon_as_it_is_logged(tmp_path):
    """wandb-core empties its transaction log's buffer after `finish()` returns; meshrun waits
    for it, so a resumed run's attempt read right after it (test_checkpoint) is whole. Before
    it did, about one run in six read back with no history here."""
    steps = [StepRow(step=s, loss=1.0, grad_norm=1.0, lr=0.1, step_time_s=0.5) for s in range(4)]
    for attempt in range(8):
        run_dir = tmp_path / f"run{attempt}"
        results = {
            "name": "n",
            "role": "run",
            "run_id": f"id{attempt}",
            "run_dir": str(run_dir),
            "status": "completed",
        }
        run = WandbRun(LoggerConfig(mode=LoggerMode.offline), {}, results, tokens_per_step=8)
        run.log_steps(steps)
        run.finish(results)
        logged = read_offline_run(run_dir)["history"]
        assert [h["_step"] for h in logged if "train/loss" in h] == [0, 1, 2, 3], attempt


def test_the_wandb_run_is_logged_while_the_run_trains(meshrun_here):
    """20 steps with a pause after each (3 s of training at least): the history's rows are
    written as rank 0 logs them, so their timestamps span the training, not its last second;
    every log step is there once, and the summary came after the last."""
    run = meshrun_here(
        *TINY[:2],
        "train.steps=20",
        "train.untimed_steps=1",
        "train.seq_len=32",
        "debug.slow_step_s=0.15",
        *TINY[-2:],
    )
    assert run.returncode == 0, run.output
    logged = read_offline_run(run.run_dir)
    rows = step_rows(logged)
    assert [h["_step"] for h in rows] == list(range(20))
    assert [h["train/loss"] for h in rows] == run.results["losses"]
    stamps = [h["_timestamp"] for h in rows]
    assert stamps == sorted(stamps)
    assert stamps[-1] - stamps[0] > 0.5 * 19 * 0.15, stamps  # all at the end: within a second
    assert logged["summary"]["tokens_per_s"] == run.results["tokens_per_s"]


def test_online_without_a_key_is_refused_before_launch_and_a_self_hosted_login_counts(
    tmp_path, monkeypatch
):
    """wandb's own places: WANDB_API_KEY, or the netrc entry `wandb login` writes for its host
    (WANDB_BASE_URL's, self-hosted); `auto` goes online only where one is found."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    netrc_file = tmp_path / "netrc"
    netrc_file.write_text("machine wandb.example.org login user password secret\n")
    netrc_file.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc_file))
    online = ("logger=wandb", "logger.mode=online")
    with pytest.raises(ConfigError) as refused:
        check_experiment(compose_config(*online))
    assert refused.value.key == "logger.mode"
    assert "no API key here" in str(refused.value) and "api.wandb.ai" in str(refused.value)
    assert resolve_mode(LoggerConfig(mode=LoggerMode["auto"])) == "offline"
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    check_experiment(compose_config(*online))
    assert resolve_mode(LoggerConfig(mode=LoggerMode["auto"])) == "online"
    monkeypatch.delenv("WANDB_BASE_URL")
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    check_experiment(compose_config(*online))
