"""Expert parallelism (parallel.ep, rank/parallel/expert.py): tokens dispatched to the rank of
their experts and back with autograd, each rank holding its share of the experts, every
layout with ep training the same model as one device, and the degrees refused before any
process starts. Real gloo processes throughout."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from meshrun.core.config import ParallelConfig
from meshrun.core.errors import ConfigError
from meshrun.core.layout import Layout
from meshrun.driver.experiment import read_steps
from meshrun.models import build_model
from meshrun.models.expert_compute import dispatched_compute, expert_compute
from meshrun.models.hf_experts import gate_and_up_by_rank
from meshrun.models.shards import held_box
from meshrun.rank.mesh import build_mesh
from meshrun.rank.parallel import parallelize
from tests.helpers import resolved_config
from tests.moe_runs import BIAS, COMMON, assert_trains_as_on_one_device
from tests.test_layouts import MICRO4
from tests.tiers import tiered
from tests.wandb_records import read_offline_run, step_rows

EXPERTS, DIM, HIDDEN = 4, 8, 4  # rows of 16 bytes or more in fp32: _grouped_mm takes them


def _weights(hidden: int = HIDDEN) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(EXPERTS, DIM, hidden), (EXPERTS, DIM, hidden), (EXPERTS, hidden, DIM)]
    return tuple(torch.randn(s, generator=gen) for s in shapes)


def _dispatched_against_local(grouped: bool) -> bool:
    """Each of 2 ranks routes its own rows (uneven counts, an expert with none) to experts
    split 2 and 2; outputs, the rows' gradients and the experts' summed gradients equal
    the loop over every expert here, the dispatched experts computed by the loop or the
    grouped GEMM (torch's CPU _grouped_mm)."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    counts = [[3, 0, 2, 4], [1, 5, 0, 2]][rank]
    x = torch.randn(sum(counts), DIM, generator=torch.Generator().manual_seed(10 + rank))
    grad = torch.randn(sum(counts), DIM, generator=torch.Generator().manual_seed(20 + rank))
    full = [w.requires_grad_() for w in _weights()]
    mine = [w[2 * rank : 2 * rank + 2].detach().clone().requires_grad_() for w in _weights()]
    xs = [x.clone().requires_grad_() for _ in range(2)]
    want = expert_compute(xs[0], tuple(full), counts, grouped=False)
    want.backward(grad)
    got = dispatched_compute(xs[1], tuple(mine), torch.tensor(counts), dist.group.WORLD, grouped)
    got.backward(grad)
    ok = torch.allclose(got, want, atol=1e-5) and torch.allclose(xs[1].grad, xs[0].grad, atol=1e-5)
    for w, m in zip(full, mine, strict=True):  # a weight's gradient sums both ranks' rows
        summed = w.grad.clone()
        dist.all_reduce(summed)
        ok = ok and torch.allclose(m.grad, summed[2 * rank : 2 * rank + 2], atol=1e-5)
    dist.destroy_process_group()
    return ok


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
def test_rows_go_to_their_experts_rank_and_come_back_with_their_gradients(rank_pool, grouped):
    assert rank_pool.run(_dispatched_against_local, grouped, world_size=2) == [True, True]


def _traded_against_whole(grouped: bool) -> bool:
    """Two TP ranks, each holding its contiguous half of a fused [gate | up] (etp's Shard of
    transformers' experts) and its share of down: their outputs' sum, the rows' summed
    gradients and each held block's gradient equal the whole experts' here."""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    counts = [3, 0, 2, 4]
    x = torch.randn(sum(counts), DIM, generator=torch.Generator().manual_seed(10))
    grad = torch.randn(sum(counts), DIM, generator=torch.Generator().manual_seed(20))
    hidden = 2 * HIDDEN  # a rank's share of it 16 bytes wide in fp32, as _grouped_mm takes
    w1, w3, w2 = (w.requires_grad_() for w in _weights(hidden))
    fused = torch.cat([w1, w3], dim=2).detach()  # [E, DIM, 2 hidden], gate's columns first
    held = fused[..., rank * hidden : (rank + 1) * hidden].clone().requires_grad_()
    share = hidden // 2
    down = w2[:, rank * share : (rank + 1) * share].detach().clone().requires_grad_()
    xs = [x.clone().requires_grad_() for _ in range(2)]
    want = expert_compute(xs[0], (w1, w3, w2), counts, grouped=False)
    want.backward(grad)
    trade = functools.partial(gate_and_up_by_rank, group=dist.group.WORLD)
    got = expert_compute(xs[1], (held, None, down), torch.tensor(counts), grouped, trade)
    got.backward(grad)
    dist.all_reduce(got.data)
    dist.all_reduce(xs[1].grad)
    ok = torch.allclose(got, want, atol=1e-5) and torch.allclose(xs[1].grad, xs[0].grad, atol=1e-5)
    whole = torch.cat([w1.grad, w3.grad], dim=2)[..., rank * hidden : (rank + 1) * hidden]
    ok = ok and torch.allclose(held.grad, whole, atol=1e-5)
    ok = ok and torch.allclose(down.grad, w2.grad[:, rank * share : (rank + 1) * share], atol=1e-5)
    dist.destroy_process_group()
    return ok


def _gate_and_up_traded(_) -> tuple[list[int], list[int]]:
    """Products with the rows of a fused [gate; up] (f = 6 each, numbered 0..11 by their
    place in it) as the TP rank holds them (its contiguous block, etp's Shard), two rows of
    tokens; the columns after the trade, and the gradient of their weighted sum back on the
    columns held."""
    dist.init_process_group("gloo")
    tp, rank = dist.get_world_size(), dist.get_rank()
    width = 12 // tp
    held = torch.arange(rank * width, (rank + 1) * width, dtype=torch.float32).repeat(2, 1)
    held.requires_grad_()
    traded = gate_and_up_by_rank(held, dist.group.WORLD)
    (traded * torch.arange(1, width + 1)).sum().backward()
    columns, grads = traded[1].int().tolist(), held.grad[1].int().tolist()
    dist.destroy_process_group()
    return columns, grads


@pytest.mark.parametrize("tp", [2, 3])
def test_each_tp_rank_gets_gate_and_up_columns_of_its_share_of_the_hidden_width(rank_pool, tp):
    """etp's trade of transformers' fused gate|up products (hf_experts.gate_and_up_by_rank):
    rank r ends with gate's columns r*f/tp.. and up's same columns (f/tp each, gate first),
    whatever block of rows it held; each gradient goes back to the rank and column it came
    from."""
    share = 6 // tp
    got = rank_pool.run(_gate_and_up_traded, None, world_size=tp)
    for rank, (columns, _) in enumerate(got):
        mine = list(range(rank * share, (rank + 1) * share))
        assert columns == mine + [6 + c for c in mine]
    # the gradient of column c is its weight (its 1-based place) on the rank it went to
    weight = {c: place + 1 for columns, _ in got for place, c in enumerate(columns)}
    width = 12 // tp
    for rank, (_, grads) in enumerate(got):
        assert grads == [weight[c] for c in range(rank * width, (rank + 1) * width)]


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped"])
def test_fused_gate_up_split_over_tp_computes_the_whole_experts(rank_pool, grouped):
    """transformers' experts under etp (hf_experts): the trade of the gate|up products, by
    the loop and by the grouped GEMM (which CUDA's experts take)."""
    assert rank_pool.run(_traded_against_whole, grouped, world_size=2) == [True, True]


def _held_experts(_) -> dict[str, list[int]]:
    """Which experts of layer 0 this rank's w1 holds, fsdp4 x ep2 on 4 ranks."""
    dist.init_process_group("gloo")
    cfg = resolved_config(*COMMON, "parallel=single")
    parallel = ParallelConfig(name="ep2", dp_shard=4, ep=2)
    layout = Layout.of(parallel)
    model = parallelize(
        build_model(cfg.model, cfg.train.seq_len, "meta"),
        build_mesh(layout, "cpu"),
        layout,
        parallel,
        torch.device("cpu"),
        seed=0,
        param_dtype=torch.float32,
    )
    w1 = model.parts[0].layers["0"].feed_forward.experts.w1
    local, box = held_box(w1)
    dist.destroy_process_group()
    return {"experts": list(range(box[0].start, box[0].stop)), "rows": [local.shape[0]]}


@pytest.mark.slow
def test_each_rank_holds_its_share_of_the_experts(rank_pool):
    """ep2 splits tiny-moe's 8 experts 4 and 4 (ep rank = dp_shard rank mod 2), FSDP2 the
    4 over the other 2 ranks: 2 experts a rank, every expert held once."""
    held = [r["experts"] for r in rank_pool.run(_held_experts, None, world_size=4)]
    assert held == [[0, 1], [4, 5], [2, 3], [6, 7]]


LAYOUTS = {
    "ep2": ("parallel=ep2",),  # FSDP2 over 2 ranks, the experts split between them
    "fsdp2_ep2": ("parallel=ep2", "launcher.nproc_per_node=4"),  # and each half sharded
    "tp2_ep2": ("parallel=tp2_ep2", "launcher.nproc_per_node=4", MICRO4),
    "pp2_ep2": ("parallel=pp2_ep2", "launcher.nproc_per_node=4"),
    "hsdp_ep2": ("parallel=hsdp", "parallel.ep=2", "launcher.nproc_per_node=4"),
    "cp2_ep2": ("parallel=cp2", "parallel.ep=2", "model.moe.load_balance=none"),
    "ep4_full_checkpointing": (
        "parallel=ep2",
        "parallel.ep=4",
        "launcher.nproc_per_node=4",
        "parallel.activation_checkpointing=full",
    ),
    "ep2_bias": ("parallel=ep2", *BIAS),
    # the MoE layer under SP: its input gathered over the sequence, its output sliced
    "tp2_sp": ("parallel=tp2", "parallel.sequence_parallel=true", MICRO4),
    # each expert's hidden width split over the TP ranks too (Megatron's expert TP)
    "tp2_etp2": ("parallel=tp2", "parallel.etp=2", MICRO4),
    "tp2_sp_etp2": ("parallel=tp2", "parallel.sequence_parallel=true", "parallel.etp=2", MICRO4),
    "tp2_ep2_etp2": ("parallel=tp2_ep2", "parallel.etp=2", "launcher.nproc_per_node=4", MICRO4),
    "fsdp2_tp2_etp2": (
        "parallel=fsdp2_tp2",
        "parallel.etp=2",
        "launcher.nproc_per_node=4",
        MICRO4,
    ),
}
FAST = {"ep2", "tp2_sp_etp2"}


@pytest.mark.parametrize("layout", tiered(LAYOUTS, FAST))
def test_an_moe_model_trains_under_expert_parallelism_as_on_one_device(
    experiment, single_moe_steps, layout
):
    assert_trains_as_on_one_device(experiment, single_moe_steps, LAYOUTS[layout])


REFUSED = {
    "a dense model": (("model=tiny", "parallel=ep2"), "has none"),
    "a dense transformers model": (("model=hf/tiny-llama", "parallel=ep2"), "has none"),
    "no dp_shard to draw from": (("model=tiny-moe", "parallel=ddp", "parallel.ep=2"), "dp_shard"),
    "experts it does not divide": (
        ("model=tiny-moe", "parallel=ep2", "parallel.ep=3", "launcher.nproc_per_node=3"),
        "the model's 8 experts",
    ),
    "a degree below one": (("model=tiny-moe", "parallel=ep2", "parallel.ep=0"), "must be >= 1"),
    "etp other than tp": (("model=tiny-moe", "parallel=tp2", "parallel.etp=4"), "1 or 2"),
    "etp of a dense model": (("model=tiny", "parallel=tp2", "parallel.etp=2"), "has none"),
    "etp the hidden width does not divide": (
        ("model=tiny-moe", "model.moe.expert_ffn_dim=63", "parallel=tp2", "parallel.etp=2"),
        "hidden width (63)",
    ),
}
NOT_THE_MODEL = tuple(o for o in COMMON if not o.startswith("model="))


@pytest.mark.parametrize("case", REFUSED)
def test_an_impossible_ep_is_refused_with_the_key_and_a_fix(case):
    """(The CLI turns a ConfigError into its message and exit 2: test_config_errors.py.)"""
    overrides, reason = REFUSED[case]
    with pytest.raises(ConfigError) as caught:
        resolved_config(*NOT_THE_MODEL, *overrides)
    assert caught.value.key == ("parallel.etp" if "etp" in case else "parallel.ep")
    assert reason in str(caught.value)


@pytest.mark.slow
def test_an_expert_parallel_runs_routers_reach_its_wandb_run(meshrun_here):
    """An offline W&B run of ep2 (W&B itself, read back from its transaction log): each
    step's router figures in the history, the last step's in the summary."""
    run = meshrun_here(
        "model=tiny-moe",
        "parallel=ep2",
        "train.steps=3",
        "train.untimed_steps=1",
        "train.seq_len=32",
        "metrics.baseline=off",
        "logger=wandb",
        "logger.mode=offline",
    )
    assert run.returncode == 0, run.output
    logged = read_offline_run(run.run_dir)
    rows = step_rows(logged)
    loads = [s.moe_max_load for s in read_steps(run.run_dir) if s.moe_max_load is not None]
    assert [h["train/moe_max_load"] for h in rows] == loads and len(loads) == 3
    assert all(h["train/moe_aux_loss"] > 0 for h in rows)
    assert logged["summary"]["router_max_load"] == loads[-1]
    assert "fsdp2 x ep2" in logged["summary"]["layout_name"]
