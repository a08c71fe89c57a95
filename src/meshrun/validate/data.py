"""The rules about data: the files a source reads, before anything is read (`check_data`);
once the global batch is resolved, data=text's held-out part (`check_text_heldout`); and for
data=hf what only the tokenizer and the tokenized cache can tell (`check_vocab`,
`check_windows`, called by the driver's prepare step). A held-out split must hold one
evaluation's samples only when the run evaluates (train.eval.every_steps > 0)."""

from __future__ import annotations

from pathlib import Path

from meshrun.core.batch import global_batch_size
from meshrun.core.choices import DataFormat
from meshrun.core.config import DataConfig, ExperimentConfig
from meshrun.core.data_files import TokenCache, n_windows, text_spans
from meshrun.core.errors import fail, positive
from meshrun.models import model_shape

# A file's format by its suffix; a directory is a `save_to_disk` dataset.
SUFFIXES = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".txt": "text",
    ".text": "text",
}
DISK_MARKERS = ("state.json", "dataset_dict.json")


def check_data(cfg: ExperimentConfig) -> None:
    if cfg.data.name in ("text", "hf") and not 0 <= cfg.data.heldout_fraction < 1:
        fail(
            "data.heldout_fraction",
            cfg.data.heldout_fraction,
            "is the share of the data held out for evaluation",
            "a number in [0, 1)",
        )
    if cfg.data.name == "text":
        _check_text(cfg)
    elif cfg.data.name == "hf":
        _check_hf(cfg)


def _check_text(cfg: ExperimentConfig) -> None:
    path = Path(str(cfg.data.path))
    if path.is_dir():
        _text_directory(cfg.data.path, path)
    if not path.is_file():
        fail("data.path", cfg.data.path, "no such file", "the path of a local text file")
    length = cfg.train.seq_len + 1
    train, _ = text_spans(path.stat().st_size, cfg.data.heldout_fraction)
    if len(train) < length:
        fail(
            "data.path",
            cfg.data.path,
            f"file's training part ({len(train)} bytes, data.heldout_fraction="
            f"{cfg.data.heldout_fraction} held out) is shorter than train.seq_len + 1 "
            f"({length} bytes)",
            "a longer file or a smaller seq_len",
        )
    if model_shape(cfg.model).vocab_size < 256:
        fail(
            "model.vocab_size",
            model_shape(cfg.model).vocab_size,
            "data=text uses byte tokens (256 values)",
            ">= 256",
        )


def _text_directory(given: str, path: Path) -> None:
    """data=text given a directory: what it is and which source reads it."""
    if any((path / marker).is_file() for marker in DISK_MARKERS):
        fail(
            "data.path",
            given,
            "is a directory; data=text reads one text file, and this is a save_to_disk "
            "dataset, which data=hf reads",
            f"data=hf data.path={path} data.tokenizer=<tokenizer>, or one text file",
        )
    fail(
        "data.path",
        given,
        "is a directory; data=text reads one text file (its bytes are the tokens)",
        "the path of one text file (the directory's files joined into one: cat DIR/*.txt > "
        "corpus.txt), or data=hf for a json/jsonl, parquet or save_to_disk dataset",
    )


def _check_hf(cfg: ExperimentConfig) -> None:
    d = cfg.data
    if not Path(str(d.path)).exists():
        fail(
            "data.path",
            d.path,
            "no such file or directory",
            "a local json/jsonl, parquet or text file, or a save_to_disk directory",
        )
    dataset_format(d)
    if d.tokenizer is None or not Path(d.tokenizer).exists():
        fail(
            "data.tokenizer",
            d.tokenizer,
            "no such file or directory",
            "a local tokenizer directory (save_pretrained) or a tokenizer.json",
        )
    if d.num_workers < 0:
        fail(
            "data.num_workers",
            d.num_workers,
            "must not be negative",
            "0 (load in the rank's own process) or more worker processes",
        )
    positive("data.prefetch_factor", d.prefetch_factor)
    if d.separator_id is not None and d.separator_id < 0:
        fail("data.separator_id", d.separator_id, "is a token id", "an id >= 0, or null (EOS)")


def dataset_format(d: DataConfig) -> DataFormat:
    """`data.format`, or the format the path's suffix (or directory) names."""
    if d.format is not None:
        return d.format
    path = Path(str(d.path))
    if path.is_dir():
        if not any((path / marker).is_file() for marker in DISK_MARKERS):
            fail(
                "data.path",
                d.path,
                f"a directory that is no save_to_disk dataset (no {' or '.join(DISK_MARKERS)})",
                "a save_to_disk directory, or a file",
            )
        return DataFormat["disk"]
    if path.suffix not in SUFFIXES:
        fail(
            "data.format",
            None,
            f"cannot tell the format of {path.name!r} by its suffix",
            f"data.format={' | '.join(DataFormat.values())}, or a path ending in "
            f"{' | '.join(SUFFIXES)}",
        )
    return DataFormat[SUFFIXES[path.suffix]]


def check_vocab(cfg: ExperimentConfig, tokenizer_vocab: int) -> None:
    vocab = model_shape(cfg.model).vocab_size
    if tokenizer_vocab > vocab:
        fail(
            "model.vocab_size",
            vocab,
            f"is smaller than the tokenizer's vocabulary "
            f"({tokenizer_vocab} tokens, data.tokenizer={cfg.data.tokenizer})",
            f"model.vocab_size >= {tokenizer_vocab}",
        )


def check_windows(cfg: ExperimentConfig, cache: TokenCache) -> None:
    """Enough training windows for one global batch; when the run evaluates, enough
    held-out windows for one evaluation."""
    d, t = cfg.data, cfg.train
    length = t.seq_len + 1
    train, heldout = cache.spans(d.heldout_fraction)
    have, batch = n_windows(train, length), global_batch_size(cfg)
    if have < batch:
        fail(
            "data.path",
            d.path,
            f"has {have} training windows of train.seq_len + 1 = "
            f"{length} tokens ({len(train)} tokens), one step needs train.global_batch_size "
            f"= {batch}",
            "more documents, a smaller seq_len or global batch",
        )
    _check_heldout(cfg, heldout, "tokens")


def check_text_heldout(cfg: ExperimentConfig) -> None:
    """data=text's held-out bytes against one evaluation of the resolved global batch."""
    if cfg.data.name == "text":
        size = Path(str(cfg.data.path)).stat().st_size
        _check_heldout(cfg, text_spans(size, cfg.data.heldout_fraction)[1], "bytes")


def _check_heldout(cfg: ExperimentConfig, heldout: range, unit: str) -> None:
    """One evaluation reads train.eval.batches global batches of distinct held-out windows."""
    t = cfg.train
    if not t.eval.every_steps:
        return
    length = t.seq_len + 1
    batch = global_batch_size(cfg)
    have, need = n_windows(heldout, length), t.eval.batches * batch
    if have < need:
        fail(
            "data.heldout_fraction",
            cfg.data.heldout_fraction,
            f"holds out {have} windows of train.seq_len + 1 = {length} {unit} "
            f"({len(heldout)} {unit}); one evaluation needs train.eval.batches x "
            f"train.global_batch_size = {t.eval.batches} x {batch} = {need}",
            "a larger fraction or more data, fewer train.eval.batches, or "
            "train.eval.every_steps=0 (no evaluation)",
        )
