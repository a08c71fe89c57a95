"""`meshrun-comm`: nccl-tests' tables from real gloo ranks, busbw by nccl-tests' factors,
checked results, its records (comm.json, the store's comm_runs, W&B), backend sweeps, config
errors before any rank starts, and a rank that never enters a collective."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from meshrun.core.errors import ConfigError
from meshrun.core.hardware import HostFacts
from meshrun.core.run_files.positions import read_positions
from meshrun.driver.sinks.store import ResultsStore
from meshrun.driver.tool_config import CommConfig, CommRunConfig, comm_from_dict
from meshrun.tools.comm import main as comm_main
from meshrun.tools.comm.busbw import OPS, bus_factor, element_count, sizes
from meshrun.tools.comm.collectives import device_type, measurements, wrong_values
from meshrun.tools.comm.main import validate_comm
from tests.cli import CliRun, compose_command, run_console, run_meshrun
from tests.wandb_records import read_offline_run

COMM = (sys.executable, "-m", "meshrun.tools.comm")
SMALL = ("comm.max_bytes=65536", "comm.warmup_iters=2", "comm.iters=5")


@pytest.fixture
def comm(tmp_path: Path) -> Callable[..., CliRun]:
    counter = iter(range(1000))

    def run(*overrides: str, multirun: bool = False, **kwargs) -> CliRun:
        entrypoint = (*COMM, "-m") if multirun else COMM
        return run_meshrun(
            tmp_path / f"comm{next(counter)}",
            tmp_path / "meshrun.db",
            *overrides,
            entrypoint=entrypoint,
            defaults=("logger=none",),
            **kwargs,
        )

    return run


def report(run: CliRun) -> dict:
    return json.loads((run.run_dir / "comm.json").read_text())


def comm_rows(run: CliRun) -> list[dict]:
    return ResultsStore(run.store_path).runs("comm_runs")


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_bus_factors_are_nccl_tests(n):
    assert bus_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bus_factor(op, n) == pytest.approx((n - 1) / n)
    assert bus_factor("broadcast", n) == bus_factor("sendrecv", n) == 1.0


def test_sizes_and_counts_follow_nccl_tests_flags():
    assert sizes(1024, 65536, 4) == [1024, 4096, 16384, 65536]
    assert sizes(1000, 1000, 2) == [1000]
    assert element_count("all_reduce", 1000, 4, 3) == 250
    assert element_count("all_gather", 1000, 4, 3) == 249  # divisible by the ranks
    assert element_count("reduce_scatter", 4, 4, 2) == 0  # one element cannot be split


def test_one_rank_skips_point_to_point_only():
    plan = measurements(CommConfig(min_bytes=1024, max_bytes=4096), 1)
    assert {op for op, *_ in plan} == set(OPS) - {"sendrecv"}
    assert len(plan) == 2 * (len(OPS) - 1)


def test_only_nccl_measures_gpu_memory():
    assert device_type("nccl") == "cuda"
    assert device_type("gloo") == device_type("mpi") == "cpu"  # gloo on host memory, even on GPUs


def test_check_counts_every_wrong_value():
    expected = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert wrong_values(expected.clone(), expected) == 0
    assert wrong_values(torch.tensor([1.0, 2.5, 3.0, 0.0]), expected) == 2
    assert wrong_values(torch.tensor([1, 2, 3, 5], dtype=torch.int8), expected) == 1


@pytest.mark.slow
def test_gloo_two_ranks_prints_every_op_with_no_wrong_values(comm):
    run = comm(
        "backend=gloo",
        "launcher.nproc_per_node=2",
        "comm.dtypes=[float32,bfloat16]",
        "logger=wandb",
        "logger.mode=offline",
        *SMALL,
    )
    assert run.returncode == 0, run.output
    for op in OPS:
        assert f"# {op}\n" in run.output
    assert "# Avg bus bandwidth:" in run.output
    rep = report(run)
    assert rep["status"] == "completed" and rep["world_size"] == 2 and rep["wrong"] == 0
    assert {r["op"] for r in rep["rows"]} == set(OPS)
    assert {r["dtype"] for r in rep["rows"]} == {"float32", "bfloat16"}
    for r in rep["rows"]:  # busbw from the measured time by nccl-tests' factor
        seconds = r["time_us"] / 1e6
        assert r["algbw_gbs"] == pytest.approx(r["size_bytes"] / seconds / 1e9, rel=1e-9)
        assert r["busbw_gbs"] == pytest.approx(r["algbw_gbs"] * bus_factor(r["op"], 2), rel=1e-9)
        assert r["wrong"] == 0
        assert f"{r['busbw_gbs']:.3f}" in run.output
    [row] = comm_rows(run)
    assert row["run_id"] == rep["run_id"] and row["avg_busbw_gbs"] == rep["avg_busbw_gbs"]
    summary = read_offline_run(run.run_dir)["summary"]
    assert summary["backend"] == "gloo"
    assert summary["all_reduce/peak_busbw_gbs"] == pytest.approx(
        max(r["busbw_gbs"] for r in rep["rows"] if r["op"] == "all_reduce")
    )


def test_backend_sweep_records_one_run_per_backend(tmp_path, monkeypatch, rank_pool):
    """`meshrun-comm -m` in this process, its ranks on the pool."""
    monkeypatch.setattr(comm_main, "launch", rank_pool.launch)
    sweep = tmp_path / "sweep"
    run = run_console(
        comm_main.main,
        tmp_path / "comm",
        tmp_path / "meshrun.db",
        "backend=gloo,auto",
        f"hydra.sweep.dir={sweep}",
        "comm.ops=[all_reduce]",
        *SMALL,
        defaults=("logger=none",),
        multirun=True,
    )
    assert run.returncode == 0, run.output
    reports = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/comm.json"))]
    auto = "nccl" if torch.cuda.is_available() else "gloo"
    assert [r["backend"] for r in reports] == ["gloo", auto]
    assert len(comm_rows(run)) == 2


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"ops": ["all_reduce", "gossip"]}, "comm.ops='gossip': unknown choice"),
        ({"ops": []}, "comm.ops=[]: nothing to measure"),
        ({"dtypes": ["float8"]}, "comm.dtypes='float8': unknown choice"),
        ({"redop": "avg", "dtypes": ["int32"]}, "comm.redop='avg': avg needs floating-point"),
        ({"redop": "xor"}, "comm.redop='xor': unknown choice"),
        ({"min_bytes": 4096, "max_bytes": 1024}, "comm.max_bytes=1024: below comm.min_bytes"),
        ({"step_factor": 1}, "comm.step_factor=1: sizes would never grow"),
        ({"iters": 0}, "comm.iters=0: must be positive"),
        ({"warmup_iters": -1}, "comm.warmup_iters=-1: must not be negative"),
        ({"ops": ["all_gather"], "max_bytes": 4, "min_bytes": 4}, "comm.max_bytes=4: no size"),
    ],
)
def test_config_errors(override, message):
    cfg = _config(comm=override)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate_comm(cfg, HostFacts.detect())


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"debug": {"fail_rank": 2}}, "debug.fail_rank=2: no such rank in a run of 2"),
        ({"debug": {"fail_step": 99}}, "debug.fail_step=99: outside the 2 measurements"),
        ({"launcher": {"name": "ssh"}}, "launcher.name='ssh': unknown choice"),
        ({"launcher": {"nnodes": 2}}, "launcher.nnodes=2: launcher=local runs on one node"),
    ],
)
def test_launch_config_errors(override, message):
    cfg = _config(comm={"ops": ["all_reduce"], "min_bytes": 1024, "max_bytes": 4096}, **override)
    with pytest.raises(ConfigError, match=message):
        validate_comm(cfg, HostFacts.detect())


def comm_run(tmp_path: Path, monkeypatch, env: dict[str, str], *overrides: str) -> int:
    """`meshrun-comm <overrides>`'s exit code, its `run` in-process over the real launcher
    (the ranks inherit `env`)."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    store = f"store.path={tmp_path / 'meshrun.db'}"
    return comm_main.run(
        compose_command("comm", tmp_path / "comm", store, "logger=none", *overrides)
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a CPU-only host")
def test_nccl_without_cuda_is_a_config_error(tmp_path, monkeypatch, capsys):
    assert comm_run(tmp_path, monkeypatch, {}, "backend=nccl", *SMALL) == 2
    assert "backend='nccl': nccl needs CUDA devices" in capsys.readouterr().out
    assert not (tmp_path / "comm" / "comm.json").exists()
    assert not (tmp_path / "meshrun.db").exists()


def _config(comm: dict, **sections: dict) -> CommRunConfig:
    raw = {
        "backend": {"name": "gloo", "timeout_s": 30},
        "hardware": {"name": "cpu", "device_type": "cpu"},
        "launcher": {"name": "local", "nproc_per_node": 2},
        "logger": {"name": "none"},
        "comm": comm,
        **sections,
    }
    return comm_from_dict(raw)  # the launcher's schema by its name, as the ranks rebuild it


@pytest.mark.waits  # on the collective timeout
def test_rank_that_never_enters_a_collective_is_named(tmp_path, monkeypatch, marked_env, capsys):
    timeout = 5
    code = comm_run(
        tmp_path,
        monkeypatch,
        marked_env,
        "backend=gloo",
        f"backend.timeout_s={timeout}",
        "debug.fail_rank=1",
        "debug.fail_step=1",
        "debug.fail_mode=hang",
        *SMALL,
    )
    ended = time.time()
    assert code == 1
    rep = json.loads((tmp_path / "comm" / "comm.json").read_text())
    assert rep["status"] == "failed" and rep["failed_rank"] == 0
    assert "rank 0 waited in all_reduce of 4096 B float32 at step 1" in rep["error"]
    assert "rank 1 never entered it (was at step 1, outside any collective)" in rep["error"]
    assert "collective hang" in capsys.readouterr().out
    hang_started = read_positions(str(tmp_path / "comm"))[1].since
    assert ended - hang_started < timeout + 15


@pytest.mark.slow  # test_torchrun.py starts meshrun's ranks with torchrun in CI
def test_torchrun_ranks_run_the_same_benchmark(tmp_path):
    """Started by torchrun, every process is one rank; rank 0 reports once."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            "-m",
            "meshrun.tools.comm.main",
            "logger=none",
            f"store.path={tmp_path / 'meshrun.db'}",
            "comm.ops=[all_reduce,sendrecv]",
            *SMALL,
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [report_file] = (tmp_path / "outputs" / "torchrun").glob("*/comm.json")
    rep = json.loads(report_file.read_text())
    assert rep["world_size"] == 2 and rep["wrong"] == 0
    assert {r["op"] for r in rep["rows"]} == {"all_reduce", "sendrecv"}
    assert proc.stdout.count("# Avg bus bandwidth:") == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_nccl_one_rank_per_gpu(comm):
    run = comm("backend=nccl", *SMALL)
    assert run.returncode == 0, run.output
    rep = report(run)
    assert rep["device_type"] == "cuda" and rep["wrong"] == 0
    assert rep["world_size"] == torch.cuda.device_count()


def test_online_wandb_without_a_key_is_refused_before_any_rank(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    cfg = _config(comm={"ops": ["all_reduce"]}, logger={"name": "wandb", "mode": "online"})
    with pytest.raises(ConfigError, match=r"logger\.mode='online': W&B has no API key here"):
        validate_comm(cfg, HostFacts.detect())
