"""Every config mistake stops before any process starts, with one message naming the key,
the bad value and what would be valid."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import sqlite3
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from omegaconf import OmegaConf

from meshrun.core.config import (
    LAUNCHER_SCHEMAS,
    BackendConfig,
    DataConfig,
    HardwareConfig,
    HFModelConfig,
    LlamaModelConfig,
    LocalLauncherConfig,
    LoggerConfig,
    ParallelConfig,
    Schedule,
    SlurmLauncherConfig,
    from_dict,
    with_resolved,
)
from meshrun.core.errors import ConfigError
from meshrun.core.hardware import HostFacts
from meshrun.core.paths import CONF_DIR
from meshrun.driver import cli
from meshrun.driver.resolve import resolve
from meshrun.driver.schemas import ROOT_SCHEMAS
from meshrun.driver.tool_config import CommRunConfig, comm_from_dict
from meshrun.entrypoints import COMMANDS as SCRIPT_COMMANDS
from meshrun.rank.parallel.pipeline import SCHEDULES
from meshrun.tools.plan import command as plan_command
from meshrun.validate import fault_tolerance, optimizer
from tests.cli import CliRun, run_console
from tests.helpers import compose_config

BAD_CONFIGS = [
    # (overrides, key named in the error, fragment of the message)
    (["train.steps=0"], "train.steps", "must be positive"),
    (["plan.efficiency=0"], "plan.efficiency", "(0, 1]"),
    (["plan.efficiency=1.5"], "plan.efficiency", "(0, 1]"),
    (["plan.headroom_gib=-1"], "plan.headroom_gib", ">= 0"),
    (["plan.fragmentation=1"], "plan.fragmentation", "a fraction in [0, 1)"),
    (
        ["parallel=ddp", "parallel.ddp.static_graph=true"],
        "parallel.ddp.static_graph",
        "train.micro_batch_size=4",
    ),
    (["metrics.baseline_max_age_h=0"], "metrics.baseline_max_age_h", "must be positive"),
    (["hardware.intra_node.latency_us=-5"], "hardware.intra_node.latency_us", ">= 0"),
    (["hardware=cpu", "hardware.intra_node.bw_gbs=0"], "hardware.intra_node.bw_gbs", "> 0"),
    (["hardware.network.nics=0"], "hardware.network.nics", "> 0"),
    (["hardware.network.nic_gbps=-25"], "hardware.network.nic_gbps", "> 0"),
    (
        ["hardware=cpu", "hardware.devices.0.matmul_efficiency=2"],
        "hardware.devices.0.matmul_efficiency",
        "(0, 1]",
    ),
    (
        [
            "hardware=cpu",
            "hardware.devices.0.attention={seq:[512,1024],"
            "forward_tflops:[100],backward_tflops:[100,120]}",
        ],
        "hardware.devices.0.attention.forward_tflops",
        "2 positive numbers",
    ),
    (
        [
            "hardware=cpu",
            "hardware.devices.0.attention={seq:[1024,512],"
            "forward_tflops:[1,1],backward_tflops:[1,1]}",
        ],
        "hardware.devices.0.attention.seq",
        "ascending order",
    ),
    (["model=llama-7b", "parallel=ddp"], "parallel", "predicted peak memory"),
    (["model=small", "plan.headroom_gib=1e9"], "parallel", "exceeds the"),
    (["train.steps=-5"], "train.steps", "must be positive"),
    (["train.untimed_steps=0"], "train.untimed_steps", "1 <= untimed_steps"),
    (["train.steps=4", "train.untimed_steps=4"], "train.untimed_steps", "< train.steps"),
    (
        ["train.steps=4", "train.lr_schedule.warmup_steps=4"],
        "train.lr_schedule.warmup_steps",
        "< train.steps (4)",
    ),
    (["train.lr_schedule.min_lr_ratio=1.5"], "train.lr_schedule.min_lr_ratio", "fraction"),
    (["parallel=ddp", "train.global_batch_size=10"], "train.global_batch_size", "multiple of 4"),
    (["train.micro_batch_size=0"], "train.micro_batch_size", "must be positive"),
    (["train.lr=0"], "train.lr", "must be positive"),
    (["train.grad_clip=-1"], "train.grad_clip", "must be positive"),
    (["train.eval.every_steps=-1"], "train.eval.every_steps", "must not be negative"),
    (["train.eval.batches=0"], "train.eval.batches", "must be positive"),
    (["parallel=single", "launcher.nproc_per_node=2"], "launcher.nproc_per_node", "needs 1"),
    (["parallel=hsdp", "launcher.nproc_per_node=3"], "launcher.nproc_per_node", "multiple of 2"),
    (["parallel.dp_shard=0"], "parallel.dp_shard", "-1 for 'the rest'"),
    (["parallel.dp_replicate=-1", "parallel.dp_shard=-1"], "parallel.dp_shard", "only one"),
    (["parallel=tp4"], "parallel.tp", "model.n_heads (6) is not divisible by tp"),
    (["model=tiny", "parallel=tp4", "model.n_kv_heads=2"], "parallel.tp", "n_kv_heads (2)"),
    (
        ["parallel=tp2", "parallel.sequence_parallel=true", "train.seq_len=127"],
        "parallel.tp",
        "train.seq_len (127)",
    ),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel", "tp > 1"),
    (["parallel=tp2_pp2", "launcher.nproc_per_node=2"], "launcher.nproc_per_node", "needs 4"),
    (["parallel=pp4", "model.n_layers=3"], "parallel.pp", "but the model has 3 layers"),
    (["parallel=pp2", "parallel.pp_layers=[3,2]"], "parallel.pp_layers", "adding up to"),
    (["parallel=pp2", "parallel.stages_per_rank=2"], "parallel.stages_per_rank", "one stage"),
    (
        ["parallel=pp2_interleaved", "parallel.stages_per_rank=1"],
        "parallel.stages_per_rank",
        ">= 2",
    ),
    (
        ["parallel=pp2_interleaved", "train.micro_batch_size=8"],
        "train.micro_batch_size",
        "at least one micro-batch per stage rank",
    ),
    (
        ["parallel=pp2", "train.micro_batch_size=3", "train.global_batch_size=8"],  # a given one
        "train.micro_batch_size",
        "divide the local",
    ),
    (
        [
            "parallel=pp2",
            "model=custom",
            "model.target=tests.user_model:build_tied",
            "model.layers=blocks",
            "model.embedding=embed",
            "model.head=head",
        ],
        "model.target",
        "would put on different stages",
    ),
    (["parallel.pp_layers=[1,1]"], "parallel.pp_layers", "only applies to pipelines"),
    (["parallel.pp_layers=auto"], "parallel.pp_layers", "only applies to pipelines"),
    (["parallel=pp2", "parallel.pp_layers=even"], "parallel.pp_layers", "or auto"),
    (["parallel=pp2", "parallel.pp_layers=[a,b]"], "parallel.pp_layers", "each >= 1"),
    (["parallel.tp_plan=nowhere.plans:apply"], "parallel.tp_plan", "cannot be loaded"),
    (["parallel.tp_plan=tests.plans:missing"], "parallel.tp_plan", "module:function"),
    (["parallel=dataparallel"], "parallel", "needs >= 2 CUDA devices"),
    (["backend=nccl"], "backend", "nccl needs CUDA devices"),
    (["backend.timeout_s=0"], "backend.timeout_s", "must be positive"),
    (["hardware=a100-80g"], "hardware", "no CUDA device here"),
    (["model.n_heads=5"], "model.n_heads", "divisor of 384"),
    (["model.context_len=0"], "model.context_len", "must be positive"),
    (["model.n_kv_heads=4"], "model.n_kv_heads", "divisor of 6"),
    (["model=tiny", "model.n_kv_heads=3"], "model.n_kv_heads", "divisor of 8"),
    (["data=text", "data.path=/nonexistent/corpus.txt"], "data.path", "no such file"),
    (
        ["data=hf", "data.path=/nonexistent/corpus.jsonl", "data.tokenizer=/nonexistent"],
        "data.path",
        "no such file or directory",
    ),
    (["launcher.nnodes=2"], "launcher.nnodes", "one node"),
    (["launcher.nnodes=0"], "launcher.nnodes", "must be positive"),
    (["launcher.name=pbs"], "launcher.name", "local | slurm"),
    (
        ["launcher=slurm", "launcher.nnodes=2", "parallel=single"],
        "launcher.nnodes",
        "has 1 ranks, not a multiple of nnodes",
    ),
    (
        ["launcher=slurm", "launcher.nnodes=2", "launcher.nproc_per_node=2", "parallel=tp2"],
        "launcher.nproc_per_node",
        "needs 2 ranks (1 on each of 2 nodes)",
    ),
    (["launcher=slurm", "launcher.time_min=0"], "launcher.time_min", "must be positive"),
    (["launcher=slurm", "launcher.cpus_per_task=0"], "launcher.cpus_per_task", "positive"),
    (["launcher=slurm", "launcher.mem_gb=-4"], "launcher.mem_gb", "must be positive"),
    (["launcher=slurm", "launcher.gpus_per_node=-1"], "launcher.gpus_per_node", "negative"),
    (
        ["launcher=slurm", "+launcher.sbatch_extra.partition=gpu"],
        "launcher.sbatch_extra",
        "set by the launcher itself. Valid: launcher.partition",
    ),
    (
        ["launcher=slurm", "+launcher.sbatch_extra.Mail_Type=END"],
        "launcher.sbatch_extra",
        "not an sbatch flag name",
    ),
    (["debug.fail_rank=5"], "debug.fail_rank", "0..1"),
    (["debug.slow_step_s=-1"], "debug.slow_step_s", ">= 0"),
    (["checkpoint.every_steps=-2"], "checkpoint.every_steps", "must not be negative"),
    (["checkpoint.keep=0"], "checkpoint.keep", "at least the latest"),
    (["checkpoint.resume=/nonexistent/step-00000010"], "checkpoint.resume", "no such checkpoint"),
    (["checkpoint.resume=/nonexistent/run"], "checkpoint.resume", "holds no complete checkpoint"),
    (
        [
            "model=custom",
            "model.target=tests.user_model:build",
            "model.vocab_size=256",
            "checkpoint.export=hf",
        ],
        "checkpoint.export",
        "no Hugging Face form",
    ),
    (["model=tiny-moe", "checkpoint.export=hf"], "checkpoint.export", "MoE LLaMA has no"),
    # A disk without room: one checkpoint of GPT-3 (fp32 weights, AdamW's two moments) is 2 TB.
    (
        ["model=gpt3-175b", "plan.allow_oom=true", "checkpoint.every_steps=100"],
        "checkpoint.dir",
        "needs about 1957.83 GiB",
    ),
    # ... and so is checkpoint.every_steps=auto (issue 59)
    (
        ["model=gpt3-175b", "plan.allow_oom=true", "checkpoint.every_steps=auto"],
        "checkpoint.dir",
        "needs about 1957.83 GiB",
    ),
    (["checkpoint.every_steps=often"], "checkpoint.every_steps", "is no step count"),
    # The whole run's figures (plan/run_time.py): positive, or null for their defaults.
    (["plan.tokens=0"], "plan.tokens", "the run's token budget"),
    (["plan.tokens=-1e9"], "plan.tokens", "the run's token budget"),
    (["plan.price_per_gpu_hour=0"], "plan.price_per_gpu_hour", "what one device costs"),
    (["plan.mtbf_hours=-1"], "plan.mtbf_hours", "mean time between failures"),
    (["hardware.storage_gbs=0"], "hardware.storage_gbs", "writes its checkpoints at"),
    # Context parallelism: what its load balance, Ulysses and its reach need.
    (["parallel=cp2", "train.seq_len=66"], "train.seq_len", "not divisible by 2 x cp = 4"),
    (
        [
            "model=tiny",
            "parallel=tp2_cp2",
            "parallel.tp=4",
            "launcher.nproc_per_node=8",
            "train.seq_len=76",
        ],
        "train.seq_len",
        "a CP rank's 38 tokens are not divisible by tp (4)",
    ),
    (
        ["model=small", "parallel=cp2", "parallel.cp=4", "parallel.cp_method=alltoall"],
        "parallel.cp_method",
        "model.n_heads (6) / tp (1) = 6 is not divisible by cp (4)",
    ),
    (["parallel=dataparallel", "parallel.cp=2"], "parallel.data_parallel", "pp, ep, etp = 1"),
    (["parallel.checkpoint_every=0"], "parallel.checkpoint_every", "n (every n-th block"),
    (["parallel.checkpoint_every=2"], "parallel.checkpoint_every", "activation_checkpointing=full"),
    (
        ["model=small", "parallel.activation_checkpointing=full", "model.head_dim=17"],
        "model.head_dim",
        "an even head dim",
    ),
    (["model=tiny-moe", "model.moe.top_k=9"], "model.moe.top_k", "1 <= top_k <= 8"),
    (["model=tiny-moe", "model.moe.top_k=0"], "model.moe.top_k", "1 <= top_k <= 8"),
    (["model=tiny", "model.moe.experts=-2"], "model.moe.experts", "0 (dense)"),
    (["model=tiny-moe", "model.moe.capacity_factor=0"], "model.moe.capacity_factor", "> 0"),
    (["model=tiny-moe", "model.moe.expert_ffn_dim=0"], "model.moe.expert_ffn_dim", "> 0"),
    (["model=tiny-moe", "model.moe.aux_loss_coef=-1"], "model.moe.aux_loss_coef", ">= 0"),
    (["model=tiny-moe", "model.moe.shared_experts=-1"], "model.moe.shared_experts", "0 or more"),
    (
        ["model=tiny-moe", "model.pretrained=/somewhere"],
        "model.pretrained",
        "model.moe.experts=0",
    ),
    (
        ["model=tiny-moe", "model.moe.load_balance=bias", "model.moe.bias_update_rate=0"],
        "model.moe.bias_update_rate",
        "> 0",
    ),
    (["debug.profile_steps=[3]"], "debug.profile_steps", "[first, last]"),
    (["train.steps=5", "debug.profile_steps=[4,5]"], "debug.profile_steps", "(0..4)"),
    (["debug.profile_steps=[4,3]"], "debug.profile_steps", "or []"),
    (["debug.memory_snapshot=true"], "debug.memory_snapshot", "CUDA hardware profile"),
    (["parallel=ddp", "debug.slow_rank=2"], "debug.slow_rank", "0..1"),
    (["parallel=single", "debug.slow_rank=0"], "debug.slow_rank", "waits for nobody"),
    (["parallel=ddp", "debug.slow_factor=0.5"], "debug.slow_factor", ">= 1"),
    (["parallel=ddp", "debug.grad_error=1.5"], "debug.grad_error", "between -1 and 1"),
    (["metrics.straggler_threshold=1"], "metrics.straggler_threshold", "> 1"),
    (["train.guard.max_skipped=0"], "train.guard.max_skipped", ">= 1"),
    (["train.steps=5", "debug.corrupt_step=5"], "debug.corrupt_step", "0..4"),
    (["debug.corrupt_mode=inf"], "debug.corrupt_mode", "nan | spike"),
    (["train.steps=5", "debug.corrupt_step=[1,7]"], "debug.corrupt_step", "0..4"),
    (
        ["debug.corrupt_step=[1,2,3]", "debug.corrupt_mode=[nan,spike]"],
        "debug.corrupt_mode",
        "one for each",
    ),
    (["debug.corrupt_mode=[nan,inf]"], "debug.corrupt_mode", "nan | spike"),
    (
        ["parallel=tp2", "parallel.fault_tolerance=torchft"],
        "parallel.fault_tolerance",
        "parallel.dp_replicate >= 2",
    ),
    (
        ["parallel=ddp", "parallel.fault_tolerance=torchft", "debug.slow_rank=0"],
        "debug.slow_rank",
        "null with parallel.fault_tolerance=torchft",
    ),
    (["parallel.replica_restarts=-1"], "parallel.replica_restarts", ">= 0"),
    (
        [
            "launcher=slurm",
            "parallel=ddp",
            "parallel.fault_tolerance=torchft",
            "launcher.wait=false",
        ],
        "launcher.wait",
        "restarted by the driver",
    ),
    (
        [
            "launcher=slurm",
            "launcher.nnodes=3",
            "launcher.nproc_per_node=2",
            "parallel=hsdp",
            "parallel.dp_replicate=2",
            "parallel.dp_shard=3",
            "parallel.fault_tolerance=torchft",
        ],
        "launcher.nproc_per_node",
        "one SLURM job of 3 ranks",
    ),
    (["parallel.replica_restart_delay_s=-1"], "parallel.replica_restart_delay_s", ">= 0"),
    # issue 63: FSDP2's offload replaces no DDP; activation offload's hooks miss DataParallel's
    (["parallel=ddp", "parallel.fsdp.offload=cpu"], "parallel.fsdp.offload", "dp_shard >= 2"),
    (
        ["parallel=fsdp", "train.float8.enabled=true", "train.optimizer_states=8bit"],
        "train.optimizer_states",
        "train.float8.fsdp_all_gather=false",
    ),
    (
        ["train.compile=true", "parallel.activation_offload=cpu"],
        "parallel.activation_offload",
        "train.compile=false",
    ),
    (
        ["parallel=dataparallel", "parallel.activation_offload=cpu"],
        "parallel.activation_offload",
        "parallel=ddp",
    ),
    # issue 64's matrix: what the zero-bubble schedule's two backward passes, the experts'
    # own FSDP2 unit and 8-bit states under SP do not combine with
    (
        [
            "parallel=pp2_interleaved",
            "parallel.schedule=interleaved_zb",
            "parallel.activation_checkpointing=op",
        ],
        "parallel.activation_checkpointing",
        "full or none with parallel.schedule=interleaved_zb",
    ),
    (
        ["parallel=pp2_interleaved", "parallel.schedule=interleaved_zb", "train.compile=true"],
        "train.compile",
        "train.compile=false with parallel.schedule=interleaved_zb",
    ),
    (
        ["model=tiny-moe", "parallel=ep2", "parallel.activation_checkpointing=selective"],
        "parallel.activation_checkpointing",
        "full or none with parallel.ep > 1",
    ),
    (["train.guard.spike=true"], "train.guard.spike", "checkpoint.every_steps=N"),
    (
        ["train.guard.spike=true", "checkpoint.every_steps=5", "train.guard.spike_ratio=0.5"],
        "train.guard.spike_ratio",
        "> 1",
    ),
    (
        ["train.guard.spike=true", "checkpoint.every_steps=5", "train.guard.spike_window=4"],
        "train.guard.spike_window",
        ">= 8",
    ),
    (
        ["train.guard.spike=true", "checkpoint.every_steps=5", "train.guard.spike_sigma=0"],
        "train.guard.spike_sigma",
        "> 0",
    ),
    (
        ["train.guard.spike=true", "checkpoint.every_steps=5", "train.guard.skip_batches=-1"],
        "train.guard.skip_batches",
        ">= 0",
    ),
    (
        ["train.guard.spike=true", "checkpoint.every_steps=5", "train.guard.max_rollbacks=0"],
        "train.guard.max_rollbacks",
        ">= 1",
    ),
]


@pytest.mark.parametrize(("overrides", "key", "fragment"), BAD_CONFIGS, ids=str)
def test_bad_config_names_key_value_and_fix(overrides, key, fragment):
    cfg = compose_config(*overrides)
    with pytest.raises(ConfigError) as caught:
        resolve(cfg, HostFacts.detect())
    message = str(caught.value)
    assert caught.value.key == key
    assert message.startswith(f"{key}=")
    assert fragment in message
    assert "Valid:" in message


@pytest.mark.skipif(dist.is_mpi_available(), reason="this torch build has MPI")
def test_mpi_backend_without_mpi_build_is_refused():
    with pytest.raises(ConfigError, match="no MPI support"):
        resolve(compose_config("backend=mpi"), HostFacts.detect())


def test_slurm_without_a_slurm_client_is_refused(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("PATH", str(tmp_path))  # a host where sbatch does not exist
    with pytest.raises(ConfigError, match=r"launcher='slurm': no SLURM client on this host"):
        resolve(compose_config("launcher=slurm"), HostFacts.detect())


def test_torchft_without_torchft_installed_is_refused(monkeypatch):
    monkeypatch.setattr(fault_tolerance.importlib.util, "find_spec", lambda name: None)
    cfg = compose_config("parallel=ddp", "parallel.fault_tolerance=torchft")
    with pytest.raises(ConfigError, match=r"fault_tolerance='torchft': needs torchft, which is"):
        resolve(cfg, HostFacts.detect())


def test_8bit_optimizer_states_without_torchao_are_refused(monkeypatch):
    monkeypatch.setattr(optimizer.importlib.util, "find_spec", lambda name: None)
    cfg = compose_config("train.optimizer_states=8bit")
    with pytest.raises(ConfigError, match=r"optimizer_states='8bit': is torchao's AdamW8bit, an"):
        resolve(cfg, HostFacts.detect())


def test_torchft_under_torchrun_is_refused(monkeypatch):
    """torchrun starts the ranks itself: torchft's replica groups would never be."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = compose_config("parallel=ddp", "parallel.fault_tolerance=torchft")
    with pytest.raises(ConfigError, match=r"fault_tolerance='torchft': starts its replica"):
        resolve(cfg, HostFacts.detect())


