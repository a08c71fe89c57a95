"""`meshrun-plan calibrate` (issue 34, item 2): this host's rates measured with the plan's
ranks, written beside the store, and the plans and runs on this host that find it costed by
them (and saying so)."""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from benchmarks.speed_vs_published import cluster_config
from meshrun.core.calibration import (
    Calibration,
    calibration_path,
    read_calibration,
    write_calibration,
)
from meshrun.core.errors import ConfigError
from meshrun.core.hardware import HostFacts, fingerprint_key, host_fingerprint, rank_threads
from meshrun.core.layout import Layout
from meshrun.driver.resolve import resolve
from meshrun.plan.candidate import host_calibration
from meshrun.plan.collectives import Fabric
from meshrun.plan.placement import GroupSpan
from meshrun.plan.shapes import Dims
from meshrun.plan.speed import SpeedPrediction, predict_speed
from meshrun.plan.stage_time import formula_cost
from meshrun.tools.plan import main as plan_main
from meshrun.tools.plan.block_collectives import collectives_in
from meshrun.tools.plan.calibrate import Workload, _in_rank_processes
from meshrun.tools.plan.matmul_in_step import in_step_block, matmul_in_a_step
from meshrun.tools.plan.small_block import ops_per_layer, small_block
from meshrun.tools.plan.wrapper_overhead import (
    CHECKPOINTING,
    CONTEXT,
    MAX_EXPERTS,
    WRAPPERS,
    _few_experts,
    _stepper,
    wrapper_overheads,
)
from meshrun.validate import check_experiment
from tests.cli import run_console
from tests.helpers import compose_config, resolved_config

SMALL = ("model=small", "parallel=ddp")


def _calibration(**changes) -> Calibration:
    """A profile with round figures, for the speed model's arithmetic."""
    values = {
        "fingerprint_key": "x",
        "created_at": "2026-12-05T00:00:00+00:00",
        "device_type": "cpu",
        "ranks": 2,
        "threads_per_rank": 1,
        "precision": "fp32",
        "model": "small",
        "tokens": 256,
        "matmul_flops": 50e9,
        "attention_flops": 20e9,
        "memory_bw": 10e9,
        "op_seconds": 5e-6,
        "ops_per_layer": 200,
        "link_bw_gbs": 1.0,
        "link_latency_us": 500.0,
    }
    return Calibration(**(values | changes))


def test_a_calibrated_cpu_step_is_costed_by_the_measured_rates():
    cfg = resolved_config(*SMALL, "plan.calibration=none")
    base = predict_speed(cfg, calibration=_calibration())
    faster = predict_speed(cfg, calibration=_calibration(matmul_flops=100e9))
    busier = predict_speed(cfg, calibration=_calibration(op_seconds=10e-6))
    parts, m = base.step_parts(), cfg.train.global_batch_size // 2 // cfg.train.micro_batch_size
    assert parts["matmul"] == pytest.approx(2 * faster.step_parts()["matmul"])
    layers = cfg.model.n_layers
    assert parts["overhead"] == pytest.approx(m * layers * 200 * 5e-6)
    assert busier.step_parts()["overhead"] == pytest.approx(2 * parts["overhead"])
    slow_link = predict_speed(cfg, calibration=_calibration(link_bw_gbs=0.1))
    assert slow_link.breakdown["dp"] > base.breakdown["dp"]
    assert sum(parts.values()) == pytest.approx(base.step_time_s)


GPU = {
    "device_type": "cuda",
    "precision": "bf16",
    "matmul_flops": 500e12,
    "attention_flops": 300e12,
    "memory_bw": 2.5e12,
    "op_seconds": 8e-6,
    "ops_per_layer": 200,
    "link_bw_gbs": 300.0,
    "link_latency_us": 2.0,
}


def _h100_step(*overrides: str, **changes) -> SpeedPrediction:
    cfg = cluster_config("model=llama-1b", "hardware=h100-80g", *overrides, nodes=1, dp_shard=8)
    return predict_speed(cfg, calibration=_calibration(**(GPU | changes)))


