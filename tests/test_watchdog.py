"""Hang watchdog: a rank stuck in a collective ends the training run with a message naming
the rank, the step and the operation, within timeout + 15 s, and tears every rank down; when
the backend's timeout does not fire, the rank's own watchdog thread ends it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time

import pytest

from meshrun.core.run_files.failures import first_failure
from meshrun.core.run_files.flight_records import (
    TRANSFERS_KEY,
    describe,
    dump_path,
    read_dumps,
    stack_path,
    transfers_waited,
)
from meshrun.core.run_files.positions import diagnose, read_positions
from meshrun.rank.watchdog import GRACE_S, Watchdog, step_collectives
from tests.test_failures import failed_run

HANG = (
    "model=tiny",
    "parallel=ddp",
    "train.steps=8",
    "train.untimed_steps=1",
    "train.log_every=1",
    "debug.fail_rank=1",
    "debug.fail_step=2",
    "debug.fail_mode=hang",
)


@pytest.mark.waits  # on backend.timeout_s
def test_hung_training_run_names_rank_step_and_operation(tmp_path, monkeypatch, marked_env):
    """The real launcher (torch elastic), so that every rank is proven torn down."""
    timeout = 5
    results, _, _ = failed_run(
        tmp_path, monkeypatch, marked_env, *HANG, f"backend.timeout_s={timeout}"
    )
    ended = time.time()
    expected = (
        "collective hang: rank 0 waited in forward/backward (gradient all_reduce) at step 2; "
        "rank 1 never entered it (was at step 2, outside any collective)"
    )
    assert results["status"] == "failed" and expected in results["error"]
    assert len(results["losses"]) == 2  # steps 0 and 1 finished and are kept
    hang_started = read_positions(results["run_dir"])[1].since
    assert ended - hang_started < timeout + 15
    # the flight recorder's account: rank 0 issued step 2's first collective (DDP's buffer
    # broadcast), rank 1's last is the one before it (step 1's log step)
    dumps = read_dumps(results["run_dir"])
    assert set(dumps) == {0, 1}
    stuck, before = dumps[0][-1], dumps[1][-1]
    assert stuck.op.startswith("gloo:") and stuck.seq == before.seq + 1
    assert stuck.group == before.group and before.op.startswith("gloo:")
    assert f"rank 0's last collective: {stuck}" in results["error"]
    assert (
        f"rank 1 never issued it (its last there: {before.op} #{before.seq})" in (results["error"])
    )
    # where rank 1 was instead: its main thread's stack, in the injected hang
    assert "faults.py" in stack_path(results["run_dir"], 1).read_text()


@pytest.mark.waits  # on backend.timeout_s
def test_a_pipeline_hang_names_the_transfer_each_rank_waited_on(tmp_path, monkeypatch, marked_env):
    """gloo's flight recorder keeps no send or receive: meshrun's own record of the stages'
    transfers says that rank 0's last was micro-batch 0's activations sent to rank 1 (gloo's
    send waits for the receive), and that rank 1, which hangs before its step 2, posted no
    receive since step 1's last gradients it sent."""
    results, _, _ = failed_run(
        tmp_path,
        monkeypatch,
        marked_env,
        *HANG[:1],
        "parallel=pp2",
        *HANG[2:],
        "backend.timeout_s=5",
    )
    error = results["error"]
    assert "Timed out waiting 5000ms for send operation" in error
    assert (
        "meshrun's record of the pipeline's transfers: rank 0 has no receive pending (its last "
        "posted: send of micro-batch 0's activations to rank 1 ([2, 128, 64] float32, 65,536 "
        "bytes)), rank 1 has no receive pending (its last posted: send of micro-batch 3's "
        "gradients to rank 0"
    ) in error, error


@pytest.mark.waits  # on the watchdog's timeout
def test_watchdog_ends_a_rank_the_backend_does_not_time_out(tmp_path):
    """No process group at all: only the watchdog thread can end this 'collective'."""
    code = textwrap.dedent(f"""
        import time
        from meshrun.rank.watchdog import Watchdog
        watchdog = Watchdog({str(tmp_path)!r}, rank=3, world_size=1, timeout_s=1)
        with watchdog.inside(7, "all_reduce (stuck)", one_collective=True):
            time.sleep(120)
    """)
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, timeout=60, check=False
    )
    assert proc.returncode == 1
    assert time.monotonic() - started < 1 + GRACE_S + 15
    rank, error, _ = first_failure(str(tmp_path))
    assert rank == 3
    assert error.startswith("CollectiveHang: rank 3 stuck in all_reduce (stuck) at step 7")
    assert "backend.timeout_s=1" in error
    assert diagnose(str(tmp_path), 3) == "rank 3 waited in all_reduce (stuck) at step 7"


