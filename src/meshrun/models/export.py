"""A trained model out of its DCP checkpoint, whole, in one process: a Hugging Face directory
(`from_pretrained` loads it; meshrun's LLaMA as a LlamaForCausalLM) or a consolidated torch
state dict. Whatever layout saved it, DCP reads each tensor whole; what the layout changed
is undone here: the vocabulary's TP padding, GPT-2's q|k|v rows regrouped per TP rank and
its Conv1D weights stored transposed."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from meshrun.core.checkpoints import read_manifest
from meshrun.core.choices import ExportFormat
from meshrun.core.config import ModelConfig
from meshrun.models.hf_export import unpadded
from meshrun.models.registry import model_kind

TORCH_FILE = "model.pt"


def export_checkpoint(
    checkpoint: Path, cfg: ModelConfig, seq_len: int, fmt: ExportFormat, out: Path
) -> Path:
    """Writes the checkpoint's model to `out` in `fmt`; returns the directory or file."""
    tp = read_manifest(checkpoint).degrees.get("tp", 1)
    kind = model_kind(cfg)
    model = kind.build(cfg, seq_len, "cpu", tp)
    if tp > 1:
        model.prepare_tp(tp)  # the row orders TP saved GPT-2's fused q|k|v in
    state = model.state_dict()
    dcp.load({f"model.{k}": v for k, v in state.items()}, checkpoint_id=checkpoint, no_dist=True)
    vocab = getattr(model, "vocab_size", None)
    if fmt == "torch":
        out.mkdir(parents=True, exist_ok=True)
        tensors = {name: unpadded(name, t, vocab) for name, t in state.items()}
        torch.save(tensors, out / TORCH_FILE)
        return out / TORCH_FILE
    kind.save_hf(model, cfg, out)
    return out
