"""data=text trains on a local file's bytes, split over data-parallel ranks like synthetic."""

from __future__ import annotations

import torch

from meshrun.core.config import DataConfig
from meshrun.rank.train.data import TextBytes, build_dataset


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
    losses = [step["loss"] for step in measured.steps]
    assert losses[-1] < 0.8 * losses[0]  # a repetitive text is quickly learnt
