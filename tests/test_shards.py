"""A parameter gets exactly its box of a full tensor from any source: a tensor, a checkpoint
read from disk (no byte more than the box), transposed or with its rows reordered; rows
past the source (vocabulary padding) are zero."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from meshrun.models.checkpoint_files import SavedTensors
from meshrun.models.shards import Reordered, Transposed, fill

FULL = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
BOXES = [
    (slice(0, 8), slice(0, 6)),
    (slice(2, 5), slice(1, 4)),
    (slice(7, 8), slice(0, 6)),
    (slice(3, 3), slice(0, 6)),
]


def test_a_checkpoint_reads_just_the_box_transposed_and_reordered(tmp_path):
    save_file({"w": FULL.T.contiguous()}, tmp_path / "model.safetensors")
    saved = SavedTensors(tmp_path)
    order = torch.tensor([4, 5, 0, 1, 6, 7, 2, 3])  # runs of two, as a fused q|k|v regrouped
    source = Reordered(Transposed(saved["w"]), order)
    assert source.shape == FULL.shape
    for box in BOXES:
        before = saved.bytes_read
        torch.testing.assert_close(source[box], FULL[order][box], rtol=0, atol=0)
        assert saved.bytes_read - before == FULL[box].numel() * 4


def test_fill_pads_rows_past_the_source_with_zeros():
    param = torch.full((10, 6), float("nan"))
    fill(param, FULL)
    assert torch.equal(param[:8], FULL) and not param[8:].any()
