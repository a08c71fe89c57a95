"""The speed model on GPU clusters (plan/speed.py, stage_time.py, comm_time.py, compute.py,
collectives.py, placement.py): links by placement, overlap, recomputation, matmul
efficiency, and published throughput. Nothing runs on a GPU: these are the model's own
predictions, checked against first principles and against published large-scale runs
(benchmarks/speed_vs_published.py)."""

from __future__ import annotations

import time

import pytest

from benchmarks.speed_vs_published import ROWS, cluster_config, megatron_flops_per_token
from meshrun.core.config import AttentionKernel, FSDPConfig
from meshrun.core.hardware import load_profile
from meshrun.core.layout import Layout
from meshrun.models import model_shape
from meshrun.plan.collectives import Fabric, overlapped
from meshrun.plan.comm_time import tied_time
from meshrun.plan.compute import ATTENTION_RATE, DeviceRates, kernel_rates
from meshrun.plan.placement import GroupSpan, group_span
from meshrun.plan.speed import SpeedPrediction, predict_speed
from meshrun.plan.stage_time import formula_cost

LLAMA_13B = (
    "model=llama-13b",
    "hardware=a100-80g",
    "train.seq_len=4096",
    "train.global_batch_size=256",
    "train.micro_batch_size=1",
)
A100 = DeviceRates(matmul=312e12 * 0.86, memory=2039e9 * 0.8, sms=108)


def speed(*overrides: str, nodes: int, **parallel) -> SpeedPrediction:
    return predict_speed(cluster_config(*overrides, nodes=nodes, **parallel))


def test_tp_is_innermost_and_pp_outermost_in_meshruns_rank_order():
    layout = Layout(pp=16, dp_shard=8, tp=8)
    assert group_span(layout, "tp", 8) == GroupSpan(8, 1)
    assert group_span(layout, "dp_shard", 8) == GroupSpan(1, 8)
    assert group_span(layout, "pp", 8) == GroupSpan(1, 16)
    assert group_span(Layout(dp_shard=8, tp=2), "dp_shard", 8) == GroupSpan(4, 2)
    assert group_span(Layout(tp=16), "tp", 8) == GroupSpan(8, 2)


def test_a_group_straddling_a_node_boundary_counts_as_spanning_nodes():
    """6 devices a node, tp=4: ranks 4-7 sit on two nodes, two on each."""
    assert group_span(Layout(dp_shard=3, tp=4), "tp", 6) == GroupSpan(2, 2)


def test_matmul_efficiency_rises_with_matmul_size():
    def efficiency(m: int, n: int, k: int) -> float:
        return 2 * m * n * k / A100.gemm(m, n, k, 2) / 312e12

    small, medium, large = (
        efficiency(256, 512, 512),
        efficiency(2048, 2048, 2048),
        efficiency(8192, 8192, 8192),
    )
    assert small < 0.3 < medium < large <= 0.86
    assert large == pytest.approx(0.86, rel=0.02)


def test_the_attention_kernels_rates_are_interpolated_in_log_sequence_and_held_at_the_ends():
    kernel = AttentionKernel(
        seq=[1024, 4096], forward_tflops=[200.0, 300.0], backward_tflops=[100.0, 160.0]
    )
    assert kernel_rates(kernel, 1024) == (200e12, 100e12)
    assert kernel_rates(kernel, 2048) == pytest.approx((250e12, 130e12))  # halfway in log2
    assert kernel_rates(kernel, 256) == (200e12, 100e12)
    assert kernel_rates(kernel, 131072) == (300e12, 160e12)


def attention_rate(*overrides: str, **parallel) -> float:
    """The causal-attention FLOP/s a rank's step achieves, forward and backward together: its
    attention FLOPs (half of 4·b·s²·h a layer forward, 2.5x that backward) over the
    predicted seconds."""
    cfg = cluster_config(*overrides, nodes=1, **parallel)
    shape, layout = model_shape(cfg.model), Layout.of(cfg.parallel)
    sequences = cfg.train.global_batch_size // (layout.dp_replicate * layout.dp_shard)
    forward = 2 * sequences * cfg.train.seq_len**2 * shape.dim / layout.tp / layout.cp
    return 3.5 * forward * shape.n_layers / predict_speed(cfg).breakdown["attention"]


HOPPER_8B = ("model=hf/llama-3.1-8b", "train.global_batch_size=64", "train.micro_batch_size=1")


