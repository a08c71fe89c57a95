"""Inside a step (issue 35): a profiled run's traces per rank with meshrun's phases, their
split into compute / communication / idle, the timeline picture in the run dir and the
report, the slow rank named against the others, and the inspection keys' config errors."""

from __future__ import annotations

import gzip
import json
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import matplotlib.image
import pytest
import torch

from meshrun.core.errors import ConfigError
from meshrun.core.rank_report import RankReport
from meshrun.core.record import RunRecord
from meshrun.core.run_files.metrics import StepRow
from meshrun.core.run_files.profiles import TIMELINE_FILE, summarize, trace_path
from meshrun.driver.inspection import MIN_JUDGED_STEPS, straggler_fields
from meshrun.driver.results import assemble
from meshrun.rank.metrics.busy import busy_fields
from meshrun.tools.plan.matmul_in_step import MATMUL_OPS
from meshrun.tools.report import main as report_main
from meshrun.validate.inspection import check_inspection
from tests.chromium import loaded_dom, needs_chromium, screenshot
from tests.cli import run_console
from tests.helpers import compose_config
from tests.wandb_records import read_offline_run, read_table

pytestmark = pytest.mark.timeout(300)
SHORT = ("model=tiny", "train.steps=7", "train.untimed_steps=2", "metrics.baseline=off")


@pytest.fixture(scope="module")
def profiled(tmp_path_factory, rank_pool) -> tuple[RunRecord, Path]:
    """A pp2 run with steps 3 and 4 traced, logged to W&B offline; its record and store."""
    from meshrun.driver import cli  # noqa: PLC0415 (the pool's launcher patched in below)

    tmp = tmp_path_factory.mktemp("profiled")
    launch = cli.launch
    cli.launch = rank_pool.launch
    try:
        run = run_console(
            cli.main, tmp / "run", tmp / "meshrun.db", *SHORT, "parallel=pp2",
            "debug.profile_steps=[3,4]", "logger=wandb", "logger.mode=offline",
        )  # fmt: skip
    finally:
        cli.launch = launch
    assert run.returncode == 0, run.output
    return RunRecord.from_dict(json.loads((tmp / "run" / "results.json").read_text())), tmp


def _events(run_dir: str, rank: int) -> list[dict]:
    with gzip.open(trace_path(run_dir, rank), "rt") as f:
        return json.load(f)["traceEvents"]


def test_profiled_pipeline_leaves_a_trace_per_rank_with_meshruns_phases(profiled):
    record, _ = profiled
    for rank in (0, 1):
        names = {e.get("name") for e in _events(record.run_dir, rank)}
        assert {"meshrun:step 3", "meshrun:step 4"} <= names
        assert "meshrun:step 2" not in names and "meshrun:step 5" not in names
        assert {"meshrun:data", "meshrun:optimizer", "meshrun:all_reduce (gradient norm)"} <= names
        # the pipeline's micro-batches of this rank's stage, each collective gloo ran
        assert {f"meshrun:forward stage {rank} mb {i}" for i in range(4)} <= names
        assert {f"meshrun:backward stage {rank} mb {i}" for i in range(4)} <= names
        assert {"gloo:send", "gloo:recv", "gloo:all_reduce"} <= names


def test_profile_splits_each_ranks_steps_into_compute_communication_idle(profiled):
    record, _ = profiled
    assert record.inspection.profiled_steps == [3, 4]
    assert [p["rank"] for p in record.inspection.profile] == [0, 1]
    for p in record.inspection.profile:
        assert p["steps"] == 2
        whole = p["compute_s"] + p["exposed_comm_s"] + p["idle_s"]
        assert whole == pytest.approx(p["step_s"], rel=1e-6)
        assert 0 < p["overlapped_s"] <= min(p["compute_s"], p["comm_s"])
        # the matmuls' own time is compute, however long the host kept the ranks waiting
        matmuls = sum(t for name, t in p["top_ops"] if name in MATMUL_OPS)
        assert 0 < matmuls <= p["compute_s"]
        boxes = p["timeline"]["micro_batches"]
        assert [b[2] for b in boxes if b[2].startswith("F")] == [
            f"F{i} s{p['rank']}" for i in range(4)
        ]


