"""Mixture-of-experts blocks (model.moe, models/moe.py): the router's choices, dropped
assignments counted, the sequence-wise balance loss and its gradient at the training loss's
weight, and every layout training the same MoE model as one device, in real gloo processes
(the experts' compute: tests/test_expert_compute.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from meshrun.core.config import MoEConfig
from meshrun.core.errors import ConfigError
from meshrun.core.record import RunRecord
from meshrun.driver.results import router_fields
from meshrun.driver.sinks.console import console, print_summary
from meshrun.driver.sinks.wandb_sink import step_metrics
from meshrun.models import build_model, moe
from meshrun.plan import predict, traced
from meshrun.plan.shapes import Dims, StageShare, inactive_matmul_params, local_param_elements
from meshrun.validate.experts import check_expert_layout
from tests.helpers import compose_config, resolved_config
from tests.moe_runs import BIAS, COMMON, assert_trains_as_on_one_device
from tests.ranks import assert_steps_match, losses
from tests.tiers import tiered

DIM, HIDDEN = 16, 24


def _block(**overrides) -> moe.MoEFeedForward:
    torch.manual_seed(0)
    block = moe.MoEFeedForward(MoEConfig(experts=4, top_k=2, **overrides), DIM, HIDDEN, None, 0)
    for p in (block.gate.weight, *block.experts.parameters()):
        torch.nn.init.normal_(p, std=0.3)
    return block


def _balance_loss(block: moe.MoEFeedForward, x: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (eq. 17-20) written out, mean over sequences."""
    batch, seq, _ = x.shape
    experts, k = block.cfg.experts, block.cfg.top_k
    scores = F.linear(x.view(-1, DIM), block.gate.weight).softmax(-1).view(batch, seq, -1)
    per_sequence = []
    for i in range(batch):
        chosen = scores[i].topk(k, -1).indices.flatten()
        f = torch.bincount(chosen, minlength=experts).float() * experts / (k * seq)
        p = (scores[i] / scores[i].sum(-1, keepdim=True)).mean(0)
        per_sequence.append((f * p).sum())
    return torch.stack(per_sequence).mean()