def test_on_hopper_attention_runs_at_torchs_flashattention_2_rates_not_the_matmuls():
    """torch's SDPA runs FlashAttention-2 on an H100: 333 TFLOP/s forward, 318 backward at
    8k (Shah et al. 2024), far under the 0.7 x 792 a matmul-rate rule would give; short
    sequences slower; fp32 (no FlashAttention) and an A100 profile (no table) keep the rule."""
    h100 = load_profile("h100-80g").devices[0]
    bf16 = ("hardware=h100-80g", "train.precision=bf16", *HOPPER_8B)
    at_8k = attention_rate(*bf16, "train.seq_len=8192", dp_shard=8)
    both_8k = 3.5 / (1 / 333e12 + 2.5 / 318e12)
    assert at_8k == pytest.approx(both_8k, rel=1e-6)
    at_1k = attention_rate(*bf16, "train.seq_len=1024", dp_shard=8)
    assert at_1k == pytest.approx(3.5 / (1 / 260e12 + 2.5 / 260e12), rel=1e-6)
    # a ring's rank spans seq/cp: 8k of a 64k sequence; Ulysses' the whole of it
    ring_64k = attention_rate(*bf16, "train.seq_len=65536", cp=8)
    assert ring_64k == pytest.approx(both_8k, rel=1e-6)
    ulysses_8k = attention_rate(*bf16, "train.seq_len=8192", cp=8, cp_method="alltoall")
    assert ulysses_8k == pytest.approx(both_8k, rel=1e-6)
    rule = ATTENTION_RATE * h100.matmul_efficiency * 989.4e12
    fp32 = attention_rate("hardware=h100-80g", "train.precision=fp32", *HOPPER_8B, dp_shard=8)
    assert fp32 == pytest.approx(ATTENTION_RATE * h100.matmul_efficiency * 494.7e12, rel=1e-6)
    a100 = attention_rate("hardware=a100-80g", "train.precision=bf16", *HOPPER_8B, dp_shard=8)
    assert a100 == pytest.approx(ATTENTION_RATE * 0.86 * 312e12, rel=1e-6)
    assert at_1k < at_8k < 0.6 * rule


def test_one_tile_more_than_the_sms_costs_a_second_wave():
    """12 x 9 tiles of 128 x 128 fill an A100's 108 SMs once; 13 x 9 need two waves."""
    full, spill = A100.gemm(12 * 128, 9 * 128, 16384, 2), A100.gemm(13 * 128, 9 * 128, 16384, 2)
    assert spill == pytest.approx(2 * full, rel=0.01)


def test_tp_across_nodes_is_predicted_much_slower_than_inside():
    """Two nodes: TP of 16 spans both (its groups' rings ride the NICs, and each rank moves
    the whole micro-batch's activations), TP of 8 with a pipeline of 2 stays on NVLink."""
    inside = speed(*LLAMA_13B, nodes=2, tp=8, pp=2)
    across = speed(*LLAMA_13B, nodes=2, tp=16)
    assert across.breakdown["tp"] > 2 * inside.breakdown["tp"]
    assert across.tokens_per_s < 0.8 * inside.tokens_per_s


def test_a_tp_group_split_over_two_nodes_rides_the_nics_instead_of_nvlink():
    """The same TP of 16 on one 16-GPU NVSwitch node and on two 8-GPU nodes: the split
    group's ring leaves each node through its 8 NICs (8 x 25 GB/s against NVLink's 300 a
    GPU), with the network's latency on each hop out; on 25 GbE it crawls."""
    one = speed(*LLAMA_13B, nodes=1, per_node=16, tp=16)
    two = speed(*LLAMA_13B, nodes=2, tp=16)
    ethernet = speed(*LLAMA_13B, "hardware=a100-80g-25gbe", nodes=2, tp=16)
    assert two.breakdown["tp"] > 1.25 * one.breakdown["tp"]
    assert ethernet.breakdown["tp"] > 10 * one.breakdown["tp"]
    assert two.breakdown["matmul"] == one.breakdown["matmul"]


def test_llama_13b_on_8_nodes_ranks_tp_inside_a_node_over_tp_across():
    layouts = [
        dict(tp=8, pp=8),
        dict(tp=8, pp=2, dp_replicate=4),
        dict(tp=8, pp=4, dp_shard=2),
        dict(tp=16, pp=4),
        dict(tp=16, pp=2, dp_replicate=2),
        dict(tp=32, pp=2),
    ]
    rates = {tuple(d.items()): speed(*LLAMA_13B, nodes=8, **d).tokens_per_s for d in layouts}
    inside = max(r for d, r in rates.items() if dict(d)["tp"] <= 8)
    across = max(r for d, r in rates.items() if dict(d)["tp"] > 8)
    assert inside > 1.3 * across


