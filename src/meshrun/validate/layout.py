"""Rules of legal layouts: degrees and world size, tensor-parallel divisibility, pipeline
stages, schedules and micro-batches, batch divisibility. The -1 degrees, rank counts and CPU
threads are filled by the resolution (driver/resolution.py); a pipeline's micro-batch count
follows from train.micro_batch_size."""

from __future__ import annotations

import math

from meshrun.core.batch import local_batch_size, n_microbatches
from meshrun.core.config import ExperimentConfig, ParallelConfig
from meshrun.core.errors import fail
from meshrun.core.hardware import HostFacts
from meshrun.core.imports import import_callable
from meshrun.core.layout import MESH_DIMS, Layout, dataparallel_devices
from meshrun.core.stages import MULTI_STAGE_SCHEDULES, PP_AUTO, stage_layer_counts
from meshrun.models import model_kind, model_shape
from meshrun.validate.launcher import check_launcher, check_start_method


def check_layout_keys(cfg: ExperimentConfig) -> None:
    """The launcher's and the layout's own keys, before the degrees are filled."""
    check_launcher(cfg.launcher)
    check_start_method(cfg.launcher, cfg.hardware.device_type == "cuda")
    check_degrees(cfg.parallel)
    _check_checkpoint_every(cfg.parallel)


def _check_checkpoint_every(p: ParallelConfig) -> None:
    if p.checkpoint_every < 1:
        fail(
            "parallel.checkpoint_every",
            p.checkpoint_every,
            "must be >= 1",
            "1 (every block) or n (every n-th block checkpointed)",
        )
    if p.checkpoint_every > 1 and p.activation_checkpointing == "none":
        fail(
            "parallel.checkpoint_every",
            p.checkpoint_every,
            "says which blocks activation checkpointing wraps, and it is off",
            "parallel.activation_checkpointing=full (selective, op), or checkpoint_every=1",
        )


def check_degrees(p: ParallelConfig) -> None:
    """Each degree >= 1, or -1 ('the rest') for one of them at most."""
    degrees = {dim: getattr(p, dim) for dim in MESH_DIMS}
    for dim, n in degrees.items():
        if n == 0 or n < -1:
            fail(
                f"parallel.{dim}",
                n,
                "degrees are >= 1, or -1 for 'the rest'",
                "a positive integer or -1",
            )
    fill = [dim for dim, n in degrees.items() if n == -1]
    if len(fill) > 1:
        fail(
            f"parallel.{fill[1]}",
            -1,
            f"only one degree may be -1 (also {fill[0]})",
            "explicit degrees for all but one dim",
        )


def check_fill(p: ParallelConfig, world: int, key: str) -> None:
    """`p`'s -1 degree (if any) can be filled from `world` ranks; `key` is what sized the
    world, named if it cannot be split."""
    degrees = {dim: getattr(p, dim) for dim in MESH_DIMS}
    if -1 not in degrees.values():
        return
    fixed = math.prod(n for n in degrees.values() if n != -1)
    if world % fixed:
        fail(
            key,
            world,
            f"{world} ranks cannot be split with "
            f"the fixed degrees of parallel={p.name} (product {fixed})",
            f"a multiple of {fixed}",
        )


def check_dataparallel(cfg: ExperimentConfig, facts: HostFacts) -> None:
    """torch.nn.DataParallel: one process over this host's CUDA devices, no mesh degrees."""
    p = cfg.parallel
    if any(getattr(p, dim) != 1 for dim in (*MESH_DIMS, "ep", "etp")):
        fail(
            "parallel.data_parallel",
            "dataparallel",
            "DataParallel is one process; it does not combine with mesh degrees",
            "all of dp_replicate, dp_shard, cp, tp, pp, ep, etp = 1",
        )
    if p.activation_offload == "cpu":
        fail(
            "parallel.activation_offload",
            "cpu",
            "keeps a block's saved tensors in host memory through autograd's saved-tensor "
            "hooks, which are thread-local: DataParallel runs its replicas' forwards on "
            "threads of their own, where the hooks do not apply",
            "parallel=ddp (a process a device), or parallel.activation_offload=none",
        )
    n_gpus = len(facts.cuda_devices)
    devices = dataparallel_devices(p, n_gpus)
    if n_gpus < 2 or not 2 <= devices <= n_gpus:
        fail(
            "parallel",
            p.name,
            f"torch.nn.DataParallel needs >= 2 CUDA devices; {n_gpus} visible",
            "ddp (the multi-process equivalent), or run on a multi-GPU machine",
        )