@pytest.mark.waits  # on a sleep past the deadline
def test_watchdog_leaves_phases_that_also_compute_to_the_backend(tmp_path):
    """A long forward/backward is not a hang: only one-collective phases have a deadline."""
    code = textwrap.dedent(f"""
        import time
        from meshrun.rank.watchdog import GRACE_S, Watchdog
        watchdog = Watchdog({str(tmp_path)!r}, rank=0, world_size=1, timeout_s=0.5)
        with watchdog.inside(0, "forward/backward (gradient all_reduce)"):
            time.sleep(0.5 + GRACE_S + 2)
    """)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert first_failure(str(tmp_path)) is None


def test_an_error_outside_collectives_is_no_hang(tmp_path):
    watchdogs = [Watchdog(str(tmp_path), rank, world_size=2, timeout_s=60) for rank in (0, 1)]
    watchdogs[0].at(4)
    try:
        with watchdogs[1].inside(4, "all_reduce (gradient norm)"):
            raise RuntimeError("peer closed the connection")
    except RuntimeError:
        pass
    assert diagnose(str(tmp_path), 0) is None  # rank 0 failed outside any collective
    assert diagnose(str(tmp_path), 1) == (
        "rank 1 waited in all_reduce (gradient norm) at step 4; "
        "rank 0 never entered it (was at step 4, outside any collective)"
    )
    for watchdog in watchdogs:
        watchdog.stop()
    assert sorted(read_positions(str(tmp_path))) == [0, 1]


def test_step_collectives_follow_the_layout():
    assert step_collectives({"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 1}) == (
        "forward/backward"
    )
    assert step_collectives({"pp": 2, "dp_replicate": 1, "dp_shard": 2, "tp": 2}) == (
        "forward/backward (pipeline send/recv, FSDP all_gather/reduce_scatter, "
        "tensor-parallel collectives)"
    )


def _dump(run_dir, rank: int, *collectives: tuple[str, int]) -> None:
    """A flight-recorder dump in torch's JSON format (`_dump_fr_trace_json`'s entries)."""
    entries = [
        {
            "process_group": ["0", "default_pg"],
            "collective_seq_id": seq,
            "p2p_seq_id": 0,
            "is_p2p": False,
            "profiling_name": op,
            "input_sizes": [[4]],
            "input_dtypes": ["Float"],
            "time_created_ns": seq,
        }
        for op, seq in collectives
    ]
    path = dump_path(str(run_dir), rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"entries": entries}))


def test_flight_recorder_names_who_never_issued_the_collective(tmp_path):
    _dump(tmp_path, 0, ("gloo:all_reduce", 1), ("gloo:broadcast", 2))
    _dump(tmp_path, 1, ("gloo:all_reduce", 1))
    said = describe(str(tmp_path), failed_rank=0, world_size=3)
    assert said.startswith(
        "rank 0's last collective: gloo:broadcast #2 of default_pg (input [[4]] Float); "
        "rank 1 never issued it (its last there: gloo:all_reduce #1); rank 2 left no dump (gone)"
    )


def test_the_transfer_each_rank_waits_on_is_its_oldest_receive_not_done(tmp_path):
    sent = {"op": "send", "what": "activations", "microbatch": 1, "peer": 1, "shape": [2, 4],
            "dtype": "float32", "bytes": 32, "posted_s": 1.0, "done_s": None}  # fmt: skip
    waited = {**sent, "op": "recv", "what": "gradients", "microbatch": 0, "posted_s": 2.0}
    ahead = {**waited, "microbatch": 1, "posted_s": 3.0}
    got = {**waited, "peer": 0, "what": "activations", "done_s": 2.5}
    for rank, noted in ((0, [sent, ahead, waited]), (1, [got])):
        path = dump_path(str(tmp_path), rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"entries": [], TRANSFERS_KEY: noted}))
    assert transfers_waited(str(tmp_path)) == (
        "rank 0 waits on the receive of micro-batch 0's gradients from rank 1 ([2, 4] float32, "
        "32 bytes), rank 1 has no receive pending (its last posted: receive of micro-batch "
        "0's activations from rank 0 ([2, 4] float32, 32 bytes))"
    )


def test_flight_recorder_does_not_blame_a_collective_every_rank_issued(tmp_path):
    """A wait in what gloo does not record (a pipeline's send): no peer is behind."""
    for rank in (0, 1):
        _dump(tmp_path, rank, ("gloo:all_reduce", 1), ("gloo:barrier", 2))
    said = describe(str(tmp_path), failed_rank=0, world_size=2)
    assert said.startswith("every rank's last recorded collective is gloo:barrier #2")
    assert "the recorder does not keep" in said