def test_sequence_parallelism_moves_the_same_tp_bytes_and_shrinks_replicated_work():
    """All-gather + reduce-scatter carry an all-reduce's bytes (with no latency, the same
    time); the norms and residual adds each TP rank repeated are split among them."""
    no_latency = (*LLAMA_13B, "hardware.intra_node.latency_us=0")
    plain = speed(*no_latency, nodes=1, tp=8)
    sp = speed(*no_latency, nodes=1, tp=8, sequence_parallel=True)
    assert sp.breakdown["tp"] == pytest.approx(plain.breakdown["tp"], rel=1e-3)
    assert sp.breakdown["elementwise"] < 0.5 * plain.breakdown["elementwise"]
    assert sp.breakdown["matmul"] == plain.breakdown["matmul"]


def test_full_recompute_costs_a_forward_and_selective_only_the_elementwise_work():
    """selective keeps every matmul and attention output: its recompute is the memory-bound
    elementwise work (a third of an unfused block's forward here); op adds every other
    matmul."""
    none, full, selective, op = (
        speed(*LLAMA_13B, nodes=1, tp=8, activation_checkpointing=c)
        for c in ("none", "full", "selective", "op")
    )
    forward = none.compute_s / 3  # backward does about twice the forward's work
    assert full.breakdown["recompute"] == pytest.approx(forward, rel=0.25)
    assert 0 < selective.breakdown["recompute"] < 0.4 * full.breakdown["recompute"]
    assert (
        selective.breakdown["recompute"] < op.breakdown["recompute"] < full.breakdown["recompute"]
    )
    assert none.breakdown["recompute"] == 0
    assert none.step_time_s < selective.step_time_s < op.step_time_s < full.step_time_s


def test_overlap_leaves_only_what_outlasts_the_compute():
    assert overlapped(comm=1.0, compute=10.0, chunks=4) == pytest.approx(0.25)
    assert overlapped(comm=10.0, compute=4.0, chunks=4) == pytest.approx(7.0)
    assert overlapped(comm=1.0, compute=0.0, chunks=1) == 1.0


def test_ddp_hides_its_gradient_all_reduce_behind_a_long_backward():
    """llama-1b, DDP over 8 A100s: the all-reduce of 5 GB of fp32 gradients (~200 buckets)
    rides NVLink while backward runs; only the last bucket is left."""
    run = speed(
        "model=llama-1b",
        "hardware=a100-80g",
        "train.seq_len=2048",
        "train.global_batch_size=64",
        "train.micro_batch_size=8",
        nodes=1,
        dp_replicate=8,
    )
    dp, exposed = run.breakdown["dp"], run.breakdown["dp_exposed"]
    assert 0 < exposed < 0.02 * dp


def test_fsdp2_copies_each_gathered_unit_and_packs_each_gradient_on_the_compute_stream():
    """Every micro-batch: the all-gather's output split into the parameters (bf16 read and
    written) forward and again backward, the gradients packed into the reduce-scatter's fp32
    input (bf16 read, fp32 written); half the gathers without the backward's re-gather; once
    a step under a pipeline; none under DDP."""
    memory = 2039e9 * 0.8  # A100-80GB's HBM at the streaming efficiency

    def copies(**parallel) -> tuple[float, int, int]:
        """(the step's copies, the elements a rank gathers, micro-batches a step)"""
        cfg = cluster_config(*LLAMA_13B, nodes=1, **parallel)
        layout = Layout.of(cfg.parallel)
        m = cfg.train.global_batch_size // layout.dp_size // cfg.train.micro_batch_size
        elements = formula_cost(cfg, layout).rank_elements
        return predict_speed(cfg).step_parts()["fsdp_copies"], elements, m

    sharded, elements, m = copies(dp_shard=8)
    assert sharded == pytest.approx(elements * m * (2 * 2 * 2 + (2 + 4)) / memory, rel=1e-9)
    kept, _, _ = copies(dp_shard=8, fsdp=FSDPConfig(reshard_after_forward=False))
    assert kept == pytest.approx(elements * m * (2 * 2 + (2 + 4)) / memory, rel=1e-9)
    pipelined, stage_elements, _ = copies(dp_shard=4, pp=2)
    assert pipelined == pytest.approx(stage_elements * (2 * 2 + (2 + 4)) / memory, rel=1e-9)
    assert copies(dp_replicate=8)[0] == 0.0


