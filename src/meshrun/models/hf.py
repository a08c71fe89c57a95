"""Hugging Face transformers causal LMs, as meshrun's layouts see a decoder.

The transformers model is built from its config on the meta device (no hub), then taken
apart into what a layout needs, under the names meshrun's own decoder uses: the token
embedding `tok_embeddings`, the decoder layers `layers` keyed by their global index (a
pipeline stage drops those it does not own and names stay stable), the final `norm` and the
head `output`. Which modules those are comes from the model's own `base_model_pp_plan` (its
first entry the embedding, then the layer list, its last entry the final norm) and its output
embeddings; the TP plan from its `base_model_tp_plan`. The forward is the base model's,
unrolled: embed, the rotary position embeddings, each layer with the causal mask left to
SDPA (no padding in training windows), norm, head.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.pytorch_utils import Conv1D

from meshrun.core.config import HFModelConfig
from meshrun.models.checkpoint_files import SavedTensors
from meshrun.models.hf_attention import sliding_window_mask, sliding_windows, use_meshrun_sdpa
from meshrun.models.hf_experts import is_hf_experts
from meshrun.models.hf_files import conversions, saved_sources
from meshrun.models.init import seeded_normal
from meshrun.models.shards import (
    Reordered,
    Source,
    Transposed,
    fill,
    model_name,
    named_tensors,
)
from meshrun.models.vocab import pad_vocab, unpad_logits, unpadded_shape


@dataclass(frozen=True)
class ShippedPlan:
    """What meshrun supplies for an architecture whose config has no pp/tp plan: the base
    model's (embedding, layer list, final norm), a learned position table on the first stage,
    a TP plan in transformers' naming, and the (attention, projection) of each block whose
    projection computes q|k|v fused, which TP needs regrouped per rank (prepare_tp)."""

    stages: tuple[str, str, str]
    tp_plan: dict[str, str]
    positions: str | None = None
    fused_qkv: tuple[str, str] | None = None


SHIPPED_PLANS = {
    # GPT-2's Conv1D layers (weights stored transposed) become nn.Linear when built.
    "GPT2LMHeadModel": ShippedPlan(
        stages=("wte", "h", "ln_f"),
        tp_plan={
            "h.*.attn.c_attn": "colwise",
            "h.*.attn.c_proj": "rowwise",
            "h.*.mlp.c_fc": "colwise",
            "h.*.mlp.c_proj": "rowwise",
        },
        positions="wpe",
        fused_qkv=("attn", "c_attn"),
    ),
}


def model_class(architecture: str) -> type[PreTrainedModel]:
    cls = getattr(transformers, architecture, None)
    if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)):
        raise ValueError(f"transformers has no model class {architecture!r}")
    return cls


def hf_config(cfg: HFModelConfig) -> PretrainedConfig:
    """The architecture's config class with the preset's fields over its defaults."""
    return model_class(cfg.architecture).config_class(**cfg.config)


def stage_names(architecture: str, config: PretrainedConfig) -> tuple[str, str, str]:
    """(embedding, layer list, final norm) attribute names of the base model."""
    if architecture in SHIPPED_PLANS:
        return SHIPPED_PLANS[architecture].stages
    plan = list(getattr(config, "base_model_pp_plan", None) or {})
    if len(plan) != 3:  # GPT-NeoX, Phi: a dropout between embedding and layers, not run here
        what = f"a base_model_pp_plan of {plan}" if plan else "no base_model_pp_plan"
        raise ValueError(f"{architecture} has {what}, not (embedding, layers, norm) to cut by")
    return plan[0], plan[1], plan[2]


def can_cut(architecture: str) -> bool:
    """Whether meshrun can take the class apart (stage_names) and train it as a causal LM:
    a plan it ships, or a transformers causal LM whose config's base_model_pp_plan is
    (embedding, layers, norm)."""
    if architecture in SHIPPED_PLANS:
        return True
    from transformers.models.auto.modeling_auto import (  # noqa: PLC0415 (lazy: 200 names)
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    )

    if architecture not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        return False
    return _has_pp_plan(model_class(architecture).config_class)


@functools.cache
def supported_architectures() -> tuple[str, ...]:
    """Every architecture `can_cut` takes, from this transformers' causal-LM classes (their
    config classes are imported: seconds, so only when a refusal lists them)."""
    from transformers.models.auto.configuration_auto import (  # noqa: PLC0415
        CONFIG_MAPPING,
    )
    from transformers.models.auto.modeling_auto import (  # noqa: PLC0415
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    )

    found = set(SHIPPED_PLANS)
    for model_type, architecture in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if model_type in CONFIG_MAPPING and _has_pp_plan(CONFIG_MAPPING[model_type]):
            found.add(architecture)
    return tuple(sorted(found))


def _has_pp_plan(config_class: type[PretrainedConfig]) -> bool:
    """A plan stage_names cuts by: (embedding, layers, norm)."""
    return len(getattr(config_class, "base_model_pp_plan", None) or {}) == 3


# What config.json says about the file rather than the model.
CONFIG_METADATA = frozenset(
    {
        "architectures",
        "auto_map",
        "dtype",
        "torch_dtype",
        "model_type",
        "transformers_version",
        "_name_or_path",
        "_commit_hash",
        "_attn_implementation_autoset",
    }
)


def saved_fields(architecture: str, directory: str) -> dict[str, Any]:
    """A save_pretrained directory's config as a preset's `config`: the fields of the
    architecture's config class whose values differ from the class's defaults, as transformers
    reads config.json (a field an older version wrote under another name comes under its
    current one), without metadata (CONFIG_METADATA) or keys that are no field of the class,
    and without a field the class derives from the others (layer_types from
    num_hidden_layers), so that an override of those others stays consistent."""
    config_class = model_class(architecture).config_class
    saved = _as_json(config_class.from_pretrained(directory))
    defaults = _as_json(config_class())
    fields = {
        key: value
        for key, value in saved.items()
        if key in defaults and key not in CONFIG_METADATA and defaults[key] != value
    }
    for key in list(fields):
        rest = {k: v for k, v in fields.items() if k != key}
        if _as_json(config_class(**rest)).get(key) == fields[key]:
            fields = rest
    return fields


def _as_json(config: PretrainedConfig) -> dict[str, Any]:
    """Every field, as config.json would hold it (lists, not tuples; dtypes as names)."""
    return json.loads(config.to_json_string(use_diff=False))


def weight_shapes(architecture: str, fields: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor the class's checkpoint holds, for a config (built on meta)."""
    cls = model_class(architecture)
    with torch.device("meta"):
        model = cls._from_config(cls.config_class(**fields))
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


