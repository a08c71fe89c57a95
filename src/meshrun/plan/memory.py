"""Predicted peak memory per rank, split like the measured breakdown (metrics/memory.py).

Model state, per parameter this rank holds: 4 bytes of fp32 weights (bf16 runs keep fp32
master weights and cast on the fly), 4 of fp32 gradients, 8 of AdamW state (exp_avg,
exp_avg_sq): 16 bytes, divided by FSDP's shard degree and by tensor parallelism for the
sharded matrices. DDP adds a bucket copy of the gradients (4 bytes a parameter) unless
`ddp.gradient_as_bucket_view`.

Activations, per micro-batch of T = b*s tokens, in 4-byte floats per token (2-byte for the
matmul-side tensors under bf16 autocast), counted from the tensors autograd saves in meshrun's
block (RMSNorm -> q/k/v -> RoPE -> SDPA -> o; RMSNorm -> SwiGLU), in the manner of
Korthikanti et al. 2022 (whose 16-bit GPT figure is s*b*h*(34 + 5*a*s/h) bytes a layer; SDPA
keeps no s*s scores here):

    per layer    (4h + 2) replicated + (4h + 2hk + 4f + a) / tp      (+h under TP: the
                 attention's all-reduced output is saved as well, per saved-tensor hooks) ;
                 with sequence parallelism the replicated part is / tp too ; under bf16
                 autocast the replicated part (residual stream, norms) stays fp32, and
                 autocast's bf16 copies of the weights (2 bytes a parameter) are kept for
                 backward
    full ckpt    h per layer (the block input) + one block recomputed in backward; with
                 parallel.checkpoint_every = n only every n-th block, the others keeping
                 all of theirs (within 2.1% of measured, ddp, fsdp, pp2: test_plan_accuracy)
    selective    (2h + 2hk + 2f + a) / tp + 2h per layer (matmul and attention outputs
                 kept, o's and down's whole under TP) + h (the block input); the recompute's
                 transient is the block less those (within 3.5% of measured: 4,742 elements
                 a token-layer at h=384, f=1024, measured and predicted)
    op           torchtitan's every other matmul: (2h + hk + f + a) / tp + h + h
    first stage  8 bytes of token ids ; last stage 3h + 1, 8 bytes of targets, and what
                 the loss keeps (loss_memory)
    transients   at the loss (loss_memory); elsewhere one block's backward temporaries,
                 (3f + 2h) / tp; checkpointed, the recomputed block plus those temporaries
                 (last stage: h, + V/tp where the loss leaves its logits' gradient)

The loss (train.loss, models/loss.py), in fp32 floats, T a micro-batch's tokens:
    full         the log-softmax's output kept, V a token (under a pipeline the stage's
                 output logits too: 2V), and 2V transient at its backward (its gradient
                 and the logits'), V whole on every TP rank (gathered): 3V in all, measured
                 3,160 MiB of activations at T = 4,096, V = 65,536 (tiny, one rank)
    vocab_parallel  the same over V/tp, with one V/tp more transient (loss_parallel's
                 backward): 4V/tp
    chunked      no V a token: the input gradient (h a token, kept from forward, where it
                 is taken) and the head's parameter gradients (V x h a micro-batch, kept);
                 one chunk's logits transient, c = chunk_tokens(V) of them (or T, if
                 fewer): 3cV, with one more V x h gradient but on a pipeline's last stage
                 (measured: 312.7 MiB of activations predicted and measured at T = 4,096,
                 V = 65,536, one rank; pp2 GPipe's last stage within 0.2%); on Liger's
                 kernel (train.loss_kernel=liger) the same but its chunk: liger_chunk_tokens
                 of them, cV at the matmuls' width (its gradient written in place), not
                 yet measured on a GPU (scripts/gpu_checks.py's levers check)

A pipeline rank holds several micro-batches at once: GPipe all m, 1F1B min(m, p - stage),
interleaved 1F1B its warmup chunks + 1 (each a 1/v share of the rank's layers). FSDP
without a pipeline reshards everything between steps, its peak in backward, with the root
module and two blocks gathered (the current one and the one prefetched for the next
backward) and a third
block-sized buffer (gloo's staging copy of the prefetch's all-gather output, or the current
block's unsharded gradient, whichever comes at the peak): those count as activations, since
a step allocates and frees them. Under a pipeline FSDP stays gathered all step, with
unsharded gradients (predict_rank). "other" holds the DDP buckets and a pipeline stage's
receive buffers (one T x h tensor per micro-batch); the last stage keeps no logits between
micro-batches (rank/parallel: the schedule runs with return_outputs=False).

Context parallelism: a CP rank holds seq/cp tokens of each sequence and FSDP shards over
dp_shard x cp. allgather keeps the whole sequence's K/V a layer for backward (the gathered
blocks its attention saves): 2hk(cp - 1)/tp more per token of the rank's own. ring's and
allgather's chunk pairs (c = seq/2cp tokens) run the kernel core/attention_kernels.py names:
a fused one keeps no scores; where none applies (explicit) one pair's fp32 scores are
transient, 3 of them alive at its backward's peak: 3 x a/tp x c/2 floats a token; and where
that kernel or the CPU's computes in fp32 under a 16-bit run, the q, K/V and output CP keeps
are fp32. Not yet counted: the ring's blocks in flight and Ulysses' head-sharded copies
(transient: measured within 3% without them, benchmarks/context_parallel.py).

GQA: where SDPA's fused kernels cannot take fewer K/V heads (fp32 on CUDA: flash only takes
GQA, and only 16-bit; core/attention_kernels.py), the K/V heads are repeated before SDPA
(models/attention.py) and it keeps them so: hk becomes hq in what attention saves.

Expert parallelism: a rank holds E/ep experts of each MoE block (FSDP2 shards them over what
ep leaves of dp_shard x cp: the same share of the model state; a gathered block holds E/ep
experts), and its experts take the whole ep group's rows for them, at an even load: k a
token of its own (measured within the bars at the near-even routing of a fresh router,
tests/test_plan_accuracy.py; stage_time.py plans for the busiest rank's allowance). The
all-to-alls' row buffers are transient, not counted. Where the experts run as one grouped GEMM
(CUDA sm90/sm100 in bf16, models/expert_compute.py) each keeps one zero row more a layer: E/ep
rows of h + 4f/etp elements, 1.3% of tiny-moe's expert activations at 256 tokens a
micro-batch, 0.09% of mixtral-8x7b's at 4096; not counted.

DataParallel (parallel=dataparallel): one process scatters each micro-batch over n devices
(Tensor.chunk's ceil-sized chunks, fewer where the micro-batch is smaller), runs a replica on
each in a thread and gathers the outputs on the first, where the loss runs. Each device is
predicted from one device computing the first (largest) share alone (the formula's or the
trace's), one prediction a device (the record measures each):

    first device   the model state; its share's activations, and the other shares' logits
                   gathered to it with the loss over them (loss_bytes a token); at the end
                   of backward, in place of the activations, replica 0's gradients and the
                   sum of every replica's (4 + 4 bytes a parameter: Broadcast.backward ->
                   ReduceAddCoalesced, torch/nn/parallel/_functions.py) before they are
                   added to .grad
    other devices  a replica: its share's activations but the loss (its logits gathered
                   away), its fp32 weights where backward keeps them (fp32: under autocast
                   the matmuls keep their half copies, counted already) and at the end of
                   backward their gradients (4 bytes a parameter), summed onto the first

A device's peak is the higher of its two ends: the excess of the other counts as other.

Optimizer states (train.optimizer_states): 8 bytes a parameter in fp32, 4 in bf16, 2.03 in
8 bits. Offload (plan/host.py counts what goes to the host; on a CPU nothing moves):
parallel.fsdp.offload takes the parameters, gradients and optimizer state off the device
(FSDP2's gathered units stay, as activations); parallel.activation_offload leaves one block's
saved tensors on the device at a time (the one backward brings back), the head's and the
transients as they were.

train.float8 (plan/float8.py's memory_change): no autocast copies of its weights, its gathered
weights at one byte under FSDP2's float8 all-gather, one linear's float8 operands transient.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from meshrun.core.attention_kernels import AttentionSite, block_kernel, expands_kv_heads
from meshrun.core.choices import HALF_PRECISIONS, SAC_POLICIES
from meshrun.core.config import ExperimentConfig
from meshrun.core.layout import Layout
from meshrun.models.loss import (
    chunk_tokens,
    liger_chunk_tokens,
    loss_kernel,
    loss_method,
)
from meshrun.plan.float8 import memory_change
from meshrun.plan.shapes import (
    Dims,
    StageShare,
    checkpointed_layers,
    layer_param_elements,
    local_param_elements,
    micro_batching,
    rank_tokens,
    stage_shares,
)

FP32 = 4
# AdamW's two moments a parameter by train.optimizer_states: fp32, bf16, and torchao's 8-bit
# (a byte a value, an fp32 scale a block of 256: torchao/optim/subclass_8bit.py; its tensors
# under 4,096 elements, the norms, stay fp32: not counted).
OPTIMIZER_STATE_BYTES = {"fp32": 8, "bf16": 4, "8bit": 2 * (1 + FP32 / 256)}
MiB = 2**20
# cuBLAS/cuBLASLt workspaces come from the caching allocator: 65-84 MiB measured on an H200
# (torch 2.11, CUDA 13) whatever the model.
CUBLAS_WORKSPACES = 64 * MiB
# The capability the planner's attention kernels are chosen at: meshrun's GPU profiles are
# all sm80 or newer.
PLANNED_CAPABILITY = (8, 0)
SCORES_ALIVE = 3  # an explicit chunk pair's [b, h, c, c] fp32 tensors at its backward's peak
PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class MemoryPrediction:
    params: int
    grads: int
    optimizer: int
    activations: int
    other: int

    @property
    def peak(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.other

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "peak": self.peak}


def in_flight(
    schedule: str, n_microbatches: int, pp: int, pp_rank: int, stages_per_rank: int
) -> float:
    """Micro-batches whose activations one pipeline rank holds at its peak (in units of its
    whole share of layers: an interleaved chunk is 1/stages_per_rank of it)."""
    if pp == 1:
        return 1
    if schedule == "gpipe":
        return n_microbatches
    if schedule == "1f1b":
        return min(n_microbatches, pp - pp_rank)
    warmup = (pp - pp_rank - 1) * 2 + (stages_per_rank - 1) * pp + 1
    return min(warmup, n_microbatches * stages_per_rank) / stages_per_rank


@dataclass(frozen=True)
class AttentionKept:
    """What a layer's attention keeps that the kernels decide: the K/V width SDPA saves (hk,
    or hq where the heads are repeated first), the other CP ranks' K/V blocks (allgather's
    cp - 1), whether CP keeps its q, K/V and output in fp32 whatever the run's width, and
    the transient scores of one explicit chunk pair (bytes a token)."""

    kv: int
    gathered: int = 0
    fp32_copies: bool = False
    scores: float = 0.0


def attention_site(cfg: ExperimentConfig, d: Dims) -> AttentionSite:
    """The kernel rules' view of the run's attention (core/attention_kernels.py)."""
    dtype = PRECISION_DTYPES[cfg.train.precision]
    return AttentionSite(cfg.hardware.device_type, dtype, d.hq // d.a, PLANNED_CAPABILITY)


def attention_kept(cfg: ExperimentConfig, layout: Layout, d: Dims) -> AttentionKept:
    site = attention_site(cfg, d)
    kv = d.hq if d.hk < d.hq and expands_kv_heads(site) else d.hk
    if layout.cp == 1 or cfg.parallel.cp_method == "alltoall":
        return AttentionKept(kv)
    kernel = block_kernel(site)
    chunk = cfg.train.seq_len // (2 * layout.cp)
    scores = SCORES_ALIVE * d.a / layout.tp * chunk / 2 * FP32 if kernel == "explicit" else 0.0
    gathered = layout.cp - 1 if cfg.parallel.cp_method == "allgather" else 0
    return AttentionKept(kv, gathered, kernel in ("cpu_flash", "explicit"), scores)


def _layer_bytes(
    d: Dims, tp: int, sp: bool, ckpt: str, width: int, kept: AttentionKept
) -> tuple[float, float]:
    """(kept per layer, recomputed transient of one layer), bytes per token. The residual
    stream and norms stay fp32 under autocast (the weights are fp32); the matmul side is
    `width` bytes, but for what `kept` says is fp32."""
    replicated = ((4 * d.h + 2) / (tp if sp else 1) + (d.h if tp > 1 else 0)) * FP32
    kv = 2 * kept.kv * (1 + kept.gathered)
    attention = d.h + 3 * d.hq + kv + d.a  # 4h + 2hk + a, hq = h
    matmul_side = attention / tp + _mlp_kept(d, tp, 4)
    full = replicated + matmul_side * width + _router_bytes(d)
    if kept.fp32_copies:  # CP's q, K/V and output
        full += (2 * d.hq + kv) / tp * (FP32 - width)
    block_input = d.h / (tp if sp else 1) * FP32
    if ckpt == "full":
        return block_input, full
    if ckpt in SAC_POLICIES:  # the outputs SAC caches, the rest recomputed
        saved = _sac_saved(d, tp, sp, ckpt) * width
        return saved + block_input + _router_bytes(d), full - saved
    return full, 0.0


def _sac_saved(d: Dims, tp: int, sp: bool, ckpt: str) -> float:
    """Elements a token's block caches under selective checkpointing: the outputs of the ops
    its policy saves (rank/parallel/checkpointing.py). selective: q, k, v, attention's output
    and log-sum-exp, o, the feed-forward's gate and up, down; op, every other matmul of the
    forward's q, k, v, o, gate, up, down: q, v, gate, down, and attention's. A row-parallel
    matmul's output (o, down) is a whole h on each TP rank before its all-reduce; under
    sequence parallelism its reduce-scattered h/tp is kept too, under both (a dense MLP's;
    an MoE's output is not row-parallel). An MoE's experts keep gate, up and down a row
    under selective, about half of them under op (the alternation runs over a number of
    expert matmuls that depends on the routing)."""
    attention = 2 * d.hq + d.a + (2 * d.hk if ckpt == "selective" else d.hk)
    if ckpt == "selective":
        attention_out, mlp = d.h, 2 * d.f / tp + d.h
    else:
        attention_out, mlp = 0.0, d.f / tp + d.h
    if d.experts:
        rows = d.routed * (2 * d.fe / d.etp + d.h) + (2 * d.fs + d.h if d.fs else 0)
        mlp = rows if ckpt == "selective" else rows / 2
    if sp and tp > 1:
        attention_out += d.h / tp * (1 if d.experts else 2)
    return attention / tp + attention_out + mlp


def _mlp_kept(d: Dims, tp: int, per_hidden: int) -> float:
    """Elements a token's feed-forward keeps for backward, `per_hidden` a hidden unit (gate,
    up, their activation and product: 4). An MoE (not split by TP) keeps them for each of
    its k experts, with the token's copy in and its output out of each (models/moe.py)."""
    if not d.experts:
        return per_hidden * d.f / tp
    return d.routed * (2 * d.h + per_hidden * d.fe / d.etp) + per_hidden * d.fs


