"""`meshrun-report` on a store of real runs of five layouts (ddp, ddp_bucket_view, fsdp,
dp2_tp2, pp2), written by one `meshrun -m` sweep on the session's rank pool: the sweep prints
its comparison table when it ends; the report groups by canonical layout name (five of them,
not the presets' names), draws each run's loss curve and step-time distribution, writes
nothing unless `html=` asks, and its page fits a 1400 px Chromium window."""

from __future__ import annotations

import subprocess
import sys

import matplotlib.image
import pytest
from matplotlib.text import Text

from meshrun.driver import cli
from meshrun.driver.sinks.compare import FLAG, cells
from meshrun.tools.report import main as report_main
from meshrun.tools.report import plots
from tests.chromium import loaded_dom, needs_chromium, screenshot
from tests.cli import run_console

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
PRESETS = ("ddp", "ddp_bucket_view", "fsdp", "dp2_tp2", "pp2")
LAYOUTS = {"ddp2", "ddp2(bucket-view)", "fsdp2", "fsdp-replicate2 x tp2", "pp2(1f1b, m=2)"}
POINT = (
    "model=tiny",
    "train.steps=5",
    "train.untimed_steps=1",
    "train.global_batch_size=8",
    "train.micro_batch_size=4",
    "train.seq_len=32",
    "metrics.baseline=off",
)
SWEEP = "five-layouts"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, rank_pool):
    """`meshrun -m parallel=<the five>` in this process, its ranks on the pool."""
    tmp = tmp_path_factory.mktemp("layouts")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cli, "launch", rank_pool.launch)
        patch.chdir(tmp)
        run = run_console(
            cli.main,
            tmp / "unused",
            tmp / "meshrun.db",
            f"parallel={','.join(PRESETS)}",
            f"hydra.sweep.dir={tmp / SWEEP}",
            *POINT,
            multirun=True,
        )
    assert run.returncode == 0, run.output
    return run


def layout_in(label: Text) -> str:
    """The layout name a plot's run label starts with (after the flag of a flagged run)."""
    return label.get_text().removeprefix(f"{FLAG} ").split("  ")[0]


def report(tmp_path, monkeypatch, store, *overrides: str):
    """`meshrun-report` as a user runs it, in an empty working directory."""
    monkeypatch.chdir(tmp_path)
    return run_console(
        report_main.main, tmp_path, None, f"store.path={store}", *overrides, defaults=()
    )


@pytest.mark.slow
def test_sweep_prints_its_comparison_table_when_it_ends(sweep):
    rows = sweep.stored()
    assert {r["layout_name"] for r in rows} == LAYOUTS
    closing = sweep.output[sweep.output.index(f"sweep {SWEEP}: 5 runs") :]
    for row in rows:
        assert row["run_id"] in closing and row["layout_name"] in closing
    assert f"meshrun-report sweep={SWEEP} html={SWEEP}.html" in closing


@pytest.mark.slow
def test_report_without_html_prints_and_writes_nothing(sweep, tmp_path):
    """Run as a user runs it (no hydra.run.dir given), in an empty working directory."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshrun.tools.report.main",
            f"store.path={sweep.store_path}",
            "sweep=latest",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert f"sweep=latest ({SWEEP})" in output  # which sweep `latest` picked
    assert all(row["run_id"] in output for row in sweep.stored())
    assert "add html=<file>.html" in output
    assert list(tmp_path.iterdir()) == []


def test_report_page_has_five_layouts_loss_curves_and_step_times(sweep, tmp_path, monkeypatch):
    run = report(tmp_path, monkeypatch, sweep.store_path, "sweep=latest", "html=cmp.html")
    assert run.returncode == 0, run.output
    assert [p.name for p in tmp_path.iterdir()] == ["cmp.html"]
    html = (tmp_path / "cmp.html").read_text()
    sections = {part.split('"', 1)[0]: part for part in html.split('<section id="')[1:]}
    for drawn in ("step-times", "losses", "memory", "bubble"):
        assert "data:image/png;base64," in sections[drawn], drawn
    for header in ("layout", "data", "schedule", "micro-batches", "backend"):
        assert f"<th>{header}</th>" in html, header
    rows = sweep.stored()
    for row in rows:
        assert f'data-run-id="{row["run_id"]}"' in html
    assert {cells(row)["layout"] for row in rows} == LAYOUTS
    [pp] = [cells(r) for r in rows if r["parallel"] == "pp2"]
    assert (pp["schedule"], pp["micro-batches"]) == ("1f1b", "2")
    # each run's curve and step-time box, labelled with its layout name
    legend = plots.loss_curves(rows).legends[0].get_texts()
    assert sorted(map(layout_in, legend)) == sorted(LAYOUTS)
    boxes = plots.step_times(rows).axes[0]
    assert sorted(map(layout_in, boxes.get_yticklabels())) == sorted(LAYOUTS)


@needs_chromium
def test_report_page_fits_1400_px_in_headless_chromium(sweep, tmp_path, monkeypatch):
    report(tmp_path, monkeypatch, sweep.store_path, "html=cmp.html")
    page, png = tmp_path / "cmp.html", tmp_path.parent / f"{tmp_path.name}.png"
    screenshot(page, png, height=4000)
    pixels = matplotlib.image.imread(png)
    assert pixels.std() > 0.05  # not a blank page
    _, images, width = loaded_dom(page, width=1400)
    assert width <= 1400, f"the page is {width} px wide: something overflows the window"
    # no speedup (metrics.baseline=off) and no heatmap (one batch point)
    assert [img["alt"] for img in images] == [
        "Step-time distributions",
        "Loss curves",
        "Memory per rank by category",
        "Pipeline bubble: measured vs theory",
        "The plan kept honest: the run's budget, predicted vs measured",
    ]
    assert all(img["complete"] and 0 < img["width"] <= 1400 for img in images), images
