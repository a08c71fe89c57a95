"""The ready batch x micro-batch sweep, end to end on CPU: one `meshrun -m` command runs the
3x3 grid, every point lands in the store (invalid ones as skipped, with the reason) and in its
own offline W&B run, all in one group; `meshrun-report` compares them on a page that headless
Chromium renders with every run listed and every image loaded."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import matplotlib.image
import pytest
from omegaconf import OmegaConf

from meshrun.core.errors import ConfigError
from meshrun.driver.sinks.selection import select_runs
from meshrun.driver.sinks.store import ResultsStore
from meshrun.driver.sweep import SWEEPS_DIR
from meshrun.driver.tool_config import RunFilter
from tests.chromium import loaded_dom, needs_chromium, screenshot
from tests.cli import MULTIRUN, run_meshrun
from tests.helpers import resolved_config
from tests.wandb_records import read_offline_run, read_table

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # the sweep: ~30 s here
# A sweep's jobs run in one driver: with forkserver their ranks (and baselines) fork from one
# server that imported torch once (spawn is every other CLI test's start method).
POINT = (
    "model=tiny",
    "train.steps=3",
    "train.untimed_steps=1",
    "train.seq_len=32",
    "launcher.start_method=forkserver",
)
PARAMS = OmegaConf.load(SWEEPS_DIR / "batch_microbatch.yaml").hydra.sweeper.params


def grid() -> list[tuple[int, int]]:
    """The (global batch, micro-batch) points the sweep file declares."""
    values = [
        [int(v) for v in str(PARAMS[key]).split(",")]
        for key in ("train.global_batch_size", "train.micro_batch_size")
    ]
    return list(itertools.product(*values))


def skip_reason(batch: int, micro: int) -> str | None:
    """What meshrun's validation says of the point on this host: None if it is valid."""
    try:
        resolved_config(
            *POINT, f"train.global_batch_size={batch}", f"train.micro_batch_size={micro}"
        )
    except ConfigError as err:
        return str(err)
    return None


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sweep")
    overrides = ("+sweeps=batch_microbatch", *POINT, "logger=wandb", "logger.mode=offline")
    # the store where a user's sweep puts it (store.path's default, under the working
    # directory: resolved through Hydra's config, which the sweep's end must set itself)
    run = run_meshrun(tmp / "unused", None, *overrides, timeout=900, entrypoint=MULTIRUN)
    run = dataclasses.replace(run, store_path=tmp / "outputs" / "meshrun.db")
    print(f"3x3 sweep took {run.seconds:.0f} s")
    assert run.returncode == 0, run.output
    rows = [r for r in run.stored() if r["role"] == "run"]
    return run, rows


def test_every_grid_point_is_a_row_invalid_ones_skipped_with_the_reason(sweep):
    run, rows = sweep
    assert len(grid()) == 9
    assert sorted((r["global_batch_size"], r["micro_batch_size"]) for r in rows) == sorted(grid())
    [name] = {r["sweep"] for r in rows}
    assert name.startswith("batch_microbatch_")
    expected = {point: skip_reason(*point) for point in grid()}
    assert any(expected.values()) and not all(expected.values())  # the grid has both kinds
    for row in rows:
        reason = expected[(row["global_batch_size"], row["micro_batch_size"])]
        if reason:
            assert (row["status"], row["error"]) == ("skipped", reason)
            assert f"skipped {reason}" in run.output
        else:
            assert row["status"] == "completed", row["error"]
            assert row["tokens_per_s"] > 0 and row["speedup"] > 0
    # The sweep ends with its comparison table: every point, the skipped ones' reasons under it.
    closing = run.output[run.output.index(f"sweep {name}: 9 runs") :]
    assert all(row["run_id"] in closing for row in rows)
    # The baselines measured for the speedups belong to the sweep too.
    baselines = [r for r in run.stored() if r["role"] == "baseline"]
    assert baselines and {r["sweep"] for r in baselines} == {name}


