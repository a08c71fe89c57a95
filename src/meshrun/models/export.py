"""A trained model out of its DCP checkpoint, whole, in one process: a Hugging Face directory
(`from_pretrained` loads it; meshrun's LLaMA as a LlamaForCausalLM) or a consolidated torch
state dict. Whatever layout saved it, DCP reads each tensor whole; what the layout changed
is undone here: the vocabulary's TP padding, GPT-2's q|k|v rows regrouped per TP rank and
its Conv1D weights stored transposed."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from meshrun.core.checkpoints import read_manifest
from meshrun.core.choices import ExportFormat
from meshrun.core.config import HFModelConfig, LlamaModelConfig, ModelConfig
from meshrun.models import build_model
from meshrun.models.convert import export_hf
from meshrun.models.vocab import unpadded_shape

TORCH_FILE = "model.pt"


def export_checkpoint(
    checkpoint: Path, cfg: ModelConfig, seq_len: int, fmt: ExportFormat, out: Path
) -> Path:
    """Writes the checkpoint's model to `out` in `fmt`; returns the directory or file."""
    tp = read_manifest(checkpoint).degrees.get("tp", 1)
    model = build_model(cfg, seq_len, "cpu", vocab_multiple=tp)
    if tp > 1:
        model.prepare_tp(tp)  # the row orders TP saved GPT-2's fused q|k|v in
    state = model.state_dict()
    dcp.load({f"model.{k}": v for k, v in state.items()}, checkpoint_id=checkpoint, no_dist=True)
    vocab = getattr(model, "vocab_size", None)
    if fmt == "torch":
        out.mkdir(parents=True, exist_ok=True)
        tensors = {name: _unpadded(name, t, vocab) for name, t in state.items()}
        torch.save(tensors, out / TORCH_FILE)
        return out / TORCH_FILE
    if isinstance(cfg, LlamaModelConfig):
        export_hf(model, out)
    elif isinstance(cfg, HFModelConfig):
        _save_transformers(model, cfg, out)
    else:
        raise ValueError(f"model.kind={cfg.kind} has no Hugging Face form: export it as torch")
    return out


def _unpadded(name: str, tensor: torch.Tensor, vocab: int | None) -> torch.Tensor:
    if vocab is None:
        return tensor
    return tensor[: unpadded_shape(name, tensor, vocab)[0]].contiguous()


def _save_transformers(model: nn.Module, cfg: HFModelConfig, out: Path) -> None:
    """Our tensors under transformers' names, in a model of its own class: save_pretrained
    then writes what from_pretrained reads (config, tied weights, safetensors), in the
    layout its checkpoints have (core_model_loading.revert_weight_conversion: fused MoE
    experts one by one, Mixtral's under block_sparse_moe.experts.{i}.w1/w2/w3)."""
    from meshrun.models.hf import hf_config, model_class  # noqa: PLC0415 (meshrun[hf])

    theirs = {}
    for name, param in model.named_parameters():
        value = _unpadded(name, param.detach(), model.vocab_size)
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