def test_text_data_needs_byte_vocabulary(tmp_path: Path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world " * 100)
    cfg = compose_config("data=text", f"data.path={corpus}", "model.vocab_size=128")
    with pytest.raises(ConfigError, match=r"model.vocab_size=128: data=text uses byte tokens"):
        resolve(cfg, HostFacts.detect())


def test_text_heldout_part_must_hold_one_evaluation_when_the_run_evaluates(tmp_path: Path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world " * 100)  # 1200 bytes: 60 held out, one window of 33
    common = ("data=text", f"data.path={corpus}", "train.seq_len=32")
    resolve(compose_config(*common), HostFacts.detect())  # no evaluation: no such rule
    cfg = compose_config(*common, "train.eval.every_steps=5")
    with pytest.raises(ConfigError) as caught:
        resolve(cfg, HostFacts.detect())
    assert caught.value.key == "data.heldout_fraction"
    assert "holds out 1 windows of train.seq_len + 1 = 33 bytes (60 bytes)" in str(caught.value)
    assert "4 x 8 = 32" in str(caught.value)


def test_hf_heldout_split_without_a_window_is_fine_without_evaluation(hf_corpus, tmp_path):
    cfg = compose_config(
        *hf_corpus.overrides(),
        f"data.cache_dir={tmp_path}",
        "train.seq_len=128",
        "data.heldout_fraction=0.001",
    )
    assert resolve(cfg, HostFacts.detect()).config.resolved.data_cache is not None


BAD_HF_DATA = [
    # (overrides with {corpus paths}, key named in the error, fragment of the message)
    (["data.path={tmp}/corpus.csv"], "data.format", "cannot tell the format of 'corpus.csv'"),
    (["data.path={root}"], "data.path", "no save_to_disk dataset"),
    (["data.text_field=body"], "data.text_field", "no such column in the dataset. Valid: text"),
    (["data.tokenizer=/nonexistent/tokenizer.json"], "data.tokenizer", "no such file"),
    (["data.tokenizer={jsonl}"], "data.tokenizer", "is not a tokenizer"),
    (["model.vocab_size=256"], "model.vocab_size", "smaller than the tokenizer's vocabulary"),
    (["train.global_batch_size=4096"], "data.path", "one step needs train.global_batch_size"),
    (
        ["train.seq_len=128", "data.heldout_fraction=0.001", "train.eval.every_steps=5"],
        "data.heldout_fraction",
        "holds out 0 windows of train.seq_len + 1 = 129 tokens",
    ),
    (
        ["train.eval.every_steps=5", "train.eval.batches=1000"],
        "data.heldout_fraction",
        "one evaluation needs train.eval.batches x train.global_batch_size = 1000 x 8 = 8000",
    ),
    (["data.heldout_fraction=1"], "data.heldout_fraction", "[0, 1)"),
    (["data.num_workers=-1"], "data.num_workers", "must not be negative"),
]


@pytest.mark.parametrize(("overrides", "key", "fragment"), BAD_HF_DATA, ids=str)
def test_bad_hf_data_names_key_value_and_fix(hf_corpus, tmp_path, overrides, key, fragment):
    (tmp_path / "corpus.csv").write_text("text\nhello\n")
    paths = {"tmp": tmp_path, "root": hf_corpus.jsonl.parent, "jsonl": hf_corpus.jsonl}
    given = [o.format(**paths) for o in overrides]
    cfg = compose_config(*hf_corpus.overrides(), f"data.cache_dir={tmp_path}", *given)
    with pytest.raises(ConfigError) as caught:
        resolve(cfg, HostFacts.detect())
    assert caught.value.key == key
    assert fragment in str(caught.value)
    assert "Valid:" in str(caught.value)


def test_cli_config_error_exits_2_before_any_rank_starts(meshrun_here):
    run = meshrun_here("parallel=ddp", "train.global_batch_size=10")
    assert run.returncode == 2
    assert "train.global_batch_size=10" in run.output
    assert "Traceback" not in run.output
    assert not (run.run_dir / "metrics.jsonl").exists()
    assert not run.store_path.exists()


ENUM_CHOICES = [
    # (override, key, the valid values OmegaConf lists when composing)
    ("train.precision=fp8", "train.precision", "fp32 | bf16"),
    ("parallel.schedule=zb", "parallel.schedule", "gpipe | 1f1b | interleaved_1f1b"),
    (
        "parallel.activation_checkpointing=some",
        "parallel.activation_checkpointing",
        "none | full | selective",
    ),
    ("parallel.data_parallel=zero3", "parallel.data_parallel", "auto | dataparallel"),
    ("backend.name=ucc", "backend.name", "auto | gloo | nccl | mpi"),
    ("hardware.device_type=tpu", "hardware.device_type", "cpu | cuda"),
    ("metrics.scaling=linear", "metrics.scaling", "weak | strong"),
    ("logger.mode=sometimes", "logger.mode", "auto | online | offline | disabled"),
    ("debug.fail_mode=crash", "debug.fail_mode", "raise | hang"),
    ("launcher.start_method=thread", "launcher.start_method", "spawn | fork | forkserver"),
    ("train.lr_schedule.decay=cosin", "train.lr_schedule.decay", "constant | linear | cosine"),
    ("data.name=csv", "data.name", "synthetic | text | hf"),
    ("data.format=csv", "data.format", "json | parquet | text | disk"),
    ("model.moe.score=relu", "model.moe.score", "softmax | sigmoid"),
    ("model.moe.load_balance=loss", "model.moe.load_balance", "aux_loss | bias | none"),
]


@pytest.mark.parametrize(("override", "key", "valid"), ENUM_CHOICES, ids=str)
def test_closed_choice_is_rejected_at_compose_time_listing_the_valid_values(override, key, valid):
    with pytest.raises(ConfigError) as caught:
        compose_config(override)
    assert caught.value.key == key
    assert "Valid: " in str(caught.value)
    assert valid in str(caught.value)


def test_enum_values_behave_as_their_strings(tmp_path: Path):
    cfg = compose_config("parallel=pp2", "parallel.schedule=gpipe", "train.precision=bf16")
    schedule, precision = cfg.parallel.schedule, cfg.train.precision
    assert schedule == "gpipe" and f"{schedule}" == "gpipe" and str(precision) == "bf16"
    assert json.loads(json.dumps({"s": schedule})) == {"s": "gpipe"}
    db = sqlite3.connect(tmp_path / "enum.db")
    db.execute("create table t (schedule text)")
    db.execute("insert into t values (?)", (schedule,))
    assert db.execute("select schedule, typeof(schedule) from t").fetchone() == ("gpipe", "text")


def test_pipeline_schedules_are_exactly_the_schedule_enum():
    assert set(SCHEDULES) == set(Schedule) and set(Schedule.values()) == set(SCHEDULES)


@pytest.mark.parametrize(
    ("overrides", "key", "fragment"),
    [
        (["+train.micro_batchsize=2"], "train.micro_batchsize", "train.micro_batch_size (nearest)"),
        (["+hardware.flops=1"], "hardware.flops", "keys of hardware: name | device_type"),
        (["+foo=1"], "foo", "keys of the config: model | parallel"),
        # a misspelt group with a key below it: the key and value given, not None
        (["trian.steps=3"], "trian", "trian={'steps': '3'}: not a key of the config. Valid: train"),
        (
            ["hardware=cpu", "+hardware.devices.0.memory=1"],
            "hardware.devices[0].memory",
            "hardware.devices[0].memory_gib (nearest)",
        ),
        (
            ["launcher=local", "launcher.partition=gpu"],
            "launcher.partition",
            "not a key of launcher=local (launcher=slurm has it)",
        ),
        (["parallel=tp2pp2"], "parallel", "tp2_pp2 (nearest); parallel presets: auto"),
        (["train.steps=many"], "train.steps", "Valid: an integer"),
    ],
    ids=str,
)
def test_unknown_key_preset_or_type_is_a_config_error_with_the_nearest(overrides, key, fragment):
    """`+` or not: OmegaConf.to_object would silently drop a key the schema does not have."""
    with pytest.raises(ConfigError) as caught:
        compose_config(*overrides)
    assert caught.value.key == key
    assert fragment in str(caught.value)
    assert "use +" not in str(caught.value)


def test_open_dicts_take_any_key():
    cfg = compose_config("+backend.env.NCCL_DEBUG=INFO")
    assert cfg.backend.env == {"NCCL_DEBUG": "INFO"}
    cfg = compose_config("launcher=slurm", "+launcher.sbatch_extra.mail-type=END")
    assert cfg.launcher.sbatch_extra == {"mail-type": "END"}


def test_each_launcher_preset_has_its_own_schema_and_workers_rebuild_it():
    local = compose_config("launcher=local")
    slurm = compose_config("launcher=slurm", "launcher.partition=gpu")
    assert type(local.launcher) is LocalLauncherConfig and not hasattr(local.launcher, "partition")
    assert type(slurm.launcher) is SlurmLauncherConfig and slurm.launcher.partition == "gpu"
    for cfg in (local, slurm):
        assert from_dict(dataclasses.asdict(cfg)) == with_resolved(cfg)
    comm = CommRunConfig(
        backend=local.backend, hardware=local.hardware, launcher=slurm.launcher, logger=local.logger
    )
    assert comm_from_dict(dataclasses.asdict(comm)) == comm


# (command, overrides, what the one-line error must name: key, valid choices / nearest)
CLI_CONFIG_ERRORS = [
    (
        "meshrun",
        ["train.micro_batchsize=2"],
        [
            "train.micro_batchsize='2': not a key of train",
            "Valid: train.micro_batch_size (nearest)",
        ],
    ),
    (
        "meshrun",
        ["parallel=tp2pp2"],
        [
            "parallel='tp2pp2': no such preset",
            "Valid: tp2_pp2 (nearest); parallel presets: auto | ",
        ],
    ),
    (
        "meshrun",
        ["train.precision=bf61"],
        [
            "train.precision='bf61': unknown choice",
            "Valid: bf16 (nearest); choices: fp32 | bf16 | fp16",
        ],
    ),
    (
        "meshrun",
        ["launcher=local", "launcher.partition=gpu"],
        [
            "launcher.partition='gpu': not a key of launcher=local (launcher=slurm has it)",
            "keys of launcher: name | nnodes",
        ],
    ),
    ("meshrun", ["train.steps=many"], ["train.steps='many': wrong type", "Valid: an integer"]),
    # the switch of older meshruns is a choice now
    (
        "meshrun",
        ["metrics.baseline=false"],
        ["metrics.baseline='false': unknown choice", "choices: fresh | stored | off"],
    ),
    ("meshrun-plan", ["parallel=tp2pp2"], ["parallel='tp2pp2'", "Valid: tp2_pp2 (nearest)"]),
    # a multirun stops before its first job when any job's config is bad
    (
        "meshrun -m",
        ["train.steps=2,3", "+train.stepz=4"],
        ["train.stepz=4: not a key of train", "Valid: train.steps (nearest)"],
    ),
    # before the rules of the profile's 8-GPU box (ddp8's batch), which do not matter here
    pytest.param(
        "meshrun",
        ["hardware=a100-80g"],
        ["hardware='a100-80g': no CUDA device here"],
        marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host"),
    ),
]
COMMANDS = {
    "meshrun": (cli.main, False),
    "meshrun-plan": (plan_command.main, False),
    "meshrun -m": (cli.main, True),
}


def check_exit_2_before_anything_ran(run: CliRun, fragments: list[str], tmp_path: Path) -> None:
    assert run.returncode == 2, run.output
    assert "meshrun: config error " in run.output
    for fragment in fragments:
        assert fragment in run.output
    assert "Traceback" not in run.output
    assert "use +" not in run.output and "HYDRA_FULL_ERROR" not in run.output
    assert not (run.run_dir / "metrics.jsonl").exists()
    assert not (run.run_dir / "results.json").exists()
    assert not run.store_path.exists()
    assert not (tmp_path / "multirun").exists()


def test_console_script_exits_2_on_a_key_added_with_plus(meshrun, tmp_path: Path):
    """The issue's headline case through the real console script, in its own process."""
    fragments = [
        "train.micro_batchsize=2: not a key of train",
        "Valid: train.micro_batch_size (nearest)",
    ]
    check_exit_2_before_anything_ran(meshrun("+train.micro_batchsize=2"), fragments, tmp_path)


def test_the_console_scripts_start_without_importing_dtensor():
    """DTensor's import is a second of every start (and of every config error); only ranks
    that shard need it."""
    entrypoints = "meshrun.driver.cli, meshrun.tools.verify, meshrun.tools.plan.command"
    code = f"import sys, {entrypoints}; print('torch.distributed.tensor' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_no_console_script_makes_its_ranks_import_the_command():
    """multiprocessing starts a rank by running the driver's main module again as
    __mp_main__ (`_fixup_main_from_path`): each installed console script, run so, imports no
    command, no driver and no Hydra (meshrun/entrypoints.py)."""
    installed = {
        ep.name: ep.value
        for ep in importlib.metadata.entry_points(group="console_scripts")
        if ep.value.startswith("meshrun.")
    }
    assert installed == {s: f"meshrun.entrypoints:{s.replace('-', '_')}" for s in SCRIPT_COMMANDS}
    scripts = [str(Path(sys.executable).with_name(name)) for name in installed]
    code = (
        "import runpy, sys\n"
        f"for script in {scripts!r}:\n"
        "    runpy.run_path(script, run_name='__mp_main__')\n"
        "print(sorted(m for m in sys.modules if m.startswith(('meshrun.', 'hydra'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['meshrun.entrypoints']"


@pytest.mark.parametrize(("command", "overrides", "fragments"), CLI_CONFIG_ERRORS, ids=str)
def test_cli_composition_error_exits_2_in_meshrun_format_before_anything_runs(
    tmp_path: Path, monkeypatch, command, overrides, fragments
):
    monkeypatch.chdir(tmp_path)
    main, multirun = COMMANDS[command]
    run = run_console(
        main, tmp_path / "run", tmp_path / "meshrun.db", *overrides, multirun=multirun
    )
    check_exit_2_before_anything_ran(run, fragments, tmp_path)


USER_PLAN = """
import os
from pathlib import Path

from meshrun.rank.parallel.tensor import apply_tp


def plan(model, tp_mesh, sequence_parallel):
    driver = sorted(m for m in sys.modules if m.startswith(("meshrun.driver.cli", "hydra")))
    Path(f"plan_called_by_rank{os.environ['RANK']}").write_text(repr(driver))
    apply_tp(model, tp_mesh, sequence_parallel)
"""


@pytest.mark.slow
def test_tp_plan_module_in_the_working_directory_is_imported_by_driver_and_ranks(
    meshrun, tmp_path: Path
):
    """The console script itself, which keeps the working directory off sys.path. Its ranks
    import it again as their __main__ (multiprocessing does), and with it nothing of the
    driver (meshrun/entrypoints.py)."""
    (tmp_path / "my_tp_plan.py").write_text("import sys\n" + USER_PLAN)
    run = meshrun(
        "model=tiny",
        "parallel=tp2",
        "parallel.tp_plan=my_tp_plan:plan",
        "train.steps=2",
        "train.untimed_steps=1",
        "metrics.baseline=off",
        entrypoint=(str(Path(sys.executable).with_name("meshrun")),),
    )
    assert run.returncode == 0, run.output
    called = {p.name: p.read_text() for p in tmp_path.glob("plan_called_by_rank*")}
    assert called == {"plan_called_by_rank0": "[]", "plan_called_by_rank1": "[]"}


def _restated(data: dict, schema: type, parent: dict, prefix: str = "") -> list[str]:
    """Keys of a YAML mapping whose value is the schema's own default (`name` identifies a
    preset and may repeat it), unless they undo a value of the preset it builds on."""
    defaults = OmegaConf.to_container(OmegaConf.structured(schema), resolve=False)
    hints = typing.get_type_hints(schema)
    found = []
    for key, value in data.items():
        if key in ("defaults", "hydra", "name") or key not in defaults:
            continue
        if isinstance(value, dict) and dataclasses.is_dataclass(hints[key]):
            found += _restated(value, hints[key], parent.get(key) or {}, f"{prefix}{key}.")
        elif value == defaults[key] and parent.get(key, value) == value:
            found.append(f"{prefix}{key}")
    return found


def _parent(path: Path, data: dict) -> dict:
    """The preset of the same group this one builds on (`defaults: [a100-80g, _self_]`)."""
    for entry in data.get("defaults", []):
        sibling = path.parent / f"{entry}.yaml" if isinstance(entry, str) else None
        if sibling is not None and sibling.is_file():
            return yaml.safe_load(sibling.read_text()) or {}
    return {}


def test_yaml_presets_do_not_restate_the_schema_defaults():
    groups = {
        "backend": BackendConfig,
        "hardware": HardwareConfig,
        "logger": LoggerConfig,
        "data": DataConfig,
        "model": LlamaModelConfig,
        "model/hf": HFModelConfig,
        "parallel": ParallelConfig,
        **{f"launcher/{n}": s for n, s in LAUNCHER_SCHEMAS.items()},
    }
    files = {p: s for g, s in groups.items() for p in CONF_DIR.glob(f"{g}*.yaml")}
    files |= {p: s for g, s in groups.items() for p in CONF_DIR.glob(f"{g}/*.yaml")}
    files |= {
        CONF_DIR / f"{name}.yaml": ROOT_SCHEMAS[schema]
        for name, schema in [
            ("train", "experiment"),
            ("plan", "plan"),
            ("verify", "verify"),
            ("comm", "comm"),
            ("doctor", "doctor"),
        ]
    }
    loaded = {p: yaml.safe_load(p.read_text()) or {} for p in files}
    restated = {
        p.name: keys
        for p, s in files.items()
        if (keys := _restated(loaded[p], s, _parent(p, loaded[p])))
    }
    assert restated == {}


# Each module run as `python -m` does (runpy, as __main__) with --help, in one interpreter
# (the imports once: 7 interpreters took 29 s): its exit code and whether it printed.
_RUN_AS_MAIN = """
import contextlib, io, json, runpy, sys
said = {}
for module in sys.argv[1:]:
    sys.argv, out, code = [module, "--help"], io.StringIO(), 0
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as exit:
            code = exit.code or 0
    said[module] = [code, bool(out.getvalue().strip())]
print(json.dumps(said))
"""


@pytest.mark.slow
def test_every_console_script_runs_as_python_m_its_module():
    """A bare image runs the commands as `python -m <module>` (scripts/gpu-check.sh, with
    PYTHONPATH=src): each module must run its command, not import it and exit 0 in silence."""
    modules = sorted(set(SCRIPT_COMMANDS.values()))
    out = subprocess.run(
        [sys.executable, "-c", _RUN_AS_MAIN, *modules],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    said = json.loads(out.stdout.strip().splitlines()[-1])
    assert said == {module: [0, True] for module in modules}