def test_a_collective_hidden_behind_compute_still_costs_the_sms_nccls_channels_take():
    """Pure FSDP of llama-13b over 4 nodes: the all-gathers and reduce-scatters hide behind
    compute, but compute runs on 108 - 16 SMs meanwhile; TP alone hides nothing."""
    fsdp = speed(*LLAMA_13B, nodes=4, dp_shard=32)
    hidden = fsdp.breakdown["dp"] - fsdp.breakdown["dp_exposed"]
    assert hidden > 0.5 * fsdp.breakdown["dp"]
    assert fsdp.breakdown["contention"] == pytest.approx(hidden * 16 / 108)
    assert fsdp.exposed_comm_s >= fsdp.breakdown["dp_exposed"] + fsdp.breakdown["contention"]
    assert speed(*LLAMA_13B, nodes=1, tp=8).breakdown["contention"] == 0


def test_a_slower_network_slows_data_parallelism_across_nodes_only():
    """FSDP over 4 nodes: 25 Gb/s Ethernet against 8 x 200 Gb/s InfiniBand; TP stays on
    NVLink either way."""
    args = (
        "model=llama-1b",
        "train.seq_len=2048",
        "train.global_batch_size=64",
        "train.micro_batch_size=2",
    )
    ib = speed(*args, "hardware=a100-80g", nodes=4, dp_shard=16, tp=2)
    eth = speed(*args, "hardware=a100-80g-25gbe", nodes=4, dp_shard=16, tp=2)
    assert eth.breakdown["dp"] > 20 * ib.breakdown["dp"]
    assert eth.breakdown["tp"] == ib.breakdown["tp"]
    assert eth.tokens_per_s < ib.tokens_per_s


def test_a_cluster_preset_is_its_node_profile_on_another_network():
    node, cluster = load_profile("a100-80g"), load_profile("a100-80g-25gbe")
    assert cluster.devices == node.devices and cluster.intra_node == node.intra_node
    assert (cluster.network.nics, cluster.network.nic_gbps) == (1, 25)
    assert (node.network.nics, node.network.nic_gbps) == (8, 200)


def test_gpt3_175b_on_128_nodes_of_a100_predicts_megatrons_published_throughput():
    """Narayanan et al. 2021 (SC21, sec. 5.1): GPT-3 175B on 1024 A100-80GB, batch 1536,
    138-163 TFLOP/s a GPU across their Table 1 and 140 for this run (Megatron's count, the
    recomputed forward included: 97.6 tokens/s a GPU). Band: 120-175 TFLOP/s, 85-120
    tokens/s a GPU. tp8 pp16 is our reading of their layout."""
    row = next(r for r in ROWS if r.what.startswith("GPT-3 175B"))
    cfg = cluster_config(
        *row.model,
        *row.hardware,
        "train.seq_len=2048",
        "train.global_batch_size=1536",
        "train.micro_batch_size=1",
        nodes=128,
        tp=8,
        pp=16,
        dp_replicate=8,
        activation_checkpointing="full",
    )
    per_gpu = predict_speed(cfg).tokens_per_s / 1024
    assert 85 < per_gpu < 120
    assert 120 < per_gpu * megatron_flops_per_token(cfg) / 1e12 < 175


def test_prediction_does_not_grow_with_the_world_size():
    """8 ranks and 8,192 (1,024 nodes): the same stages and device kinds to cost."""
    args = (
        "model=gpt3-175b",
        "hardware=a100-80g",
        "train.seq_len=2048",
        "train.micro_batch_size=1",
    )
    small = cluster_config(*args, "train.global_batch_size=64", nodes=1, tp=8)
    large = cluster_config(
        *args, "train.global_batch_size=16384", nodes=1024, tp=8, pp=16, dp_replicate=64
    )
    for cfg in (small, large):
        predict_speed(cfg)  # warm the block cache
    started = time.perf_counter()
    for _ in range(20):
        predict_speed(large)
    assert (time.perf_counter() - started) / 20 < 0.01


LONG_CONTEXT = (
    "model=hf/llama-3.1-8b",
    "hardware=h100-80g",
    "train.seq_len=131072",
    "train.global_batch_size=8",
    "train.micro_batch_size=1",
)


def test_a_context_parallel_rank_does_a_data_parallel_ranks_work():
    """cp8 trains each sequence on 8 ranks, FSDP8 a sequence on each: the same tokens a rank
    and, the causal chunks balanced, the same attention work."""
    cp = speed(*LONG_CONTEXT, nodes=1, cp=8)
    fsdp = speed(*LONG_CONTEXT, nodes=1, dp_shard=8)
    for kind in ("matmul", "attention", "elementwise"):
        assert cp.breakdown[kind] == pytest.approx(fsdp.breakdown[kind], rel=0.02), kind
    assert cp.breakdown["cp"] > 0 and fsdp.breakdown["cp"] == 0


