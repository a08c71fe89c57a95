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
    return logits if logits.shape[-1] == vocab else logits[..., :vocab]


def unpadded_shape(name: str, param: torch.Tensor, vocab: int) -> torch.Size:
    """The shape `name` has without padding: the values a layout-independent init draws."""
    if name.split(".", 1)[0] in VOCAB_MODULES and param.shape[0] != vocab:
        return torch.Size((vocab, *param.shape[1:]))
    return param.shape
