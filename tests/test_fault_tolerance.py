"""Replica-level fault tolerance with torchft (issue 36, items 3 and 4): the data-parallel
replicas as worlds of their own, joined each step through the driver's lighthouse; a replica
that dies is started again and joins the live one with its state while that one trains on;
the record tells each failure and the steps trained with fewer replicas. Real processes,
real torchft (lighthouse, Manager, gloo), real SIGKILLs."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from meshrun.core.checkpoints import complete, read_manifest
from meshrun.core.config import corrupted_steps
from meshrun.core.record import RunRecord
from meshrun.core.run_files.metrics import (
    METRICS_FILE,
    ROLLED_BACK_FILE,
    StepRow,
    fill_from_replicas,
    read_records,
    replica_metrics,
)
from meshrun.driver.experiment import RunFailed, run_experiment
from tests.cli import interrupted_meshrun
from tests.helpers import compose_config
from tests.launch_host import LaunchHost
from tests.ranks import RankPool, config_in

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchft") is None, reason="torchft is not installed (meshrun[ft])"
)

COMMON = (
    "model=tiny",
    "parallel=ddp",
    "launcher.nproc_per_node=2",
    "train.seq_len=32",
    "train.untimed_steps=1",
    "train.log_every=5",
    "metrics.baseline=off",
    "logger.name=none",
)
TORCHFT = (*COMMON, "parallel.fault_tolerance=torchft")
# a restart here takes a second (the forkserver has torch loaded): the delay lets the live
# replica be seen training alone first, as it is while a real one reloads its device
KILL_REPLICA_1 = ("debug.fail_rank=1", "debug.fail_mode=kill", "parallel.replica_restart_delay_s=3")


def _run(on: LaunchHost | RankPool, tmp: Path, *overrides: str) -> RunRecord:
    """On the launch host (the real launcher: torchft's replica groups) or, for a layout the
    replicas must equal, whose own processes are not what is tested, on the rank pool."""
    return run_experiment(config_in(tmp, *overrides), on.launch)


def _steps(tmp: Path) -> list[StepRow]:
    return read_records(tmp / "run" / METRICS_FILE)


def _agree_where_both_trained(tmp: Path) -> None:
    """Replica 1's own records hold, for every step it trained, the loss replica 0 wrote:
    the loss is the quorum's mean, the run's, not a replica's."""
    written = {r.step: r for r in _steps(tmp)}
    own = read_records(replica_metrics(str(tmp / "run"), 1))
    assert own
    for record in own:
        loss, theirs = record.loss, written[record.step].loss
        assert loss == theirs or (math.isnan(loss) and math.isnan(theirs)), record.step


@pytest.mark.slow
def test_torchft_replicas_train_and_evaluate_as_ddp_does(tmp_path, rank_pool, launch_host):
    """Two replicas without a fault: the same losses as DDP on two ranks (each replica the
    same share of the global batch, gradients averaged over the quorum), and the same
    held-out losses (each replica its share of the held-out batches, averaged)."""
    evaluated = ("train.steps=8", "train.eval.every_steps=4")
    ddp = _run(rank_pool, tmp_path / "ddp", *COMMON, *evaluated)
    ft = _run(launch_host, tmp_path / "ft", *TORCHFT, *evaluated)
    assert ft.status == "completed" and ft.series.losses
    for got, want in zip(ft.series.losses, ddp.series.losses, strict=True):
        assert abs(got - want) <= 1e-6 * want
    assert [step for step, _ in ft.evaluation.eval_losses] == [3, 7]  # after steps 4 and 8
    for (_, got), (_, want) in zip(
        ft.evaluation.eval_losses, ddp.evaluation.eval_losses, strict=True
    ):
        assert abs(got - want) <= 1e-6 * want
    assert ft.faults.replica_failure_count == 0 and ft.faults.steps_with_fewer_replicas == 0
    assert {r.replicas for r in _steps(tmp_path / "ft")} == {2}


HSDP = ("parallel.dp_replicate=2", "parallel.dp_shard=2", "launcher.nproc_per_node=4")


@pytest.mark.slow
def test_replica_groups_of_fsdp2_ranks_train_as_hsdp_does(tmp_path, rank_pool, launch_host):
    """dp_replicate=2 x dp_shard=2: two torchft groups of two FSDP2 ranks each, every rank's
    gradient shard averaged with the same rank's of the other group: HSDP's losses."""
    hsdp = _run(rank_pool, tmp_path / "hsdp", *COMMON, *HSDP, "train.steps=6")
    ft = _run(launch_host, tmp_path / "ft", *TORCHFT, *HSDP, "train.steps=6")
    assert ft.layout_name == hsdp.layout_name == "hsdp2x2"
    for got, want in zip(ft.series.losses, hsdp.series.losses, strict=True):
        assert abs(got - want) <= 1e-6 * want
    assert {r.replicas for r in _steps(tmp_path / "ft")} == {2}


@pytest.mark.waits
def test_a_rank_killed_in_a_replica_group_restarts_its_group_from_the_others_shards(
    tmp_path, launch_host
):
    """Rank 3 (group 1's second FSDP2 rank) is killed: group 1 stops and starts again, each
    of its ranks loads its shards from the same rank of group 0, and trains beside it."""
    run = _run(
        launch_host,
        tmp_path,
        *TORCHFT,
        *HSDP,
        "debug.fail_rank=3",
        "debug.fail_mode=kill",
        "debug.fail_step=6",
        "parallel.replica_restart_delay_s=2",
        "train.steps=40",
        "debug.slow_step_s=0.1",
    )
    assert run.status == "completed"
    [failure] = run.faults.replica_failures
    assert (failure["replica"], failure["rank"], failure["error"]) == (1, 3, "killed (SIGKILL)")
    steps = _steps(tmp_path)
    assert [r.step for r in steps] == list(range(40))
    assert run.faults.fewer_replica_steps[0] == [6, 1] and steps[-1].replicas == 2
    _agree_where_both_trained(tmp_path)


def test_torchft_replicas_resume_from_replica_0s_checkpoint(tmp_path, rank_pool, launch_host):
    """Replica 0 saves; every replica resumes from it at the checkpoint's step, and the run
    goes on as the uninterrupted DDP run does."""
    saving = (*TORCHFT, "checkpoint.every_steps=4")
    _run(launch_host, tmp_path, *saving, "train.steps=4")
    resumed = _run(launch_host, tmp_path, *saving, "train.steps=8", "checkpoint.resume=auto")
    ddp = _run(rank_pool, tmp_path / "ddp", *COMMON, "train.steps=8")
    assert resumed.resumed_from_step == 4
    assert [r.step for r in _steps(tmp_path)] == list(range(8))
    for got, want in zip(resumed.series.losses, ddp.series.losses, strict=True):
        assert abs(got - want) <= 1e-6 * want


@pytest.mark.waits
def test_a_killed_replica_is_restarted_and_rejoins_while_the_other_trains_on(
    tmp_path, capsys, launch_host
):
    """Replica 1 is SIGKILLed before step 8: replica 0 goes on alone (the steps say 1
    replica), replica 1 is started again, loads replica 0's state and trains beside it to the
    end; no requeue, no step lost or trained twice."""
    run = _run(
        launch_host,
        tmp_path,
        *TORCHFT,
        *KILL_REPLICA_1,
        "debug.fail_step=8",
        "train.steps=40",
        "debug.slow_step_s=0.1",
    )
    assert run.status == "completed" and not run.host.requeues
    [failure] = run.faults.replica_failures
    assert (failure["replica"], failure["attempt"]) == (1, 0)
    assert failure["error"] == "killed (SIGKILL)"
    steps = _steps(tmp_path)
    assert [r.step for r in steps] == list(range(40))
    alone = [step for step, replicas in run.faults.fewer_replica_steps if replicas == 1]
    assert alone and alone[0] == 8 and alone == list(range(8, 8 + len(alone)))
    assert run.faults.steps_with_fewer_replicas == len(alone)
    assert all(r.replicas == 2 for r in steps[alone[-1] + 1 :]), "replica 1 rejoined"
    _agree_where_both_trained(tmp_path)
    said = capsys.readouterr().out
    assert "replica 1 lost (rank 1: killed (SIGKILL)); the others train on, it starts again" in said


@pytest.mark.waits
def test_replica_0_killed_its_missing_steps_come_from_the_other(tmp_path, launch_host):
    """Replica 0 writes metrics.jsonl: the steps it missed while down are filled from replica
    1's records, marked as theirs; the restarted replica 0 reports the run."""
    run = _run(
        launch_host,
        tmp_path,
        *TORCHFT,
        "debug.fail_rank=0",
        "debug.fail_mode=kill",
        "parallel.replica_restart_delay_s=3",
        "debug.fail_step=8",
        "train.steps=60",
        "debug.slow_step_s=0.1",
    )
    assert run.status == "completed"
    assert [f["replica"] for f in run.faults.replica_failures] == [0]
    steps = _steps(tmp_path)
    assert [r.step for r in steps] == list(range(60))
    # replica 0 last wrote at step 4 (train.log_every=5); replica 1's records fill in from 5
    filled = [r.step for r in steps if r.written_by_replica == 1]
    assert filled == list(range(5, 5 + len(filled))) and 5 + len(filled) >= 8
    assert run.memory.memory_per_rank, "the restarted replica 0 reported the run"


@pytest.mark.waits
def test_ctrl_c_stops_the_replicas_which_save_and_the_run_resumes(tmp_path, launch_host):
    """SIGINT to the process group, as a terminal sends it: replica 0 saves, `meshrun` exits
    130 with the run interrupted and its resume line; resumed, it ends with every step."""
    args = (*TORCHFT, "train.steps=30", "checkpoint.every_steps=100", "train.log_every=2")
    run_dir = tmp_path / "run"
    code, output = interrupted_meshrun(
        run_dir, tmp_path / "meshrun.db", *args, "debug.slow_step_s=0.2"
    )
    assert code == 130, output
    assert "resume with checkpoint.resume=" in output
    [saved] = complete(run_dir / "checkpoints")
    assert 4 <= read_manifest(saved).step < 30
    finished = _run(launch_host, tmp_path, *args, "checkpoint.resume=auto")
    assert finished.status == "completed"
    assert [r.step for r in _steps(tmp_path)] == list(range(30))


def test_a_replica_failing_past_the_restarts_fails_the_run_keeping_its_steps(tmp_path, launch_host):
    """parallel.replica_restarts=0: the first replica lost stops the run, recorded as failed
    with why, the steps trained before it kept."""
    with pytest.raises(RunFailed) as failed:
        _run(
            launch_host,
            tmp_path,
            *TORCHFT,
            *KILL_REPLICA_1,
            "debug.fail_step=12",
            "train.steps=60",
            "train.log_every=2",
            "debug.slow_step_s=0.05",
            "parallel.replica_restarts=0",
        )
    record = failed.value.results
    assert record.status == "failed" and record.failed_rank == 1
    assert "replica 1 killed (SIGKILL); parallel.replica_restarts=0 spent" in record.error
    assert record.steps_completed >= 12


def test_an_exception_in_a_replica_fails_the_run_without_a_restart(tmp_path, launch_host):
    """A replica that raises fails as any rank does: the same error would come back."""
    with pytest.raises(RunFailed) as failed:
        _run(
            launch_host,
            tmp_path,
            *TORCHFT,
            "debug.fail_rank=1",
            "debug.fail_step=3",
            "train.steps=30",
        )
    record = failed.value.results
    assert "injected failure on rank 1 at step 3" in record.error
    assert record.faults.replica_failures is None or len(record.faults.replica_failures) <= 1


@pytest.mark.waits
def test_chaos_a_killed_rank_a_non_finite_step_and_a_spike_in_200_steps(tmp_path, launch_host):
    """Issue 36's chaos run: replica 1 killed before step 30, batch 80's loss NaN, batch
    140's a spike. Every step is accounted for: trained once (a rolled-back step once more,
    its first try kept in rolled_back.jsonl), the NaN step skipped on both replicas, the
    spike rolled back to the step-140 checkpoint; the record tells all three."""
    run = _run(
        launch_host,
        tmp_path,
        *TORCHFT,
        *KILL_REPLICA_1,
        "debug.fail_step=30",
        "debug.corrupt_step=[80,140]",
        "debug.corrupt_mode=[nan,spike]",
        "train.guard.spike=true",
        "checkpoint.every_steps=20",
        "train.steps=200",
        "debug.slow_step_s=0.03",
    )
    assert run.status == "completed" and run.steps_completed == 200
    steps = _steps(tmp_path)
    assert [r.step for r in steps] == list(range(200))
    # the killed rank
    assert [(f["replica"], f["error"]) for f in run.faults.replica_failures] == [
        (1, "killed (SIGKILL)")
    ]
    assert run.faults.fewer_replica_steps[0] == [30, 1]
    assert steps[-1].replicas == 2
    # the non-finite step
    assert run.faults.skipped_steps == [80] and math.isnan(steps[80].loss)
    assert all(math.isfinite(r.loss) for r in steps if r.step != 80)
    # the spike
    [rollback] = run.faults.rollbacks
    assert (rollback["step"], rollback["restored_step"]) == (140, 140)
    assert tuple(rollback["skipped_batches"]) == (140, 140)
    undone = read_records(tmp_path / "run" / ROLLED_BACK_FILE)
    assert undone[0].step == 140 and undone[0].loss > 5 * rollback["mean"]
    assert steps[140].loss < 2 * rollback["mean"]  # step 140 trained again, on batch 141
    assert steps[-1].loss < steps[0].loss
    _agree_where_both_trained(tmp_path)


def test_metrics_are_completed_from_the_other_replicas_records(tmp_path):
    """Steps replica 0 did not write come from the lowest other replica that did, marked."""
    run_dir = tmp_path
    (run_dir / METRICS_FILE).write_text(
        "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (0, 1, 4))
    )
    for replica, steps in ((1, (2, 3, 4)), (2, (3, 5))):
        path = replica_metrics(str(run_dir), replica)
        path.parent.mkdir(exist_ok=True)
        path.write_text(
            "".join(json.dumps({"step": s, "loss": float(replica)}) + "\n" for s in steps)
        )
    assert fill_from_replicas(str(run_dir)) == [2, 3, 5]
    records = read_records(run_dir / METRICS_FILE)
    assert [(r.step, r.loss, r.written_by_replica) for r in records] == [
        (0, 1.0, None),
        (1, 1.0, None),
        (2, 1.0, 1),
        (3, 1.0, 1),
        (4, 1.0, None),
        (5, 2.0, 2),
    ]


@pytest.mark.parametrize(
    ("overrides", "corrupted"),
    [
        ((), {}),
        (("debug.corrupt_step=3",), {3: "nan"}),
        (("debug.corrupt_step=[3,9]", "debug.corrupt_mode=spike"), {3: "spike", 9: "spike"}),
        (("debug.corrupt_step=[3,9]", "debug.corrupt_mode=[nan,spike]"), {3: "nan", 9: "spike"}),
    ],
)
def test_corrupted_steps_pair_each_step_with_its_mode(overrides, corrupted):
    assert corrupted_steps(compose_config(*overrides).debug) == corrupted
