"""Memory and FLOPs of any model, from its actual parallel module run on fake tensors.

The formulas of memory.py know meshrun's decoder and the transformers families it models;
a user's own module (model=custom) has none. So, for each pipeline rank, this builds the
rank's real share as the worker does (rank/parallel: cut, TP, checkpointing, FSDP2) on a
fake process group under torch's FakeTensorMode, and runs two training steps under torch's
MemTracker (FSDPMemTracker with FSDP2): one micro-batch to make the gradients and the
optimizer state, then two where a step has more (the second one runs with the first one's
gradients held). Every tensor has a shape and no
storage: nothing is allocated or communicated, and the peak is the sum of the tensors alive
at the worst moment, by kind. FLOPs per token: FlopCounterMode over one forward and backward
of the whole model, on fake tensors too.

What a trace of micro-batches one after the other does not see is added as memory.py does:
a pipeline rank holds several micro-batches' activations at once (memory.in_flight), its
receive buffers and, on the last stage, every micro-batch's logits; DDP (whose constructor
needs real tensors, so its replicas are traced unwrapped) adds its gradient buckets;
DataParallel's devices are one device's trace of the first share of a micro-batch, spread
as memory.dataparallel_devices does.

Fake tensors have no values to route by: a mixture-of-experts block is traced with every
expert given the same share of the tokens (models/moe.even_routing), the load the formulas
assume too (plan.trace; a user's module with experts).
"""

from __future__ import annotations

import dataclasses
import functools
import json

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.flop_counter import FlopCounterMode

from meshrun.core.choices import HALF_PRECISIONS
from meshrun.core.config import (
    ExperimentConfig,
    ModelConfig,
    ParallelConfig,
    TrainConfig,
    from_dict,
)
from meshrun.core.layout import Layout
from meshrun.models import build_model, from_key, model_key, model_shape, moe
from meshrun.models.loss import loss_method
from meshrun.plan.memory import (
    OPTIMIZER_STATE_BYTES,
    MemoryPrediction,
    chunk_sizes,
    dataparallel_devices,
    in_flight,
)
from meshrun.plan.shapes import layer_counts, micro_batching
from meshrun.plan.stage_time import ModelCost
from meshrun.rank.mesh import build_mesh
from meshrun.rank.parallel.compose import materialise, sharded_part, stage_parts
from meshrun.rank.parallel.loss import cross_entropy, loss_context
from meshrun.rank.train.optim import build_optimizer

FP32 = 4
# MemTracker's kinds (and FSDPMemTracker's) -> the breakdown's; what a step allocates and
# frees (FSDP's unsharded parameters and its collectives' buffers) counts as activations
KINDS = {
    "Parameter": "params",
    "Buffer": "params",
    "Sharded Param": "params",
    "Gradient": "grads",
    "Sharded Grad": "grads",
    "Optstate": "optimizer",
    "OptState": "optimizer",
    "Activation": "activations",
    "Temp": "activations",
    "Inputs": "activations",
    "Unsharded Param": "activations",
    "Unsharded Grad": "activations",
    "All Gather": "activations",
    "Reduce Scatter": "activations",
    "Other": "other",
}


@dataclasses.dataclass(frozen=True)
class Trace:
    """One pipeline rank's traced step: the peak by kind; what one micro-batch's forward
    leaves for its backward (the activations a pipeline holds per micro-batch in flight); the
    tensors a pipeline keeps per micro-batch (its input, received; the last stage's logits,
    `vocab` wide, `logits_width` bytes an element)."""

    peak: dict[str, int]
    kept: int
    input_bytes: int
    logits_bytes: int
    vocab: int
    logits_width: int


def traced_memory(cfg: ExperimentConfig) -> list[MemoryPrediction]:
    """One prediction per rank, in rank order, for a resolved config (as predict_memory).
    Each pipeline rank is traced in turn as rank 0 of a fake group of the layout's world
    size; DDP's replicas as one (DDP's constructor needs real tensors). Cached: the
    pre-launch check and the record ask for the same config; a tool's config (meshrun-plan's)
    is traced as the experiment it holds."""
    experiment = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(ExperimentConfig)}
    cfg_json = json.dumps(
        dataclasses.asdict(ExperimentConfig(**experiment)), sort_keys=True, default=str
    )
    return list(_traced(cfg_json))