def check_batch(cfg: ExperimentConfig) -> None:
    t, p = cfg.train, cfg.parallel
    dp = Layout.of(p).dp_size
    unit = t.micro_batch_size * dp
    if t.global_batch_size % unit:
        fail(
            "train.global_batch_size",
            t.global_batch_size,
            f"not divisible by micro_batch_size ({t.micro_batch_size}) x data-parallel "
            f"size ({dp}) = {unit}",
            f"a multiple of {unit}, e.g. {unit} or {2 * unit}",
        )
    ddp = p.dp_replicate > 1 and p.dp_shard == 1 and p.tp == 1 and p.pp == 1
    accumulates = n_microbatches(cfg) > 1
    if ddp and p.ddp.static_graph and accumulates:
        # torch 2.13's reducer asserts (expect_autograd_hooks_) in the first no_sync backward
        fail(
            "parallel.ddp.static_graph",
            True,
            f"fails inside torch's DDP when a step accumulates {n_microbatches(cfg)} "
            "micro-batches (no_sync)",
            f"false, or train.micro_batch_size={local_batch_size(cfg)} (one micro-batch a step)",
        )


def check_tensor_parallel(cfg: ExperimentConfig) -> None:
    p, m = cfg.parallel, model_shape(cfg.model)
    if p.sequence_parallel and p.tp == 1:
        fail(
            "parallel.sequence_parallel",
            True,
            "shards the sequence over tensor-parallel ranks and there are none (tp=1)",
            "false, or tp > 1",
        )
    if p.tp_plan is not None:
        try:
            import_callable(p.tp_plan)
        except (ImportError, ValueError) as err:
            fail(
                "parallel.tp_plan",
                p.tp_plan,
                f"cannot be loaded ({err})",
                '"package.module:function", importable from the current directory or sys.path',
            )
    if p.tp == 1:
        return
    dims = {
        "model.n_heads": m.n_heads,
        "model.n_kv_heads": m.n_kv_heads,
        "model ffn hidden size": m.ffn_dim,
    }  # the vocabulary is padded to a multiple of tp (core/model_shape.py)
    if p.sequence_parallel:
        dims["train.seq_len"] = cfg.train.seq_len
    for name, size in dims.items():
        if size is not None and size % p.tp:  # None: a custom module's (validate/custom.py)
            valid = [t for t in range(2, size + 1) if size % t == 0 and t <= 8] or [1]
            fail(
                "parallel.tp",
                p.tp,
                f"{name} ({size}) is not divisible by tp",
                f"tp in {valid}, or a model whose sizes divide by {p.tp}",
            )


def check_pipeline(cfg: ExperimentConfig) -> None:
    """Nothing of a pipeline is resolved here: n_microbatches derives its m from the batch
    wherever m is needed."""
    p = cfg.parallel
    if p.pp == 1:
        _check_no_pipeline(cfg)
        return
    _check_stages_per_rank(cfg)
    shape = model_shape(cfg.model)
    _check_stage_layers(cfg, shape.n_layers)
    if shape.tied and model_kind(cfg.model).own_ties(cfg.model):  # else a head copy: tied.py
        fail(
            "model.target",
            cfg.model.target,
            "ties parameters, which a pipeline would put on different stages (meshrun keeps "
            "a tied embedding and head of its own and transformers' models in step across "
            "stages, not a module's own ties)",
            "a module without tied parameters with pp > 1",
        )
    _check_micro_batches(cfg)
    _check_split_backward(cfg)


