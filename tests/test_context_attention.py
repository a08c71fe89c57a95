"""Context parallelism's attention and sequence sharding (rank/parallel/context_attention.py
and context_shards.py), on real gloo ranks: every method's output and q/k/v gradients on each
rank equal full causal SDPA's restricted to that rank's tokens."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshrun.rank.parallel import context_attention as context_module
from meshrun.rank.parallel.block_attention import _explicit_attend, _explicit_grads
from meshrun.rank.parallel.context_attention import METHODS, context_attention
from meshrun.rank.parallel.context_shards import (
    load_balanced_chunks,
    sequence_positions,
    shard_sequence,
    unshard_sequence,
)
from tests.cuda_attention_on_cpu import cuda_attention_on_cpu

TOL = 1e-5
BATCH, CHUNK, HEAD_DIM = 2, 3, 8


def _init() -> tuple[int, int]:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    return dist.get_rank(), dist.get_world_size()


def _errors(case: dict, group: dist.ProcessGroup, seed: int) -> dict[str, float]:
    """Largest difference of this rank's output and q/k/v grads from the full causal SDPA's
    (same seeded inputs and upstream gradient on every rank) restricted to its tokens."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    heads, kv_heads, scale = case["heads"], case["kv_heads"], case.get("scale")
    seq = 2 * cp * CHUNK
    gen = torch.Generator().manual_seed(seed)
    q, k, v, grad = (
        torch.randn(BATCH, h, seq, HEAD_DIM, generator=gen)
        for h in (heads, kv_heads, kv_heads, heads)
    )
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*full, is_causal=True, scale=scale, enable_gqa=True)
    want.backward(grad)
    local = [shard_sequence(t, rank, cp, dim=2).requires_grad_() for t in (q, k, v)]
    got = context_attention(case["method"])(*local, group, scale=scale)
    got.backward(shard_sequence(grad, rank, cp, dim=2))
    pairs = {"out": (got, want)} | {
        name: (mine.grad, ref.grad) for name, mine, ref in zip("qkv", local, full, strict=True)
    }
    return {
        name: (mine - shard_sequence(ref, rank, cp, dim=2)).abs().max().item()
        for name, (mine, ref) in pairs.items()
    }


def _attention_on_ranks(case: dict) -> dict[str, float]:
    _init()
    return _errors(case, dist.group.WORLD, seed=0)


HEADS = {  # cp -> (heads, K/V heads, scale): MHA and GQA; alltoall needs both divisible by cp
    1: [(4, 4, None), (4, 2, None)],
    2: [(4, 4, None), (4, 2, None), (8, 2, 0.3)],
    4: [(4, 4, None), (8, 4, None)],
}


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("method", ["ring", "allgather", "alltoall"])
def test_attention_and_grads_equal_full_causal_sdpa_on_every_rank(rank_pool, method, cp):
    for heads, kv_heads, scale in HEADS[cp]:
        case = {"method": method, "heads": heads, "kv_heads": kv_heads, "scale": scale}
        for rank, errors in enumerate(rank_pool.run(_attention_on_ranks, case, cp)):
            assert max(errors.values()) < TOL, (case, f"cp rank {rank}", errors)


def _subgroups_on_ranks(_) -> dict[str, dict[str, float]]:
    """World 4 as two CP groups {0, 2} and {1, 3} (tp innermost, as the mesh orders them)."""
    rank, _ = _init()
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    mine = groups[rank % 2]
    return {
        method: _errors({"method": method, "heads": 4, "kv_heads": 2}, mine, seed=rank % 2)
        for method in METHODS
    }


def _through_a_cuda_kernel(case: dict) -> dict[str, float]:
    """`_errors` with every chunk pair through one CUDA kernel's code (its ops on CPU)."""
    _init()
    chosen = context_module._kernel
    context_module._kernel = lambda q: (case["kernel"], q.dtype)
    try:
        with cuda_attention_on_cpu():
            return _errors(case, dist.group.WORLD, seed=0)
    finally:
        context_module._kernel = chosen


@pytest.mark.parametrize("kernel", ["flash", "efficient", "cudnn", "explicit"])
@pytest.mark.parametrize("method", ["ring", "allgather"])
def test_chunk_pairs_through_each_cuda_kernels_code_equal_full_causal_sdpa(
    rank_pool, method, kernel
):
    """Each kernel's ops called as on CUDA (tests/cuda_attention_on_cpu.py: their layouts,
    efficient's padded log-sum-exp, what each refuses), GQA given to flash whole and to the
    others repeated: outputs and gradients as full SDPA's."""
    for heads, kv_heads, scale in HEADS[2]:
        case = {"method": method, "kernel": kernel, "heads": heads, "kv_heads": kv_heads}
        case["scale"] = scale
        for rank, errors in enumerate(rank_pool.run(_through_a_cuda_kernel, case, 2)):
            assert max(errors.values()) < TOL, (case, f"cp rank {rank}", errors)


def test_every_method_keeps_to_its_cp_subgroup(rank_pool):
    """Peers are the group's ranks, not the world's: two CP groups side by side, each on
    its own data, both exact."""
    for rank, by_method in enumerate(rank_pool.run(_subgroups_on_ranks, None, 4)):
        for method, errors in by_method.items():
            assert max(errors.values()) < TOL, (method, f"rank {rank}", errors)


