"""A small local corpus for data=hf, written the ways `datasets` reads (jsonl, parquet, text,
save_to_disk), and a byte-level BPE trained on it (a tokenizer.json and a save_pretrained
directory of the same tokenizer). Everything real, nothing downloaded."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import datasets
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

VOCAB = 384  # the BPE's most (this corpus learns fewer); model=tiny needs model.vocab_size=384
EOS = "</s>"
SUBJECTS = ("the cat", "a dog", "my friend", "the old man", "a small bird", "the teacher")
VERBS = ("sees", "likes", "follows", "draws", "finds", "carries")
OBJECTS = ("the red ball", "a green apple", "the long road", "a quiet river", "the blue box")


@dataclass
class Corpus:
    docs: list[str]
    jsonl: Path
    parquet: Path
    text: Path
    disk: Path
    tokenizer_json: Path
    tokenizer_dir: Path

    def overrides(self, path: Path | None = None, *extra: str) -> list[str]:
        """`meshrun` overrides training model=tiny on this corpus (jsonl unless `path`)."""
        return [
            "data=hf",
            f"data.path={path or self.jsonl}",
            f"data.tokenizer={self.tokenizer_json}",
            "model=tiny",
            f"model.vocab_size={VOCAB}",
            *extra,
        ]


def documents(n: int, seed: int = 0) -> list[str]:
    """Documents of 2 to 6 sentences from a tiny grammar: learnable in a few steps."""
    rng = random.Random(seed)

    def sentence() -> str:
        return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}."

    return [" ".join(sentence() for _ in range(rng.randint(2, 6))) for _ in range(n)]


def train_tokenizer(docs: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(docs, trainer)
    return tok


def write_corpus(root: Path, n_docs: int = 400) -> Corpus:
    datasets.disable_progress_bars()
    root.mkdir(parents=True, exist_ok=True)
    docs = documents(n_docs)
    jsonl = root / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    table = datasets.Dataset.from_dict({"text": docs})
    table.to_parquet(str(root / "corpus.parquet"))
    (root / "corpus.txt").write_text("".join(d + "\n" for d in docs))  # one document a line
    table.save_to_disk(str(root / "corpus-disk"))
    tok = train_tokenizer(docs)
    tok.save(str(root / "tokenizer.json"))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS).save_pretrained(
        str(root / "tokenizer")
    )
    return Corpus(
        docs,
        jsonl,
        root / "corpus.parquet",
        root / "corpus.txt",
        root / "corpus-disk",
        root / "tokenizer.json",
        root / "tokenizer",
    )
