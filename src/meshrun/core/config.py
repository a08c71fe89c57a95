"""Typed schema of an experiment (the other commands' schemas build on it: tool_config.py).

Hydra composes YAML presets onto these dataclasses, so a wrong type or an unknown key fails
at compose time; the cross-field rules (layout vs world size, batch divisibility, ...) live in
`meshrun.validate`. Workers receive the resolved plain dict and rebuild it with `from_dict`,
so they never import Hydra.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from omegaconf import MISSING, OmegaConf

from meshrun.core.choices import (
    Backend,
    BaselineMode,
    Checkpointing,
    CpMethod,
    DataFormat,
    DataName,
    DataParallel,
    DeviceType,
    ExportFormat,
    FailMode,
    FaultTolerance,
    Float8Recipe,
    LoadBalance,
    LoggerMode,
    LossKernel,
    LossMethod,
    LrDecay,
    Offload,
    OptimizerStates,
    Precision,
    RouterScore,
    Scaling,
    Schedule,
    StartMethod,
)
from meshrun.core.imports import import_target


@dataclass
class ModelConfig:
    """What every model has: its preset's name, its kind, which picks the schema below
    (conf/model/<name>.yaml names it first: `- /schema/model/meshrun@_here_`), and
    `pretrained`, a local Hugging Face save_pretrained directory (config.json, safetensors)
    to load weights from instead of the seeded init (a user's own module loads its own).
    `kind` is meshrun, hf or custom (models/kinds.py), or a kind of your own named by its
    import path, "package.module:attribute" of a models.kind.ModelKind (class or instance),
    whose `schema` (a subclass of this one) types the preset's keys; the driver and every
    rank import it from there (docs/architecture.md, "A new model kind")."""

    name: str = MISSING
    kind: str = "meshrun"
    pretrained: str | None = None
    context_len: int | None = None  # the sequence it was pretrained at: a GPU plan's default


@dataclass
class MoEConfig:
    """A mixture-of-experts feed-forward in every block (models/moe.py); `experts: 0` is the
    dense SwiGLU. Each token goes to its `top_k` experts by router score (`score`: softmax
    over the experts, or DeepSeek-V3's sigmoid with the top-k weights renormalised), plus
    `shared_experts` that every token passes through; an expert's hidden width is
    `expert_ffn_dim` (null: the model's ffn_dim). `capacity_factor` (null: none) caps an
    expert at factor x tokens x top_k / experts tokens a micro-batch; the rest of its
    assignments are dropped (counted). `load_balance: aux_loss` adds `aux_loss_coef` times
    the sequence-wise balance loss (DeepSeek-V3, eq. 17-20) to the training loss; `bias` is
    DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias on the scores that pick
    the top-k (not on the weights), moved by `bias_update_rate` after each step towards the
    experts the step's batch under-used (sign of the mean load minus the expert's).
    `grouped_mm`: the routed experts as one grouped GEMM a matrix where torch has its native
    kernel (CUDA sm90 or sm100, bf16: models/expert_compute.py); false, a loop over the
    experts everywhere (the same numbers; to compare, or where the kernel misbehaves). How
    the model computes, not what it is: a checkpoint resumes under either."""

    experts: int = 0
    top_k: int = 2
    shared_experts: int = 0
    expert_ffn_dim: int | None = None
    score: RouterScore = RouterScore["softmax"]
    capacity_factor: float | None = None
    load_balance: LoadBalance = LoadBalance["aux_loss"]
    aux_loss_coef: float = 0.01
    bias_update_rate: float = 0.001  # DeepSeek-V3's gamma
    grouped_mm: bool = True


@dataclass
class LlamaModelConfig(ModelConfig):
    """kind=meshrun: meshrun's own LLaMA-style decoder; `ffn_dim` None means SwiGLU's 8/3*dim
    rounded to `multiple_of`; `head_dim` None means dim / n_heads (Qwen3's heads are wider:
    n_heads x head_dim > dim); `pretrained` is a LlamaForCausalLM of the preset's sizes
    (models/convert.py)."""

    dim: int = MISSING
    n_layers: int = MISSING
    n_heads: int = MISSING
    n_kv_heads: int | None = None
    head_dim: int | None = None
    vocab_size: int = MISSING
    ffn_dim: int | None = None
    multiple_of: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_embeddings: bool = False
    moe: MoEConfig = field(default_factory=MoEConfig)


@dataclass
class HFModelConfig(ModelConfig):
    """kind=hf: a Hugging Face transformers causal LM, built from its config on the meta
    device (no hub): `architecture` is the transformers class (LlamaForCausalLM), `config` the
    fields of its config class that differ from that class's defaults. `architecture: auto`
    (model=hf/auto) reads both from `pretrained`'s config.json when the experiment is resolved
    (validate/model.read_pretrained), `config`'s keys over what it read (the run's
    `Resolved.model_read_from` then names that config.json)."""

    kind: str = "hf"
    architecture: str = MISSING
    config: dict[str, Any] = field(default_factory=dict)


@dataclass
class CustomModelConfig(ModelConfig):
    """kind=custom: your own nn.Module. `target` ("module:callable", importable from the
    current directory) is called with `kwargs` and returns a module whose forward maps token
    ids [batch, seq] to logits [batch, seq, vocab]. The optional keys name what a layout needs
    and cannot guess, as dotted paths into that module: `layers` its list of blocks (the FSDP
    units, what activation checkpointing wraps, where a pipeline cuts), `embedding`, `norm`
    and `head` (a pipeline stage runs embedding -> layers -> norm -> head in that order), and
    `tp_plan`, module-name patterns to TP styles (rank/parallel/tensor.py) or a
    "module:callable" returning such a dict. `vocab_size`: the embedding's when null.
    `positions`: the keyword by which the module's forward takes each token's position
    ([1, seq], as transformers' `position_ids`), passed where set; context parallelism needs
    it, its ranks holding two chunks of each sequence whose positions the module cannot
    count itself."""

    kind: str = "custom"
    target: str = MISSING
    kwargs: dict[str, Any] = field(default_factory=dict)
    vocab_size: int | None = None
    layers: str | None = None
    embedding: str | None = None
    norm: str | None = None
    head: str | None = None
    tp_plan: Any = None
    positions: str | None = None


MODEL_SCHEMAS: dict[str, type[ModelConfig]] = {
    "meshrun": LlamaModelConfig,
    "hf": HFModelConfig,
    "custom": CustomModelConfig,
}


def model_schema(kind: str) -> type[ModelConfig]:
    """The config schema of the model kind `kind` names: meshrun's own, or the `schema` of
    the kind at the import path `kind`; ImportError or ValueError where there is none."""
    if kind in MODEL_SCHEMAS:
        return MODEL_SCHEMAS[kind]
    schema = getattr(import_target(kind), "schema", None)
    if not (isinstance(schema, type) and issubclass(schema, ModelConfig)):
        raise ValueError(f"{kind!r} has no `schema`, a subclass of ModelConfig")
    return schema


@dataclass
class DDPConfig:
    """Knobs passed straight to torch.nn.parallel.DistributedDataParallel."""

    gradient_as_bucket_view: bool = False
    bucket_cap_mb: float = 25.0
    static_graph: bool = False
    find_unused_parameters: bool = False


@dataclass
class FSDPConfig:
    """`offload=cpu`: FSDP2's CPUOffloadPolicy, the sharded parameters, their gradients and
    the optimizer step in host memory (pinned on CUDA), each unit copied to the device for
    its forward and backward (rank/parallel/fsdp.py)."""

    reshard_after_forward: bool = True
    offload: Offload = Offload["none"]


@dataclass
class ParallelConfig:
    """Degrees of each mesh dimension; -1 fills the rest of the world size (at most one).

    dp_replicate > 1 alone is DDP, dp_shard > 1 is FSDP2, both together HSDP; composed with
    tp or pp, replication also goes through FSDP2 (DTensor-aware). A pipeline runs local
    batch / train.micro_batch_size micro-batches a step; `pp_layers` is an explicit
    layers-per-stage split, or `auto`: the ranks time a block, the embedding and the head
    with the loss, and split the layers so the slowest stage is fastest (null: even);
    `stages_per_rank` > 1 for the interleaved schedules.
    `tp_plan` ("module:function") replaces the built-in tensor-parallel plan with a user's
    own, called as function(model, tp_mesh, sequence_parallel).
    `cp` > 1 splits each sequence over a context-parallel group, which shares attention by
    `cp_method`: `ring` (K/V blocks passed round), `allgather` (K/V gathered once a layer) or
    `alltoall` (Ulysses: sequence shards traded for head shards). CP ranks hold the same
    parameters: FSDP2 shards them over dp_shard x cp.
    `ep` > 1 splits an MoE model's routed experts over groups of ep ranks drawn from
    dp_shard x cp (as torchtitan: the ranks that would otherwise hold the same experts), each
    token sent to the rank of its experts and back with all-to-alls; the dense parts keep
    their layout, and FSDP2 shards each rank's experts over the rest of dp_shard x cp.
    `etp` = tp splits each expert's hidden width over the TP ranks too (Megatron's expert
    tensor parallelism; 1: the experts whole on each TP rank).
    `activation_offload=cpu` keeps what each block saves for backward in host memory
    (pinned on CUDA), copied back in its backward (rank/parallel/activation_offload.py).
    `fault_tolerance=torchft` runs the dp_replicate replicas as worlds of their own, joined
    each step by torchft: a replica that dies is restarted (`replica_restarts` times at
    most, all replicas together) `replica_restart_delay_s` after (a killed process's GPU
    memory is freed by the driver after it exits) and loads a live one's state while the
    others train on.
    """

    name: str = MISSING
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    cp_method: CpMethod = CpMethod["ring"]
    ep: int = 1
    etp: int = 1
    schedule: Schedule = Schedule["1f1b"]
    stages_per_rank: int = 1
    pp_layers: Any = None  # list[int] | "auto" | None (OmegaConf has no such union)
    sequence_parallel: bool = False
    tp_plan: str | None = None
    activation_checkpointing: Checkpointing = Checkpointing["none"]
    checkpoint_every: int = 1
    activation_offload: Offload = Offload["none"]
    data_parallel: DataParallel = DataParallel["auto"]
    dataparallel_devices: int = -1
    ddp: DDPConfig = field(default_factory=DDPConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    fault_tolerance: FaultTolerance = FaultTolerance["none"]
    replica_restarts: int = 3
    replica_restart_delay_s: float = 0.0


@dataclass
class BackendConfig:
    name: Backend = Backend["auto"]
    timeout_s: float = 120.0
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class AttentionKernel:
    """What the causal attention kernel eager PyTorch runs on a device reaches (16-bit, head
    dim 128), as measured by its authors: forward and backward TFLOP/s (the causal half of
    the FLOPs; backward 2.5x the forward's) at each sequence length of `seq`, ascending;
    none given, the planner's rule of thumb (plan/compute.py)."""

    seq: list[int] = field(default_factory=list)
    forward_tflops: list[float] = field(default_factory=list)
    backward_tflops: list[float] = field(default_factory=list)


@dataclass
class DeviceSpec:
    """One kind of accelerator in a box; `match` are regular expressions, one of which must be
    the whole of torch's device name (case aside): "NVIDIA H100 80GB HBM3" is the SXM5 part,
    "NVIDIA H100 PCIe" another device with other figures.
    For the planner's matmul model (plan/compute.py), from the datasheet: `memory_bw_gbs`
    (DRAM, GB/s) and `sms` (streaming multiprocessors); measured: `matmul_efficiency`, the
    fraction of the dense peak the best large matmul reaches (Bekman's MAMF table),
    `fp8_matmul_efficiency` the same of the `fp8` peak for a float8 matmul (train.float8; a
    device without an fp8 peak has no float8 tensor cores), and `attention`, the rates of
    the attention kernel torch's SDPA picks there. `host_link_gbs`: GB/s one device moves to
    or from host memory (PCIe's effective rate, NVLink-C2C's), which offload's copies take
    (plan/speed.py; null: the planner counts no copies)."""

    name: str = MISSING
    count: int = 1
    memory_gib: float = MISSING
    peak_tflops: dict[str, float] = field(default_factory=dict)
    match: list[str] = field(default_factory=list)
    memory_bw_gbs: float | None = None
    sms: int | None = None
    matmul_efficiency: float = 0.8
    fp8_matmul_efficiency: float = 0.78  # H100's (conf/hardware/h100-80g.yaml says whose)
    host_link_gbs: float | None = None
    attention: AttentionKernel = field(default_factory=AttentionKernel)


@dataclass
class LinkConfig:
    """The link between two devices of a node (NVLink, PCIe, or loopback for CPU ranks):
    `bw_gbs` GB/s per direction per device (the datasheet's; a CPU profile states gloo's
    measured bus bandwidth), `latency_us` one hop's latency (NCCL's per-step latency)."""

    name: str = "unknown"
    bw_gbs: float | None = None
    latency_us: float = 0.0


@dataclass
class NetworkConfig:
    """The network between nodes, per node: `nics` adapters of `nic_gbps` Gb/s each, as
    they are sold (InfiniBand HDR 200, NDR 400, 25 Gb/s Ethernet), `latency_us` one hop's
    latency. null `nic_gbps`: no network (one box)."""

    name: str = "none"
    nics: int = 1
    nic_gbps: float | None = None
    latency_us: float = 0.0


@dataclass
class HardwareConfig:
    """A node: its devices in PCI bus order, the link between them (`intra_node`) and, for
    plans of several nodes, the `network` between nodes. `storage_gbs`: GB/s a node writes
    to the checkpoint dir, all its ranks at once (null: what `meshrun-plan calibrate`
    measured on this host, else a published cluster's share: plan/checkpoint_cost.py).
    `host_memory_gib`: the node's host memory, which its ranks' offloaded state and
    activations must fit (plan/host.py; null: not checked)."""

    name: str = "auto"
    device_type: DeviceType = DeviceType["cpu"]
    devices: list[DeviceSpec] = field(default_factory=list)
    intra_node: LinkConfig = field(default_factory=LinkConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    storage_gbs: float | None = None
    host_memory_gib: float | None = None


@dataclass
class LauncherConfig:
    """What every launcher has: `nproc_per_node` ranks on each of `nnodes` nodes, each with
    `threads_per_rank` CPU threads. conf/launcher/<name>.yaml picks its own schema below.
    What the layers below the driver ask of a launcher's settings they ask here (a schema
    overrides it), so that none of them names a launcher: `spans_nodes`, whether its ranks
    can run on several nodes."""

    spans_nodes: ClassVar[bool] = False
    name: str = MISSING
    nnodes: int = 1
    nproc_per_node: int | None = None
    threads_per_rank: int | None = None

    def task_cpus(self) -> int | None:
        """The CPUs a scheduler gives each rank; None where the launcher does not say."""
        return None

    def waits_for_ranks(self) -> bool:
        """Whether the command returns only once the ranks end (not once they are queued)."""
        return True

    def pinned_to(self, nodes: list[str]) -> LauncherConfig:
        """These settings with the ranks placed on `nodes` where the launcher can place them
        (plan.trials: each trial on the first one's nodes)."""
        return self


@dataclass
class LocalLauncherConfig(LauncherConfig):
    """launcher=local: ranks on this machine through torch.distributed.elastic."""

    name: str = "local"
    monitor_interval_s: float = 0.1
    start_method: StartMethod = StartMethod["forkserver"]


@dataclass
class SlurmLauncherConfig(LauncherConfig):
    """launcher=slurm: sbatch resources (one task per rank), `setup` shell lines run before
    srun, `sbatch_extra` any other sbatch flag ({"mail-type": "END"}); `wait` false returns
    after submitting, and `meshrun-collect` records the results later. `signal_delay_s`
    before the time limit, SLURM warns the ranks (SIGUSR2): a run that checkpoints saves,
    requeues and resumes in the same job. `lighthouse_host`: how the nodes reach this host,
    where a torchft run's lighthouse listens (null: the address this host reaches the SLURM
    controller from)."""

    spans_nodes: ClassVar[bool] = True
    name: str = "slurm"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    gpus_per_node: int | None = None
    cpus_per_task: int | None = None
    mem_gb: float | None = None
    time_min: int = 60
    constraint: str | None = None
    exclusive: bool = False
    setup: list[str] = field(default_factory=list)
    sbatch_extra: dict[str, str] = field(default_factory=dict)
    wait: bool = True
    signal_delay_s: int = 90
    lighthouse_host: str | None = None

    def task_cpus(self) -> int | None:
        return self.cpus_per_task

    def waits_for_ranks(self) -> bool:
        return self.wait

    def pinned_to(self, nodes: list[str]) -> LauncherConfig:
        """The user's own nodelist wins; else sbatch's --nodelist of `nodes`."""
        if "nodelist" in self.sbatch_extra:
            return self
        return dataclasses.replace(
            self, sbatch_extra={**self.sbatch_extra, "nodelist": ",".join(nodes)}
        )


# The launcher a plan of several nodes runs with (plan/search.py) where the user's cannot span
# them.
CLUSTER_LAUNCHER: type[LauncherConfig] = SlurmLauncherConfig

# meshrun's launchers' schemas by name; a user's launcher is named by its import path
# (`launcher_schema`, driver/launch/registry.py).
LAUNCHER_SCHEMAS: dict[str, type[LauncherConfig]] = {
    schema.name: schema for schema in (LocalLauncherConfig, SlurmLauncherConfig)
}


def launcher_schema(name: str) -> type[LauncherConfig]:
    """The config schema of the launcher `name` names: meshrun's own, or the `schema` of the
    Launcher at the import path `name`; ImportError or ValueError where there is none."""
    if name in LAUNCHER_SCHEMAS:
        return LAUNCHER_SCHEMAS[name]
    schema = getattr(import_target(name), "schema", None)
    if not (isinstance(schema, type) and issubclass(schema, LauncherConfig)):
        raise ValueError(f"{name!r} has no `schema`, a subclass of LauncherConfig")
    return schema


@dataclass
class LoggerConfig:
    name: str = "wandb"
    project: str = "meshrun"
    entity: str | None = None
    group: str | None = None
    mode: LoggerMode = LoggerMode["auto"]
    tags: list[str] = field(default_factory=list)


@dataclass
class DataConfig:
    """Where tokens come from. `path`: data=text's file; data=hf's local dataset (a json/jsonl,
    parquet or text file, or a `save_to_disk` directory; `format` null: read off the path),
    tokenized once with `tokenizer` (a local tokenizer directory or a tokenizer.json) into a
    cache under `cache_dir` (null: `data-cache/` beside the store) that the ranks memory-map.
    Documents are joined with the tokenizer's EOS (or `separator_id`); the last
    `heldout_fraction` of them (data=text: of the file's bytes) is held out for evaluation
    (train.eval), whether or not a run evaluates, so that training sees the same data either
    way. The loader's knobs are torch.utils.data.DataLoader's; `pin_memory` applies on CUDA
    only."""

    name: DataName = DataName["synthetic"]
    path: str | None = None
    format: DataFormat | None = None
    text_field: str = "text"
    tokenizer: str | None = None
    separator_id: int | None = None
    heldout_fraction: float = 0.05
    shuffle: bool = True
    cache_dir: str | None = None
    num_workers: int = 0
    pin_memory: bool = True
    prefetch_factor: int = 2


@dataclass
class LrScheduleConfig:
    """`train.lr` reached by a linear warmup over `warmup_steps`, then held (constant) or
    decayed (linear, cosine) to `min_lr_ratio` x lr at the last step (rank/train/optim.py)."""

    decay: LrDecay = LrDecay["constant"]
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0


@dataclass
class EvalConfig:
    """Held-out loss and perplexity after every `every_steps` steps and after the last (0:
    never), over `batches` global batches of train.global_batch_size held-out samples: the
    same samples every time, so that the curve compares like with like."""

    every_steps: int = 0
    batches: int = 4


@dataclass
class LossScaleConfig:
    """fp16's dynamic loss scale (rank/train/loss_scale.py): starts at `init`, halves on a
    step with non-finite gradients (skipped), doubles after `growth_interval` finite ones."""

    init: float = 65536.0
    growth_interval: int = 2000


@dataclass
class GuardConfig:
    """What a step may not do to the run (rank/train/guard.py): a step whose global gradient
    norm is not finite (a non-finite loss makes it so) is skipped on every rank alike, in
    every precision; `max_skipped` such steps in a row stop the run. `spike`: a loss more
    than `spike_sigma` standard deviations above the mean of the last `spike_window` steps'
    (or, where `spike_ratio` is set, above that many times the mean) rolls the run back to
    its last checkpoint and skips the batches from there through the spike's and
    `skip_batches` more; `max_rollbacks` of them stop the run."""

    max_skipped: int = 10
    spike: bool = False
    spike_sigma: float = 5.0
    spike_ratio: float | None = None
    spike_window: int = 20
    skip_batches: int = 0
    max_rollbacks: int = 3


@dataclass
class Float8Config:
    """train.float8: the block linears' matmuls in float8 through torchao's Float8Linear
    (rank/parallel/float8.py), weights, gradients and optimizer state staying in high
    precision. Converted: every nn.Linear whose in and out features are multiples of 16 (the
    float8 kernels' requirement), never the output head, the embedding or an MoE router, nor
    a module whose name contains one of `skip` (torchtitan's filter_fqns). `recipe`:
    `tensorwise` one scale a tensor (fastest; its TP all-gathers in float8),
    `rowwise` one a row, `rowwise_with_gw_hp` rowwise with the weight gradient's matmul in
    high precision (most accurate). `fsdp_all_gather`: FSDP2 all-gathers the weights in
    float8, their scales computed in one all-reduce after each optimizer step (null: on for
    tensorwise, which alone supports it)."""

    enabled: bool = False
    recipe: Float8Recipe = Float8Recipe["tensorwise"]
    skip: list[str] = field(default_factory=list)
    fsdp_all_gather: bool | None = None

    @property
    def gathers_float8(self) -> bool:
        """`fsdp_all_gather`, null meaning the tensorwise recipe's yes (torchao all-gathers
        float8 weights for no other: validate/float8.py)."""
        return self.recipe == "tensorwise" if self.fsdp_all_gather is None else self.fsdp_all_gather


@dataclass
class TrainConfig:
    """`untimed_steps`: the first steps, left out of the step times (allocator and kernel
    warm-up, torch.compile's compilations) and where memory is measured; not the LR warmup
    (lr_schedule.warmup_steps). `global_batch_size` null: derived from the layout, 8
    rounded up to a multiple of micro_batch_size x the data-parallel size (core/batch.py),
    so the default experiment runs on any number of ranks. `precision` auto: bf16 on CUDA
    where every device has it (sm80+), else fp32 (core/precision.py). `tf32`: an fp32 run on
    CUDA does its matmuls on TF32 tensor cores (as torchtitan and Lightning advise; the
    planner and MFU count the TF32 peak), false: in full fp32. `compile`: torch.compile each
    decoder block (inductor). `float8`: float8 matmuls (Float8Config). `optimizer_states`:
    AdamW's two moments in `fp32` (8 bytes a parameter), `bf16` (4: updated in fp32, stored
    with stochastic rounding) or `8bit` (torchao's AdamW8bit: ~2, one byte each and a scale a
    block of 256): rank/train/optim_states.py. `loss`: `full`, the cross-entropy over the
    whole [tokens x vocabulary] logits in fp32; `chunked`, the head and the loss over chunks
    of tokens, each chunk's gradients taken as it goes (one chunk's logits exist at a time);
    `vocab_parallel` (under TP), the cross-entropy on the logits left sharded over the
    vocabulary (torch's loss_parallel); `auto`, the one of these the layout takes
    (models/loss.py), said in the summary. `loss_kernel`: what computes a chunked loss:
    `liger` (Liger's fused linear cross-entropy, Triton on CUDA: meshrun[liger]), `torch`
    (rank/parallel/loss.py's chunks), `auto` Liger's where it can run."""

    steps: int = 20
    untimed_steps: int = 2
    global_batch_size: int | None = None
    micro_batch_size: int = 2
    seq_len: int = 128
    lr: float = 3e-4
    lr_schedule: LrScheduleConfig = field(default_factory=LrScheduleConfig)
    weight_decay: float = 0.1
    grad_clip: float | None = 1.0
    precision: Precision = Precision["auto"]
    tf32: bool = True
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    seed: int = 0
    log_every: int = 5
    progress_bar: bool = True
    eval: EvalConfig = field(default_factory=EvalConfig)
    compile: bool = False
    guard: GuardConfig = field(default_factory=GuardConfig)
    float8: Float8Config = field(default_factory=Float8Config)
    optimizer_states: OptimizerStates = OptimizerStates["fp32"]
    loss: LossMethod = LossMethod["auto"]
    loss_kernel: LossKernel = LossKernel["auto"]

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch_size * self.seq_len


@dataclass
class CheckpointConfig:
    """DCP checkpoints (model, optimizer, LR schedule, data position, RNG, step) after every
    `every_steps` steps and after the last (0: none; `auto`: the Young/Daly interval of the
    plan's save cost and failure rate, in steps of the step time measured over the first
    timed steps: plan/run_time.py, rank/train/auto_interval.py), under `dir` (null:
    <run_dir>/checkpoints); written in the background (`async_save`) while training goes
    on; the last `keep` complete ones are kept. `resume`: `auto` continues from the latest
    complete checkpoint in `dir` (a fresh start where there is none), or the path of one
    checkpoint (a step-* directory), of a checkpoints directory (its latest) or of a run dir
    (the latest in its checkpoint directory); resumed in a run dir of its own (named), a new
    run, else the checkpoint's run continued (docs/long-runs.md). `export`:
    the final model, whole, into <run_dir>/export: `hf` a directory transformers'
    from_pretrained loads (meshrun's LLaMA as LlamaForCausalLM), `torch` a state dict."""

    every_steps: Any = 0  # int | "auto" (OmegaConf has no such union)
    dir: str | None = None
    keep: int = 2
    async_save: bool = True
    resume: str | None = None
    export: ExportFormat = ExportFormat["none"]


@dataclass
class MetricsConfig:
    """`scaling`: weak keeps the per-device batch of the baseline, strong its global batch.
    `baseline`: `fresh` measures the single-device baseline beside the run (rank 0
    trains it between the run's timed steps where both fit, else on its own after the run);
    `stored` reuses one of the same fingerprint (host, devices, versions, threads, model,
    batch, sequence, precision) at most `baseline_max_age_h` old, else measures it fresh;
    `off`: no speedup. `straggler_threshold`: the slowest rank's busy time over the ranks'
    median above which the run is flagged as having a straggler (rank/metrics/busy.py)."""

    scaling: Scaling = Scaling["weak"]
    baseline: BaselineMode = BaselineMode["fresh"]
    baseline_max_age_h: float = 24.0
    straggler_threshold: float = 1.15


@dataclass
class DebugConfig:
    """Fault injection, to check that a failing or hanging rank brings the whole run down;
    `slow_step_s`, a pause after every step, gives Ctrl-C and preemption a run to stop;
    `slow_rank` computes `slow_factor` times as long as it would (a straggler on purpose);
    `corrupt_step` makes every rank's loss of that step non-finite (`corrupt_mode=nan`) or
    SPIKE times itself (`spike`), its gradients with it; it is the step's batch that carries
    the fault, so a rollback that skips the batch (train.guard.spike) skips it too; lists
    corrupt several (`corrupt_step=[80,140] corrupt_mode=[nan,spike]`, one mode for all).
    `grad_error` plants an error: the model's last parameter's gradient times 1 + grad_error
    after every backward, on every rank holding it (meshrun-verify must fail it: 0.01 is 1%);
    `reverse_micro_batches` sums a step's micro-batches last to first, the same math in
    another order, and `regroup_states` quantizes 8-bit optimizer states in blocks of half
    the size, the same values in other groups (meshrun-verify's measure of a run's own
    noise: a layout sums in its own order, and its shards group 8-bit states their way).
    Looking inside: `profile_steps=[a,b]` traces steps a..b on every rank with torch.profiler
    (rank/profiling.py); `memory_snapshot` records CUDA's allocator history and writes it at
    the peak step and on an out-of-memory error."""

    fail_rank: int | None = None
    fail_step: int = 0
    fail_mode: FailMode = FailMode["raise"]
    slow_step_s: float = 0.0
    slow_rank: int | None = None
    slow_factor: float = 1.0
    profile_steps: list[int] = field(default_factory=list)
    memory_snapshot: bool = False
    corrupt_step: Any = None  # int | list[int] | None (OmegaConf has no such union)
    corrupt_mode: Any = "nan"  # nan | spike, or a list: Hydra reads `nan` as a float
    grad_error: float = 0.0
    reverse_micro_batches: bool = False
    regroup_states: bool = False


def corrupted_steps(debug: DebugConfig) -> dict[int, str]:
    """debug.corrupt_step's batches and their modes (`nan` given as Hydra's float too)."""
    if debug.corrupt_step is None:
        return {}
    steps = debug.corrupt_step if isinstance(debug.corrupt_step, list) else [debug.corrupt_step]
    modes = debug.corrupt_mode if isinstance(debug.corrupt_mode, list) else [debug.corrupt_mode]
    modes = [str(mode) for mode in modes] * (len(steps) if len(modes) == 1 else 1)
    return dict(zip(steps, modes, strict=False))


@dataclass
class StoreConfig:
    path: str = "outputs/meshrun.db"


@dataclass
class PlanConfig:
    """The planner: `efficiency`, the MFU a good run reaches, replaces the speed model's
    matmul-shape costing of a GPU with FLOPs over peak x efficiency (null: shapes on GPU
    profiles, the device type's default elsewhere, plan/speed.py); `headroom_gib` of each
    device is kept free (CUDA context, cuBLAS and NCCL buffers) and, on a GPU, `fragmentation`
    of what is left: PyTorch's caching allocator reserves more than it hands out (blocks
    split and cached by size; GMLake, Guo et al. ASPLOS 2024, measured large shares in LLM
    training), so a plan at 99% of a device OOMs in practice; `allow_oom` launches a run
    predicted not to fit anyway. `trace`: a run also records the prediction of its parallel
    module traced on fake tensors (plan/traced.py) and torch's count of its FLOPs beside the
    formulas' (a model without formulas, model=custom, is always traced). `trials`: with
    parallel=auto, the planner's first `trials` layouts that fit each run `trial_steps` timed
    steps on the real ranks first, and the run trains with the fastest measured
    (driver/trials.py); `trials_only` stops after the trials. `calibration`: the rates
    `meshrun-plan calibrate` measured on this host (core/calibration.py): `auto` the one
    beside the results store where it was measured here with the same ranks and threads,
    `none`, or a file's path. The whole run (plan/run_time.py): `tokens`, its token budget
    (null: train.steps x global batch x sequence), at each layout's speed its wall time and
    device-hours, their cost at `price_per_gpu_hour` (null: none), and what checkpoints and
    failures add at `mtbf_hours`, each node's mean time between failures (null: the Llama 3
    paper's, plan/run_time.py)."""

    allow_oom: bool = False
    efficiency: float | None = None
    headroom_gib: float = 1.0
    fragmentation: float = 0.1
    trace: bool = False
    trials: int = 0
    trial_steps: int = 5
    trials_only: bool = False
    calibration: str = "auto"
    tokens: float | None = None
    price_per_gpu_hour: float | None = None
    mtbf_hours: float | None = None


@dataclass
class ExperimentConfig:
    # The schema of its `kind` (model_schema), as `launcher` below.
    model: Any = MISSING
    parallel: ParallelConfig = MISSING
    backend: BackendConfig = MISSING
    hardware: HardwareConfig = MISSING
    # The schema `name` names (launcher_schema): OmegaConf has no union of structured types,
    # so the field is untyped and the node keeps the type of the schema its preset selected.
    launcher: Any = MISSING
    logger: LoggerConfig = MISSING
    data: DataConfig = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    run_dir: str = "."
    name: str | None = None
    # Shared by the runs of one sweep (store column, W&B group); null: the Hydra sweep dir's
    # name in multirun, `wandb-<id>` under a W&B agent, none for a single run.
    sweep: str | None = None


@dataclass
class RunPrediction:
    """The plan's prediction for the run's layout, made once before the launch (with the
    memory check, driver/resolve.py) and read by the record: each rank's memory by kind
    (MemoryPrediction.as_dict), the trace where the run records one, the step's seconds and
    its parts, tokens a second, and when the calibration the speed used was measured; for a
    run that saves checkpoints, one checkpoint's bytes a rank writes, seconds it holds
    training and seconds to its last byte (plan/checkpoint_cost.py)."""

    memory: list[dict[str, int]] = field(default_factory=list)
    traced: list[dict[str, int]] | None = None
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    step_parts: dict[str, float] | None = None
    calibrated_at: str | None = None
    checkpoint_bytes_per_rank: int | None = None
    checkpoint_blocked_s: float | None = None
    checkpoint_save_s: float | None = None


@dataclass
class Resolved:
    """What the driver decides for a run from its settings, which no user sets (as torchtitan
    keeps JobConfig for settings and ParallelDims for what follows from them).
    `baseline_beside`: rank 0 trains the single-device baseline between the run's timed steps
    (driver/baseline.py: a fresh one is needed and both fit); `data_cache`: data=hf's tokens,
    prepared for the ranks to memory-map (driver/prepare_data.py); `model_read_from`: the
    config.json model=hf/auto's architecture and config were read from
    (validate/model.read_pretrained);
    `batch_derived`: train.global_batch_size was null and derived from the layout;
    `precision_auto`: why train.precision=auto became what it is (e.g. `sm90`, `CPU`);
    `loss_kernel_auto`: why train.loss_kernel=auto became what it is;
    `checkpoint_interval_s`: checkpoint.every_steps=auto's interval, seconds between two saves
    (the plan's Young/Daly interval, driver/run_plan.py), and `checkpoint_interval_why` what it
    came from, which the ranks turn into steps at their measured step time; `prediction`:
    the plan's for this very config (none once the layout changes: the baseline's, a split
    the ranks chose); `settings`: the experiment as composed, before any of this (plain)."""

    baseline_beside: bool = False
    data_cache: str | None = None
    model_read_from: str | None = None
    batch_derived: bool = False
    precision_auto: str | None = None
    loss_kernel_auto: str | None = None
    checkpoint_interval_s: float | None = None
    checkpoint_interval_why: str | None = None
    prediction: RunPrediction | None = None
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunConfig(ExperimentConfig):
    """An experiment's settings with what the driver resolved from them: what the ranks get.
    Hydra types the settings alone (ExperimentConfig), so no override can reach `resolved`."""

    resolved: Resolved = field(default_factory=Resolved)


def settings_of(cfg: ExperimentConfig) -> ExperimentConfig:
    """The experiment's own settings in `cfg`: without what was resolved, or the keys of a
    command's own schema (meshrun-plan's, meshrun-verify's)."""
    fields = dataclasses.fields(ExperimentConfig)
    return ExperimentConfig(**{f.name: getattr(cfg, f.name) for f in fields})


def with_resolved(cfg: ExperimentConfig, **changes: Any) -> RunConfig:
    """`cfg` as a RunConfig, its resolved values updated by `changes`."""
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(ExperimentConfig)}
    return RunConfig(**fields, resolved=dataclasses.replace(resolved_of(cfg), **changes))


def resolved_of(cfg: ExperimentConfig) -> Resolved:
    """What the driver resolved for `cfg`: nothing yet for settings alone."""
    return cfg.resolved if isinstance(cfg, RunConfig) else Resolved()


def unpredicted(cfg: ExperimentConfig) -> ExperimentConfig:
    """`cfg` without the prediction it carries: the one for a config it was derived from."""
    if not isinstance(cfg, RunConfig) or cfg.resolved.prediction is None:
        return cfg
    return dataclasses.replace(cfg, resolved=dataclasses.replace(cfg.resolved, prediction=None))


def rebuild(schema: type, data: dict[str, Any]) -> Any:
    """`schema` typed again from a plain dict; the launcher by its `name`'s schema, the
    model (where the schema has one) by its `kind`'s."""
    base = OmegaConf.structured(schema)
    launcher = (data.get("launcher") or {}).get("name", "local")  # local: as if unnamed
    try:
        base.launcher = OmegaConf.structured(launcher_schema(launcher))
    except (ImportError, ValueError):  # unknown: the common fields, for validation to name it
        base.launcher = OmegaConf.structured(LauncherConfig)
    if any(f.name == "model" for f in dataclasses.fields(schema)):
        kind = (data.get("model") or {}).get("kind", "meshrun")
        base.model = OmegaConf.structured(model_schema(kind))
    return OmegaConf.to_object(OmegaConf.merge(base, data))


def from_dict(data: dict[str, Any]) -> RunConfig:
    """Rebuild the typed config from the driver's resolved dict (no Hydra needed)."""
    return rebuild(RunConfig, data)
