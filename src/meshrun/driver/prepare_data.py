"""data=hf's one tokenization: in the driver, before any rank starts, into a cache the ranks
memory-map (its format: core/data_files.py).

The cache's name is a fingerprint of everything its tokens depend on: the dataset's files
(path, size, mtime), the tokenizer's files (contents), the text field, the format and the
separator. A later run with the same fingerprint reuses it; a changed file gets a new one.
A cache is built in a temporary directory and renamed into place, so a killed prepare never
leaves one that looks complete (and of two concurrent prepares, the first rename wins).
Everything is read from local files; the Hugging Face libraries are kept offline.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from meshrun.core.config import DataConfig, ExperimentConfig, RunConfig, with_resolved
from meshrun.core.data_files import META_FILE, OFFSETS_FILE, TOKENS_FILE, TokenCache
from meshrun.core.errors import fail
from meshrun.validate.data import check_vocab, check_windows, dataset_format

CACHE_VERSION = 1
# A bare tokenizer.json names no EOS; these are the usual ones.
EOS_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
# A tokenizer directory may be a whole model's: its weights are no part of the tokenizer.
WEIGHT_SUFFIXES = {".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".onnx"}
BATCH_DOCS = 1000


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """The Hugging Face libraries never reach the network (their flags are read at import,
    which happens in here); the driver's env is restored after, so that a forkserver started
    before stays valid."""
    keys = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    saved = {key: os.environ.get(key) for key in keys}
    os.environ.update(dict.fromkeys(keys, "1"))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@dataclass
class TextTokenizer:
    """A tokenizers.Tokenizer or a transformers tokenizer, seen the same way."""

    vocab_size: int
    eos_id: int | None
    encode: Callable[[list[str]], list[list[int]]]  # without special tokens


def load_tokenizer(path: str) -> TextTokenizer:
    with offline():
        try:
            if Path(path).is_file():
                from tokenizers import Tokenizer  # noqa: PLC0415 (optional: meshrun[hf]; offline)

                tok = Tokenizer.from_file(path)
                eos = next((i for t in EOS_TOKENS if (i := tok.token_to_id(t)) is not None), None)
                return TextTokenizer(
                    tok.get_vocab_size(with_added_tokens=True),
                    eos,
                    lambda texts: [
                        e.ids for e in tok.encode_batch(texts, add_special_tokens=False)
                    ],
                )
            from transformers import AutoTokenizer  # noqa: PLC0415 (optional: meshrun[hf]; offline)

            auto = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as err:  # any reader's complaint: it is not a tokenizer
            fail(
                "data.tokenizer",
                path,
                f"is not a tokenizer ({type(err).__name__}: {err})",
                "a tokenizer.json, or a directory a tokenizer was saved to",
            )
    return TextTokenizer(
        len(auto),
        auto.eos_token_id,
        lambda texts: auto(texts, add_special_tokens=False)["input_ids"],
    )


def separator(d: DataConfig, tokenizer: TextTokenizer) -> int:
    if d.separator_id is not None:
        return d.separator_id
    if tokenizer.eos_id is None:
        fail(
            "data.separator_id",
            None,
            f"the tokenizer ({d.tokenizer}) has no EOS token to put between documents",
            "a token id to separate documents with",
        )
    return tokenizer.eos_id


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def fingerprint(d: DataConfig, sep: int) -> str:
    digest = hashlib.sha256()
    data = Path(str(d.path)).resolve()
    stats = [
        (str(p.relative_to(data)) if p != data else "", p.stat().st_size, p.stat().st_mtime_ns)
        for p in _files(data)
    ]
    ident = [CACHE_VERSION, str(data), stats, d.text_field, dataset_format(d), sep]
    digest.update(json.dumps(ident).encode())
    for p in _files(Path(str(d.tokenizer))):
        if p.suffix not in WEIGHT_SUFFIXES:
            digest.update(p.name.encode())
            digest.update(p.read_bytes())
    return digest.hexdigest()[:20]


def cache_root(cfg: ExperimentConfig) -> Path:
    return Path(cfg.data.cache_dir or Path(cfg.store.path).parent / "data-cache")


def load_dataset_file(d: DataConfig, scratch: Path):
    """The dataset as one datasets.Dataset (a DatasetDict's "train" split, or its only one);
    the library's own arrow cache goes to `scratch`."""
    with offline():
        import datasets  # noqa: PLC0415 (optional: meshrun[hf]; read offline at import)

        datasets.disable_progress_bars()  # the driver's console is meshrun's
        fmt = dataset_format(d)
        if fmt == "disk":
            loaded = datasets.load_from_disk(str(d.path))
        else:
            loaded = datasets.load_dataset(
                str(fmt), data_files=str(d.path), split="train", cache_dir=str(scratch)
            )
    if isinstance(loaded, datasets.DatasetDict):
        loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
    if d.text_field not in loaded.column_names:
        fail(
            "data.text_field",
            d.text_field,
            "no such column in the dataset",
            " | ".join(loaded.column_names),
        )
    return loaded


def tokenize_into(out: Path, d: DataConfig, tokenizer: TextTokenizer, sep: int) -> dict:
    """Writes the cache files into `out`; its meta."""
    started = time.perf_counter()
    dataset = load_dataset_file(d, out / "hf-scratch")
    dtype = np.uint16 if tokenizer.vocab_size <= 2**16 else np.uint32
    offsets = [0]
    with (out / TOKENS_FILE).open("wb") as tokens:
        for batch in dataset.iter(batch_size=BATCH_DOCS):
            docs = [ids for ids in tokenizer.encode([t or "" for t in batch[d.text_field]]) if ids]
            # an empty document adds no separator either
            np.asarray([t for ids in docs for t in (*ids, sep)], dtype=dtype).tofile(tokens)
            offsets.extend((offsets[-1] + np.cumsum([len(ids) + 1 for ids in docs])).tolist())
    np.save(out / OFFSETS_FILE, np.asarray(offsets, dtype=np.int64))
    shutil.rmtree(out / "hf-scratch", ignore_errors=True)
    return {
        "version": CACHE_VERSION,
        "path": str(d.path),
        "format": str(dataset_format(d)),
        "text_field": d.text_field,
        "tokenizer": str(d.tokenizer),
        "vocab_size": tokenizer.vocab_size,
        "separator_id": sep,
        "dtype": np.dtype(dtype).name,
        "n_docs": len(offsets) - 1,
        "n_tokens": offsets[-1],
        "tokenize_s": round(time.perf_counter() - started, 3),
    }


@dataclass
class Prepared:
    cache: TokenCache
    built: bool  # tokenized now, not found in the cache


def prepare(cfg: ExperimentConfig) -> Prepared:
    """The cache of `cfg.data`'s tokens, built if no complete one has its fingerprint."""
    d = cfg.data
    tokenizer = load_tokenizer(str(d.tokenizer))
    check_vocab(cfg, tokenizer.vocab_size)
    sep = separator(d, tokenizer)
    final = (cache_root(cfg) / fingerprint(d, sep)).resolve()
    if (final / META_FILE).is_file():
        return Prepared(TokenCache(final), built=False)
    scratch = final.parent / f".{final.name}.{uuid.uuid4().hex[:8]}.tmp"
    scratch.mkdir(parents=True)
    try:
        meta = tokenize_into(scratch, d, tokenizer, sep)
        (scratch / META_FILE).write_text(json.dumps(meta, indent=2))
        try:
            scratch.rename(final)
        except OSError:  # another prepare renamed its own copy first
            if not (final / META_FILE).is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return Prepared(TokenCache(final), built=True)


def prepare_data(cfg: ExperimentConfig) -> RunConfig:
    """`cfg` with data=hf's cache prepared and checked, its directory its `data_cache` (what
    the ranks map); none for any other source."""
    if cfg.data.name != "hf":
        return with_resolved(cfg)
    cache = prepare(cfg).cache
    check_windows(cfg, cache)
    return with_resolved(cfg, data_cache=str(cache.path))
