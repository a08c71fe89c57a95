"""Any vocabulary under tensor parallelism (Megatron's make-vocab-size-divisible-by): the
embedding and the head are built with the vocabulary padded to a multiple of the TP degree,
so that each rank holds an equal slice. Padded rows start at zero and no token id reaches
them; the padded logits are cut off before the loss, which is then exactly the unpadded one
(and their rows get no gradient)."""

from __future__ import annotations

import torch
from torch import nn

from meshrun.core.model_shape import padded_vocab

VOCAB_MODULES = ("tok_embeddings", "output")


def pad_vocab(model: nn.Module, vocab: int, multiple: int) -> None:
    """Swap in padded embedding and head (on the same device), keeping a tied head tied."""
    padded = padded_vocab(vocab, multiple)
    if padded == vocab:
        return
    embedding, head = model.tok_embeddings, model.output
    device = embedding.weight.device
    model.tok_embeddings = nn.Embedding(padded, embedding.embedding_dim, device=device)
    model.output = nn.Linear(head.in_features, padded, bias=head.bias is not None, device=device)
    model.tie_weights()


def unpad_logits(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """The logits of the `vocab` real tokens. A head that computed the loss itself returns it
    (0-d: train.loss=chunked), which passes. Logits sharded over the vocabulary
    (train.loss=vocab_parallel) keep their width, the padded columns pushed to the lowest
    value, which no softmax picks: cutting them off would gather every shard."""
    if logits.ndim == 0 or logits.shape[-1] == vocab:
        return logits
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 (the driver loads no DTensor)

    if isinstance(logits, DTensor):
        return logits + _padding_mask(logits, vocab)
    return logits[..., :vocab]


def _padding_mask(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """0 for the real columns, the dtype's lowest for the padded ones, sharded as `logits`'
    last dim is (each rank cuts its own slice: no communication)."""
    from torch.distributed.tensor import Shard, distribute_tensor  # noqa: PLC0415

    mask = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.to_local().device)
    mask[vocab:] = torch.finfo(logits.dtype).min
    return distribute_tensor(mask, logits.device_mesh, [Shard(0)], src_data_rank=None)


def unpadded_shape(name: str, param: torch.Tensor, vocab: int) -> torch.Size:
    """The shape `name` has without padding: the values a layout-independent init draws."""
    if name.split(".", 1)[0] in VOCAB_MODULES and param.shape[0] != vocab:
        return torch.Size((vocab, *param.shape[1:]))
    return param.shape