def test_rank_holds_chunks_r_and_mirror_with_their_global_positions():
    assert [load_balanced_chunks(r, 2) for r in range(2)] == [(0, 3), (1, 2)]
    assert sequence_positions(8, 0, 2).tolist() == [0, 1, 6, 7]
    assert sequence_positions(8, 1, 2).tolist() == [2, 3, 4, 5]
    for cp in (1, 2, 3, 4):
        seq = 2 * cp * 3
        tokens = torch.arange(seq)[None]
        for rank in range(cp):
            assert shard_sequence(tokens, rank, cp)[0].equal(sequence_positions(seq, rank, cp))


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_shard_then_unshard_gives_the_sequence_back(cp):
    x = torch.randn(2, 2 * cp * 5, 3, 4)
    shards = [shard_sequence(x, rank, cp) for rank in range(cp)]
    assert {s.shape[1] for s in shards} == {x.shape[1] // cp}
    assert unshard_sequence(shards).equal(x)
    heads_first = x.transpose(1, 2)  # [b, h, seq, d], attention's layout
    shards = [shard_sequence(heads_first, r, cp, dim=2) for r in range(cp)]
    assert unshard_sequence(shards, dim=2).equal(heads_first)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_every_rank_has_the_same_number_of_unmasked_causal_scores(cp):
    """A token at position p sees p + 1 keys: each rank's sum over its tokens is equal."""
    seq = 2 * cp * 4
    work = {int((sequence_positions(seq, r, cp) + 1).sum()) for r in range(cp)}
    assert len(work) == 1
    assert work.pop() * cp == seq * (seq + 1) // 2


@pytest.mark.parametrize("cp", [2, 3])
def test_a_sequence_that_2cp_does_not_divide_is_refused(cp):
    with pytest.raises(
        ValueError, match=rf"sequence length 10 is not divisible by 2 x cp = {2 * cp}"
    ):
        shard_sequence(torch.zeros(1, 10), 0, cp)
    with pytest.raises(ValueError, match="not divisible by 2 x cp"):
        sequence_positions(10, 0, cp)


def test_an_unknown_method_is_refused_naming_the_valid_ones():
    with pytest.raises(ValueError, match="'flash'; valid: ring, allgather, alltoall"):
        context_attention("flash")


def _refusals_on_ranks(_) -> list[str]:
    """alltoall with heads (or K/V heads) cp does not divide: refused before any exchange."""
    _init()
    messages = []
    for heads, kv_heads in ((6, 6), (4, 1)):
        q, kv = torch.zeros(1, heads, 4, 8), torch.zeros(1, kv_heads, 4, 8)
        try:
            context_attention("alltoall")(q, kv, kv, dist.group.WORLD)
        except ValueError as error:
            messages.append(str(error))
    # Every rank leaves together: one that tore its process group down while a peer still
    # completed gloo's connections closed them under it ("Connection closed by peer").
    dist.barrier()
    return messages


def test_alltoall_refuses_heads_cp_does_not_divide(rank_pool):
    messages = rank_pool.run(_refusals_on_ranks, None, 4)[0]
    rule = "alltoall splits heads over cp: heads ({}) and K/V heads ({}) must both be divisible"
    assert messages == [rule.format(6, 6) + " by cp (4)", rule.format(4, 1) + " by cp (4)"]


@pytest.mark.parametrize("causal", [False, True])
def test_the_ring_blocks_explicit_path_equals_sdpa_forward_and_backward(causal):
    """The ring's block attention where torch's fused CPU kernel is not used (other devices):
    output, log-sum-exp and the flash-style gradients equal SDPA's."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 8, 16, generator=gen, requires_grad=True) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3)
    dout = torch.randn(want.shape, generator=gen)
    want.backward(dout)
    with torch.no_grad():
        out, lse = _explicit_attend(q, k, v, causal, 0.3)
        grads = _explicit_grads((dout, q, k, v, out, lse), causal, 0.3)
        scores = (q @ k.transpose(-2, -1) * 0.3).masked_fill(
            torch.ones(8, 8, dtype=torch.bool).triu(1) & causal, float("-inf")
        )
    assert (out - want).abs().max() < 1e-5
    assert (lse - scores.logsumexp(-1)).abs().max() < 1e-5
    for got, x in zip(grads, (q, k, v), strict=True):
        assert (got - x.grad).abs().max() < 1e-5


def test_held_scores_stay_fp32_under_bf16_autocast():
    """The explicit path's matmuls (autocast would make them 16-bit) run in fp32: output,
    log-sum-exp and gradients as without autocast."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, dout = (torch.randn(2, 4, 8, 16, generator=gen) for _ in range(4))
    out, lse = _explicit_attend(q, k, v, True, 0.3)
    grads = _explicit_grads((dout, q, k, v, out, lse), True, 0.3)
    with torch.autocast("cpu", torch.bfloat16):
        out16, lse16 = _explicit_attend(q, k, v, True, 0.3)
        grads16 = _explicit_grads((dout, q, k, v, out16, lse16), True, 0.3)
    for fp32, under_autocast in zip((out, lse, *grads), (out16, lse16, *grads16), strict=True):
        assert under_autocast.dtype == torch.float32
        assert torch.equal(under_autocast, fp32)
