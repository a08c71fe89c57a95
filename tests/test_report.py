"""`meshrun-report` pieces on rows written here (real runs' rows are in test_report_layouts
and test_sweep_grid): which runs a filter selects and in what order, what each plot draws,
memory by category where a run has the breakdown (and the peak alone where it has not), the
list of sweeps, and the command's errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from meshrun.core.record import MEMORY_CATEGORIES
from meshrun.driver.sinks.compare import cells, print_table
from meshrun.driver.sinks.selection import select_runs
from meshrun.driver.sinks.store import ResultsStore
from meshrun.driver.tool_config import RunFilter
from meshrun.tools.report import main as report_main
from meshrun.tools.report import plots
from meshrun.tools.report.budget_plot import budget_times
from meshrun.tools.report.html import render
from tests.cli import CliRun, run_console

MIB = 2**20


def row(run_id: str, name: str, devices: int, batch: int, micro: int, **fields) -> dict:
    base: dict[str, Any] = {
        "run_id": run_id,
        "role": "run",
        "created_at": "2026-01-02T03:04:05+00:00",
        "status": "completed",
        "error": None,
        "sweep": "s1",
        "model": "tiny",
        "data": "synthetic",
        "parallel": name,
        "layout_name": name,
        "layout": {"pp": 1, "dp_replicate": devices, "dp_shard": 1, "tp": 1},
        "world_size": devices,
        "devices": devices,
        "backend": "gloo",
        "global_batch_size": batch,
        "micro_batch_size": micro,
        "tokens_per_s": 1000.0 * devices,
        "speedup": 0.9 * devices,
        "scaling_efficiency": 0.9,
        "step_times": [0.02, 0.021, 0.022, 0.03],
        "losses": [5.0, 4.5, 4.2],
        "peak_memory_bytes": [64 * MIB] * devices,
        "peak_memory_max_bytes": 64 * MIB,
        "bubble_theoretical": None,
        "bubble_measured": None,
        "predicted_budget_s": 10.0 / devices,
        "measured_budget_s": 12.0 / devices,
    }
    return {**base, **fields}


def breakdown(ranks: int) -> list[dict[str, int]]:
    sizes = {"params": 4, "grads": 4, "optimizer": 8, "activations": 30, "other": 2}
    return [
        {"rank": r, "peak": 48 * MIB, **{k: v * MIB for k, v in sizes.items()}}
        for r in range(ranks)
    ]


@pytest.fixture
def runs() -> list[dict[str, Any]]:
    predicted = [{**b, "peak": 50 * MIB} for b in breakdown(2)]
    return [
        row("single1", "single", 1, 4, 1, memory_per_rank=None),  # an older row: peaks only
        row(
            "ddp1",
            "ddp2",
            2,
            8,
            2,
            memory_per_rank=breakdown(2),
            memory_predicted=predicted,
            speedup_p10=1.6,
            speedup_p90=1.9,
            speedup_rounds=4,
            parallel="ddp",
        ),
        row(
            "ddp2",
            "ddp2",
            2,
            8,
            4,
            tokens_per_s=2500.0,
            step_times=[0.3, 0.31, 0.33],
            parallel="ddp",
        ),
        # refused before its degrees were known: named by its preset, as the store has it
        row(
            "ddp3",
            "ddp",
            2,
            4,
            4,
            status="skipped",
            error="train.global_batch_size=4: ...",
            tokens_per_s=None,
            speedup=None,
            scaling_efficiency=None,
            peak_memory_bytes=None,
            step_times=[],
            losses=[],
            layout=None,
        ),
        row(
            "pp1",
            "pp2(1f1b, m=4)",
            2,
            8,
            2,
            bubble_theoretical=0.2,
            bubble_measured=0.35,
            bubble_per_rank=[0.3, 0.4],
            pp_schedule="1f1b",
            n_microbatches=4,
            memory_per_rank=[{"rank": 0, "peak": 40 * MIB}, {"rank": 1, "peak": 30 * MIB}],
            profiled_steps=[3, 4],
            profile=[traced_rank(0), traced_rank(1)],
        ),
    ]


def traced_rank(rank: int) -> dict[str, Any]:
    """A profiled pipeline rank's record (core/run_files/profiles.RankProfile.as_dict)."""
    shift = 2.0 * rank
    return {
        "rank": rank,
        "steps": 2,
        "step_s": 0.02,
        "compute_s": 0.012,
        "comm_s": 0.01,
        "overlapped_s": 0.004,
        "exposed_comm_s": 0.006,
        "idle_s": 0.002,
        "top_ops": [["aten::mm", 0.006]],
        "timeline": {
            "start_ms": 1000.0 + shift,
            "length_ms": 10.0,
            "compute": [[0.0, 3.0], [5.0, 8.0]],
            "comm": [[2.0, 6.0]],
            "micro_batches": [[0.0, 3.0, f"F0 s{rank}"], [5.0, 8.0, f"B0 s{rank}"]],
        },
    }


