"""Parameter tensors of the model as one rank holds them, from the config alone (nothing is
allocated): which layers its pipeline stages own, what tensor parallelism leaves of each
matrix, and FSDP2's dim-0 shard (padded to equal shards)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshrun.core.batch import local_batch_size, n_microbatches
from meshrun.core.config import ExperimentConfig, ModelConfig, ParallelConfig
from meshrun.core.layout import Layout
from meshrun.core.model_shape import padded_vocab
from meshrun.core.stages import PP_AUTO, balanced_layer_counts, local_stage_ids, stage_layer_counts
from meshrun.models import model_shape


@dataclass(frozen=True)
class Dims:
    """The sizes every formula uses: hidden h, kv width hk, FFN f, heads a, vocab V (padded
    for TP), and the MLP's matrices (3 gated, 2 plain); hq the queries' width (h unless the
    heads are wider, model.head_dim)."""

    h: int
    hk: int
    f: int
    a: int
    vocab: int
    layers: int
    tied: bool
    mlp: int = 3
    hq: int = 0  # (Dims.of sets it)
    # a mixture of experts: E experts of width fe, k a token, fs the shared experts' width
    experts: int = 0
    k: int = 0
    fe: int = 0
    fs: int = 0
    # expert parallelism: the ep degree (a rank holds experts/ep of them), and the routed
    # rows the busiest ep rank computes over an even share (stage_time.py's allowance)
    ep: int = 1
    load: float = 1.0
    etp: int = 1  # the TP ranks each expert's hidden width is split over (parallel.etp)

    @property
    def routed(self) -> float:
        """Expert rows a token brings to the busiest rank's experts (k, at an even load)."""
        return self.k * self.load

    def mlp_tensors(self) -> list[tuple[tuple[int, ...], int | None]]:
        """A block's feed-forward tensors and the dim TP splits (None: replicated). An MoE's
        router, experts (3-D, dim 0 the expert) and shared experts stay whole under TP."""
        if not self.experts:
            return [((self.f, self.h), 0)] * (self.mlp - 1) + [((self.h, self.f), 1)]
        router = ((self.experts, self.h), None)
        held = self.experts // self.ep
        split = self.etp > 1  # w1, w3 column-wise and w2 row-wise over the TP ranks
        experts = [((held, self.h, self.fe), 2 if split else None)] * 2 + [
            ((held, self.fe, self.h), 1 if split else None)
        ]
        shared = [((self.fs, self.h), None)] * 2 + [((self.h, self.fs), None)] if self.fs else []
        return [router, *experts, *shared]

    def mlp_matmul(self, active: bool) -> int:
        """Matmul elements a token meets in a block's feed-forward (`active`: its top-k
        experts only; else every expert a rank holds, as the parameters count them)."""
        if not self.experts:
            return self.mlp * self.f * self.h
        routed = self.k if active else self.experts // self.ep
        return (3 * (routed * self.fe // self.etp + self.fs) + self.experts) * self.h

    def expert_elements(self) -> int:
        """Elements of a block's routed experts one rank holds (E/ep of them, 1/etp of each
        one's hidden width), before FSDP2's shards."""
        return 3 * (self.experts // self.ep) * self.h * self.fe // self.etp

    @classmethod
    def of_layout(cls, model_cfg: ModelConfig, layout: Layout, load: float = 1.0) -> Dims:
        """The sizes as a rank of `layout` holds them (`load`: as in `of`)."""
        return cls.of(model_cfg, layout.tp, layout.ep, load, layout.etp)

    @classmethod
    def of(
        cls, model_cfg: ModelConfig, tp: int = 1, ep: int = 1, load: float = 1.0, etp: int = 1
    ) -> Dims:
        """`tp`: the degree the vocabulary is padded for (models/vocab.py); `ep`: the experts'
        (parallel.ep); `load`: the busiest ep rank's rows over an even share (at most all of
        the group's: ep; one rank holding every expert gets exactly k a token); `etp`: the
        experts' TP (parallel.etp)."""
        m = model_shape(model_cfg)
        head_dim = m.head_dim or m.dim // m.n_heads
        return cls(
            m.dim,
            m.n_kv_heads * head_dim,
            m.ffn_dim,
            m.n_heads,
            padded_vocab(m.vocab_size, tp),
            m.n_layers,
            m.tied,
            m.mlp_matrices,
            m.n_heads * head_dim,
            m.experts,
            m.top_k,
            m.expert_ffn,
            m.shared_ffn,
            ep,
            min(ep, load) if ep > 1 else 1.0,
            etp,
        )


@dataclass(frozen=True)
class StageShare:
    """What one pipeline rank owns: its layers and whether it holds the embedding / head."""

    layers: int
    first: bool
    last: bool
    stages_per_rank: int  # stages (model chunks) on this rank


def stage_shares(model: ModelConfig, parallel: ParallelConfig, layout: Layout) -> list[StageShare]:
    """One entry per pp rank."""
    stages_per_rank = parallel.stages_per_rank if layout.pp > 1 else 1
    n_stages = layout.pp * stages_per_rank
    counts = layer_counts(model, parallel, n_stages, layout.tp)
    shares = []
    for pp_rank in range(layout.pp):
        ids = local_stage_ids(pp_rank, layout.pp, stages_per_rank)
        shares.append(
            StageShare(sum(counts[i] for i in ids), 0 in ids, n_stages - 1 in ids, stages_per_rank)
        )
    return shares


def layer_counts(model: ModelConfig, parallel: ParallelConfig, n_stages: int, tp: int) -> list[int]:
    """Layers per stage; `auto` as the ranks would split by measured cost, here by formula
    (the planner cannot time): a block's matmul FLOPs a token against the head's 2hV, the
    embedding's lookup free, every stage on equal devices."""
    n_layers = model_shape(model).n_layers
    if parallel.pp_layers != PP_AUTO:
        return stage_layer_counts(n_layers, n_stages, parallel.pp_layers or None)
    d = Dims.of(model, tp)
    block = 2 * (2 * d.hq * d.h + 2 * d.hk * d.h + d.mlp_matmul(active=True))
    head = 2 * d.h * d.vocab
    return balanced_layer_counts(n_layers, [float(block)] * n_stages, 0.0, float(head))


def checkpointed_layers(p: ParallelConfig, share: StageShare) -> int:
    """Blocks of the stage activation checkpointing wraps: all, or with `checkpoint_every`
    n the stage's share of every n-th (its floor: exact where a stage starts on a multiple)."""
    if p.activation_checkpointing == "none":
        return 0
    return share.layers // p.checkpoint_every


def micro_batching(cfg: ExperimentConfig, layout: Layout) -> tuple[int, int]:
    """(micro-batches of a step, samples in each) on one data-parallel rank: the pipeline
    schedule's m, or gradient accumulation over `train.micro_batch_size`."""
    local = local_batch_size(cfg)
    if layout.pp > 1:
        m = n_microbatches(cfg)
        return m, local // m
    micro = min(cfg.train.micro_batch_size, local)
    return local // micro, micro


def rank_tokens(cfg: ExperimentConfig, layout: Layout, samples: int) -> int:
    """Tokens of `samples` sequences that one rank holds: a CP rank its seq/cp of each."""
    return samples * cfg.train.seq_len // layout.cp


def _sharded(shape: tuple[int, ...], tp_dim: int | None, tp: int, fsdp: int) -> int:
    """Elements this rank stores of a tensor split over tp along `tp_dim`, then by FSDP2."""
    dims = list(shape)
    if tp_dim is not None:
        dims[tp_dim] //= tp
    dims[0] = math.ceil(dims[0] / fsdp)
    return math.prod(dims)


def local_param_elements(d: Dims, share: StageShare, tp: int, fsdp: int) -> int:
    """Elements of the parameters one rank holds (TP shards, then FSDP2 shards): a block's
    tensors times the stage's layers, not a sum over every layer (a plan of a 96-layer model
    asks thousands of times)."""
    block = [
        ((d.hq, d.h), 0),
        ((d.hk, d.h), 0),
        ((d.hk, d.h), 0),
        ((d.h, d.hq), 1),  # q k v o
        *d.mlp_tensors(),
        ((d.h,), None),
        ((d.h,), None),  # the two norms
    ]
    tensors = []
    if share.first:
        tensors.append(((d.vocab, d.h), 0))
    if share.last:
        tensors.append(((d.h,), None))
        if not (d.tied and share.first):
            tensors.append(((d.vocab, d.h), 0))
    # the routed experts (3-D) are sharded by FSDP2 over what ep leaves of its ranks
    per_block = sum(
        _sharded(shape, tp_dim, tp, fsdp if len(shape) < 3 else max(1, fsdp // d.ep))
        for shape, tp_dim in block
    )
    return share.layers * per_block + sum(_sharded(s, dim, tp, fsdp) for s, dim in tensors)


def layer_param_elements(d: Dims, tp: int) -> int:
    """One transformer block, TP-sharded, unsharded by FSDP (what FSDP gathers at a time)."""
    if not d.experts:
        return (2 * d.hq * d.h + 2 * d.hk * d.h + d.mlp * d.f * d.h) // tp + 2 * d.h
    return (2 * d.hq * d.h + 2 * d.hk * d.h) // tp + d.mlp_matmul(active=False) + 2 * d.h


def inactive_matmul_params(d: Dims) -> int:
    """Matmul parameters a token does not meet: the experts it is not routed to."""
    return d.layers * (d.mlp_matmul(active=False) - d.mlp_matmul(active=True))