def _router_bytes(d: Dims) -> float:
    """An MoE router's fp32 scores and its picks' int64 indices (chosen, sorted), a token."""
    return (d.experts * FP32 + 2 * d.k * 8) if d.experts else 0.0


def activation_bytes(
    cfg: ExperimentConfig,
    layout: Layout,
    share: StageShare,
    pp_rank: int,
    n_microbatches: int,
    micro_batch: int,
) -> float:
    d = Dims.of_layout(cfg.model, layout)
    p = cfg.parallel
    tokens = rank_tokens(cfg, layout, micro_batch)
    width = 2 if cfg.train.precision in HALF_PRECISIONS else FP32
    attention = attention_kept(cfg, layout, d)
    kept, recompute = _layer_bytes(
        d, layout.tp, p.sequence_parallel, p.activation_checkpointing, width, attention
    )
    checkpointed = checkpointed_layers(p, share)
    if checkpointed < share.layers:  # checkpoint_every: the other blocks keep everything
        whole, _ = _layer_bytes(d, layout.tp, p.sequence_parallel, "none", width, attention)
        kept = (checkpointed * kept + (share.layers - checkpointed) * whole) / share.layers
        recompute = recompute if checkpointed else 0.0
    loss = loss_memory(cfg, layout, d, tokens, width)
    blocks_here = share.layers
    if offloads_activations(cfg):  # the others' saved tensors in host memory (plan/host.py)
        blocks_here = min(1, share.layers)
    per_mb = blocks_here * kept + (8 if share.first else 0)
    if share.last:
        per_mb += (3 * d.h + 1) * FP32 + 8 + loss.kept
    held = in_flight(p.schedule, n_microbatches, layout.pp, pp_rank, share.stages_per_rank) * per_mb
    mlp_temps = 3 * d.f / layout.tp if not d.experts else 3 * (d.routed * d.fe / d.etp + d.fs)
    backward_temps = (mlp_temps + 2 * d.h / layout.tp) * width + attention.scores
    if recompute:  # one block recomputed, with its backward temporaries or the loss's
        # (its micro-batch's loss done: what the loss kept for it is freed)
        tail = d.h * FP32 + loss.logits_gradient - loss.kept if share.last else backward_temps
        transient = tokens * (recompute + tail)
    else:
        transient = 0.0 if share.last else tokens * backward_temps
    if share.last:  # the loss's own, before the last block's backward or recompute
        transient = max(transient, loss.transient)
    return tokens * held + transient


