"""W&B is a mirror of the run, never its keeper: when W&B fails for real, meshrun warns and
the run is still in the store and results.json. The per-rank memory table takes the measured
breakdown (and the prediction) where a run has them, else the peaks."""

from __future__ import annotations

from meshrun.driver.sinks.wandb_sink import memory_rows, run_tags

TINY = ("model=tiny", "parallel=single", "train.steps=3", "train.untimed_steps=1",
        "train.seq_len=32", "logger=wandb", "logger.mode=offline")  # fmt: skip


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
    results = {"layout_name": "fsdp2 x tp2", "model": "tiny", "hardware": "cpu",
               "backend": "gloo"}  # fmt: skip
    assert run_tags(results) == ["layout:fsdp2 x tp2", "model:tiny", "hardware:cpu",
                                 "backend:gloo"]  # fmt: skip
    assert run_tags({**results, "status": "skipped"})[-1] == "skipped"


def test_memory_table_without_a_breakdown_has_the_peaks():
    assert memory_rows({"peak_memory_bytes": [10, 20]}) == (["rank", "peak"], [[0, 10], [1, 20]])
    assert memory_rows({"peak_memory_bytes": None}) == (["rank", "peak"], [])


def test_memory_table_with_a_breakdown_and_prediction():
    measured = [{"rank": r, "peak": 100 + r, "params": 10, "grads": 10, "optimizer": 20,
                 "activations": 50 + r, "other": 10} for r in (0, 1)]  # fmt: skip
    predicted = [{**m, "peak": 90} for m in measured]
    columns, rows = memory_rows({"memory_per_rank": measured, "memory_predicted": predicted})
    assert columns[:7] == ["rank", "peak", "params", "grads", "optimizer", "activations", "other"]
    assert "predicted_peak" in columns and "allocated" not in columns  # CPU: no CUDA columns
    assert [dict(zip(columns, row, strict=True))["activations"] for row in rows] == [50, 51]
    assert {dict(zip(columns, row, strict=True))["predicted_peak"] for row in rows} == {90}
