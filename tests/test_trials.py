"""`parallel=auto plan.trials=K` (issue 34, item 3): the planner's first K layouts run as
trials of their own on real ranks, the run trains with the fastest measured, and the record
and summary set the prediction beside the measurement."""

from __future__ import annotations

import dataclasses
import json
import socket
from pathlib import Path

import pytest

from meshrun.core.config import RunConfig
from meshrun.core.errors import ConfigError
from meshrun.core.hardware import HostFacts
from meshrun.core.naming import layout_name
from meshrun.core.record import RunRecord
from meshrun.driver.resolve import resolve_trials
from meshrun.driver.sinks.console import trials_verdict
from meshrun.driver.sinks.store import ResultsStore
from meshrun.driver.trial_ranking import (
    Trial,
    calibration_said,
    fastest,
    first_choice_loss,
    node_sets,
    rank_correlation,
)
from meshrun.driver.trials import on_nodes, run_with_trials
from meshrun.validate.trials import check_trials
from tests.helpers import compose_config
from tests.wandb_records import read_offline_run

SHORT = ("model=tiny", "train.untimed_steps=1", "plan.trial_steps=2", "train.steps=3")


def _trial(layout: str, predicted: float | None, measured: float | None, status="completed"):
    return Trial("id", layout, "", status, predicted, measured)


def test_predictions_say_whether_this_host_was_calibrated_and_how_to_calibrate_it():
    said = calibration_said(["2026-12-01T10:00", "2026-12-01T10:00"], "tiny", 2)
    assert said == "predicted on this host's calibration of 2026-12-01T10:00"
    for partly in ([None, None], ["2026-12-01T10:00", None], []):
        said = calibration_said(partly, "small", 8)
        assert said.startswith("predicted uncalibrated: the hardware profile's rates")
        assert "`meshrun-plan calibrate model=small world_size=8`" in said


def test_rank_correlation_is_spearmans_rho():
    agree = [_trial("a", 3, 30), _trial("b", 2, 20), _trial("c", 1, 10)]
    assert rank_correlation(agree) == pytest.approx(1.0)
    reversed_ = [_trial("a", 3, 10), _trial("b", 2, 20), _trial("c", 1, 30)]
    assert rank_correlation(reversed_) == pytest.approx(-1.0)
    # ranks (3, 2, 1) against (2.5, 2.5, 1): rho = 0.866
    tied = [_trial("a", 3, 30), _trial("b", 2, 30), _trial("c", 1, 10)]
    assert rank_correlation(tied) == pytest.approx(3**0.5 / 2)


def test_rank_correlation_leaves_out_failed_trials_and_needs_two():
    trials = [_trial("a", 3, None, "failed"), _trial("b", 2, 10), _trial("c", 1, 20)]
    assert rank_correlation(trials) == pytest.approx(-1.0)
    assert rank_correlation(trials[:2]) is None
    assert rank_correlation([_trial("a", 1, 10), _trial("b", 1, 20)]) is None  # all ties


def test_first_choice_loss_is_what_the_predicted_first_lacked():
    trials = [_trial("a", 3, 75), _trial("b", 2, 100), _trial("c", 1, None, "failed")]
    assert fastest(trials) == 1
    assert first_choice_loss(trials) == pytest.approx(0.25)
    failed_first = [_trial("a", 3, None, "failed"), _trial("b", 2, 100)]
    assert first_choice_loss(failed_first) is None
    assert fastest([_trial("a", 3, None, "failed")]) is None


def test_trials_on_different_nodes_are_said_not_to_be_side_by_side():
    same = [_trial("a", 2, 20), _trial("b", 1, 10)]
    for t in same:
        t.nodes = ["n1", "n2"]
    assert node_sets(same) == [["n1", "n2"]]
    assert "side by side" not in trials_verdict(same)
    apart = [*same, _trial("c", 1, 15)]
    apart[2].nodes = ["n3", "n4"]
    assert node_sets(apart) == [["n1", "n2"], ["n3", "n4"]]
    assert "measured on different nodes (n1,n2 / n3,n4): not side by side" in trials_verdict(apart)