@dataclass(frozen=True)
class LossMemory:
    """What the loss holds on the last stage (the module docstring's table): `kept` bytes a
    token of a micro-batch from its forward to its backward, `transient` bytes at its own
    worst moment, `logits_gradient` bytes a token left at the last block's backward (its
    recompute's tail)."""

    kept: float
    transient: float
    logits_gradient: float


def loss_memory(
    cfg: ExperimentConfig, layout: Layout, d: Dims, tokens: int, width: int
) -> LossMemory:
    """The loss's share of a last stage's activations, for train.loss as models/loss.py
    resolves it in `layout`; `tokens` a micro-batch's, `width` the matmuls' bytes."""
    method = loss_method(cfg)[0]
    if method == "chunked":
        param_width = width if layout.uses_fsdp else FP32  # FSDP2 gathers at the run's width
        gradients = d.vocab * d.h * param_width
        kept = d.h * width + gradients / tokens
        # measured: one device, DDP and FSDP peak with one more V x h gradient beside the
        # chunk's logits; a pipeline's last stage (GPipe and 1F1B, pp2) without it
        beside = gradients if layout.pp == 1 else 0.0
        if loss_kernel(cfg)[0] == "liger":
            # its chunk's logits at the input's width, their gradient written in place
            chunk = liger_chunk_tokens(tokens, d.vocab, d.h)
            return LossMemory(kept, chunk * d.vocab * width + beside, 0.0)
        chunk = min(chunk_tokens(d.vocab), tokens)
        return LossMemory(kept, chunk * 3 * d.vocab * FP32 + beside, 0.0)
    vocab = d.vocab / layout.tp if method == "vocab_parallel" else d.vocab
    kept = vocab * FP32 * (2 if layout.pp > 1 else 1)
    transient = (3 if method == "vocab_parallel" else 2) * vocab * FP32
    return LossMemory(kept, tokens * transient, d.vocab / layout.tp * FP32)


