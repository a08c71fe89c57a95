"""Per-step rows (metrics.jsonl) written and read through one type, StepRow: the file keeps
the format it had (tests/fixtures/main_b6bbd68/metrics.jsonl, written by meshrun before
StepRow), and rows of older files read with what they lack as None."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from meshrun.core.run_files.metrics import ALWAYS, ROLLED_BACK_FILE, StepRow, read_records
from meshrun.driver.experiment import read_steps
from meshrun.driver.results import data_wait_share
from meshrun.rank.metrics.log import MetricsLog
from meshrun.rank.train.pending import step_records

BEFORE = Path(__file__).parent / "fixtures" / "main_b6bbd68" / "metrics.jsonl"


def test_rows_written_before_read_as_step_rows_and_write_back_the_same():
    lines = BEFORE.read_text().splitlines()
    rows = read_records(BEFORE)
    assert [r.step for r in rows] == list(range(6))
    assert rows[0].step_time_s is None and rows[2].step_time_s > 0  # untimed, then timed
    assert all(r.slowest_rank in (0, 1) and r.data_wait_s >= 0 for r in rows)
    assert [r.to_json() for r in rows] == [json.loads(line) for line in lines]


def test_an_older_row_reads_with_what_it_lacks_as_none_and_unknown_keys_dropped():
    older = StepRow.from_json({"step": 3, "loss": 2.0, "step_time_s": 1.0, "retired_key": 1})
    assert older == StepRow(step=3, loss=2.0, step_time_s=1.0)
    assert older.data_wait_s is None and older.eval_loss is None and not older.profiled
    assert data_wait_share([older]) is None  # no waits measured: none claimed


def test_a_resume_keeps_the_earlier_attempts_rows_as_they_were_written(tmp_path):
    """A resumed run's rank 0 drops the steps it trains again (MetricsLog.keep_before); the
    driver reads the kept ones, written by the earlier attempt, with the new ones after."""
    path = tmp_path / "metrics.jsonl"
    shutil.copy(BEFORE, path)
    log = MetricsLog(path)
    dropped = log.keep_before(4)
    assert [r.step for r in dropped] == [4, 5]
    assert path.read_text().splitlines() == BEFORE.read_text().splitlines()[:4]
    log(step_records(4, [1.5, 1.4], [0.9, 0.8], [3e-4, 3e-4], [0.5, 0.6], [0.01, 0.02]))
    steps = read_steps(str(tmp_path))
    assert [r.step for r in steps] == list(range(6))
    assert steps[5] == StepRow(5, 1.4, grad_norm=0.8, lr=3e-4, step_time_s=0.6, data_wait_s=0.02)


def test_a_written_row_has_the_always_keys_and_only_the_others_it_has(tmp_path):
    [row] = step_records(7, [2.0], [1.0], [1e-3], [], [0.1])
    assert list(row.to_json()) == list(ALWAYS)  # untimed: step_time_s null, as before
    log = MetricsLog(tmp_path / "metrics.jsonl")
    log([row])
    log.roll_back(7, rollback=1)
    [undone] = [json.loads(line) for line in (tmp_path / ROLLED_BACK_FILE).read_text().splitlines()]
    assert undone == {**row.to_json(), "rollback": 1}
