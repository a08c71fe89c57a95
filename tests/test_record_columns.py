"""The results record in sub-records, its flat columns through one mapping (as_dict /
from_dict): results.json, the store's columns, W&B's summary keys and the report's columns
are those a run recorded by meshrun before the grouping (main at b6bbd68: the files in
tests/fixtures/main_b6bbd68 are its run's results.json and its store's columns), and one
more each since, None in a file written before it: `settings`, the experiment as the user
wrote it (issue 57: the record keeps the settings beside what was resolved), and `loss`,
`loss_auto`, train.loss as it ran (issue 63; `loss` a store column and a summary key), and
`loss_kernel`, `loss_kernel_auto`, what computed a chunked loss."""

from __future__ import annotations

import json
from pathlib import Path

from meshrun.core.record import RunRecord, flat_fields, report_columns, summary_keys
from meshrun.driver.sinks.store import COLUMNS, ResultsStore

BEFORE = Path(__file__).parent / "fixtures" / "main_b6bbd68"


def before(name: str) -> dict:
    return json.loads((BEFORE / name).read_text())


ADDED = {  # fields since b6bbd68
    "settings": None,
    "loss": None,
    "loss_auto": None,
    "loss_kernel": None,
    "loss_kernel_auto": None,
}
ADDED_COLUMNS = {"loss": "TEXT"}


def read_now(name: str) -> dict:
    """A file written before the ADDED fields were recorded, as the record reads it today."""
    return before(name) | ADDED


def test_a_results_file_of_the_flat_record_reads_into_its_parts_and_writes_back_the_same():
    written = before("results.json")
    record = RunRecord.from_dict(written)
    assert record.speed.tokens_per_s == written["tokens_per_s"]
    assert record.speed.step_times == written["step_times"]
    assert record.comparison.baseline_mode == written["baseline_mode"] == "fresh"
    assert record.memory.memory_per_rank == written["memory_per_rank"]
    assert record.prediction.predicted_step_time_s == written["predicted_step_time_s"]
    assert record.host.fingerprint_key == written["fingerprint_key"]
    assert record.series.losses == written["losses"]
    assert record.settings is None  # a file written before the settings were recorded
    assert record.as_dict() == read_now("results.json")  # every column, every value


def test_every_column_round_trips_through_the_mapping():
    names = [f.name for _, f in flat_fields()]
    assert len(names) == len(set(names))  # a column names one field of one part
    flat = {name: f"value of {name}" for name in names}
    record = RunRecord.from_dict(flat)
    assert record.as_dict() == flat
    assert RunRecord.from_dict(record.as_dict()) == record
    assert record.checkpoints.export_path == "value of export_path"
    assert record.selection.trial_of == "value of trial_of"


def test_the_store_wandb_and_report_keep_the_columns_they_had():
    had = before("columns.json")
    assert had["store_columns"] | ADDED_COLUMNS == COLUMNS  # names and SQLite types
    assert set(summary_keys()) == set(had["summary_keys"]) | set(ADDED_COLUMNS)
    assert [list(c) for c in report_columns()] == had["report_columns"]  # and their order
    assert set(RunRecord().as_dict()) == set(before("results.json")) | set(ADDED)


def test_a_store_row_of_the_flat_record_reads_back_whole(tmp_path):
    store = ResultsStore(tmp_path / "meshrun.db")
    store.record(before("results.json"))
    (record,) = store.records()
    assert record.as_dict() == read_now("results.json")
    assert store.runs() == [read_now("results.json")]
