"""meshrun's overhead over hand-written DDP, measured side by side in one run.

(A) "hand": plain torch, as a user would write it: mp.spawn, gloo, DistributedDataParallel,
AdamW, gradient accumulation with no_sync, clip_grad_norm_. (B) "meshrun": the same training
through the `meshrun` CLI (parallel=ddp). Each rank trains on its own contiguous share of
every global batch. How both are run, timed and compared: see common.py.
"""

from __future__ import annotations

import functools

import torch
from common import (
    GRAD_CLIP,
    SEED,
    HandRank,
    Setup,
    accumulate,
    adamw,
    main,
    seeded_model,
    step_tokens,
)
from torch.nn.parallel import DistributedDataParallel

from meshrun.core.config import LlamaModelConfig
from meshrun.rank.train.data import SyntheticTokens


def build_ddp(rank: int, setup: Setup, model_cfg: LlamaModelConfig) -> HandRank:
    """One rank of hand-written DDP."""
    model = seeded_model(model_cfg, setup)
    ddp_model = DistributedDataParallel(model)
    params = list(model.parameters())
    data = SyntheticTokens(model_cfg.vocab_size, SEED)

    def forward_backward(step: int) -> torch.Tensor:
        tokens = step_tokens(data, setup, step, rank, setup.ranks)
        return accumulate(ddp_model, tokens, setup.micro_batch_size, ddp_model.no_sync)

    clip = functools.partial(torch.nn.utils.clip_grad_norm_, params, GRAD_CLIP, foreach=True)
    return HandRank(adamw(params), forward_backward, clip)


if __name__ == "__main__":
    main("DDP overhead", "ddp", build_ddp, __file__, __doc__)