def test_a_calibrated_gpu_is_costed_by_its_measured_rates_not_the_datasheets():
    """The matmul rate measured at the run's shapes (their waves of tiles in it), the
    measured attention and link; the H100 profile's figures give another step."""
    args = ("train.seq_len=2048", "train.global_batch_size=64", "train.micro_batch_size=8")
    measured = _h100_step(*args)
    parts = measured.step_parts()
    faster = _h100_step(*args, matmul_flops=1e15).step_parts()["matmul"]
    assert parts["matmul"] == pytest.approx(2 * faster, rel=1e-3)  # a few are memory-bound
    assert parts["attention"] == pytest.approx(
        2 * _h100_step(*args, attention_flops=600e12).step_parts()["attention"]
    )
    assert measured.breakdown["dp"] > _h100_step(*args, link_bw_gbs=600.0).breakdown["dp"]
    datasheet = predict_speed(
        cluster_config("model=llama-1b", "hardware=h100-80g", *args, nodes=1, dp_shard=8)
    )
    assert datasheet.step_parts()["matmul"] != pytest.approx(parts["matmul"], rel=0.05)


def test_a_gpus_dispatch_shows_only_where_it_outlasts_the_kernels():
    """The host issues a block's 200 ops (1.6 ms) ahead of the GPU: behind 8 x 2,048 tokens'
    kernels it is hidden; a micro-batch of 64 tokens waits for it, not for its sum with the
    kernels (a CPU host would: its dispatch and compute share the cores)."""
    busy = _h100_step(
        "train.seq_len=2048", "train.global_batch_size=64", "train.micro_batch_size=8"
    )
    assert busy.step_parts().get("overhead", 0.0) == 0.0
    idle = _h100_step("train.seq_len=64", "train.global_batch_size=8", "train.micro_batch_size=1")
    layers = compose_config("model=llama-1b").model.n_layers
    dispatch = layers * 200 * 8e-6  # one micro-batch a rank
    overhead = idle.step_parts()["overhead"]
    kernels = sum(idle.step_parts()[k] for k in ("matmul", "attention", "elementwise"))
    assert 0 < overhead < dispatch
    assert overhead == pytest.approx(dispatch - kernels, rel=1e-6)


@pytest.mark.parametrize(
    ("parallel", "wrappers"),
    [
        (("parallel=ddp",), 0.0),
        (("parallel=fsdp",), 3e-3),
        (("parallel=tp2",), 1e-3),
        (("parallel=tp2", "parallel.sequence_parallel=true"), 2e-3),
        (("parallel=fsdp2_tp2", "launcher.nproc_per_node=4"), 1e-3 + 3e-3),
        (("parallel=ddp", "parallel.activation_checkpointing=selective"), 5e-3),
        (("parallel=tp2", "parallel.activation_checkpointing=op"), 1e-3 + 6e-3),
        # every other block checkpointed: half of them pay it
        (
            (
                "parallel=ddp",
                "parallel.activation_checkpointing=full",
                "parallel.checkpoint_every=2",
            ),
            2e-3,
        ),
        (("parallel=cp2",), 3e-3 + 7e-3),  # FSDP2 over cp reduces its gradients
        (("parallel=fsdp2_cp2", "parallel.cp_method=alltoall"), 3e-3 + 9e-3),
    ],
    ids=[
        "ddp",
        "fsdp",
        "tp2",
        "tp2-sp",
        "fsdp2-tp2",
        "selective",
        "tp2-op",
        "full-every-2",
        "cp2-ring",
        "fsdp2-cp2-alltoall",
    ],
)
def test_a_calibrated_block_pays_the_measured_dispatch_of_its_layouts_wrappers(parallel, wrappers):
    """Each block, each micro-batch: its ops' dispatch, plus what DTensor costs under TP (more
    with SP) and FSDP2's hooks (here 1, 2 and 3 ms), a checkpointed block its policy's (4, 5
    and 6 ms for full, selective, op) and a CP block its method's (7, 8, 9 ms for ring,
    allgather, alltoall), as calibrate measured them."""
    cfg = resolved_config("model=small", *parallel, "plan.calibration=none")
    measured = {
        "tp_layer_overhead": 1e-3,
        "sp_layer_overhead": 2e-3,
        "fsdp_layer_overhead": 3e-3,
        "checkpoint_layer_overhead": {"full": 4e-3, "selective": 5e-3, "op": 6e-3},
        "context_layer_overhead": {"ring": 7e-3, "allgather": 8e-3, "alltoall": 9e-3},
    }
    calibration = _calibration(ranks=cfg.launcher.nproc_per_node, **measured)
    parts = predict_speed(cfg, calibration=calibration).step_parts()
    micro_batches = cfg.train.global_batch_size // cfg.train.micro_batch_size
    micro_batches //= Layout.of(cfg.parallel).dp_size
    expected = micro_batches * cfg.model.n_layers * (200 * 5e-6 + wrappers)
    assert parts["overhead"] == pytest.approx(expected, rel=1e-9)