def predict_rank(
    cfg: ExperimentConfig,
    layout: Layout,
    share: StageShare,
    pp_rank: int,
    n_microbatches: int,
    micro_batch: int,
) -> MemoryPrediction:
    d = Dims.of_layout(cfg.model, layout)
    elements = local_param_elements(d, share, layout.tp, layout.shard_size)
    state = elements * FP32
    activations = activation_bytes(cfg, layout, share, pp_rank, n_microbatches, micro_batch)
    other = 0
    if layout.uses_fsdp and layout.pp > 1:
        # torch's pipeline schedule keeps FSDP2 from resharding or syncing between
        # micro-batches (set_reshard_after_backward / set_requires_gradient_sync False until
        # the step's last backward): the stage stays gathered all step (the param dtype)
        # and its gradients accumulate unsharded (fp32, FSDP2's reduce dtype). Measured on
        # CPU (pp2 x fsdp2, fp32, model=small): within 1% on the last stage; 17% above on
        # the first, whose peak comes before its gradients exist: on the safe side.
        unsharded = local_param_elements(d, share, layout.tp, 1)
        param_width = 2 if cfg.train.precision in HALF_PRECISIONS else FP32
        activations += unsharded * (param_width + FP32)
    elif layout.uses_fsdp:
        gathered = local_param_elements(d, StageShare(0, share.first, share.last, 1), layout.tp, 1)
        block = layer_param_elements(d, layout.tp)
        param_width = 2 if cfg.train.precision in HALF_PRECISIONS else FP32
        # at the backward peak: the root, the current and the prefetched block gathered,
        # and one more block-sized buffer (all-gather staging or unsharded gradient)
        activations += (gathered + 2 * block) * param_width + block * FP32
    else:
        if cfg.train.precision in HALF_PRECISIONS:
            activations += elements * 2  # autocast's bf16 weight copies, kept for backward
        if layout.uses_ddp and not cfg.parallel.ddp.gradient_as_bucket_view:
            other += state  # DDP's gradient buckets
    activations += memory_change(
        cfg, layout, d, share.layers, rank_tokens(cfg, layout, micro_batch)
    )
    if cfg.hardware.device_type == "cuda":
        other += CUBLAS_WORKSPACES
    if layout.pp > 1:  # the stage's receive buffers, one per micro-batch
        tokens = rank_tokens(cfg, layout, n_microbatches * micro_batch)
        other += tokens * d.h * FP32
    optimizer = int(elements * OPTIMIZER_STATE_BYTES[cfg.train.optimizer_states])
    if offloads_state(cfg):  # FSDP2's sharded state in host memory (plan/host.py)
        return MemoryPrediction(0, 0, 0, int(activations), other)
    return MemoryPrediction(state, state, optimizer, int(activations), other)


