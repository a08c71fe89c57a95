"""Rules of a mixture-of-experts model (`model.moe`, models/moe.py): a router that can pick
its top-k, the one layout its load balancing cannot run under, and expert parallelism's degree
(`parallel.ep`, drawn from dp_shard x cp)."""

from __future__ import annotations

from meshrun.core.config import ExperimentConfig, ModelConfig, ParallelConfig
from meshrun.core.errors import fail, positive
from meshrun.core.layout import Layout
from meshrun.models import model_kind, model_shape


def check_experts(m: ModelConfig) -> None:
    moe = model_kind(m).moe(m)
    if moe is None:
        return
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
    """What an MoE block does not combine with, and why."""
    m, p = cfg.model, cfg.parallel
    check_expert_parallel(cfg)
    moe = model_kind(m).moe(m)
    if moe is None or not moe.experts:
        return
    _check_split_experts_checkpointing(p)
    if p.data_parallel == "dataparallel" and moe.load_balance == "bias":
        fail(
            "model.moe.load_balance",
            "bias",
            "does not combine with torch.nn.DataParallel: its replicas route the tokens, and "
            "what they count is lost with them, so the biases would never move",
            "model.moe.load_balance=aux_loss or none, or parallel=ddp",
        )


def _check_split_experts_checkpointing(p: ParallelConfig) -> None:
    """torch's selective checkpointing of a block whose split experts are an FSDP2 unit of
    their own (tests/test_combinations.py shows it, the rule lifted)."""
    if p.ep > 1 and p.activation_checkpointing in ("selective", "op"):
        fail(
            "parallel.activation_checkpointing",
            p.activation_checkpointing,
            "recomputes a block whose split experts are an FSDP2 unit of their own, whose "
            "hooks open profiler ranges (torch/distributed/fsdp/_fully_shard/_fsdp_state.py) "
            "the recompute does not repeat as the forward ran them, and selective "
            "checkpointing needs the same ops again (torch/utils/checkpoint.py:1448 in 2.13: "
            '"encountered during backward but not found in storage")',
            "full or none with parallel.ep > 1",
        )


def check_expert_parallel(cfg: ExperimentConfig) -> None:
    """`parallel.ep` and `parallel.etp` on a resolved layout: experts to split, ranks to
    split them over."""
    m, p = cfg.model, cfg.parallel
    if p.ep < 1:
        fail("parallel.ep", p.ep, "must be >= 1", "1 (no expert parallelism) or more")
    if p.etp not in (1, p.tp):
        fail(
            "parallel.etp",
            p.etp,
            f"the experts are split over the TP ranks or not at all: 1 or parallel.tp ({p.tp})",
            f"1 or {p.tp}",
        )
    if p.ep == 1 and p.etp == 1:
        return
    key, value = ("parallel.ep", p.ep) if p.ep > 1 else ("parallel.etp", p.etp)
    shape = model_shape(m)
    experts = shape.experts
    if not experts:
        fail(
            key,
            value,
            f"splits the routed experts of an MoE model; model={m.name} has none",
            f"{key}=1, or an MoE model (model=tiny-moe, mixtral-8x7b, hf/tiny-mixtral, "
            "or model.moe.experts > 0)",
        )
    model_kind(m).check_expert_split(m, p.etp)
    _check_ep(p, experts)
    if p.etp > 1 and shape.expert_ffn % p.etp:
        fail(
            "parallel.etp",
            p.etp,
            f"must divide an expert's hidden width ({shape.expert_ffn})",
            f"a divisor of {shape.expert_ffn}, or 1",
        )


def _check_ep(p: ParallelConfig, experts: int) -> None:
    shard = Layout.of(p).shard_size
    if shard % p.ep:
        fail(
            "parallel.ep",
            p.ep,
            f"its ranks are drawn from dp_shard x cp, {p.dp_shard} x {p.cp} = {shard} here, "
            "which it must divide",
            f"a divisor of {shard}, or parallel.dp_shard a multiple of {p.ep} (parallel=ep2 "
            "shards the dense parts over every rank and splits the experts in two)",
        )
    if experts % p.ep:
        fail(
            "parallel.ep",
            p.ep,
            f"must divide the model's {experts} experts: each ep rank holds a whole number of them",
            f"a divisor of {experts}",
        )