class HFCausalLM(nn.Module):
    def __init__(self, hf: PreTrainedModel) -> None:
        super().__init__()
        self.config = hf.config
        architecture = type(hf).__name__
        self.shipped = SHIPPED_PLANS.get(architecture)
        embed, layers, norm = stage_names(architecture, hf.config)
        base = hf.base_model
        head = hf.get_output_embeddings()
        [head_name] = [name for name, module in hf.named_children() if module is head]
        prefix = hf.base_model_prefix
        self.base_model_prefix = prefix
        self.conversions = conversions(hf)  # how its checkpoints store what it holds
        self.init_module = hf._init_weights  # transformers' init of a module (_init_buffers)
        self.layers_name = layers
        # our name -> its name in the transformers model (and so in its checkpoints)
        self.source_prefixes = {
            "tok_embeddings.": f"{prefix}.{embed}.",
            "layers.": f"{prefix}.{layers}.",
            "norm.": f"{prefix}.{norm}.",
            "output.": f"{head_name}.",
        }
        self.tok_embeddings = getattr(base, embed)
        self.layers = nn.ModuleDict(
            {str(i): layer for i, layer in enumerate(getattr(base, layers))}
        )
        self.norm = getattr(base, norm)
        self.output = head
        self.rotary_emb = getattr(base, "rotary_emb", None)
        positions = self.shipped.positions if self.shipped else None
        self.pos_embeddings = getattr(base, positions) if positions else None
        if positions:
            self.source_prefixes["pos_embeddings."] = f"{prefix}.{positions}."
        self.transposed = _conv1d_to_linear(self.layers)
        self.tied = bool(hf.config.tie_word_embeddings)
        self.seq_shards = 1  # sequence shards of a stage's input under SP (set by apply_tp)
        self.positions: torch.Tensor | None = None  # a CP rank's tokens' (use_positions)
        self.row_orders: dict[str, torch.Tensor] = {}  # set by prepare_tp
        self.vocab_size = hf.config.vocab_size
        self.windows = sliding_windows(hf.config)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.tied and self.output is not None and self.tok_embeddings is not None:
            self.output.weight = self.tok_embeddings.weight

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> HFCausalLM:
        """Materialise (from meta) keeping a tied head tied (to_empty gives each its own)."""
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights()
        return self

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids -> logits; a pipeline stage without the embedding takes hidden states
        (sequence-sharded under SP), one without the head returns them."""
        if self.tok_embeddings is not None:
            seq = tokens.shape[1]
            h = self.tok_embeddings(tokens)
        else:
            h, seq = tokens, tokens.shape[1] * self.seq_shards
        if self.positions is None:
            positions = torch.arange(seq, device=h.device).unsqueeze(0)
        else:
            if self.positions.device != h.device:  # once: no host copy a step
                self.positions = self.positions.to(h.device)
            positions = self.positions.unsqueeze(0)
        if self.tok_embeddings is not None and self.pos_embeddings is not None:
            h = h + self.pos_embeddings(positions)  # [1, seq, dim]: sharded over seq under SP
        kwargs = {"position_ids": positions}
        if self.rotary_emb is not None:
            kwargs["position_embeddings"] = self.rotary_emb(h, positions)
        for name, layer in self.layers.items():
            window = self.windows.get(int(name), seq)
            mask = sliding_window_mask(seq, window, h.device) if window < seq else None
            out = layer(h, attention_mask=mask, **kwargs)
            h = out[0] if isinstance(out, tuple) else out
        if self.output is None:
            return h
        return unpad_logits(self.output(self.norm(h)), self.vocab_size)

    def use_positions(self, positions: torch.Tensor) -> None:
        """The global positions of the tokens this rank sees (a context-parallel rank's
        shard of each sequence), for the rotary or learned position embeddings."""
        self.positions = positions

    def tp_plan(self) -> dict[str, str]:
        """The model's `base_model_tp_plan` in parallel/tensor.py's styles, with what SP adds:
        each block's norms sharded over the sequence, its column-wise sub-blocks and its MoE
        block gathering their input first (the MoE block's output sliced back)."""
        plan = {"tok_embeddings": "embedding", "norm": "sequence_parallel", "output": "head"}
        if self.pos_embeddings is not None:  # sharded over positions: Shard(1) out under SP
            plan["pos_embeddings"] = "embedding"
        own = f"{self.layers_name}.*."
        base_plan = self.shipped.tp_plan if self.shipped else self.config.base_model_tp_plan
        for pattern, style in (base_plan or {}).items():
            if not pattern.startswith(own) or style not in ("colwise", "rowwise"):
                raise ValueError(
                    f"{type(self.config).__name__}.base_model_tp_plan: {pattern}={style} is not "
                    "a colwise/rowwise entry of its layers; set parallel.tp_plan"
                )
            key = "layers.*." + pattern.removeprefix(own)
            if style == "colwise":
                plan.setdefault(key.rsplit(".", 1)[0], "gather_input")
            plan[key] = style
        block = next(iter(self.layers.values()))
        for name, child in block.named_children():
            if "norm" in type(child).__name__.lower():
                plan[f"layers.*.{name}"] = "sequence_parallel"
            elif any(is_hf_experts(m) for m in child.modules()):  # an MoE block routes the
                plan.setdefault(f"layers.*.{name}", "gather_input")  # whole sequence under SP
        return plan

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Seeded normal(0, initializer_range) matrices (init.py), zero biases, unit norms:
        transformers' own `_init_weights` scheme, layout-independent."""
        std = getattr(self.config, "initializer_range", 0.02)
        norms = {
            f"{model_name(n)}."
            for n, m in self.named_modules()
            if "norm" in type(m).__name__.lower()
        }
        self._init_buffers()
        for name, param in named_tensors(self):
            if name.rsplit(".", 1)[0] + "." in norms:
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                shape = unpadded_shape(name, param, self.vocab_size)
                fill(param, self._ordered(name, seeded_normal(seed, name, shape, std)))

    @torch.no_grad()
    def load_pretrained(self, directory: str) -> int:
        """This rank's share of this stage's tensors from a save_pretrained directory,
        stored as transformers stores them (hf_files.py), and the buffers it holds (a
        router's correction bias; the others computed); the bytes it read."""
        self._init_buffers()
        saved = SavedTensors(directory)
        params = {name for name, _ in named_tensors(self)}
        stored = tuple(self.source_prefixes)  # not the rotary tables: computed
        tensors = {n: t for n, t in named_tensors(self, buffers=True) if n.startswith(stored)}
        theirs = {name: self.source_name(name) for name in tensors}
        sources = saved_sources(saved, self.conversions, theirs.values(), self.base_model_prefix)
        for name, tensor in tensors.items():
            source = sources.get(theirs[name])
            if source is None and name in params:
                raise KeyError(f"{directory} holds no {theirs[name]} (nor the parts of it)")
            if source is not None:
                transposed = Transposed(source) if name in self.transposed else source
                fill(tensor, self._ordered(name, transposed))
        return saved.bytes_read

    def prepare_tp(self, tp: int) -> None:
        """A fused q|k|v projection regrouped as [q_r | k_r | v_r] per rank r, so that its
        column-wise shard on rank r holds that rank's heads of all three (and each split of
        the local output is h/tp wide). Runs before the weights exist (on meta): the row
        order is kept for init and loading to apply."""
        if tp == 1:
            return
        self.row_orders = self.row_orders_for(tp)
        if self.row_orders:
            attention, projection = self.shipped.fused_qkv
            for block in self.layers.values():
                attn = getattr(block, attention)
                attn.split_size = getattr(attn, projection).out_features // 3 // tp

    def row_orders_for(self, tp: int) -> dict[str, torch.Tensor]:
        """Each fused q|k|v weight's and bias's rows as TP of degree `tp` holds them (row i is
        row order[i] of transformers' q|k|v), whatever this model's own tp: a checkpoint
        saved under another reads through them (rank/train/checkpoint.py)."""
        if self.shipped is None or self.shipped.fused_qkv is None:
            return {}
        attention, projection = self.shipped.fused_qkv
        orders = {}
        for index, block in self.layers.items():
            width = getattr(getattr(block, attention), projection).out_features // 3 // tp
            order = torch.cat(
                [
                    torch.arange(part * width * tp + r * width, part * width * tp + (r + 1) * width)
                    for r in range(tp)
                    for part in range(3)
                ]
            )
            for leaf in ("weight", "bias"):
                orders[f"layers.{index}.{attention}.{projection}.{leaf}"] = order
        return orders

    def _ordered(self, name: str, source: Source) -> Source:
        order = self.row_orders.get(name)
        return source if order is None else Reordered(source, order)

    def source_name(self, name: str) -> str:
        for ours, theirs in self.source_prefixes.items():
            if name.startswith(ours):
                return theirs + name.removeprefix(ours)
        raise KeyError(name)

    @torch.no_grad()
    def _init_buffers(self) -> None:
        """The buffers transformers computes rather than stores (rotary tables, an embedding's
        scale, a router's correction bias), which a model built on meta lacks: from_pretrained
        writes them with the model's own `_init_weights(module)` (modeling_utils.
        PreTrainedModel._init_weights and each family's override). Each such module's
        parameters are flagged done first, so that it writes the buffers alone
        (transformers.initialization's functions skip a tensor flagged `_is_hf_initialized`):
        meshrun seeds or reads the parameters after."""
        for module in self.modules():
            if next(module.buffers(recurse=False), None) is None:
                continue
            params = list(module.parameters(recurse=False))
            for param in params:
                param._is_hf_initialized = True
            self.init_module(module)
            for param in params:
                del param._is_hf_initialized


def _conv1d_to_linear(layers: nn.ModuleDict) -> set[str]:
    """transformers' Conv1D (y = x W + b, W stored [in, out]) as nn.Linear, which torch's
    parallel styles take; the names of the weights a checkpoint stores transposed."""
    transposed = set()
    for prefix, module in list(layers.named_modules(prefix="layers")):
        for name, child in list(module.named_children()):
            if isinstance(child, Conv1D):
                n_in, n_out = child.weight.shape
                linear = nn.Linear(n_in, n_out, device=child.weight.device)
                setattr(module, name, linear)
                transposed.add(f"{prefix}.{name}.weight")
    return transposed


def build_hf(cfg: HFModelConfig, device: torch.device | str, vocab_multiple: int = 1) -> HFCausalLM:
    """Built on `device` (meta: nothing allocated) with SDPA attention, in float32;
    `vocab_multiple`: the TP degree the vocabulary is padded for (vocab.py)."""
    use_meshrun_sdpa()
    with torch.device(device):
        hf = model_class(cfg.architecture)._from_config(
            hf_config(cfg), attn_implementation="sdpa", dtype=torch.float32
        )
        model = HFCausalLM(hf)
    pad_vocab(model, model.vocab_size, vocab_multiple)
    return model