def _check_split_backward(cfg: ExperimentConfig) -> None:
    """The zero-bubble schedule runs each backward in two passes over the stage's graph (the
    inputs' gradients with the graph retained, then the weights': torch/distributed/
    pipelining/_backward.py, stage_backward_input and stage_backward_weight), which what
    keeps one backward's state does not take."""
    p = cfg.parallel
    if p.schedule != "interleaved_zb":
        return
    if p.activation_checkpointing in ("selective", "op"):
        fail(
            "parallel.activation_checkpointing",
            p.activation_checkpointing,
            "caches the block's kept outputs for one backward (torch/utils/checkpoint.py:1459 "
            'in 2.13: "Trying to backward an extra time ... under selective activation '
            'checkpoint"), and the zero-bubble schedule backpropagates through each block '
            "twice, inputs then weights",
            "full or none with parallel.schedule=interleaved_zb, or interleaved_1f1b",
        )
    if cfg.train.compile:
        fail(
            "train.compile",
            True,
            "compiles a block's backward into one autograd node for its inputs' and weights' "
            "gradients, which the zero-bubble schedule runs twice; with buffer donation off "
            "(torch 2.13 refuses a retained graph otherwise: _functorch/_aot_autograd/"
            "runtime_wrappers.py:3539) it ran, 2.3e-3 off one device's grad norm "
            "(meshrun-verify, tiny, beyond the reference's own noise)",
            "train.compile=false with parallel.schedule=interleaved_zb, or interleaved_1f1b",
        )


def _check_no_pipeline(cfg: ExperimentConfig) -> None:
    """A split of layers without stages is a mistake in the command, not a no-op."""
    p = cfg.parallel
    if p.pp_layers:
        fail(
            "parallel.pp_layers",
            p.pp_layers,
            "only applies to pipelines (pp > 1)",
            "null, or set parallel.pp",
        )


def _check_stages_per_rank(cfg: ExperimentConfig) -> None:
    """The schedule decides how many stages a rank holds: an interleaved one needs several."""
    p = cfg.parallel
    multi = p.schedule in MULTI_STAGE_SCHEDULES
    if multi and p.stages_per_rank < 2:
        fail(
            "parallel.stages_per_rank",
            p.stages_per_rank,
            f"schedule {p.schedule} runs several stages per rank",
            ">= 2",
        )
    if not multi and p.stages_per_rank != 1:
        fail(
            "parallel.stages_per_rank",
            p.stages_per_rank,
            f"schedule {p.schedule} runs one stage per rank",
            f"1, or schedule in {MULTI_STAGE_SCHEDULES}",
        )


def _check_stage_layers(cfg: ExperimentConfig, n_layers: int) -> None:
    """Every stage holds at least one layer, in the split pp_layers gives (if it gives one)."""
    p = cfg.parallel
    stages = p.pp * p.stages_per_rank
    if n_layers < stages:
        fail(
            "parallel.pp",
            p.pp,
            f"{stages} pipeline stages but the model has {n_layers} layers",
            f"at most {n_layers} stages in all",
        )
    explicit = bool(p.pp_layers) and p.pp_layers != PP_AUTO
    if explicit and (
        not isinstance(p.pp_layers, list)
        or not all(isinstance(n, int) and not isinstance(n, bool) for n in p.pp_layers)
        or len(p.pp_layers) != stages
        or sum(p.pp_layers) != n_layers
        or min(p.pp_layers) < 1
    ):
        fail(
            "parallel.pp_layers",
            p.pp_layers,
            f"needs {stages} entries (one per "
            f"stage), each >= 1, adding up to the model's {n_layers} layers",
            f"e.g. {stage_layer_counts(n_layers, stages, None)}, or {PP_AUTO} (split by "
            "measured cost)",
        )


def _check_micro_batches(cfg: ExperimentConfig) -> None:
    """The pipeline cuts each rank's batch into micro-batches: evenly, and enough of them for
    every stage rank to hold one (GPipe aside, whose schedule runs with fewer)."""
    p, t = cfg.parallel, cfg.train
    local = local_batch_size(cfg)
    if t.micro_batch_size > local or local % t.micro_batch_size:
        fail(
            "train.micro_batch_size",
            t.micro_batch_size,
            f"must divide the local batch (global "
            f"{t.global_batch_size} / dp {Layout.of(p).dp_size} = {local}); the "
            "pipeline runs local / micro_batch_size micro-batches",
            f"a divisor of {local}",
        )
    m = n_microbatches(cfg)
    if p.schedule != "gpipe" and m < p.pp:
        fail(
            "train.micro_batch_size",
            t.micro_batch_size,
            f"gives {m} micro-batch(es) (local batch {local} / {t.micro_batch_size}) and "
            f"schedule {p.schedule} needs at least one micro-batch per stage rank (pp={p.pp})",
            f"at most {local // p.pp}, or schedule=gpipe",
        )
