"""The routed experts' compute (models/expert_compute.py): which of the grouped GEMM and the
loop runs where, the grouped GEMM's rows (one zero row after each expert's), both giving the
same numbers, forward and backward (torch's CPU _grouped_mm, its fallback loop, computes the
grouped path here), and the grouped path laying out its rows without reading the device."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from meshrun.models import moe
from meshrun.models.expert_compute import (
    expert_compute,
    grouped_mm_native,
    matmul_dtype,
    padded_groups,
)

DIM, HIDDEN = 16, 24  # rows of 64 and 96 bytes in fp32, 32 and 48 in bf16: _grouped_mm's 16


def _weights(experts: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(2)
    shapes = [(experts, DIM, HIDDEN), (experts, DIM, HIDDEN), (experts, HIDDEN, DIM)]
    return tuple(torch.randn(s, generator=gen) for s in shapes)


@pytest.mark.parametrize(
    ("counts", "autocast"),
    [([4, 0, 6], False), ([4, 0, 6], True), ([0, 10, 0], False), ([0, 0, 0], False)],
    ids=["fp32", "bf16-autocast", "one-expert-busy", "no-rows"],
)
def test_grouped_gemm_and_the_loop_over_experts_agree_forward_and_backward(counts, autocast):
    """Experts without rows too (each has its zero row in the grouped GEMM, whose weight
    gradient must stay zero); under bf16 autocast the grouped path casts what autocast casts
    for the loop's matmuls, and returns what they return."""
    rows = sum(counts)
    gen = torch.Generator().manual_seed(1)
    x, grad = torch.randn(rows, DIM, generator=gen), torch.randn(rows, DIM, generator=gen)
    results = []
    for grouped in (True, False):
        inputs = [t.clone().requires_grad_() for t in (x, *_weights(len(counts)))]
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            out = expert_compute(inputs[0], tuple(inputs[1:]), torch.tensor(counts), grouped)
        out.backward(grad.to(out.dtype))
        results.append([out, *(t.grad for t in inputs)])
    tolerance = {"rtol": 1e-2, "atol": 1e-2} if autocast else {"rtol": 1e-5, "atol": 1e-5}
    for got, want in zip(*results, strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, **tolerance)
    for e in (e for e, count in enumerate(counts) if not count):
        assert not results[0][2][e].any()  # w1's gradient of an expert without rows


def test_the_grouped_gemm_is_chosen_where_torch_has_its_kernel():
    """CUDA sm90 and sm100 only (sm120 and sm80 take torch's fallback loop), bf16 only, and
    rows of 16 bytes (the experts' widths a multiple of 8 in bf16)."""
    bf16, aligned = torch.bfloat16, (64, 128)
    assert grouped_mm_native("cuda", (9, 0), bf16, aligned)
    assert grouped_mm_native("cuda", (10, 0), bf16, aligned)
    assert not grouped_mm_native("cuda", (12, 0), bf16, aligned)
    assert not grouped_mm_native("cuda", (8, 0), bf16, aligned)
    assert not grouped_mm_native("cpu", None, bf16, aligned)
    assert not grouped_mm_native("cuda", (9, 0), torch.float32, aligned)
    assert not grouped_mm_native("cuda", (9, 0), torch.float16, aligned)
    assert not grouped_mm_native("cuda", (9, 0), bf16, (64, 60))


def test_the_experts_matmuls_compute_in_autocasts_dtype_where_it_is_on():
    """Under bf16 autocast RMSNorm's output is fp32, and the matmuls compute in bf16."""
    x = torch.randn(2, DIM)
    assert matmul_dtype(x) == torch.float32
    assert matmul_dtype(x.bfloat16()) == torch.bfloat16
    with torch.autocast("cpu", torch.bfloat16):
        assert matmul_dtype(x) == torch.bfloat16
    with torch.autocast("cpu", torch.bfloat16, enabled=False):
        assert matmul_dtype(x) == torch.float32


@pytest.mark.parametrize(
    ("counts", "positions", "offsets"),
    [
        ([4, 0, 6], [0, 1, 2, 3, 6, 7, 8, 9, 10, 11], [5, 6, 13]),
        ([0, 0], [], [1, 2]),
        ([3], [0, 1, 2], [4]),
        ([0, 2, 0, 1], [1, 2, 5], [1, 4, 5, 7]),
    ],
)
def test_each_group_is_followed_by_one_zero_row(counts, positions, offsets):
    """Every group non-empty and the last offset the padded buffer's end (rows + groups)."""
    got_positions, got_offsets = padded_groups(torch.tensor(counts), sum(counts))
    assert got_positions.tolist() == positions
    assert got_offsets.dtype == torch.int32 and got_offsets.tolist() == offsets
    assert got_offsets[-1] == sum(counts) + len(counts)


def test_the_grouped_path_reads_nothing_back_from_the_device():
    """The router's counts and the grouped GEMM's layout stay on the device: on fake tensors,
    which have no values, a read back (`.item()`, `.tolist()`, bincount's largest value)
    raises."""
    with FakeTensorMode():
        chosen = torch.randint(0, 4, (12, 2))
        order, counts = moe.sorted_by_expert(chosen, 4)
        x = torch.randn(order.numel(), DIM, dtype=torch.bfloat16)
        weights = tuple(w.bfloat16() for w in _weights(4))
        out = expert_compute(x, weights, counts, grouped=True)
    assert out.shape == (24, DIM)
