"""Which loss a layout trains with (train.loss): the one function the ranks, the planner,
the rules and the record ask, so that what runs, what is planned and what is said agree.

`auto` takes the loss that never holds the whole fp32 logits where the layout can: under
meshrun's TP plan the cross-entropy on vocabulary-sharded logits (`vocab_parallel`), else the
head and the loss over chunks of tokens (`chunked`). It falls back to `full` where neither
applies: DataParallel (its replicas' outputs are gathered on one device, the loss there), a
user's TP plan that does not shard the head with a `head` entry, and a model whose head
meshrun cannot find (model=custom without model.head).

A chunked loss runs on Liger's fused linear cross-entropy (train.loss_kernel) where it can:
on CUDA, with liger-kernel installed, over a head that is a plain linear layer."""

from __future__ import annotations

import functools
import importlib.util
import math

import torch

from meshrun.core.config import ExperimentConfig
from meshrun.core.layout import Layout
from meshrun.core.torch_floor import release
from meshrun.models.registry import model_kind


def loss_method(cfg: ExperimentConfig) -> tuple[str, str | None]:
    """(the loss `cfg` trains with, why auto chose it; None where train.loss said it)."""
    if cfg.train.loss != "auto":
        return str(cfg.train.loss), None
    if Layout.of(cfg.parallel).tp > 1:
        refused = vocab_parallel_refused(cfg)
        kept = "vocab_parallel", "TP: the logits stay sharded over the vocabulary"
    else:
        refused = chunked_refused(cfg)
        kept = "chunked", "the head and the loss over chunks of tokens"
    return kept if refused is None else ("full", refused)


def chunked_refused(cfg: ExperimentConfig) -> str | None:
    """Why train.loss=chunked cannot run in `cfg`'s layout; None where it can."""
    if Layout.of(cfg.parallel).tp > 1:
        return "TP shards the head over the vocabulary: its loss is vocab_parallel"
    if cfg.parallel.data_parallel == "dataparallel":
        return "DataParallel gathers its replicas' logits on one device"
    if not model_kind(cfg.model).finds_head(cfg.model):
        return "the model's head is not named (model.head)"
    zero_bubble = cfg.parallel.pp > 1 and cfg.parallel.schedule == "interleaved_zb"
    if zero_bubble and release(torch.__version__) < ZERO_BUBBLE_TAKES_FUNCTIONS:
        return (
            f"the zero-bubble schedule splits each backward into input and weight passes, and "
            f"torch {torch.__version__}'s weight pass (distributed/pipelining/_backward.py:262 "
            "in 2.11) reads an attribute the chunked loss's autograd Function node lacks "
            "(autograd/__init__.py:103, `out.node._input_metadata`); torch 2.13 runs it"
        )
    return None


# The first torch whose zero-bubble weight pass takes a custom autograd Function's node
# (meshrun-verify of pp2 interleaved_zb with the chunked loss: PASS on 2.13, the rank's
# RuntimeError on 2.11; 2.12 untried).
ZERO_BUBBLE_TAKES_FUNCTIONS = (2, 13)


def vocab_parallel_refused(cfg: ExperimentConfig) -> str | None:
    """Why train.loss=vocab_parallel cannot run in `cfg`'s layout; None where it can."""
    if Layout.of(cfg.parallel).tp == 1:
        return "the logits are sharded over the vocabulary only under TP (parallel.tp > 1)"
    if cfg.parallel.tp_plan is not None:
        return "a user's parallel.tp_plan lays out the head itself"
    if not model_kind(cfg.model).tp_shards_head(cfg.model):
        return "the model's TP plan leaves its head whole (no `head` entry for model.head)"
    return None


def liger_refused(cfg: ExperimentConfig) -> str | None:
    """Why Liger's kernel cannot compute `cfg`'s chunked loss; None where it can."""
    device = cfg.hardware.device_type
    if device != "cuda":
        return f"Liger's kernel is Triton for CUDA, and hardware={cfg.hardware.name} is {device}"
    if not model_kind(cfg.model).head_is_linear(cfg.model):
        return f"model.kind={cfg.model.kind}'s head is not known to be a plain linear layer"
    return liger_import_error()


@functools.cache
def liger_import_error() -> str | None:
    """Why Liger's fused linear cross-entropy does not import here (liger-kernel missing, or
    the Triton it runs on broken); None where it does. Asked on CUDA hosts only."""
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install 'meshrun[liger]')"
    try:
        import liger_kernel.transformers.functional  # noqa: F401, PLC0415
    except (ImportError, RuntimeError) as err:
        return f"liger-kernel does not import: {type(err).__name__}: {err}"
    return None


def loss_kernel(cfg: ExperimentConfig) -> tuple[str, str | None]:
    """(what computes a chunked loss in `cfg`, why auto chose it; None where
    train.loss_kernel said it)."""
    if cfg.train.loss_kernel != "auto":
        return str(cfg.train.loss_kernel), None
    refused = liger_refused(cfg)
    if refused is None:
        return "liger", "CUDA, a linear head, liger-kernel installed"
    return "torch", refused


def chunked_loss_kernel(cfg: ExperimentConfig) -> str | None:
    """What computes `cfg`'s loss where it is chunked (liger or torch); None where it is not."""
    return loss_kernel(cfg)[0] if loss_method(cfg)[0] == "chunked" else None


def liger_chunk_tokens(tokens: int, vocab: int, hidden: int) -> int:
    """The tokens of one chunk of Liger's fused linear cross-entropy over `tokens` of width
    `hidden` into a `vocab`-wide head: its chunk's logits about tokens x hidden, a power of
    two of tokens (liger_kernel/ops/fused_linear_cross_entropy.py, 0.8.5: chunk_size)."""
    chunks = math.ceil(vocab / hidden)
    return min(1 << (math.ceil(tokens / chunks) - 1).bit_length(), tokens)


# A chunk of train.loss=chunked holds this many logits (64 MiB in fp32): the chunk's share
# of the loss's activations, whatever the micro-batch, at a few matmuls of a useful size.
CHUNK_LOGITS = 2**24


def chunk_tokens(vocab: int) -> int:
    """The tokens of one chunk of the chunked loss over a `vocab`-wide head."""
    return max(1, CHUNK_LOGITS // vocab)