def test_profiled_steps_are_left_out_of_the_timing_and_their_overhead_reported(profiled):
    record, _ = profiled
    lines = Path(record.run_dir, "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines]
    assert [s["step"] for s in steps if s.get("profiled")] == [3, 4]
    assert [s["step"] for s in steps if s.get("after_profile")] == [5]
    unprofiled = [s["step_time_s"] for s in steps if s["step"] in (2, 6)]
    assert record.speed.step_times == unprofiled
    traced = [s["step_time_s"] for s in steps if s.get("profiled")]
    ratio = statistics.median(traced) / statistics.median(unprofiled)
    assert record.inspection.profile_overhead == pytest.approx(ratio - 1)


def test_run_draws_its_traced_step(profiled):
    record, _ = profiled
    picture = matplotlib.image.imread(Path(record.run_dir, "profile", TIMELINE_FILE))
    assert picture.shape[1] > 1000 and picture.std() > 0.05


@needs_chromium
@pytest.mark.slow
def test_report_shows_the_step_timeline_in_headless_chromium(profiled, tmp_path, monkeypatch):
    _, store_dir = profiled
    monkeypatch.chdir(tmp_path)
    run = run_console(
        report_main.main, tmp_path, None, f"store.path={store_dir / 'meshrun.db'}",
        "html=report.html", defaults=(),
    )  # fmt: skip
    assert run.returncode == 0, run.output
    page = tmp_path / "report.html"
    png = tmp_path.parent / f"{tmp_path.name}.png"
    screenshot(page, png, height=4000)
    _, images, width = loaded_dom(page, width=1400)
    assert width <= 1400
    [timeline] = [i for i in images if i["alt"].startswith("Inside a step")]
    assert timeline["complete"] and 1000 < timeline["width"] <= 1400


def _complete(ts: float, dur: float, name: str, tid: int = 1, cat: str = "cpu_op") -> dict:
    return {"ph": "X", "ts": ts, "dur": dur, "name": name, "tid": tid, "cat": cat}


def test_summary_counts_overlap_and_idle_from_the_intervals():
    """A 100 us step: ops 0-40 and 50-70 on the step's thread, a collective 30-60 in flight
    on another: compute 60, communication 30 of which 20 overlapped, idle 100-70 = 30."""
    events = [
        _complete(0, 100, "meshrun:step 7", cat="user_annotation"),
        _complete(0, 40, "aten::mm"),
        _complete(10, 10, "aten::add"),  # inside mm: not counted twice, mm's self time 30
        _complete(50, 20, "aten::mm"),
        _complete(45, 2, "c10d::allreduce_"),  # issuing a collective is no compute
        _complete(30, 30, "gloo:all_reduce", tid=2, cat="user_annotation"),
        _complete(80, 10, "aten::mul", tid=3),  # another thread's op: not this rank's compute
    ]
    profile = summarize({"traceEvents": events}, rank=0)
    assert (profile.step_s, profile.compute_s, profile.comm_s) == pytest.approx((1e-4, 6e-5, 3e-5))
    assert profile.overlapped_s == pytest.approx(2e-5)
    assert profile.idle_s == pytest.approx(3e-5)
    assert profile.top_ops[:2] == [("aten::mm", 5e-5), ("aten::add", 1e-5)]
    assert profile.timeline["compute"] == [[0.0, 0.04], [0.05, 0.07]]


def test_a_blocking_wait_inside_an_operator_is_no_compute():
    """DTensor's collectives block in `_c10d_functional::wait_tensor`, inside the operator
    that redistributes: the rank waits on the link there, it computes nothing (a tp2 trace
    read 99% of its communication as overlapped with compute while it was not)."""
    events = [
        _complete(0, 100, "meshrun:step 3", cat="user_annotation"),
        _complete(0, 60, "PythonSubclass"),
        _complete(20, 30, "_c10d_functional::wait_tensor"),
        _complete(15, 40, "gloo:all_reduce", tid=2, cat="user_annotation"),
    ]
    profile = summarize({"traceEvents": events}, rank=0)
    assert profile.compute_s == pytest.approx(3e-5)  # 0-20 and 50-60
    assert (profile.comm_s, profile.overlapped_s) == pytest.approx((4e-5, 1e-5))
    assert profile.idle_s == pytest.approx(4e-5)  # 60-100
    assert profile.timeline["compute"] == [[0.0, 0.02], [0.05, 0.06]]
    # the wait a row of its own, not the redistributing operator's self time
    assert profile.top_ops == [("PythonSubclass", 3e-5), ("_c10d_functional::wait_tensor", 3e-5)]


def test_busy_fields_name_each_steps_slowest_rank_against_the_others():
    per_rank = torch.tensor([[1.0, 2.0], [1.5, 1.0], [1.0, 1.0]], dtype=torch.float64)
    assert busy_fields(per_rank) == [
        {"slowest_rank": 1, "busy_max_s": 1.5, "busy_others_median_s": 1.0},
        {"slowest_rank": 0, "busy_max_s": 2.0, "busy_others_median_s": 1.0},
    ]


def _straggler_run(experiment, *overrides: str) -> tuple[RunRecord, list[StepRow]]:
    cfg, measured = experiment(*SHORT, "train.steps=12", "parallel=ddp", *overrides)
    return assemble(cfg, measured, None), measured.steps


def test_slow_rank_is_named_with_its_slowdown(experiment):
    """Rank 1 spins to 1.5x its own busy time; against rank 0's that is 1.5x give or take
    what the two ranks' own steps differ by on a loaded host (1.349 seen beside the suite)."""
    record, steps = _straggler_run(experiment, "debug.slow_rank=1", "debug.slow_factor=1.5")
    assert record.inspection.slowest_rank == 1
    assert 1.25 < record.inspection.slowest_rank_slowdown < 1.75
    assert record.inspection.straggler.startswith("rank 1 is busy 1.")
    # the log steps name it too, from every rank's busy time: most of them (a tiny step's
    # CPU time on a loaded host has outliers: CI saw a step name rank 0)
    named = [s.slowest_rank for s in steps[2:]]
    assert named.count(1) > len(named) / 2, named
    ratios = [s.busy_max_s / s.busy_others_median_s for s in steps[2:]]
    assert 1.25 < statistics.median(ratios) < 1.75


@pytest.mark.slow
def test_without_a_slow_rank_nothing_is_flagged(experiment):
    """Two ranks doing the same work on a loaded 2-vCPU host differ in CPU time by up to ~16%
    (another test's ranks beside them: 1.158 read in CI), which the default threshold (1.15,
    for a host of one's own) would flag: here it is set above that noise."""
    record, _ = _straggler_run(experiment, "metrics.straggler_threshold=1.3")
    assert record.inspection.slowest_rank_slowdown < 1.3 and record.inspection.straggler is None


def test_slow_rank_on_cuda_ranks_is_refused():
    """Nothing would name it: the busy clock sees CPU ranks only."""
    cfg = compose_config("parallel=ddp", "hardware=a100-80g", "debug.slow_rank=1")
    with pytest.raises(ConfigError) as caught:
        check_inspection(cfg, world=2)
    assert caught.value.key == "debug.slow_rank" and "CPU ranks only" in str(caught.value)


def test_wandb_gets_each_ranks_profile_and_the_slowest_rank(profiled):
    record, _ = profiled
    logged = read_offline_run(Path(record.run_dir))
    table = read_table(logged, "profile/per_rank")
    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
    assert [r["rank"] for r in rows] == [0, 1]
    for row, profile in zip(rows, record.inspection.profile, strict=True):
        assert row["compute_s"] == pytest.approx(profile["compute_s"])
        assert row["idle_s"] == pytest.approx(profile["idle_s"])
    assert logged["summary"]["slowest_rank"] == record.inspection.slowest_rank
    assert logged["summary"]["profile_overhead"] == pytest.approx(
        record.inspection.profile_overhead
    )


def test_a_straggler_is_called_over_three_timed_steps_or_more():
    """One or two steps' busy times are one sample of the ranks' noise: reported, not judged."""
    cfg = compose_config("parallel=ddp")
    report = RankReport(memory_per_rank=[], fingerprint={}, busy_per_rank=[1.0, 1.3])
    short = straggler_fields(cfg, report, timed_steps=MIN_JUDGED_STEPS - 1)
    assert short["slowest_rank"] == 1 and short["slowest_rank_slowdown"] == pytest.approx(1.3)
    assert short["straggler"] is None
    judged = straggler_fields(cfg, report, timed_steps=MIN_JUDGED_STEPS)
    assert judged["straggler"].startswith("rank 1 is busy 1.30x")


@pytest.mark.slow
def test_the_profilers_start_and_stop_print_nothing_of_kinetos():
    """kineto prints `USDT: ... profiler_start/stop` to fd 2 at each (torch 2.13): a profiled
    window of every rank, calibration's and the memory meter's would each print a pair."""
    code = textwrap.dedent("""
        import sys
        from torch.profiler import profile
        from meshrun.rank.quiet_profiler import quiet_stderr
        loud = profile()
        loud.start()
        loud.stop()
        print("QUIET FROM HERE", file=sys.stderr, flush=True)
        quiet = profile()
        with quiet_stderr():
            quiet.start()
        with quiet_stderr():
            quiet.stop()
        print("still printed", file=sys.stderr, flush=True)
    """)
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert run.returncode == 0, run.stderr
    loud, quiet = run.stderr.split("QUIET FROM HERE")
    if "profiler_start" not in loud:
        pytest.skip("this torch's kineto prints nothing at a profiler's start")
    assert "USDT" not in quiet and "still printed" in quiet
