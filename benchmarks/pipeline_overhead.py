"""meshrun's overhead over a hand-written 2-stage pipeline, measured side by side in one run.

(A) "hand": plain torch.distributed.pipelining, as a user would write it: mp.spawn, gloo, the
model cut by layers (stage 0 keeps the embedding and the first half of the layers, the last
stage the rest, the final norm and the head), each stage materialised with `to_empty` and
initialised with `init_weights(seed)`, PipelineStage + Schedule1F1B over the global batch's
micro-batches, AdamW, and clipping with the global gradient norm (squared norms summed over
the stages with an all_reduce). (B) "meshrun": the same training through the `meshrun` CLI
(parallel=pp2, schedule 1f1b). Every stage sees the whole global batch (there is no data
parallelism); micro-batches = global batch / micro-batch size. How both are run, timed and
compared: see common.py.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import GRAD_CLIP, SEED, HandRank, Setup, adamw, main, step_tokens
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from meshrun.core.config import LlamaModelConfig
from meshrun.models import build_model
from meshrun.models.llama import Transformer
from meshrun.rank.train.data import SyntheticTokens


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build_stage(rank: int, stages: int, setup: Setup, model_cfg: LlamaModelConfig) -> Transformer:
    """Stage `rank`'s part of the model, cut on the meta device, then materialised."""
    # Layers split as evenly as possible, later stages taking the remainder (they do not
    # hold the embedding), e.g. 4 layers over 2 stages: [0, 1] | [2, 3].
    base, extra = divmod(model_cfg.n_layers, stages)
    counts = [base + (stage >= stages - extra) for stage in range(stages)]
    begin = sum(counts[:rank])
    keep = {str(i) for i in range(begin, begin + counts[rank])}
    model = build_model(model_cfg, setup.seq_len, "meta")
    for name in list(model.layers):
        if name not in keep:
            del model.layers[name]
    if rank != 0:
        model.tok_embeddings = None
    if rank != stages - 1:
        model.norm = None
        model.output = None
    model.to_empty(device="cpu")
    model.init_weights(SEED)
    return model


def build_pipeline(rank: int, setup: Setup, model_cfg: LlamaModelConfig) -> HandRank:
    """Stage `rank` of a hand-written 1F1B pipeline over `setup.ranks` stages."""
    stages = setup.ranks
    model = build_stage(rank, stages, setup, model_cfg)
    stage = PipelineStage(model, rank, stages, torch.device("cpu"))
    n_microbatches = setup.global_batch_size // setup.micro_batch_size
    schedule = Schedule1F1B(stage, n_microbatches=n_microbatches, loss_fn=loss_fn)
    params = list(model.parameters())
    data = SyntheticTokens(model_cfg.vocab_size, SEED)

    def forward_backward(step: int) -> torch.Tensor | None:
        tokens = step_tokens(data, setup, step)
        losses: list[torch.Tensor] = []
        if stage.is_first:
            schedule.step(tokens[:, :-1])
        elif stage.is_last:
            schedule.step(target=tokens[:, 1:], losses=losses)
        else:
            schedule.step()
        return torch.stack([loss.detach() for loss in losses]).mean() if losses else None

    def clip() -> None:
        """Clip by the global norm: each stage's squared norm, summed over the stages."""
        norm_sq = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True) ** 2
        dist.all_reduce(norm_sq)
        torch.nn.utils.clip_grads_with_norm_(params, GRAD_CLIP, norm_sq.sqrt(), foreach=True)

    return HandRank(adamw(params), forward_backward, clip)


if __name__ == "__main__":
    main(
        "Pipeline overhead (1F1B)", "pp2", build_pipeline, __file__, __doc__, degree="pp", steps=24
    )