def test_a_slurm_trial_is_pinned_to_the_nodes_given_unless_the_user_named_some():
    slurm = compose_config("model=tiny", "parallel=ddp", "launcher=slurm")
    pinned = on_nodes(slurm, ["n1", "n2"])
    assert pinned.launcher.sbatch_extra == {"nodelist": "n1,n2"}
    assert on_nodes(slurm, None) == slurm  # no trial has reported its nodes yet
    mine = compose_config(
        "model=tiny", "parallel=ddp", "launcher=slurm", "+launcher.sbatch_extra.nodelist=n7"
    )
    assert on_nodes(mine, ["n1", "n2"]).launcher.sbatch_extra == {"nodelist": "n7"}
    local = compose_config("model=tiny", "parallel=ddp")
    assert on_nodes(local, ["n1"]) == local


BAD = [
    (["parallel=ddp", "plan.trials=2"], "plan.trials", "parallel=auto"),
    (["parallel=auto", "plan.trials_only=true"], "plan.trials_only", "plan.trials=K"),
    (["parallel=auto", "plan.trials=-1"], "plan.trials", "0 (none) or more"),
    (["parallel=auto", "plan.trials=2", "plan.trial_steps=0"], "plan.trial_steps", "> 0"),
    (
        ["parallel=auto", "plan.trials=2", "checkpoint.resume=/some/run"],
        "plan.trials",
        "plan.trials=0 with the layout",
    ),
    (
        ["parallel=auto", "plan.trials=2", "launcher=slurm", "launcher.wait=false"],
        "launcher.wait",
        "launcher.wait=true",
    ),
]


@pytest.mark.parametrize(("overrides", "key", "fragment"), BAD, ids=str)
def test_bad_trials_name_key_and_fix(overrides, key, fragment):
    cfg = compose_config("model=tiny", *overrides)
    with pytest.raises(ConfigError) as caught:
        resolve_trials(cfg, HostFacts.detect())
    assert caught.value.key == key
    assert fragment in str(caught.value)


def test_bad_trials_exit_2_before_any_rank_starts(meshrun_here):
    run = meshrun_here("model=tiny", "parallel=ddp", "plan.trials=2")
    assert run.returncode == 2, run.output
    assert "plan.trials=2" in run.output and "parallel=auto" in run.output
    assert not run.store_path.exists()


def test_trials_run_the_plans_first_layouts_and_the_run_trains_the_fastest(meshrun_here):
    run = meshrun_here("parallel=auto", "plan.trials=3", "metrics.baseline=off", *SHORT)
    assert run.returncode == 0, run.output
    main = run.results
    rows = {r["run_id"]: r for r in run.stored()}
    trials = [rows[t["run_id"]] for t in main["trials"]]
    assert len(trials) == 3
    assert {r["role"] for r in trials} == {"trial"}
    assert {r["trial_of"] for r in trials} == {main["run_id"]}
    assert len({r["sweep"] for r in trials}) == 1  # one group (store sweep, W&B group)
    assert len({r["layout_name"] for r in trials}) == 3
    for trial in trials:  # untimed + trial_steps, no more
        assert trial["status"] == "completed"
        assert trial["steps_completed"] == 3
        assert trial["run_dir"].startswith(str(run.run_dir / "trials"))
    fastest_trial = max(trials, key=lambda r: r["tokens_per_s"])
    assert main["layout_name"] == fastest_trial["layout_name"]
    assert main["steps_completed"] == 3
    measured = [
        Trial.of(RunRecord.from_dict(json.loads(Path(r["run_dir"], "results.json").read_text())))
        for r in trials
    ]
    assert [t.tokens_per_s for t in measured] == [r["tokens_per_s"] for r in trials]
    assert main["trials_rank_correlation"] == pytest.approx(rank_correlation(measured))
    assert "plan.trials" not in main["overrides"]  # the chosen layout runs again as given
    assert {tuple(t.nodes or ()) for t in measured} == {(socket.gethostname(),)}
    assert "rank correlation (Spearman)" in run.output
    assert "training with trial" in run.output
    # a test's store has no calibration of this host: its predictions say so, with the command
    assert "predicted (uncalibrated)" in run.output
    assert "meshrun-plan calibrate model=tiny world_size=2" in " ".join(run.output.split())


