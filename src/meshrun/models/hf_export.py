"""A trained meshrun model of a transformers class saved as that class's save_pretrained
directory (checkpoint.export=hf of kind=hf), the layout's changes undone: the vocabulary's TP
padding, GPT-2's q|k|v rows regrouped per TP rank and its Conv1D weights stored transposed."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from meshrun.core.config import HFModelConfig
from meshrun.models.vocab import unpadded_shape


def unpadded(name: str, tensor: torch.Tensor, vocab: int | None) -> torch.Tensor:
    """`tensor` without the vocabulary rows TP padding added (vocab.py); as it is where the
    model has no padded vocabulary (`vocab` None)."""
    if vocab is None:
        return tensor
    return tensor[: unpadded_shape(name, tensor, vocab)[0]].contiguous()


def save_transformers(model: nn.Module, cfg: HFModelConfig, out: Path) -> None:
    """Our tensors under transformers' names, in a model of its own class: save_pretrained
    then writes what from_pretrained reads (config, tied weights, safetensors), in the
    layout its checkpoints have (core_model_loading.revert_weight_conversion: fused MoE
    experts one by one, Mixtral's under block_sparse_moe.experts.{i}.w1/w2/w3)."""
    from meshrun.models.hf import hf_config, model_class  # noqa: PLC0415 (meshrun[hf])

    theirs = {}
    for name, param in model.named_parameters():
        value = unpadded(name, param.detach(), model.vocab_size)
        order = model.row_orders.get(name)
        if order is not None:  # row i holds source row order[i]
            value = torch.empty_like(value).index_copy_(0, order, value)
        if name in model.transposed:
            value = value.t()
        theirs[model.source_name(name)] = value.contiguous()
    hf = model_class(cfg.architecture)(hf_config(cfg))
    missing, unexpected = hf.load_state_dict(theirs, strict=False)
    shared = (
        dict(hf.named_parameters(remove_duplicate=False)).keys()
        - dict(hf.named_parameters()).keys()
    )  # a tied head: the embedding's tensor under a second name
    computed = dict(hf.named_buffers()).keys()  # built from the config (decay tables)
    if unexpected or set(missing) - shared - computed:
        raise RuntimeError(f"export: tensors not mapped: {unexpected or missing}")
    hf.save_pretrained(out)
