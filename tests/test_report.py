"""`meshrun-report` pieces on rows written here (real runs' rows are in test_sweep_grid):
which plots show what, memory by category where a run has the breakdown (and the peak alone
where an older row has not), and the command's errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from meshrun.driver.sinks.store import ResultsStore
from meshrun.tools.report import main as report_main
from meshrun.tools.report import plots
from meshrun.tools.report.html import render
from tests.cli import CliRun, run_console

MIB = 2**20
CATEGORIES = ("params", "grads", "optimizer", "activations", "other")


def row(run_id: str, parallel: str, devices: int, batch: int, micro: int, **fields) -> dict:
    base: dict[str, Any] = {
        "run_id": run_id, "role": "run", "created_at": "2026-01-02T03:04:05+00:00",
        "status": "completed", "error": None, "sweep": "s1", "model": "tiny",
        "parallel": parallel, "layout_name": parallel, "world_size": devices,
        "devices": devices, "backend": "gloo", "global_batch_size": batch,
        "micro_batch_size": micro, "tokens_per_s": 1000.0 * devices,
        "speedup": 0.9 * devices, "scaling_efficiency": 0.9,
        "peak_memory_bytes": [64 * MIB] * devices, "peak_memory_max_bytes": 64 * MIB,
        "bubble_theoretical": None, "bubble_measured": None,
    }  # fmt: skip
    return {**base, **fields}


def breakdown(ranks: int) -> list[dict[str, int]]:
    sizes = {"params": 4, "grads": 4, "optimizer": 8, "activations": 30, "other": 2}
    return [{"rank": r, "peak": 48 * MIB, **{k: v * MIB for k, v in sizes.items()}}
            for r in range(ranks)]  # fmt: skip


@pytest.fixture
def runs() -> list[dict[str, Any]]:
    predicted = [{**b, "peak": 50 * MIB} for b in breakdown(2)]
    return [
        row("single1", "single", 1, 4, 1),  # an older row: no breakdown
        row("ddp1", "ddp", 2, 8, 2, memory_per_rank=breakdown(2), memory_predicted=predicted),
        row("ddp2", "ddp", 2, 8, 4, tokens_per_s=2500.0),
        row("ddp3", "ddp", 2, 4, 4, status="skipped", error="train.global_batch_size=4: ...",
            tokens_per_s=None, speedup=None, scaling_efficiency=None, peak_memory_bytes=None),
        row("pp1", "pp2", 2, 8, 1, bubble_theoretical=0.2, bubble_measured=0.35,
            pp_schedule="1f1b", n_microbatches=4),
    ]  # fmt: skip


def test_page_lists_every_run_and_has_all_four_plots(runs):
    html = render(runs, "t", "sel")
    for run in runs:
        assert f'data-run-id="{run["run_id"]}"' in html
    assert html.count('<tr class="skipped"') == 1
    assert "train.global_batch_size=4: ..." in html  # the reason
    assert html.count("data:image/png;base64,") == 4
    assert 'class="empty"' not in html


def test_memory_plot_stacks_the_categories_and_marks_the_prediction(runs):
    ax = plots.memory_per_rank(runs).axes[0]
    labels = {text.get_text() for text in ax.get_legend().get_texts()}
    # "peak": the older row's bars (the skipped row has none); the prediction is ddp1's
    assert labels == {*CATEGORIES, "peak", "predicted peak"}
    bars = {c.get_label(): [p.get_width() for p in c.patches] for c in ax.containers}
    ranks = [t.get_text() for t in ax.get_yticklabels()]
    assert len(ranks) == 1 + 2 + 2 + 2  # single, ddp1, ddp2, pp1; per rank
    ddp1 = [i for i, label in enumerate(ranks) if "(ddp1)" in label]
    assert [bars["activations"][i] for i in ddp1] == [30.0, 30.0]
    assert all(bars["peak"][i] == 0 for i in ddp1)  # ddp1 has the breakdown instead


def test_memory_plot_of_older_rows_shows_the_peak_alone(runs):
    old = [r for r in runs if "memory_per_rank" not in r and r["status"] == "completed"]
    ax = plots.memory_per_rank(old).axes[0]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["peak"]


def test_heatmap_has_throughput_per_point_and_marks_the_skipped_one(runs):
    ax = plots.throughput_heatmaps(runs).axes[0]
    assert ax.get_title() == "tiny / ddp"
    texts = sorted(t.get_text() for t in ax.texts)
    assert texts == sorted(["2,000", "2,500", "skipped"])


def test_bubble_plot_puts_measured_beside_theory(runs):
    ax = plots.bubble(runs).axes[0]
    heights = {c.get_label(): [p.get_height() for p in c.patches] for c in ax.containers}
    assert heights["measured"] == [0.35]
    assert next(v for k, v in heights.items() if k.startswith("theory")) == [0.2]


def test_speedup_plot_has_a_line_per_layout(runs):
    speed_ax, eff_ax = plots.speedup_scaling(runs).axes[:2]
    assert {line.get_label() for line in speed_ax.get_lines()} == {"single", "ddp", "pp2",
                                                                     "ideal"}  # fmt: skip
    ddp = next(line for line in eff_ax.get_lines() if line.get_label() == "ddp")
    assert list(ddp.get_ydata()) == [pytest.approx(0.9)]  # skipped ddp3 is not a point


def test_plots_without_data_are_left_out():
    assert plots.bubble([row("a", "ddp", 2, 8, 2)]) is None
    assert plots.throughput_heatmaps([row("a", "ddp", 2, 8, 2)]) is None
    html = render([row("a", "ddp", 2, 8, 2)], "t", "sel")
    assert "No completed pipeline-parallel run." in html


def report(tmp_path: Path, *overrides: str) -> CliRun:
    """`meshrun-report <overrides>` (its console script's main, in this process)."""
    return run_console(report_main.main, tmp_path / "out", None, *overrides, defaults=())


def test_report_errors(tmp_path):
    missing = report(tmp_path, f"store.path={tmp_path / 'none.db'}")
    assert missing.returncode == 2
    assert "store.path=" in missing.output and "no results store there" in missing.output
    assert not (tmp_path / "none.db").exists()
    store = tmp_path / "meshrun.db"
    ResultsStore(store).record(row("a", "ddp", 2, 8, 2))
    bad_date = report(tmp_path, f"store.path={store}", "since=yesterday")
    assert bad_date.returncode == 2
    assert "since='yesterday': not a date" in bad_date.output
    nothing = report(tmp_path, f"store.path={store}", "model=llama-7b")
    assert nothing.returncode == 1
    assert "no runs" in nothing.output
    assert not (tmp_path / "out" / "report.html").exists()