def test_one_offline_wandb_run_per_point_all_in_the_sweeps_group(sweep):
    run, rows = sweep
    by_dir = {Path(r["run_dir"]): r for r in rows}
    wandb_dirs = {p.parents[1] for p in run.run_dir.parent.glob("multirun/*/*/wandb/offline-run-*")}
    assert wandb_dirs == set(by_dir)  # one W&B run per point, none per rank or baseline
    for run_dir, row in by_dir.items():
        logged = read_offline_run(run_dir)
        assert logged["run"]["group"] == row["sweep"]
        assert {
            f"model:{row['model']}",
            f"backend:{row['backend']}",
            f"hardware:{row['hardware']}",
        } <= set(logged["run"]["tags"])
        assert logged["summary"]["status"] == row["status"]
        assert logged["summary"]["sweep"] == row["sweep"]
        if row["status"] == "skipped":
            assert logged["summary"]["error"] == row["error"]
            assert "skipped" in logged["run"]["tags"]
            continue
        assert f"layout:{row['layout_name']}" in logged["run"]["tags"]
        assert logged["summary"]["tokens_per_s"] == pytest.approx(row["tokens_per_s"])
        table = read_table(logged, "memory/per_rank")
        logged_ranks = [dict(zip(table["columns"], r, strict=True)) for r in table["data"]]
        # the measured breakdown where the run has one, else the peaks alone
        expected = row.get("memory_per_rank") or [
            {"rank": rank, "peak": peak} for rank, peak in enumerate(row["peak_memory_bytes"])
        ]
        assert len(logged_ranks) == len(expected) == row["world_size"]
        assert {"rank", "peak"} <= set(table["columns"])
        for got, want in zip(logged_ranks, expected, strict=True):
            assert all(got[k] == want[k] for k in want if k in got), (got, want)


def test_report_filters_the_real_rows(sweep):
    run, rows = sweep
    stored = ResultsStore(run.store_path).runs()
    name = rows[0]["sweep"]
    today = datetime.now(timezone.utc).date()

    def count(**kw) -> int:
        return len(select_runs(stored, RunFilter(**kw)).runs)

    assert count() == count(sweep=name) == count(sweep="latest") == len(rows) == 9
    assert count(model="tiny") == 9 and count(model="small") == 0
    assert count(layout="ddp") == 9  # the preset, completed and skipped alike
    completed = [r for r in rows if r["status"] == "completed"]
    [layout_name] = {r["layout_name"] for r in completed}  # e.g. ddp2
    assert count(layout=layout_name) == len(completed)
    assert count(since=str(today - timedelta(days=1)), until=str(today + timedelta(days=1))) == 9
    assert count(until=str(today - timedelta(days=1))) == 0
    assert count(since=str(today + timedelta(days=1))) == 0
    assert count(baselines=True) > 9
    assert count(sweep="no-such-sweep") == 0


@pytest.fixture(scope="module")
def report(sweep):
    run, rows = sweep
    out = run.run_dir.parent / "report"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshrun.tools.report.main",
            f"store.path={run.store_path}",
            f"sweep={rows[0]['sweep']}",
            f"html={out}/report.html",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=out.parent,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, out / "report.html", rows


def test_report_lists_every_run_in_the_terminal_and_the_page(report):
    output, page, rows = report
    html = page.read_text()
    for row in rows:
        assert row["run_id"] in output
        assert f'data-run-id="{row["run_id"]}"' in html
    assert html.count('class="skipped"') == sum(r["status"] == "skipped" for r in rows)
    # speedup, step times, losses, memory, heatmap, the budget predicted vs measured; no pipeline
    assert html.count("data:image/png;base64,") == 6
    assert "No completed pipeline-parallel run." in html
    assert "http://" not in html and "https://" not in html  # self-contained


@needs_chromium
def test_report_page_renders_in_headless_chromium(report, tmp_path):
    _, page, rows = report
    png = tmp_path / "report.png"
    screenshot(page, png)
    pixels = matplotlib.image.imread(png)
    assert pixels.shape[0] > 1000 and pixels.std() > 0.05  # not a blank page
    dom, images, width = loaded_dom(page)
    assert width <= 1400, f"the page is {width} px wide: something overflows a 1400 px window"
    assert sorted(r["run_id"] for r in rows) == sorted(
        line.split('data-run-id="')[1].split('"')[0]
        for line in dom.split("<tr")[1:]
        if 'data-run-id="' in line
    )
    assert len(images) == 6
    assert all(img["complete"] and img["width"] > 0 for img in images), images
