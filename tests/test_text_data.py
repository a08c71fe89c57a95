"""data=text trains on a local file's bytes, split over data-parallel ranks like synthetic."""

from __future__ import annotations

import pytest
import torch

from meshrun.core.config import DataConfig
from meshrun.core.errors import ConfigError
from meshrun.rank.train.data import TextBytes, build_dataset
from meshrun.validate.data import check_data
from tests.helpers import compose_config


def test_text_samples_are_consecutive_windows_of_the_file(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(range(256)) * 4)
    dataset = build_dataset(DataConfig(name="text", path=str(corpus)), None, 256, seed=0, seq_len=8)
    assert isinstance(dataset, TextBytes)
    batch = dataset.batch(range(2, 4), 9, torch.device("cpu"))
    assert batch.tolist() == [list(range(18, 27)), list(range(27, 36))]


def test_ddp_trains_on_a_text_file(experiment, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    _, measured = experiment(
        "model=tiny",
        "parallel=ddp",
        "data=text",
        f"data.path={corpus}",
        "train.steps=12",
        "train.seq_len=32",
        "train.lr=3e-3",
        "metrics.baseline=off",
    )
    assert measured.ok, measured.meta.error
    losses = [step.loss for step in measured.steps]
    assert losses[-1] < 0.8 * losses[0]  # a repetitive text is quickly learnt


def test_a_directory_for_data_text_is_said_to_be_one(tmp_path, hf_corpus):
    """Not "no such file": it is there, and data=text reads one file; a save_to_disk
    directory is data=hf's."""
    (tmp_path / "a.txt").write_text("some text")
    with pytest.raises(ConfigError) as caught:
        check_data(compose_config("data=text", f"data.path={tmp_path}"))
    said = str(caught.value)
    assert caught.value.key == "data.path" and "no such file" not in said
    assert "is a directory; data=text reads one text file" in said
    assert "Valid: the path of one text file" in said
    with pytest.raises(ConfigError) as disk:
        check_data(compose_config("data=text", f"data.path={hf_corpus.disk}"))
    assert "a save_to_disk dataset, which data=hf reads" in str(disk.value)
    assert f"data=hf data.path={hf_corpus.disk}" in str(disk.value)
