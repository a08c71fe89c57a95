"""meshrun's three model kinds: its own LLaMA-style decoder (llama.py, sizes in conf/model),
Hugging Face transformers causal LMs (hf.py, conf/model/hf; the optional extra meshrun[hf])
and a user's own nn.Module (custom.py, model=custom). Each answers models/kind.py's questions
for its configs; what it does not override is the plain dense model's answer there."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from meshrun.core.config import (
    CustomModelConfig,
    HFModelConfig,
    LlamaModelConfig,
    MoEConfig,
)
from meshrun.core.model_shape import ModelShape, llama_shape
from meshrun.models import custom_rules, hf_rules, llama_rules
from meshrun.models.custom import build_custom, custom_shape
from meshrun.models.hf_export import save_transformers
from meshrun.models.keys import from_key, model_key
from meshrun.models.kind import ModelKind
from meshrun.models.llama import build_llama

if TYPE_CHECKING:
    import torch
    from torch import nn

MOE_EXPORT = (
    "meshrun's MoE LLaMA has no Hugging Face form: no transformers class has its router, "
    "shared experts and balancing bias",
    "torch (a consolidated state dict), none, or a transformers MoE (model=hf/...)",
)


class LlamaKind(ModelKind):
    name = "meshrun"
    schema = LlamaModelConfig

    def build(
        self,
        cfg: LlamaModelConfig,
        max_seq_len: int,
        device: torch.device | str,
        vocab_multiple: int,
    ) -> nn.Module:
        return build_llama(cfg, max_seq_len, device, vocab_multiple)

    def shape(self, cfg: LlamaModelConfig) -> ModelShape:
        return llama_shape(cfg)

    def check(self, cfg: LlamaModelConfig, read_from: str | None) -> None:
        llama_rules.check_llama(cfg)

    def moe(self, cfg: LlamaModelConfig) -> MoEConfig:
        return cfg.moe

    def hf_form_refused(self, cfg: LlamaModelConfig) -> tuple[str, str] | None:
        return MOE_EXPORT if cfg.moe.experts else None

    def save_hf(self, model: nn.Module, cfg: LlamaModelConfig, out: Path) -> None:
        from meshrun.models.convert import export_hf  # noqa: PLC0415 (safetensors: meshrun[hf])

        export_hf(model, out)

    def decoder(self, cfg: LlamaModelConfig) -> LlamaModelConfig:
        return cfg

    def head_is_linear(self, cfg: LlamaModelConfig) -> bool:
        return True  # models/llama.py's `output`, or models/vocab.py's padded one


class HFKind(ModelKind):
    name = "hf"
    schema = HFModelConfig

    def head_is_linear(self, cfg: HFModelConfig) -> bool:
        return True  # every family's lm_head (models/hf.py), or models/vocab.py's padded one

    def build(
        self, cfg: HFModelConfig, max_seq_len: int, device: torch.device | str, vocab_multiple: int
    ) -> nn.Module:
        from meshrun.models import hf  # noqa: PLC0415 (optional dependency: meshrun[hf])

        return hf.build_hf(cfg, device, vocab_multiple)

    def shape(self, cfg: HFModelConfig) -> ModelShape:
        return _hf_shape(*model_key(cfg))

    def check(self, cfg: HFModelConfig, read_from: str | None) -> None:
        hf_rules.check_hf(cfg, read_from)

    def read_pretrained(self, cfg: HFModelConfig) -> tuple[HFModelConfig, str | None]:
        return hf_rules.read_pretrained(cfg)

    def describe_read(self, cfg: HFModelConfig, read_from: str) -> str:
        return hf_rules.describe_hf_read(cfg, read_from, self.shape(cfg))

    def overrides(self, cfg: HFModelConfig) -> str:
        return hf_rules.hf_overrides(cfg)

    def context(self, cfg: HFModelConfig) -> tuple[int, str] | None:
        """`model.context_len` where set, else the config's `max_position_embeddings`."""
        if cfg.context_len:
            return super().context(cfg)
        positions = hf_rules.hf_positions(cfg)
        return (positions, "max_position_embeddings") if positions else None

    def check_sequence(self, cfg: HFModelConfig, seq_len: int) -> None:
        hf_rules.check_hf_sequence(cfg, seq_len)

    def check_context_parallel(self, cfg: HFModelConfig, seq_len: int, cp: int) -> None:
        hf_rules.check_hf_context_parallel(cfg, seq_len, cp)

    def check_expert_split(self, cfg: HFModelConfig, etp: int) -> None:
        hf_rules.check_hf_experts(cfg, etp)

    def hf_form_refused(self, cfg: HFModelConfig) -> None:
        return None

    def save_hf(self, model: nn.Module, cfg: HFModelConfig, out: Path) -> None:
        save_transformers(model, cfg, out)


class CustomKind(ModelKind):
    name = "custom"
    schema = CustomModelConfig

    def build(
        self,
        cfg: CustomModelConfig,
        max_seq_len: int,
        device: torch.device | str,
        vocab_multiple: int,
    ) -> nn.Module:
        return build_custom(cfg, device, vocab_multiple)

    def shape(self, cfg: CustomModelConfig) -> ModelShape:
        return _custom_shape(*model_key(cfg))

    def check(self, cfg: CustomModelConfig, read_from: str | None) -> None:
        custom_rules.check_custom(cfg)

    def hf_form_refused(self, cfg: CustomModelConfig) -> tuple[str, str]:
        return (
            "a model=custom module has no Hugging Face form",
            "torch (a consolidated state dict) or none",
        )

    def own_ties(self, cfg: CustomModelConfig) -> bool:
        return True

    def finds_head(self, cfg: CustomModelConfig) -> bool:
        return cfg.head is not None

    def tp_shards_head(self, cfg: CustomModelConfig) -> bool:
        """Where the plan is a mapping that names model.head `head` (a callable's plan is
        only known once the module is built: taken as leaving the head whole)."""
        plan = cfg.tp_plan
        return cfg.head is not None and isinstance(plan, Mapping) and plan.get(cfg.head) == "head"


@functools.cache
def _hf_shape(schema: type[HFModelConfig], cfg_json: str) -> ModelShape:
    """A transformers model is built on meta to be measured: once per config."""
    from meshrun.models.hf_shape import hf_shape  # noqa: PLC0415 (optional: meshrun[hf])

    return hf_shape(from_key(schema, cfg_json))


@functools.cache
def _custom_shape(schema: type[CustomModelConfig], cfg_json: str) -> ModelShape:
    """A user's module is built on meta to be measured: once per config."""
    return custom_shape(from_key(schema, cfg_json))