def page(runs: list[dict[str, Any]]) -> str:
    return render(select_runs(runs, RunFilter()), "t", "sel")


def runs_table(html: str) -> str:
    return html.split('<table id="runs">', maxsplit=1)[1].split("</table>", maxsplit=1)[0]


def test_page_lists_every_run_and_has_every_plot(runs):
    html = page(runs)
    for run in runs:
        assert f'data-run-id="{run["run_id"]}"' in html
    assert html.count('<tr class="skipped"') == 1
    assert "train.global_batch_size=4: ..." in html  # the reason
    # speedup, step times, losses, memory, bubble, the traced step, the budget, heatmap
    assert html.count("data:image/png;base64,") == 8
    assert 'class="empty"' not in html
    # one sweep: said once above the table, not in a column of its own
    assert "<th>sweep</th>" not in runs_table(html) and "sweep: s1, every run" in html
    two = page([*runs, row("x", "fsdp2", 2, 8, 2, sweep="s2")])
    assert "<th>sweep</th>" in runs_table(two) and "every run" not in two


def test_runs_of_one_layout_are_shown_together_in_the_order_the_layouts_first_ran():
    rows = [row("a", "ddp2", 2, 8, 2), row("b", "fsdp2", 2, 8, 2), row("c", "ddp2", 2, 8, 4)]
    assert [r["run_id"] for r in select_runs(rows, RunFilter()).runs] == ["a", "c", "b"]