@functools.lru_cache(maxsize=256)
def _traced(cfg_json: str) -> tuple[MemoryPrediction, ...]:
    cfg = from_dict(json.loads(cfg_json))
    layout = Layout.of(cfg.parallel)
    n_microbatches, micro_batch = micro_batching(cfg, layout)
    dataparallel = cfg.parallel.data_parallel == "dataparallel"
    # DataParallel: one device computing the first share of each micro-batch, traced as one
    # alone (its devices from it: memory.dataparallel_devices)
    traced_batch = (
        chunk_sizes(micro_batch, cfg.parallel.dataparallel_devices)[0]
        if dataparallel
        else micro_batch
    )
    traced = layout if layout.uses_fsdp else dataclasses.replace(layout, dp_replicate=1)
    # pp_layers=auto: the formula's split, as the rest of the planner predicts with
    counts = (
        layer_counts(cfg.model, cfg.parallel, layout.pp * cfg.parallel.stages_per_rank, layout.tp)
        if layout.pp > 1
        else None
    )
    parallel = dataclasses.replace(
        cfg.parallel, dp_replicate=traced.dp_replicate, data_parallel="auto", pp_layers=counts
    )
    if dist.is_initialized():
        raise RuntimeError("the planner traces on a fake process group of its own")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=traced.world_size)
    try:
        mesh = build_mesh(traced, "cpu") if traced.has_mesh else None
        # two micro-batches a step where there are more: the second one's forward and
        # backward run with the first one's gradients held
        accumulated = min(2, n_microbatches)
        traces = [
            _trace_rank(cfg, traced, parallel, mesh, pp_rank, traced_batch, accumulated)
            for pp_rank in range(layout.pp)
        ]
    finally:
        dist.destroy_process_group()
    per_stage = [
        _prediction(cfg, layout, pp_rank, n_microbatches, trace)
        for pp_rank, trace in enumerate(traces)
    ]
    if dataparallel:
        [trace] = traces
        return tuple(
            dataparallel_devices(cfg, per_stage[0], micro_batch, trace.vocab, trace.logits_width)
        )
    ranks_per_stage = layout.world_size // layout.pp
    return tuple(per_stage[rank // ranks_per_stage] for rank in range(layout.world_size))


def _prediction(
    cfg: ExperimentConfig, layout: Layout, pp_rank: int, n_microbatches: int, trace: Trace
) -> MemoryPrediction:
    split = dict.fromkeys(("params", "grads", "optimizer", "activations", "other"), 0)
    for kind, size in trace.peak.items():
        split[KINDS[kind]] += size
    p = cfg.parallel
    if layout.pp > 1:
        # the traced peak holds one micro-batch's kept activations (and the transients of a
        # backward, recomputation included); in flight, `held` of them
        held = in_flight(p.schedule, n_microbatches, layout.pp, pp_rank, p.stages_per_rank)
        split["activations"] += int(trace.kept * (held - 1))
        split["other"] += n_microbatches * (trace.input_bytes + trace.logits_bytes)
    if layout.uses_ddp and not p.ddp.gradient_as_bucket_view:
        split["other"] += split["params"]  # DDP's gradient buckets, fp32 like the parameters
    states = cfg.train.optimizer_states
    if states in TRACED_AS:
        ratio = OPTIMIZER_STATE_BYTES[states] / OPTIMIZER_STATE_BYTES[TRACED_AS[states]]
        split["optimizer"] = int(split["optimizer"] * ratio)
    return MemoryPrediction(**split)


# Optimizer states a trace cannot step, and those it steps instead: torchao's 8-bit update
# is compiled as it runs (fullgraph), which no fake tensor under the trace's dispatch modes
# can be, and its quantization map is read from tensors. `_prediction` counts the states at
# memory.py's bytes a parameter.
TRACED_AS = {"8bit": "fp32"}


def _traceable_states(train: TrainConfig) -> TrainConfig:
    """`train` with optimizer states a trace can step (TRACED_AS)."""
    if train.optimizer_states in TRACED_AS:
        return dataclasses.replace(train, optimizer_states=TRACED_AS[train.optimizer_states])
    return train


def _trace_rank(
    cfg: ExperimentConfig,
    traced: Layout,
    parallel: ParallelConfig,
    mesh: DeviceMesh | None,
    pp_rank: int,
    micro_batch: int,
    accumulated: int,
) -> Trace:
    t = cfg.train
    meta = build_model(cfg.model, t.seq_len, "meta", vocab_multiple=traced.tp)
    seq = t.seq_len // traced.cp  # a CP rank's tokens of each sequence (its attention local)
    hidden = None
    if traced.pp > 1:
        hidden = _stage_input(meta, micro_batch, seq, traced.tp, parallel.sequence_parallel)
    half = t.precision in HALF_PRECISIONS  # bf16 and fp16 take the same bytes
    dtype = torch.bfloat16 if half else torch.float32
    # on meta, outside the fake mode: FSDP2 builds device meshes, whose own (real) tensors
    # FakeTensorMode would turn fake
    method = loss_method(cfg)[0]
    parts = [
        sharded_part(part, mesh, traced, parallel, dtype, loss=method)
        for part in stage_parts(meta, pp_rank, traced, parallel)
    ]
    with FakeTensorMode(allow_non_fake_inputs=True), moe.even_routing():
        for part in parts:
            materialise(part, torch.device("cpu"), t.seed, None)
        optimizer = build_optimizer(nn.ModuleList(parts), _traceable_states(t))
        # FSDPMemTracker takes one FSDP root; an interleaved rank has several
        fsdp = traced.uses_fsdp and len(parts) == 1
        tracker = FSDPMemTracker(parts[0], optimizer) if fsdp else MemTracker()
        if not fsdp:
            tracker.track_external(*parts, optimizer)
        with tracker:
            # the first step makes the gradients and the optimizer state; the second, where
            # the peak is, holds them while its micro-batches run
            for micro_batches in (1, accumulated):
                for _ in range(micro_batches):
                    logits, kept = _step(
                        parts, micro_batch, seq, hidden, half and not fsdp, tracker, method
                    )
                    tracker.reset_mod_stats()  # per module per call; the peak stays
                optimizer.step()
                optimizer.zero_grad()
        peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    # received per micro-batch: activations from the stage before, or gradients of its output
    input_bytes = hidden.numel() * FP32 if hidden is not None else 0
    kinds = {k.value: v for k, v in peak.items() if k != "Total"}
    if logits is None:
        return Trace(kinds, kept, input_bytes, 0, 0, 0)
    return Trace(kinds, kept, input_bytes, logits.bytes, logits.vocab, logits.width)


@dataclasses.dataclass(frozen=True)
class _Logits:
    """A last stage's logits as the trace counts them: this rank's bytes (vocabulary-sharded
    ones: its shard's), the vocabulary, the bytes an element."""

    bytes: int
    vocab: int
    width: int

    @classmethod
    def of(cls, logits: torch.Tensor) -> _Logits:
        local = logits.to_local() if isinstance(logits, DTensor) else logits
        width = local.element_size()
        return cls(local.numel() * width, logits.shape[-1], width)


def _stage_input(meta: nn.Module, batch: int, seq: int, tp: int, sp: bool) -> torch.Tensor:
    """What a stage without the embedding receives: hidden states (sequence-sharded under
    SP), shaped by the embedding of the whole model (on meta)."""
    with torch.device("meta"):
        h = meta.tok_embeddings(torch.zeros(batch, seq // (tp if sp else 1), dtype=torch.long))
    return torch.empty(h.shape, device="meta")


def _step(
    parts: list[nn.Module],
    batch: int,
    seq: int,
    hidden: torch.Tensor | None,
    autocast: bool,
    tracker: MemTracker,
    method: str,
) -> tuple[_Logits | None, int]:
    """One micro-batch forward and backward through each part (an interleaved rank's chunks
    one after the other), the loss as train.loss's `method` computes it: the last stage's
    logits, if this rank has them (a chunked loss's head returns none), and the activations
    the forwards left for the backwards."""
    logits, kept = None, 0
    targets = torch.zeros(batch, seq, dtype=torch.long)
    whole = len(parts) == 1 and hidden is None  # no pipeline: token ids in, named ends or not
    for part in parts:
        before = _activations(tracker)
        first = whole or part.tok_embeddings is not None
        last = part.output is not None
        x = (
            torch.zeros(batch, seq, dtype=torch.long)
            if first
            else torch.empty(hidden.shape, requires_grad=True)
        )
        chunked = last and method == "chunked"
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast), loss_context(method):
            out = part(x, targets=targets) if chunked else part(x)
            kept += _activations(tracker) - before
            if not last:
                loss = out.float().sum()
            elif chunked:  # the head returned the loss
                loss = out
            else:
                loss, logits = cross_entropy(out, targets), _Logits.of(out)
            if whole:  # no pipeline: the loop keeps no logits (a stage keeps its output)
                del out
            loss.backward()
    return logits, kept


def _activations(tracker: MemTracker) -> int:
    current = next(iter(tracker.get_tracker_snapshot("current").values()), {})
    return sum(size for kind, size in current.items() if getattr(kind, "value", "") == "Activation")


def traced_cost(cfg: ExperimentConfig) -> ModelCost | None:
    """What the speed model needs, counted (speed.py): FLOPs by torch, each rank's
    parameters from its trace (FSDP's shards undone), the width of the embedding; None where
    TP or PP move activations of a width the model does not tell."""
    layout = Layout.of(cfg.parallel)
    width = model_shape(cfg.model).dim
    if width is None and (layout.tp > 1 or layout.pp > 1):
        return None
    fsdp = layout.dp_shard if layout.uses_fsdp else 1
    elements = max(p.params for p in traced_memory(cfg)) * fsdp // FP32
    return ModelCost(counted_flops_per_token(cfg), elements, width or 0)


def counted_flops_per_token(cfg: ExperimentConfig) -> float:
    """Training FLOPs per token (one forward and backward of the whole model) as torch's
    FlopCounterMode counts them, on fake tensors; once per model and sequence."""
    return _counted_flops(*model_key(cfg.model), cfg.train.seq_len, cfg.train.seed)


@functools.lru_cache(maxsize=64)
def _counted_flops(schema: type[ModelConfig], model_json: str, seq_len: int, seed: int) -> float:
    model = build_model(from_key(schema, model_json), seq_len, "meta")
    with FakeTensorMode(allow_non_fake_inputs=True), moe.even_routing():
        model.to_empty(device="cpu")
        model.init_weights(seed)  # buffers such as rotary tables
        tokens = torch.zeros(1, seq_len, dtype=torch.long)
        with FlopCounterMode(display=False) as counter:
            model(tokens).float().sum().backward()
    return counter.get_total_flops() / seq_len
