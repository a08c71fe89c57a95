"""The whole run planned (issue 59): a token budget's time, device-hours and cost at a
layout's speed, what one of its checkpoints writes a rank (against real DCP saves), the
Young/Daly interval and what saves, failures and restarts take of the run; checkpoint.
every_steps=auto saving at the interval it printed; a run's record and summary keeping the
plan honest; the plan's band from this host's calibrated runs; bad figures refused."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from meshrun.core.calibration import calibration_path, write_calibration
from meshrun.core.hardware import HostFacts, fingerprint_key, host_fingerprint, rank_threads
from meshrun.core.record import RunRecord
from meshrun.driver.experiment import measure
from meshrun.driver.sinks.store import ResultsStore
from meshrun.plan.checkpoint_cost import CheckpointCost, StorageRates
from meshrun.plan.prediction_band import PUBLISHED
from meshrun.plan.run_prediction import predict_checkpoint
from meshrun.plan.run_time import MTBF_NODE_HOURS, Failures, RunTime, budget_tokens
from meshrun.tools.plan.run_table import prediction_band
from meshrun.tools.report import budget_plot
from tests.helpers import compose_config, resolved_config
from tests.ranks import config_in
from tests.test_calibration import _calibration
from tests.test_plan import meshrun_plan, plan_run
from tests.tiers import tiered

RATES = StorageRates(1.0, "given", 10.0, "given")


def _cost(blocked_s: float, save_s: float, restart_s: float) -> CheckpointCost:
    return CheckpointCost(
        bytes_per_rank=1,
        staged_bytes_per_rank=1,
        node_bytes=1,
        save_s=save_s,
        blocked_s=blocked_s,
        load_s=restart_s - 1.0,
        launch_s=1.0,
        rates=RATES,
    )


def test_time_device_hours_cost_and_the_young_daly_interval_by_hand():
    """9e9 tokens at 1e5 tokens/s: 90,000 s. 4 nodes failing every 100 h each: the job every
    25 h, 90,000 s; a save holding training 0.5 s: Young's sqrt(2 x 0.5 x 90,000) = 300 s.
    Saves take 0.5/300 of the time, work redone (150 + 19.5 s in flight)/90,000, restarts
    100/90,000; the rest, 1 - 0.00466111, trains: 90,421.46 s, x 32 devices 803.75
    device-hours, $1,607.50 at $2."""
    run = RunTime(
        tokens=9e9,
        tokens_per_step=1e6,
        tokens_per_s=1e5,
        devices=32,
        price_per_gpu_hour=2.0,
        checkpoint=_cost(blocked_s=0.5, save_s=20.0, restart_s=100.0),
        failures=Failures(100.0, 4, "given"),
    )
    assert run.compute_s == 90_000
    assert run.failures.mtbf_s == 90_000
    assert run.interval_s == pytest.approx(300)
    assert run.save_share == pytest.approx(1 / 600)
    assert run.lost_work_share == pytest.approx(169.5 / 90_000)
    assert run.restart_share == pytest.approx(100 / 90_000)
    assert run.expected_s == pytest.approx(90_421.46, abs=0.01)
    assert run.gpu_hours == pytest.approx(803.746, abs=1e-3)
    assert run.cost == pytest.approx(1607.49, abs=0.01)


def test_the_interval_is_no_shorter_than_a_save_or_a_step_nor_longer_than_the_run():
    """A save waits for the one before it, and saves come between steps; a run shorter than
    the interval saves at its end."""
    failures = Failures(1.0, 1, "given")  # 3,600 s: Young's sqrt(2 x 0.5 x 3,600) = 60 s
    slow_save = RunTime(1e9, 1e3, 1e3, 1, None, _cost(0.5, 120.0, 10.0), failures)
    assert slow_save.interval_s == 120.0 and slow_save.cost is None
    short = RunTime(1e4, 1e3, 1e3, 1, None, _cost(0.5, 1.0, 10.0), failures)
    assert short.interval_s == short.compute_s == 10.0
    assert RunTime(1e9, 1e3, 1e3, 1, None, _cost(0.5, 1.0, 10.0), failures).interval_s == 60.0
    long_steps = RunTime(1e9, 2e5, 1e3, 1, None, _cost(0.5, 1.0, 10.0), failures)
    assert long_steps.step_s == long_steps.interval_s == 200.0
    # a save held for no time (an offloaded state's): every step, not every save's 1 s
    unheld = RunTime(1e9, 2e5, 1e3, 1, None, _cost(0.0, 1.0, 10.0), failures)
    assert unheld.interval_s == 200.0 and unheld.save_share == 0


def test_the_default_failure_rate_is_the_llama_3_papers_per_node():
    """419 unexpected interruptions in 54 days on 16,384 GPUs, 8 a node."""
    assert pytest.approx(2048 * 54 * 24 / 419) == MTBF_NODE_HOURS
    cfg = compose_config("launcher.nnodes=8")
    assert Failures.of(cfg).mtbf_s == pytest.approx(MTBF_NODE_HOURS * 3600 / 8)
    given = compose_config("plan.mtbf_hours=10", "launcher.nnodes=2")
    assert Failures.of(given).mtbf_s == 18_000 and Failures.of(given).source == "plan.mtbf_hours"


def test_the_budget_is_plan_tokens_or_the_runs_own_steps():
    cfg = compose_config("train.steps=30", "train.global_batch_size=8", "train.seq_len=64")
    assert budget_tokens(cfg) == 30 * 8 * 64
    assert budget_tokens(compose_config("plan.tokens=1e12")) == 1e12


CHECKPOINTED = {
    "ddp": ("parallel=ddp",),
    "fsdp": ("parallel=fsdp",),
    "tp2_pp2": ("parallel=tp2_pp2", "launcher.nproc_per_node=4"),
}


@pytest.mark.parametrize("layout", tiered(CHECKPOINTED, {"fsdp"}))
def test_checkpoint_bytes_per_rank_are_those_a_real_dcp_save_writes(tmp_path, rank_pool, layout):
    """model=small saved by DCP: each rank's file within 10% of the bytes the plan predicts a
    rank writes (its stage's state over the stage's ranks: DCP writes a replica's tensor once)."""
    cfg = config_in(
        tmp_path,
        "model=small",
        *CHECKPOINTED[layout],
        "train.steps=2",
        "train.untimed_steps=1",
        "train.global_batch_size=4",
        "train.micro_batch_size=1",
        "train.seq_len=32",
        "checkpoint.every_steps=2",
        "metrics.baseline=off",
    )
    assert measure(cfg, "run", rank_pool.launch).ok
    files = sorted((Path(cfg.run_dir) / "checkpoints" / "step-00000002").glob("__*_0.distcp"))
    assert len(files) == cfg.launcher.nproc_per_node
    predicted = predict_checkpoint(cfg).bytes_per_rank
    for written in files:
        assert written.stat().st_size == pytest.approx(predicted, rel=0.10), written.name


@pytest.mark.slow
def test_auto_saves_at_the_interval_it_printed(meshrun_here):
    """A small MTBF: Young's interval of a fraction of a second, which the ranks turn into
    steps after their first 3 timed steps (the log step of step 5) and save at from there."""
    run = meshrun_here(
        "model=tiny",
        "parallel=ddp",
        "train.steps=16",
        "train.untimed_steps=2",
        "checkpoint.every_steps=auto",
        "plan.mtbf_hours=0.01",
        "metrics.baseline=off",
    )
    assert run.returncode == 0, run.output
    every = int(re.search(r"every (\d+) steps?: ", run.output)[1])
    r = run.results
    assert r["checkpoint_every_steps"] == every
    assert (
        "Young/Daly" in r["checkpoint_interval"] and "plan.mtbf_hours" in r["checkpoint_interval"]
    )
    saved = [s["step"] for s in r["checkpoint_saves"]]
    assert saved == sorted({s for s in range(5, 17) if s % every == 0} | {16})
    assert "checkpoint interval" in run.output


def test_a_run_records_its_budget_at_the_measured_and_the_predicted_speed(meshrun_here):
    run = meshrun_here("model=tiny", "parallel=ddp", "train.steps=6", "plan.tokens=1e9")
    assert run.returncode == 0, run.output
    r = run.results
    assert r["tokens_budget"] == 1e9
    assert r["measured_budget_s"] == pytest.approx(1e9 / r["tokens_per_s"])
    assert r["predicted_budget_s"] == pytest.approx(1e9 / r["predicted_tokens_per_s"])
    stored = next(s for s in run.stored() if s["run_id"] == r["run_id"])
    assert stored["measured_budget_s"] == r["measured_budget_s"]
    said = re.search(r"│ full budget +│ (.+?) +│", run.output)[1]
    assert said.startswith("1e+09 tokens: ") and "at the measured" in said
    rows = " ".join(re.findall(r"│ (?:full budget|) +│ (.+?) +│", run.output))
    assert "predicted uncalibrated" in rows  # the test's store has no calibration of the host
    figure = budget_plot.budget_times([stored])
    assert figure is not None and len(figure.axes[0].collections) == 1  # one point, one run
    [point] = figure.axes[0].collections
    assert point.get_label() == "ddp2 (uncalibrated)" and not point.get_facecolor().any()


def test_the_plan_prints_days_gpu_hours_dollars_and_an_interval_per_row(tmp_path):
    run, plan = meshrun_plan(
        tmp_path,
        "model=llama-13b",
        "hardware=a100-80g",
        "launcher.nnodes=8",
        "plan.tokens=1e12",
        "plan.price_per_gpu_hour=2",
        "top=3",
    )
    for header in ("run time", "GPU-hours", "cost", "ckpt every"):
        assert header in run.output
    rows = [line for line in run.output.splitlines() if re.match(r"│ [123] │", line)]
    assert len(rows) == 3 and all(re.search(r"days.*\$[\d,]+ .*(min|h)", r) for r in rows)
    first = plan["layouts"][0]
    tokens_per_s = first["speed"]["tokens_per_s"]
    assert first["run"]["compute_s"] == pytest.approx(1e12 / tokens_per_s)
    assert first["run"]["cost"] == pytest.approx(first["run"]["gpu_hours"] * 2)
    assert first["run"]["gpu_hours"] == pytest.approx(first["run"]["expected_s"] * 64 / 3600)
    checkpoint = first["run"]["checkpoint"]
    blocked, mtbf = checkpoint["blocked_s"], first["run"]["failures"]["mtbf_s"]
    assert first["run"]["interval_s"] == pytest.approx(
        max(math.sqrt(2 * blocked * mtbf), checkpoint["save_s"])
    )
    assert "the cheapest that fits" in run.output
    assert PUBLISHED.describe() in run.output  # no calibration of a GPU here: the published band


def test_the_band_is_the_spread_of_this_hosts_calibrated_runs(tmp_path):
    store = tmp_path / "meshrun.db"
    cfg = resolved_config("model=small", "parallel=ddp", f"store.path={store}")
    threads = rank_threads(cfg.launcher, 2, HostFacts.detect())
    profile = _calibration(
        fingerprint_key=fingerprint_key(host_fingerprint(threads)), threads_per_rank=threads
    )
    write_calibration(profile, calibration_path(str(store)))
    results = ResultsStore(store)
    for index, (measured, predicted) in enumerate(((1.2, 1.0), (0.9, 1.0), (3.0, 1.0))):
        at = profile.created_at if index < 2 else "another calibration"
        results.record(
            RunRecord.from_dict(
                {
                    "run_id": f"r{index}",
                    "status": "completed",
                    "created_at": f"2026-12-0{index + 1}",
                    "step_time_s": measured,
                    "predicted_step_time_s": predicted,
                    "predicted_calibrated_at": at,
                }
            )
        )
    band = prediction_band(cfg)
    assert (band.low, band.high) == (pytest.approx(0.9), pytest.approx(1.2))
    assert "2 runs on this host's calibration" in band.source


def test_a_bad_figure_stops_meshrun_plan_with_exit_2_the_key_and_the_fix(tmp_path):
    """(each figure's refusal by a run: tests/test_config_errors.py)"""
    run = plan_run(tmp_path, "model=small", "plan.mtbf_hours=0")
    assert run.returncode == 2, run.output
    assert "plan.mtbf_hours=0" in run.output and "Valid: hours > 0" in run.output


def test_the_plan_json_carries_each_rows_run(tmp_path):
    _, plan = meshrun_plan(tmp_path, "model=small", "plan.tokens=1e6", "top=2")
    run = plan["layouts"][0]["run"]
    assert run["tokens"] == 1e6 and json.dumps(run)
    assert run["checkpoint"]["bytes_per_rank"] > 0