def test_a_preset_overridden_into_another_layout_files_under_that_layout():
    """An 8-rank ddp run overridden to pp2 x fsdp2 x tp2 is that layout, not `ddp`."""
    odd = row(
        "odd",
        "pp2(1f1b, m=4) x fsdp2 x tp2",
        8,
        8,
        1,
        parallel="ddp",
        layout={"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 2},
    )
    plain = row(
        "plain",
        "ddp8",
        8,
        8,
        1,
        parallel="ddp",
        layout={"pp": 1, "dp_replicate": 8, "dp_shard": 1, "tp": 1},
    )

    def chosen(layout: str) -> list[str]:
        return [r["run_id"] for r in select_runs([odd, plain], RunFilter(layout=layout)).runs]

    assert chosen("ddp") == ["plain"]
    assert chosen("pp2(1f1b, m=4) x fsdp2 x tp2") == ["odd"]
    assert cells(odd)["layout"] == "pp2(1f1b, m=4) x fsdp2 x tp2"


def test_speedup_plot_draws_the_spread_and_the_ideal(runs):
    ax = plots.speedup(runs).axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert [label.split("  ")[0] for label in labels] == [
        "single",
        "ddp2",
        "ddp2",
        "pp2(1f1b, m=4)",
    ]
    assert sorted(t.get_text() for t in ax.texts) == ["0.90x", "1.80x", "1.80x", "1.80x"]
    [spread] = ax.containers  # ddp1's whiskers: the only run with rounds
    (segment,) = spread.lines[2][0].get_segments()
    assert [x for x, _ in segment] == pytest.approx([1.6, 1.9])
    ideals = [line.get_xdata()[0] for line in ax.get_lines() if line.get_color() == "#555"]
    assert ideals == [1, 2, 2, 2]


def test_a_speedup_outside_its_rounds_spread_is_drawn_where_it_is(runs):
    """A bimodal run: the ratio of the medians' throughputs below every round's but one
    (a report crashed on matplotlib's negative error bar)."""
    [ddp1] = [r for r in runs if r["run_id"] == "ddp1"]
    ddp1.update(speedup=1.2, speedup_p10=1.6, speedup_p90=1.9)
    ax = plots.speedup(runs).axes[0]
    [spread] = ax.containers
    (segment,) = spread.lines[2][0].get_segments()
    assert [x for x, _ in segment] == pytest.approx([1.6, 1.9])
    assert 1.2 in [line.get_xdata()[0] for line in ax.get_lines()]


def test_step_times_plot_has_a_box_per_run_on_a_log_axis_when_they_differ_widely(runs):
    ax = plots.step_times(runs).axes[0]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert len(labels) == 4 and not any("ddp3" in label for label in labels)  # skipped: none
    assert ax.get_xscale() == "log"  # ddp2's 0.3 s beside 0.02 s
    assert ax.get_xlabel().startswith("step time (ms")
    alike = [r for r in runs if r["run_id"] != "ddp2"]
    assert plots.step_times(alike).axes[0].get_xscale() == "linear"


def test_loss_curves_have_a_line_per_run_and_the_legend_outside_the_axes(runs):
    fig = plots.loss_curves(runs)
    ax = fig.axes[0]
    assert ax.get_legend() is None and len(fig.legends) == 1
    assert len(fig.legends[0].get_texts()) == len(ax.get_lines()) == 4
    assert all(list(line.get_ydata()) == [5.0, 4.5, 4.2] for line in ax.get_lines())


def test_memory_plot_stacks_the_categories_and_marks_the_prediction(runs):
    fig = plots.memory_per_rank(runs)
    ax = fig.axes[0]
    labels = {text.get_text() for text in fig.legends[0].get_texts()}
    # "peak": the rows without a breakdown (single1's, pp1's); the prediction is ddp1's
    assert labels == {*MEMORY_CATEGORIES, "peak", "predicted peak"}
    bars = {c.get_label(): [p.get_width() for p in c.patches] for c in ax.containers}
    ranks = [t.get_text() for t in ax.get_yticklabels()]
    assert len(ranks) == 1 + 2 + 2 + 2  # single1, ddp1, ddp2, pp1; per rank
    ddp1 = [i for i, label in enumerate(ranks) if "ddp1" in label]
    assert [bars["activations"][i] for i in ddp1] == [30.0, 30.0]
    assert all(bars["peak"][i] == 0 for i in ddp1)  # ddp1 has the breakdown instead
    pp1 = [i for i, label in enumerate(ranks) if "pp1" in label]
    assert [bars["peak"][i] for i in pp1] == [40.0, 30.0]


def test_memory_plot_of_rows_without_the_breakdown_shows_the_peak_alone(runs):
    fig = plots.memory_per_rank([r for r in runs if r["run_id"] in ("single1", "pp1")])
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["peak"]


def test_heatmap_has_throughput_per_point_and_marks_the_skipped_one(runs):
    """The skipped point, whose layout was never named, is on its preset's map."""
    [ax, _colourbar] = plots.throughput_heatmaps(runs).axes
    assert ax.get_title() == "tiny / ddp2"
    texts = sorted(t.get_text() for t in ax.texts)
    assert texts == sorted(["2,000", "2,500", "skipped"])
    # a grid where no point completed has no throughput to map
    skipped = [{**r, "tokens_per_s": None, "status": "skipped"} for r in runs]
    assert plots.throughput_heatmaps(skipped) is None


def test_bubble_plot_puts_measured_beside_theory_and_each_rank(runs):
    ax = plots.bubble(runs).axes[0]
    widths = {c.get_label(): [p.get_width() for p in c.patches] for c in ax.containers}
    assert next(v for k, v in widths.items() if k.startswith("measured")) == [0.35]
    assert next(v for k, v in widths.items() if k.startswith("theory")) == [0.2]
    [ranks] = [line for line in ax.get_lines() if line.get_marker() == "o"]
    assert list(ranks.get_xdata()) == [0.3, 0.4]


def test_the_budget_plot_has_a_point_a_run_beside_the_line_where_plan_and_run_agree(runs):
    fig = budget_times(runs)
    (ax,) = fig.axes
    points = [tuple(xy) for c in ax.collections for xy in c.get_offsets()]
    completed = [r for r in runs if r["status"] == "completed"]
    assert sorted(points) == sorted(
        (r["predicted_budget_s"], r["measured_budget_s"]) for r in completed
    )
    assert len(ax.collections) == len({r["layout_name"] for r in completed})  # one a layout
    assert any(line.get_label() == "measured = predicted" for line in ax.lines)


def test_plots_without_data_are_left_out():
    lone = row(
        "a", "ddp2", 2, 8, 2, speedup=None, step_times=[], losses=[], predicted_budget_s=None
    )
    for plot in (
        plots.speedup,
        plots.step_times,
        plots.loss_curves,
        plots.bubble,
        plots.throughput_heatmaps,
        budget_times,
    ):
        assert plot([lone]) is None, plot.__name__
    html = page([lone])
    assert "No completed pipeline-parallel run." in html and "No run with losses." in html


def test_sweeps_are_listed_with_the_one_latest_picked():
    newer = "2026-01-03T00:00:00+00:00"
    rows = [
        row("a", "ddp2", 2, 8, 2, sweep="old"),
        row("b", "ddp2", 2, 8, 2, sweep="new", created_at=newer),
    ]
    picked = select_runs(rows, RunFilter(sweep="latest"))
    assert picked.sweep == "new" and [r["run_id"] for r in picked.runs] == ["b"]
    html = render(picked, "t", "sel")
    listed = html[html.index('<table id="sweeps">') :]
    assert listed.index('data-sweep="new"') < listed.index('data-sweep="old"')  # newest first
    assert '<td class="mark">sweep=latest, shown</td>' in listed
    assert '<td class="mark"></td>' in listed  # old: neither


def test_terminal_table_says_shared_values_once_and_flags_under_it(runs, capsys):
    flagged = [*runs[:2], {**runs[2], "flags": ["efficiency 1.3 above 1 + noise 0.1"]}]
    print_table(flagged, "t")
    out = capsys.readouterr().out
    assert "model tiny, data synthetic, backend gloo" in out
    assert "⚠ ddp2 (ddp2): efficiency 1.3 above 1 + noise 0.1" in out


def report(tmp_path: Path, *overrides: str) -> CliRun:
    """`meshrun-report <overrides>` (its console script's main, in this process)."""
    return run_console(report_main.main, tmp_path / "out", None, *overrides, defaults=())


def test_report_errors(tmp_path):
    missing = report(tmp_path, f"store.path={tmp_path / 'none.db'}")
    assert missing.returncode == 2
    assert "store.path=" in missing.output and "no results store there" in missing.output
    assert not (tmp_path / "none.db").exists()
    store = tmp_path / "meshrun.db"
    ResultsStore(store).record(row("a", "ddp2", 2, 8, 2))
    cases = {
        ("since=yesterday",): "since='yesterday': not a date",
        ("html=true",): "not an .html file path",
        (f"html={tmp_path}",): "is a directory",
        ("sweep=s2",): "sweep='s2': no sweep of that name in the store",
        ("model=tiyn",): "tiny (nearest)",
        ("layout=dpp2",): "ddp2 (nearest)",
    }
    for overrides, message in cases.items():
        bad = report(tmp_path, f"store.path={store}", *overrides)
        assert bad.returncode == 2 and message in bad.output, (overrides, bad.output)
    nothing = report(tmp_path, f"store.path={store}", "model=tiny", "until=2020-01-01")
    assert nothing.returncode == 1
    assert "no runs" in nothing.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["meshrun.db", "out"]
    assert list((tmp_path / "out").iterdir()) == []  # no page, no .hydra, no log