@pytest.mark.slow
def test_a_failing_trial_is_recorded_and_left_out_and_trials_only_stops_there(
    tmp_path, launch_host
):
    """On the real launcher (a failure would restart the session's rank pool)."""
    cfg = compose_config(
        "parallel=auto",
        "plan.trials=2",
        "plan.trials_only=true",
        f"run_dir={tmp_path}/run",
        f"store.path={tmp_path}/meshrun.db",
        *SHORT,
    )
    runs = [p.config for p in resolve_trials(cfg, HostFacts.detect())]

    def launch(run: RunConfig):  # the first layout's trial fails on rank 1 at its step 2
        if run.name.endswith("-trial1"):
            debug = dataclasses.replace(run.debug, fail_rank=1, fail_step=2)
            run = dataclasses.replace(run, debug=debug)
        return launch_host.launch(run)

    record = run_with_trials(runs, cfg.plan, launch)
    assert (record.role, record.status) == ("trials", "completed")  # the verdict: trial 2
    assert record.layout_name == layout_name(runs[1])
    stored = ResultsStore(tmp_path / "meshrun.db").records()
    assert sorted(r.role for r in stored) == ["trial", "trial", "trials"]  # no run trained
    failed = next(r for r in stored if r.status == "failed")
    assert failed.layout_name == layout_name(runs[0]) and failed.failed_rank == 1
    assert failed.selection.trial_of == record.run_id
    assert record.selection.trials_first_choice_loss is None  # the first choice failed


@pytest.mark.slow
def test_trials_only_records_the_verdict_as_a_run_of_its_own(meshrun_here):
    """plan.trials_only: the run the trials name has its row (role `trials`), results.json
    and W&B run, each with the trials, the layout that won, rho and the first choice's loss."""
    run = meshrun_here(
        "parallel=auto",
        "plan.trials=2",
        "plan.trials_only=true",
        "metrics.baseline=off",
        "logger=wandb",
        "logger.mode=offline",
        *SHORT,
    )
    assert run.returncode == 0, run.output
    verdict = run.results
    rows = {r["run_id"]: r for r in run.stored()}
    assert rows[verdict["run_id"]]["role"] == "trials"
    trials = [rows[t["run_id"]] for t in verdict["trials"]]
    assert {(r["role"], r["trial_of"]) for r in trials} == {("trial", verdict["run_id"])}
    won = max(trials, key=lambda r: r["tokens_per_s"])
    assert (verdict["layout_name"], verdict["tokens_per_s"]) == (
        won["layout_name"],
        won["tokens_per_s"],
    )
    measured = [Trial(**t) for t in verdict["trials"]]
    assert verdict["trials_first_choice_loss"] == pytest.approx(first_choice_loss(measured))
    assert verdict["trials_rank_correlation"] == rank_correlation(measured)
    logged = read_offline_run(run.run_dir)
    assert logged["run"]["job_type"] == "trials"
    summary = logged["summary"]
    assert summary["layout_name"] == won["layout_name"]
    assert summary["trials_first_choice_loss"] == pytest.approx(first_choice_loss(measured))
    assert "trials_rank_correlation" in summary
    assert "trials (2)" in run.output  # the summary's verdict row


@pytest.mark.slow
def test_the_trials_are_one_wandb_group_of_trial_runs(meshrun_here):
    """With W&B (offline): a W&B run a trial, job type `trial`, all in the trials' group; the
    chosen run its own."""
    run = meshrun_here(
        "parallel=auto",
        "plan.trials=2",
        "metrics.baseline=off",
        "logger=wandb",
        "logger.mode=offline",
        *SHORT,
    )
    assert run.returncode == 0, run.output
    trials = [read_offline_run(Path(t["run_dir"])) for t in _stored_trials(run)]
    assert [t["run"]["job_type"] for t in trials] == ["trial", "trial"]
    groups = {t["run"]["group"] for t in trials}
    assert groups == {next(r["sweep"] for r in run.stored() if r["role"] == "trial")}
    assert read_offline_run(run.run_dir)["run"]["job_type"] == "run"


def _stored_trials(run) -> list[dict]:
    rows = {r["run_id"]: r for r in run.stored()}
    return [rows[t["run_id"]] for t in run.results["trials"]]


def test_trials_are_refused_under_torchrun(monkeypatch):
    """Each trial launches this host's ranks anew; torchrun started them once already."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = compose_config("model=tiny", "parallel=auto", "plan.trials=2")
    with pytest.raises(ConfigError) as caught:
        check_trials(cfg)
    assert caught.value.key == "plan.trials"
    assert "under torchrun" in str(caught.value) and "Valid:" in str(caught.value)
