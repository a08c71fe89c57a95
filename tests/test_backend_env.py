"""What a rank sets in its environment for its backend before its process group exists
(rank/flight_recorder.rank_env): torch's flight recorder on for every backend, and on NCCL
its dump when a collective times out, into the run's folder, as docs/failures.md says,
whether the run named nccl or backend=auto chose it. NCCL itself needs a GPU; the
environment it reads is decided here, from the resolved config of a two-GPU host."""

from __future__ import annotations

import pytest

from meshrun.core.config import RunConfig
from meshrun.core.hardware import CudaDevice, HostFacts
from meshrun.core.run_files.flight_records import dumps_dir
from meshrun.driver.resolve import resolve
from meshrun.rank.flight_recorder import enable, rank_env
from tests.helpers import compose_config

H100 = CudaDevice("NVIDIA H100 80GB HBM3", 79.11)
TWO_GPUS = HostFacts([H100, H100], cpu_count=16, memory_gib=128.0)


def _resolved(tmp_path, *overrides: str) -> RunConfig:
    return resolve(compose_config(f"run_dir={tmp_path}", *overrides), TWO_GPUS).config


@pytest.mark.parametrize("backend", ["nccl", "auto"])
def test_nccl_dumps_its_flight_recorder_into_the_run_dir_on_a_timeout(tmp_path, backend):
    cfg = _resolved(tmp_path, f"backend={backend}")
    env = rank_env(cfg.backend, cfg.run_dir, {})
    prefix = str(dumps_dir(str(tmp_path)) / "nccl_rank")
    assert env == {
        "TORCH_FR_BUFFER_SIZE": "2000",
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_ENABLE_MONITORING": "1",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
    }


def test_gloo_records_its_collectives_and_sets_nothing_of_nccls(tmp_path):
    cfg = _resolved(tmp_path, "backend=gloo")
    assert rank_env(cfg.backend, cfg.run_dir, {}) == {"TORCH_FR_BUFFER_SIZE": "2000"}


def test_backend_env_goes_over_meshruns_and_the_users_environment_over_both(tmp_path):
    cfg = _resolved(
        tmp_path,
        "backend=nccl",
        "+backend.env.TORCH_NCCL_DEBUG_INFO_TEMP_FILE=/scratch/trace_",
        "+backend.env.NCCL_DEBUG=INFO",
    )
    exported = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0", "NCCL_DEBUG": "WARN"}
    env = rank_env(cfg.backend, cfg.run_dir, exported)
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/scratch/trace_"
    # torch would read meshrun's TORCH_FR_DUMP_TEMP_FILE first: none set beside the user's
    assert "TORCH_FR_DUMP_TEMP_FILE" not in env
    assert not set(exported) & set(env)


def test_the_folder_nccl_dumps_into_exists_before_its_process_group(tmp_path):
    """torch opens `<prefix><rank>` without making its folder."""
    enable("nccl", str(tmp_path / "nccl"))
    enable("gloo", str(tmp_path / "gloo"))
    assert dumps_dir(str(tmp_path / "nccl")).is_dir()
    assert not dumps_dir(str(tmp_path / "gloo")).exists()