def test_the_ring_hides_its_kv_behind_attention_where_allgather_waits_for_it():
    ring = speed(*LONG_CONTEXT, nodes=1, cp=8)
    gather = speed(*LONG_CONTEXT, nodes=1, cp=8, cp_method="allgather")
    ulysses = speed(*LONG_CONTEXT, nodes=1, cp=8, cp_method="alltoall")
    assert ring.breakdown["cp_exposed"] < 0.01 * ring.breakdown["cp"]
    for exposed in (gather, ulysses):
        assert exposed.breakdown["cp_exposed"] == exposed.breakdown["cp"] > 0
    assert ring.step_time_s < min(gather.step_time_s, ulysses.step_time_s)


def test_a_ring_across_nodes_rides_the_nics_and_shows_once_attention_is_short():
    """At 131k tokens (8k a rank) a block's attention outlasts even a NIC's transfer of the
    next; at 16k (1k a rank) it outlasts NVLink's, not the NIC's."""
    for seq, hidden_across in ((131072, True), (16384, False)):
        args = (*LONG_CONTEXT, f"train.seq_len={seq}")
        inside = speed(*args, nodes=1, per_node=16, cp=16)
        across = speed(*args, nodes=2, cp=16)
        assert across.breakdown["cp"] > 2 * inside.breakdown["cp"]
        assert inside.breakdown["cp_exposed"] < 0.01 * inside.breakdown["cp"]
        exposed = across.breakdown["cp_exposed"]
        assert (exposed < 0.01 * across.breakdown["cp"]) == hidden_across, (seq, exposed)


@pytest.mark.parametrize(
    "parallel",
    [
        {"dp_shard": 8},
        {"tp": 8, "sequence_parallel": True, "activation_checkpointing": "op"},
        {"pp": 4, "tp": 2, "dp_shard": 2, "activation_checkpointing": "full"},
        {"cp": 2, "dp_shard": 4, "activation_checkpointing": "selective"},
    ],
    ids=str,
)
def test_a_predicted_step_is_the_sum_of_its_parts(parallel):
    """What a plan row prints as its step (meshrun-plan's breakdown) adds up to the step."""
    run = speed(*LLAMA_13B, nodes=1, **parallel)
    parts = run.step_parts()
    assert sum(parts.values()) == pytest.approx(run.step_time_s, rel=1e-9)
    assert all(v >= 0 for v in parts.values())
    assert parts["matmul"] > 0 and parts["optimizer"] > 0


LLAMA_1B = (
    "model=llama-1b",  # tied embedding and head
    "hardware=a100-80g",
    "train.seq_len=4096",
    "train.global_batch_size=64",
    "train.micro_batch_size=1",
)


def test_a_tied_pipeline_sums_its_embedding_gradient_between_its_ends_once_a_step():
    """A pipeline of llama-1b's tied embedding all-reduces V x h (the rank's TP and FSDP
    shard, fp32) between its first and last stage after the last backward: exposed, once a
    step, riding the NICs where the ends sit on two nodes; nothing without the tie or the
    pipeline."""
    untied = "model.tie_embeddings=false"
    tied = speed(*LLAMA_1B, nodes=1, pp=2, tp=2, dp_shard=2)
    same_untied = speed(*LLAMA_1B, untied, nodes=1, pp=2, tp=2, dp_shard=2)
    summed = tied.breakdown["pp"] - same_untied.breakdown["pp"]
    cfg = cluster_config(*LLAMA_1B, nodes=1, pp=2, tp=2, dp_shard=2)
    fabric = Fabric.of(cfg)
    vocab, h = 128256, 2048  # divisible by tp: no padding
    assert summed == pytest.approx(fabric.all_reduce(GroupSpan(2, 1), vocab * h / 4 * 4))
    assert summed > 0 and tied.step_time_s - same_untied.step_time_s >= summed * 0.99
    assert tied_time(cfg, Layout.of(cfg.parallel), fabric) == pytest.approx(summed)
    across = cluster_config(*LLAMA_1B, nodes=2, pp=2, tp=2, dp_shard=4)
    layout = Layout.of(across.parallel)
    assert tied_time(across, layout, Fabric.of(across)) == pytest.approx(
        Fabric.of(across).all_reduce(GroupSpan(1, 2), vocab * h / 8 * 4)
    )
    assert (
        tied_time(cluster_config(*LLAMA_1B, nodes=1, dp_shard=8), Layout(dp_shard=8), fabric) == 0
    )
    untied_pipeline = cluster_config(*LLAMA_1B, untied, nodes=1, pp=2, dp_shard=4)
    assert tied_time(untied_pipeline, Layout.of(untied_pipeline.parallel), fabric) == 0
