"""A library warning shows once per run: rank 0 prints each distinct one once, however often
it is raised and however often the filters change between (which made Python show it again
every step); what only other ranks raised, the driver prints after the run."""

from __future__ import annotations

import warnings

import pytest

from meshrun.core.run_files.library_warnings import other_ranks_warnings
from meshrun.rank.library_warnings import show_once


@pytest.fixture
def routed(monkeypatch):
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        yield


def _raise_every_step(text: str, steps: int = 3) -> None:
    for _ in range(steps):
        with warnings.catch_warnings():  # as a training step's filters: the registry resets
            warnings.warn(text, UserWarning, stacklevel=1)


def test_rank_0_prints_each_warning_once(tmp_path, routed, capsys):
    show_once(str(tmp_path), rank=0)
    _raise_every_step("a view tensor")
    _raise_every_step("another")
    printed = capsys.readouterr().err
    assert printed.count("UserWarning: a view tensor") == 1
    assert printed.count("UserWarning: another") == 1


def test_other_ranks_note_theirs_and_the_driver_names_what_rank_0_did_not_raise(
    tmp_path, routed, capsys
):
    show_once(str(tmp_path), rank=0)
    _raise_every_step("everywhere")
    for rank in (1, 3):
        show_once(str(tmp_path), rank=rank)
        _raise_every_step("everywhere")
        _raise_every_step("on the last stage only")
    assert capsys.readouterr().err.count("everywhere") == 1  # ranks 1 and 3 print nothing
    assert other_ranks_warnings(str(tmp_path)) == {"UserWarning: on the last stage only": [1, 3]}


def test_ignored_warnings_stay_ignored(tmp_path, routed, capsys):
    show_once(str(tmp_path), rank=0)
    warnings.filterwarnings("ignore", "not for users")
    _raise_every_step("not for users")
    assert capsys.readouterr().err == ""
