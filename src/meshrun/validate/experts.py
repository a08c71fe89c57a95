"""Rules of a mixture-of-experts model (`model.moe`, models/moe.py): a router that can pick
its top-k, and the layouts its blocks combine with so far."""

from __future__ import annotations

from meshrun.core.config import ExperimentConfig, LlamaModelConfig, ModelConfig
from meshrun.core.errors import fail, positive


def check_experts(m: ModelConfig) -> None:
    if not isinstance(m, LlamaModelConfig):
        return
    moe = m.moe
    if moe.experts < 0:
        fail("model.moe.experts", moe.experts, "must be >= 0", "0 (dense) or more experts")
    if not moe.experts:
        return
    if not 1 <= moe.top_k <= moe.experts:
        fail(
            "model.moe.top_k",
            moe.top_k,
            f"a token's experts must be 1 to model.moe.experts ({moe.experts})",
            f"1 <= top_k <= {moe.experts}",
        )
    if moe.shared_experts < 0:
        fail("model.moe.shared_experts", moe.shared_experts, "must be >= 0", "0 or more")
    positive("model.moe.expert_ffn_dim", moe.expert_ffn_dim, allow_none=True)
    positive("model.moe.capacity_factor", moe.capacity_factor, allow_none=True)
    if moe.load_balance == "bias":
        positive("model.moe.bias_update_rate", moe.bias_update_rate)
    if moe.aux_loss_coef < 0:
        fail("model.moe.aux_loss_coef", moe.aux_loss_coef, "must be >= 0", "a number >= 0")
    if m.pretrained is not None:
        fail(
            "model.pretrained",
            m.pretrained,
            "meshrun's LLaMA reads dense Llama checkpoints only; its experts are seeded",
            "model.pretrained=null, or model.moe.experts=0",
        )


def check_expert_layout(cfg: ExperimentConfig) -> None:
    """What an MoE block does not combine with yet, each with the reason."""
    m, p = cfg.model, cfg.parallel
    if not isinstance(m, LlamaModelConfig) or not m.moe.experts:
        return
    if p.tp > 1 and p.sequence_parallel:
        fail(
            "parallel.sequence_parallel",
            True,
            "does not combine with MoE blocks yet: their experts are replicated over the TP "
            "ranks, which need the whole sequence in and out",
            "parallel.sequence_parallel=false",
        )
    if p.data_parallel == "dataparallel" and m.moe.load_balance == "bias":
        fail(
            "model.moe.load_balance",
            "bias",
            "does not combine with torch.nn.DataParallel: its replicas route the tokens, and "
            "what they count is lost with them, so the biases would never move",
            "model.moe.load_balance=aux_loss or none, or parallel=ddp",
        )
    if p.pp > 1 and m.moe.load_balance == "bias":
        fail(
            "model.moe.load_balance",
            "bias",
            "does not combine with a pipeline yet: a schedule's first step runs its shape "
            "inference through the blocks, which would move the biases",
            "model.moe.load_balance=aux_loss or none, or parallel.pp=1",
        )
    if p.cp > 1 and m.moe.load_balance == "aux_loss":
        fail(
            "model.moe.load_balance",
            "aux_loss",
            f"the sequence-wise balance loss needs each sequence on one rank; parallel.cp={p.cp} "
            "splits it",
            "model.moe.load_balance=bias or none, or parallel.cp=1",
        )