def test_the_block_sends_each_token_to_its_top_k_experts_weighted_by_score():
    block = _block()
    x = torch.randn(2, 5, DIM)
    scores = F.linear(x.view(-1, DIM), block.gate.weight).softmax(-1)
    weights, chosen = scores.topk(2, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    w = block.experts
    want = torch.zeros(10, DIM)
    for t, token in enumerate(x.view(-1, DIM)):
        for weight, e in zip(weights[t], chosen[t], strict=True):
            want[t] += weight * ((F.silu(token @ w.w1[e]) * (token @ w.w3[e])) @ w.w2[e])
    torch.testing.assert_close(block(x).view(-1, DIM), want, rtol=1e-5, atol=1e-5)
    assert block.routing.tokens_per_expert.sum() == 20
    assert block.routing.dropped == 0


def test_a_capacity_factor_drops_an_experts_assignments_past_it_and_counts_them():
    block = _block(capacity_factor=0.5)
    x = torch.randn(2, 8, DIM)
    free = _block()(x)
    capped = block(x)
    capacity = 0.5 * 16 * 2 / 4
    counts = torch.bincount(
        F.linear(x.view(-1, DIM), block.gate.weight).topk(2, -1).indices.flatten(), minlength=4
    )
    dropped = int((counts - capacity).clamp(min=0).sum())
    assert dropped > 0
    assert block.routing.dropped == dropped
    assert block.routing.tokens_per_expert.max() <= capacity
    assert not torch.allclose(free, capped)


def test_the_balance_loss_of_a_batch_is_the_mean_of_its_sequences_however_it_is_split():
    """Per sequence, so data parallelism and micro-batching leave it as it is."""
    block = _block()
    x = torch.randn(4, 6, DIM)
    block(x)
    whole = block.routing.aux_loss
    torch.testing.assert_close(whole, _balance_loss(block, x).detach())
    halves = []
    for part in x.split(2):
        block(part)
        halves.append(block.routing.aux_loss)
    torch.testing.assert_close(whole, torch.stack(halves).mean())
    assert whole >= 1.0 - 1e-6  # its minimum, an even load, is 1 (DeepSeek-V3's normalisation)


@pytest.mark.parametrize("weight", [1.0, 0.25])
def test_the_balance_loss_reaches_the_gradients_at_the_training_losss_weight(weight):
    block = _block(aux_loss_coef=0.1)
    x = torch.randn(2, 6, DIM)
    with moe.loss_weight(weight):
        (block(x).square().sum() * weight).backward()
    injected = block.gate.weight.grad.clone()
    plain = _block(load_balance="none")
    out = plain(x)
    (out.square().sum() * weight + weight * 0.1 * _balance_loss(plain, x)).backward()
    torch.testing.assert_close(injected, plain.gate.weight.grad)


def test_a_steps_router_record_is_its_loads_drops_and_balance_loss():
    counts = torch.tensor([[3.0, 1.0, 2.0, 2.0], [2.0, 2.0, 2.0, 2.0]])
    extra = torch.tensor([[1.0, 2.4, 2.0], [0.0, 1.0, 1.0]])  # dropped, summed aux, forwards
    stats = torch.cat([counts, extra], 1)
    fields = moe.router_fields(stats, balance_loss=True)
    assert fields["moe_max_load_per_layer"] == pytest.approx([1.5, 1.0])
    assert fields["moe_max_load"] == pytest.approx(1.5)
    assert fields["moe_dropped"] == pytest.approx(1 / 17)
    assert fields["moe_aux_loss"] == pytest.approx((1.2 + 1.0) / 2)
    assert "moe_aux_loss" not in moe.router_fields(stats, balance_loss=False)
    assert moe.router_fields(torch.zeros_like(stats), balance_loss=True) == {}  # none counted
    assert moe.router_fields(stats.fill_(float("nan")), balance_loss=True) == {}


def test_biases_are_refused_where_data_parallel_replicas_would_count_the_loads():
    cfg = compose_config("model=tiny-moe", "parallel=dataparallel", "model.moe.load_balance=bias")
    with pytest.raises(ConfigError) as caught:
        check_expert_layout(cfg)
    assert caught.value.key == "model.moe.load_balance"
    assert "parallel=ddp" in str(caught.value)


def test_the_bias_picks_the_experts_but_leaves_their_weights_to_the_scores():
    block = _block(load_balance="bias")
    x = torch.randn(2, 6, DIM)
    block.expert_bias[3] = 10.0  # every token's first pick
    block(x)
    assert block.routing.tokens_per_expert[3] == 12
    scores = F.linear(x.view(-1, DIM), block.gate.weight).softmax(-1)
    weights, chosen, _ = block._route(x.view(-1, DIM))
    assert (chosen == 3).any(-1).all()
    picked = scores.gather(-1, chosen)
    torch.testing.assert_close(weights, picked / picked.sum(-1, keepdim=True))


def test_a_steps_loads_move_the_biases_towards_the_experts_it_under_used():
    block = _block(load_balance="bias")
    counts = torch.tensor([[5.0, 1.0, 3.0, 3.0]])
    moe.update_biases([block], counts, rate=0.1)
    torch.testing.assert_close(block.expert_bias, torch.tensor([-0.1, 0.1, 0.0, 0.0]))


def test_the_planners_even_routing_gives_every_expert_the_same_tokens():
    block = _block()
    with moe.even_routing():
        block(torch.randn(2, 6, DIM))
    assert block.routing.tokens_per_expert.tolist() == [6, 6, 6, 6]


def test_a_tokens_flops_are_its_experts_as_torch_counts_them():
    """The formula's MFU FLOPs of tiny-moe over dense tiny's (the same attention): what the
    token's top-2 experts, the shared one and the router add, as torch counts it on fake
    tensors with an even load (every expert's parameters counted would add 4x more)."""
    formula, counted = {}, {}
    for model in ("tiny-moe", "tiny"):
        cfg = resolved_config(f"model={model}", "parallel=single", "train.seq_len=512")
        formula[model] = predict.training_flops_per_token(cfg)
        counted[model] = traced.counted_flops_per_token(cfg)
    extra = counted["tiny-moe"] - counted["tiny"]
    assert formula["tiny-moe"] - formula["tiny"] == pytest.approx(extra, rel=0.01)


def test_the_plan_counts_every_experts_parameters():
    cfg = resolved_config("model=tiny-moe", "parallel=single")
    model = build_model(cfg.model, cfg.train.seq_len, "meta")
    params = sum(p.numel() for p in model.parameters()) * 4
    [stage] = predict.stage_memory(cfg)
    assert params <= stage.params <= params * 1.02  # and the rotary tables, which are buffers


@pytest.mark.parametrize(
    ("name", "published"), [("mixtral-8x7b", 12.9e9), ("qwen3-30b-a3b", 3.3e9)]
)
def test_a_token_meets_the_published_active_parameters(name, published):
    """Every parameter but the experts a token is not routed to (the model cards' figure)."""
    d = Dims.of(compose_config(f"model={name}").model)
    total = local_param_elements(d, StageShare(d.layers, True, True, 1), 1, 1)
    active = total - inactive_matmul_params(d)
    assert active == pytest.approx(published, rel=0.02)


LAYOUTS = {
    "ddp": ("parallel=ddp",),  # the balance loss at 1/micro-batches
    "pp2": ("parallel=pp2",),  # ... and from inside a stage that never sees the loss
    "fsdp": ("parallel=fsdp",),
    "tp2": ("parallel=tp2", "train.micro_batch_size=4"),
    "fsdp_full_checkpointing": ("parallel=fsdp", "parallel.activation_checkpointing=full"),
    "cp2_without_balance_loss": ("parallel=cp2", "model.moe.load_balance=none"),
    # the balance loss's per-sequence sums over the CP ranks, its gradient theirs
    "cp2": ("parallel=cp2",),
    # biases moved by the whole batch's loads, equal on every rank (a fast rate: routing moves)
    "ddp_bias": ("parallel=ddp", *BIAS),
    # each stage moves its own blocks' biases; torch's shape inference is not counted
    "pp2_bias": ("parallel=pp2", *BIAS),
}
FAST = {"ddp", "pp2", "ddp_bias", "pp2_bias"}


@pytest.mark.parametrize("layout", tiered(LAYOUTS, FAST))
def test_an_moe_model_trains_under_each_layout_as_on_one_device(
    experiment, single_moe_steps, layout
):
    assert_trains_as_on_one_device(experiment, single_moe_steps, LAYOUTS[layout])


def test_the_summary_and_wandb_carry_the_last_steps_routers(single_moe_steps):
    steps = single_moe_steps()
    fields = router_fields(steps)
    assert fields["router_max_load"] == steps[-1].moe_max_load >= 1.0
    with console.capture() as captured:
        print_summary(RunRecord.from_dict({"status": "completed", **fields}))
    said = " ".join(captured.get().split())
    assert f"busiest expert {steps[-1].moe_max_load:.2f}x the mean" in said
    assert f"balance loss {steps[-1].moe_aux_loss:.3f}" in said
    series = step_metrics(steps[-1], tokens_per_step=8 * 64)
    assert series["train/moe_max_load"] == steps[-1].moe_max_load
    assert series["train/moe_aux_loss"] == steps[-1].moe_aux_loss


def test_an_moe_runs_mfu_counts_a_tokens_experts_and_the_summary_says_so():
    """tiny-moe: 8 experts of 3 x 64 x 64 a block, 2 a token, and a shared one; PaLM's N is
    every parameter but the embedding (a lookup)."""
    cfg = resolved_config("model=tiny-moe", "parallel=single")
    share = predict.active_share(cfg)
    d = Dims.of(cfg.model)
    model = build_model(cfg.model, 64, "meta")
    matmul = sum(p.numel() for name, p in model.named_parameters() if "embed" not in name)
    assert share == pytest.approx(1 - d.layers * 6 * 3 * 64 * 64 / matmul)
    assert predict.active_share(resolved_config("model=tiny", "parallel=single")) is None
    with console.capture() as captured:
        print_summary(
            RunRecord.from_dict({"status": "completed", "mfu": 0.1, "active_param_share": share})
        )
    said = " ".join(captured.get().split())
    assert f"MFU │ 0.1 (6N: N active, {share:.1%})" in said


# transformers' own MoE blocks (their router, experts and auxiliary loss, which meshrun's loss
# does not add: load balancing off), through meshrun's HF wrapper
HF_LAYOUTS = {
    "mixtral_ddp": ("model=hf/tiny-mixtral", "parallel=ddp"),
    "mixtral_fsdp": ("model=hf/tiny-mixtral", "parallel=fsdp"),
    "mixtral_pp2": ("model=hf/tiny-mixtral", "parallel=pp2"),
    "mixtral_tp2": ("model=hf/tiny-mixtral", "parallel=tp2", "train.micro_batch_size=4"),
    "qwen2_moe_ddp": ("model=hf/tiny-qwen2-moe", "parallel=ddp"),
    "qwen2_moe_tp2": ("model=hf/tiny-qwen2-moe", "parallel=tp2", "train.micro_batch_size=4"),
    # under SP each MoE block gathers the sequence and hands each rank its slice back
    "mixtral_tp2_sp": (
        "model=hf/tiny-mixtral",
        "parallel=tp2",
        "parallel.sequence_parallel=true",
        "train.micro_batch_size=4",
    ),
    "qwen2_moe_tp2_sp": (
        "model=hf/tiny-qwen2-moe",
        "parallel=tp2",
        "parallel.sequence_parallel=true",
        "train.micro_batch_size=4",
    ),
    # their experts split over 2 ranks (models/hf_experts.py's forward)
    "mixtral_ep2": ("model=hf/tiny-mixtral", "parallel=ep2"),
    "qwen2_moe_fsdp2_ep2": (
        "model=hf/tiny-qwen2-moe",
        "parallel=ep2",
        "launcher.nproc_per_node=4",
    ),
    # each expert's hidden width split over the TP ranks: the fused gate|up rows traded so
    # that each rank holds its share of both (hf_experts.gate_and_up_by_rank)
    "mixtral_tp2_etp2": (
        "model=hf/tiny-mixtral",
        "parallel=tp2",
        "parallel.etp=2",
        "train.micro_batch_size=4",
    ),
    "qwen2_moe_tp2_sp_ep2_etp2": (
        "model=hf/tiny-qwen2-moe",
        "parallel=tp2_ep2",
        "parallel.sequence_parallel=true",
        "parallel.etp=2",
        "launcher.nproc_per_node=4",
        "train.micro_batch_size=4",
    ),
}
HF_COMMON = tuple(o for o in COMMON if not o.startswith("model="))


@pytest.mark.parametrize("layout", tiered(HF_LAYOUTS, {"mixtral_ep2", "mixtral_tp2_etp2"}))
def test_a_transformers_moe_trains_under_each_layout_as_on_one_device(experiment, layout):
    model = HF_LAYOUTS[layout][0]
    _, single = experiment(*HF_COMMON, model, "parallel=single")
    _, measured = experiment(*HF_COMMON, *HF_LAYOUTS[layout])
    assert single.ok, single.meta.error
    assert measured.ok, measured.meta.error
    assert_steps_match(measured.steps, single.steps)
    assert losses(measured)[-1] < losses(measured)[0]