def _wrappers_on_two_ranks(_) -> tuple[dict[str, float], dict[str, Counter]]:
    dist.init_process_group("gloo")
    model = small_block(None)
    mesh = init_device_mesh("cpu", (2,))
    per_layer = {}
    for wrapper in (*WRAPPERS, *CONTEXT):
        one, two = (collectives_in(_stepper(model, n, mesh, wrapper, None)) for n in (1, 2))
        per_layer[wrapper] = two - one
    # calibrate's own rounds: the fastest of 5, on a host busy with the other tests, measured
    # the ring's mode at 0 to 1.4 ms a block against 5 to 8 ms with 12
    return wrapper_overheads(model, None), per_layer


@pytest.mark.slow
def test_calibrate_measures_what_dtensor_and_fsdp2_cost_a_block_beyond_its_collectives(
    rank_pool,
):
    """On a mesh of the calibration's ranks (two here), where DTensor issues its collectives
    (on a mesh of one it issues none, and measured half of what a TP block costs the host):
    a block's collectives are counted as the layouts issue them, each once, so that their
    time alone comes off the measured cost, and what is left is the wrappers' own."""
    [(wrappers, per_layer), _] = rank_pool.run(_wrappers_on_two_ranks, None, world_size=2)
    tokens, dim = 16 * 64, 64  # SEQ tokens of small_block's width, one micro-batch
    kv = 16 * 64  # one of K and V: a rank's 16 tokens, 4 heads of 16
    block = 4 * dim * dim + 3 * dim * 128 + 2 * dim  # q k v o, gate up down, two norms
    assert per_layer == {
        # the attention's and the MLP's output forward, their shared input's gradient back
        "tp": Counter({("all_reduce", tokens): 4}),
        # each of those an all-gather of a sequence shard and a reduce-scatter
        "sp": Counter({("all_gather", tokens // 2): 4, ("reduce_scatter", tokens): 4}),
        # the block's parameters gathered forward and again backward, its gradients scattered
        "fsdp": Counter({("all_gather", block // 2): 2, ("reduce_scatter", block): 1}),
        # K and V (4 heads of 16) of the rank's 16 tokens: the ring passes them on once
        # forward, and backward once more with their gradients passed on after each of its
        # two steps; allgather gathers them and scatters their gradients; alltoall exchanges
        # q, k, v and the output forward, each again backward
        "ring": Counter({("shift", 2 * kv): 4}),
        "allgather": Counter({("all_gather", 2 * kv): 1, ("reduce_scatter", 2 * 2 * kv): 1}),
        "alltoall": Counter({("all_to_all", 3 * kv): 2, ("all_to_all", kv): 2}),
    }
    assert set(wrappers) == {*WRAPPERS, *CHECKPOINTING, *CONTEXT}
    assert wrappers["tp"] > 0 and wrappers["sp"] > 0
    assert wrappers["selective"] > 0  # its policy called for every op, forward and recompute
    assert wrappers["ring"] > 0  # its mode called for every op, its steps and merges


def test_a_calibrated_host_costs_each_collective_at_its_own_measured_bandwidth():
    """gloo's reduce-scatter and all-gather run well under its all-reduce's rate (measured
    here: 0.43 and 0.75 against 1.33 GB/s): FSDP2's reduce-scatters are costed at theirs,
    DDP's all-reduce at its own."""
    links = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5}
    slower = links | {"reduce_scatter": 0.25}

    def dp(parallel: str, by_op: dict[str, float]) -> float:
        cfg = resolved_config("model=small", parallel, "plan.calibration=none")
        run = predict_speed(cfg, calibration=_calibration(link_bw_by_op=by_op))
        return run.breakdown["dp"]

    cfg = resolved_config("model=small", "parallel=fsdp", "plan.calibration=none")
    micro_batches = cfg.train.global_batch_size // 2 // cfg.train.micro_batch_size
    grads = formula_cost(cfg, Layout.of(cfg.parallel)).rank_elements * 4
    extra = micro_batches * 0.5 * grads * (1 / 0.25e9 - 1 / 0.5e9)
    assert dp("parallel=fsdp", slower) - dp("parallel=fsdp", links) == pytest.approx(extra)
    assert dp("parallel=ddp", slower) == dp("parallel=ddp", links)


def test_a_collective_inside_the_node_takes_its_time_from_the_measured_curve_at_its_size():
    """gloo's all-reduce at a TP block's 384 KiB took 1.6 ms here, where 2 x the 4 KiB
    time a hop plus the 16 MiB bandwidth said 0.9: a calibrated in-node collective is timed
    by its bus bandwidth curve (log-log between sizes), a node-crossing one as before."""
    curve = [[4096.0, 0.01], [262144.0, 0.2], [16777216.0, 1.0]]  # bytes, GB/s
    cfg = resolved_config("model=small", "parallel=tp2", "plan.calibration=none")
    fabric = Fabric.of(cfg, _calibration(link_curves={"all_reduce": curve}))
    pair = GroupSpan(ranks_per_node=2, nodes=1)
    # measured sizes: 2(n-1)/n x bytes / busbw, here bytes / busbw
    assert fabric.all_reduce(pair, 262144) == pytest.approx(262144 / 0.2e9)
    # between: busbw interpolated in log-log (1 MiB: a third of the way from 256 KiB to 16 MiB)
    busbw = math.exp(math.log(0.2e9) + math.log(1.0 / 0.2) / 3)
    assert fabric.all_reduce(pair, 2**20) == pytest.approx(2**20 / busbw)
    assert fabric.all_reduce(pair, 1024) == pytest.approx(4096 / 0.01e9)  # the smallest's time
    assert fabric.all_reduce(pair, 2**26) == pytest.approx(2**26 / 1e9)  # the largest's rate
    # the other collectives, and a group across nodes, keep the latency-bandwidth model
    plain = Fabric.of(cfg, _calibration())
    assert fabric.all_gather(pair, 2**20) == plain.all_gather(pair, 2**20)
    across = GroupSpan(ranks_per_node=1, nodes=2)
    assert fabric.all_reduce(across, 2**20) == plain.all_reduce(across, 2**20)
    assert fabric.all_reduce(pair, 2**20) != plain.all_reduce(pair, 2**20)


def test_the_in_step_matmuls_run_in_one_block_of_the_runs_widths():
    """The rate a CPU step's matmuls reach is taken inside a block of the run's own widths
    (any model kind), unless that block's weights and gradients would not fit a rank."""
    small = in_step_block(Dims.of(compose_config("model=small").model))
    assert small is not None
    assert (small.dim, small.n_heads, small.ffn_dim, small.n_layers) == (384, 6, 1024, 1)
    hf = in_step_block(Dims.of(compose_config("model=hf/llama-3.1-8b").model))
    assert hf is not None
    assert (hf.dim, hf.n_heads, hf.n_kv_heads, hf.head_dim, hf.ffn_dim) == (
        4096,
        32,
        8,
        128,
        14336,
    )
    assert in_step_block(Dims.of(compose_config("model=gpt3-175b").model)) is None  # 14 GB


def test_matmuls_in_a_step_are_rated_by_their_counted_flops_over_their_time():
    block = dataclasses.replace(small_block(None), dim=64, n_heads=4, ffn_dim=128)
    rate = matmul_in_a_step(block, (2, 4, 16, 16))
    assert 1e6 < rate < 1e13


def test_calibrating_a_custom_module_names_the_key_and_a_preset_to_use(tmp_path):
    """A user's module declares no widths to time its matmuls at (it raised a TypeError
    from deep in the planner's shapes): exit 2 before any rank starts."""
    run = run_console(
        plan_main.main,
        tmp_path / "cal",
        None,
        "calibrate",
        "model=custom",
        "model.target=tests.user_model:build",
        "model.embedding=embed",
        f"store.path={tmp_path / 'meshrun.db'}",
        defaults=(),
    )
    assert run.returncode == 2, run.output
    assert "model" in run.output and "model=small" in run.output
    assert "Traceback" not in run.output
    assert not calibration_path(str(tmp_path / "meshrun.db")).exists()


def test_an_moe_block_is_measured_under_the_wrappers_with_a_few_experts():
    """Qwen3-30B-A3B's 128 experts, looped over on the CPU in 8 models x 14 rounds, took
    calibrate past 5 minutes; the wrappers' cost rides on the block's modules, not on how
    many experts it repeats. A dense block is measured as it is."""
    qwen = _few_experts(small_block(compose_config("model=qwen3-30b-a3b").model))
    assert (qwen.moe.experts, qwen.moe.top_k) == (MAX_EXPERTS, 2)
    dense = small_block(compose_config("model=small").model)
    assert _few_experts(dense) == dense


def test_the_op_count_is_a_blocks_forward_and_backward():
    small = compose_config("model=small").model
    count = ops_per_layer(small)
    assert 100 < count < 1000  # norms, projections, RoPE, attention, SwiGLU, residuals, x2
    moe = compose_config("model=tiny-moe").model
    assert ops_per_layer(moe) > count  # the router and the experts' loop


@pytest.mark.slow  # two rank processes and a meshrun-comm run: ~20 s of CI's 12 minutes
def test_calibrate_writes_a_profile_that_plans_on_this_host_use_and_name(tmp_path):
    store = tmp_path / "meshrun.db"
    run = run_console(
        plan_main.main,
        tmp_path / "cal",
        None,
        "calibrate",
        "model=small",
        f"store.path={store}",
        defaults=(),
    )
    assert run.returncode == 0, run.output
    profile = read_calibration(calibration_path(str(store)))
    assert profile is not None and profile.ranks == 2 and profile.device_type == "cpu"
    for rate in (profile.matmul_flops, profile.attention_flops, profile.memory_bw):
        assert 1e8 < rate < 1e13
    assert 1e-8 < profile.op_seconds < 1e-3
    assert profile.link_bw_gbs and profile.link_latency_us
    assert profile.matmul_alone_flops and profile.matmul_alone_flops != profile.matmul_flops
    assert set(profile.link_bw_by_op) == {"all_reduce", "all_gather", "reduce_scatter"}
    for op, curve in profile.link_curves.items():  # 4 KiB to 16 MiB, x4 apart
        assert [size for size, _ in curve] == [4096 * 4**k for k in range(7)], op
        assert curve[-1][1] == profile.link_bw_by_op[op]
    assert len(profile.shapes) == 3 * 7  # q k v o, gate up down: forward and two gradients
    assert "calibrated:" in run.output and str(calibration_path(str(store))) in run.output
    # checkpoints: the node's writes beside the store (no checkpoint.dir), a rank's staging
    assert profile.storage_dir == str(tmp_path.absolute())
    assert 0.001 < profile.storage_gbs < 100 and 0.01 < profile.staging_gbs < 1000
    assert not list(tmp_path.glob(".meshrun-calibrate-*"))  # its files gone

    cfg = resolved_config(*SMALL, f"store.path={store}")
    assert host_calibration(cfg) == profile
    other_ranks = resolved_config(*SMALL, f"store.path={store}", "launcher.nproc_per_node=4")
    assert host_calibration(other_ranks) is None  # measured with 2 ranks busy, not 4
    assert (
        host_calibration(
            dataclasses.replace(cfg, plan=dataclasses.replace(cfg.plan, calibration="none"))
        )
        is None
    )

    out = tmp_path / "plan.json"
    plan = run_console(
        plan_main.main,
        tmp_path / "plan",
        None,
        "model=small",
        f"store.path={store}",
        f"json={out}",
        defaults=(),
    )
    assert plan.returncode == 0, plan.output
    assert "speed on this host's calibration" in plan.output
    assert f"calibrated on {tmp_path.absolute()}" in plan.output  # the checkpoints' storage
    rows = json.loads(out.read_text())["layouts"]
    assert all(r["speed"]["step_parts"].get("overhead", 0) > 0 for r in rows if r["speed"])


@pytest.mark.timeout(120)
@pytest.mark.slow
def test_a_calibration_rank_that_dies_ends_the_calibration_with_the_reason():
    """No hang: the rank processes' barrier would wait for the dead one for ever."""
    broken = Workload(
        threads=1, device="cpu", dtype="no_such_dtype", linears=[], attention=(1,) * 4
    )
    with pytest.raises(RuntimeError, match="a calibration rank failed \\(exit code"):
        _in_rank_processes(broken, 2)


def test_a_calibration_path_that_names_no_file_is_refused(tmp_path):
    cfg = compose_config(*SMALL, f"plan.calibration={tmp_path}/missing.json")
    with pytest.raises(ConfigError) as caught:
        resolve(cfg, HostFacts.detect())
    assert caught.value.key == "plan.calibration"
    assert "no such file" in str(caught.value) and "meshrun-plan calibrate" in str(caught.value)


def test_a_calibration_of_other_devices_or_not_one_at_all_is_refused(tmp_path):
    """A profile named by path is used as it is: a CPU host's rates would cost an H100 plan."""
    cpu_profile = tmp_path / "cpu.json"
    write_calibration(_calibration(), cpu_profile)
    cfg = compose_config("model=llama-1b", "hardware=h100-80g", f"plan.calibration={cpu_profile}")
    with pytest.raises(ConfigError) as caught:
        check_experiment(cfg)
    assert caught.value.key == "plan.calibration"
    assert "measured on cpu devices; this run's hardware is cuda" in str(caught.value)
    (tmp_path / "notes.json").write_text("my notes")
    cfg = compose_config(*SMALL, f"plan.calibration={tmp_path / 'notes.json'}")
    with pytest.raises(ConfigError, match="is not a calibration profile"):
        check_experiment(cfg)


def test_a_plan_finds_the_profile_of_its_ranks_with_the_threads_a_run_would_give_them(tmp_path):
    """One rank on this host computes with all its cores (core/hardware.rank_threads), as
    `meshrun-plan calibrate` measured it: a plan's candidate, whose threads are not set yet,
    finds that profile (a GPU box with 16 cores and one rank a GPU likewise)."""
    store = tmp_path / "meshrun.db"
    threads = rank_threads(compose_config().launcher, 1, HostFacts.detect())
    here = fingerprint_key(host_fingerprint(threads))
    profile = _calibration(fingerprint_key=here, ranks=1, threads_per_rank=threads)
    write_calibration(profile, calibration_path(str(store)))
    cfg = compose_config("model=small", "parallel=single", f"store.path={store}")
    assert cfg.launcher.threads_per_rank is None
    assert host_calibration(cfg) == profile