def offloads_state(cfg: ExperimentConfig) -> bool:
    """parallel.fsdp.offload on a GPU (a CPU's host is its device: nothing moves)."""
    return cfg.parallel.fsdp.offload == "cpu" and cfg.hardware.device_type == "cuda"


def offloads_activations(cfg: ExperimentConfig) -> bool:
    """parallel.activation_offload on a GPU."""
    return cfg.parallel.activation_offload == "cpu" and cfg.hardware.device_type == "cuda"


def without_offload(cfg: ExperimentConfig) -> ExperimentConfig:
    """`cfg` with everything on the device: what the offloads are measured against."""
    p = cfg.parallel
    fsdp = replace(p.fsdp, offload="none")
    return replace(cfg, parallel=replace(p, fsdp=fsdp, activation_offload="none"))


def loss_bytes(vocab: int) -> int:
    """A token's bytes at the loss (activation_bytes' last stage): the fp32 logits kept for
    backward, three vocab-wide fp32 transients, the int64 target."""
    return 4 * vocab * FP32 + 8


def chunk_sizes(micro_batch: int, devices: int) -> list[int]:
    """Samples of a micro-batch each of DataParallel's devices runs (torch's scatter:
    Tensor.chunk, ceil-sized chunks; 0 on a device left without one)."""
    size = -(-micro_batch // devices)
    return [max(0, min(size, micro_batch - i * size)) for i in range(devices)]


def dataparallel_devices(
    cfg: ExperimentConfig, one: MemoryPrediction, micro_batch: int, vocab: int, logits_width: int
) -> list[MemoryPrediction]:
    """Each of DataParallel's devices, from `one`: a device computing the first share of a
    `micro_batch` alone, its logits `logits_width` bytes an element (see the docstring)."""
    shares = chunk_sizes(micro_batch, cfg.parallel.dataparallel_devices)
    tokens = cfg.train.seq_len
    weights = one.params  # fp32, as the gradients of a replica
    logits, loss = vocab * logits_width, loss_bytes(vocab)
    gathered = one.activations + (micro_batch - shares[0]) * tokens * (logits + loss)
    first = replace(one, activations=gathered, other=one.other + max(0, 2 * weights - gathered))
    kept = 0 if cfg.train.precision in HALF_PRECISIONS else weights
    replica = one.activations - shares[0] * tokens * (loss - logits) + kept
    other = one.other + max(0, weights - replica)
    idle = MemoryPrediction(0, 0, 0, 0, 0)
    return [first, *(MemoryPrediction(0, 0, 0, replica, other) if n else idle for n in shares[1:])]


def predict_dataparallel(cfg: ExperimentConfig) -> list[MemoryPrediction]:
    """One prediction a device of parallel=dataparallel, the first first."""
    layout = Layout.of(cfg.parallel)
    n_microbatches, micro_batch = micro_batching(cfg, layout)
    [share] = stage_shares(cfg.model, cfg.parallel, layout)
    first = chunk_sizes(micro_batch, cfg.parallel.dataparallel_devices)[0]
    one = predict_rank(cfg, layout, share, 0, n_microbatches, first)
    width = 2 if cfg.train.precision in HALF_PRECISIONS else FP32
    vocab = Dims.of_layout(cfg.model, layout).vocab
    return dataparallel_devices(cfg, one, micro_batch, vocab, width)


def predict_stages(cfg: ExperimentConfig) -> list[MemoryPrediction]:
    """One prediction per pipeline rank (all ranks of a stage hold the same), for a resolved
    config (no -1 degrees left): what the planner compares, whatever the world size.
    DataParallel's: its first device, which holds the most."""
    if cfg.parallel.data_parallel == "dataparallel":
        return predict_dataparallel(cfg)[:1]
    layout = Layout.of(cfg.parallel)
    n_microbatches, micro_batch = micro_batching(cfg, layout)
    shares = stage_shares(cfg.model, cfg.parallel, layout)
    return [
        predict_rank(cfg, layout, share, pp_rank, n_microbatches, micro_batch)
        for pp_rank, share in enumerate(shares)
    ]


def predict_memory(cfg: ExperimentConfig) -> list[MemoryPrediction]:
    """One prediction per rank, in rank order (the pipeline dim is outermost); DataParallel's
    one rank: one a device."""
    if cfg.parallel.data_parallel == "dataparallel":
        return predict_dataparallel(cfg)
    per_stage = predict_stages(cfg)
    ranks_per_stage = Layout.of(cfg.parallel).world_size // len(per_stage)
    return [m for m in per_stage for _ in range(ranks_per_stage)]
