"""scripts/install-torch.sh on GPU boxes it has never seen: a stand-in nvidia-smi on PATH
(tests/nvidia_smi_stub.py: real drivers' headers) and torch as the image has it (none, the
real CPU build, a CUDA build standing in for one this host cannot load). The script runs for
real with MESHRUN_INSTALL_DRY_RUN=1, which prints what it would install; nothing is installed
(PIP_NO_INDEX too, so that a script that ignored it would fail rather than download)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from meshrun.core.nvidia_smi import DriverView, cuda_version
from meshrun.core.paths import REPO_ROOT
from meshrun.core.torch_build import NoBuild, choose, unseen
from tests.nvidia_smi_stub import (
    B200,
    H100,
    R515_CUDA_11_7,
    R550_CUDA_12_4,
    R570_CUDA_12_8,
    R580_CUDA_13_0,
    R610_CUDA_13_3,
    V100,
    Gpu,
    stub_nvidia_smi,
)

SCRIPT = REPO_ROOT / "scripts" / "install-torch.sh"
INDEX = "https://download.pytorch.org/whl"
P100 = Gpu("Tesla P100-PCIE-16GB", 16384, "6.0")


def driver(cuda: tuple[int, int] | None, *caps: tuple[int, int], gpus: int = 8) -> DriverView:
    return DriverView(gpus, ("GPU",) * gpus, cuda, caps or ((9, 0),) * gpus)


@pytest.mark.parametrize(
    ("header", "version"),
    [
        (R515_CUDA_11_7, (11, 7)),
        (R550_CUDA_12_4, (12, 4)),
        (R580_CUDA_13_0, (13, 0)),
        (R610_CUDA_13_3, (13, 3)),  # "CUDA UMD Version" from R610 on
        ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver", None),
    ],
)
def test_the_drivers_cuda_version_from_nvidia_smis_header(header, version):
    assert cuda_version(header) == version


@pytest.mark.parametrize(
    ("view", "machine", "args"),
    [
        (driver((13, 0)), "x86_64", ("torch>=2.11",)),  # PyPI's default: CUDA 13.0
        (driver((13, 0)), "aarch64", ("torch>=2.11", "--index-url", f"{INDEX}/cu130")),
        (driver((12, 4)), "x86_64", ("torch>=2.11", "--index-url", f"{INDEX}/cu126")),
        (driver((12, 8), (10, 0)), "x86_64", ("torch>=2.11", "--index-url", f"{INDEX}/cu128")),
        (driver((13, 0), (10, 0)), "x86_64", ("torch>=2.11",)),
        (driver((13, 0), (7, 0)), "x86_64", ("torch>=2.11", "--index-url", f"{INDEX}/cu126")),
    ],
    ids=["cuda13", "cuda13-arm", "cuda12.4", "blackwell-cuda12.8", "blackwell-13", "volta-13"],
)
def test_the_build_a_driver_runs(view, machine, args):
    assert choose(view, machine).args == args


@pytest.mark.parametrize(
    ("view", "reason"),
    [
        (driver((11, 7), (6, 0)), "needs CUDA 12 (driver 525+)"),
        (driver((12, 4), (10, 0)), "Blackwell GPUs need CUDA 12.8 (driver 570+)"),
        (driver(None), "no CUDA version"),
    ],
)
def test_no_build_for_an_old_driver_says_what_to_update(view, reason):
    with pytest.raises(NoBuild, match=re.escape(reason)):
        choose(view, "x86_64")


def test_what_is_wrong_where_torch_does_not_see_the_gpus():
    eight = driver((12, 4))
    assert unseen(eight, "2.13.0+cpu", None, 0) == (
        "nvidia-smi lists 8 GPUs, torch 2.13.0+cpu sees none: a CPU build"
    )
    too_old = unseen(eight, "2.13.0+cu130", "13.0", 0)
    assert "built for CUDA 13.0, and the driver runs CUDA up to 12.4" in too_old
    assert "CUDA 13 needs driver 580+" in too_old
    assert "sees 4" in unseen(eight, "2.13.0+cu130", "13.0", 4)
    assert unseen(eight, "2.13.0+cu126", "12.6", 8) is None
    mig = DriverView(2, ("A100",) * 2, (12, 4), ((8, 0),) * 2, mig=True)
    assert unseen(mig, "2.13.0+cu126", "12.6", 1) is None  # CUDA sees instances, not GPUs


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory) -> Path:
    """A python with nothing installed (not even pip): an image without torch."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    return venv / "bin" / "python"


def fake_torch(tmp_path: Path, version: str, cuda: str, sees: int) -> str:
    """A CUDA build of torch as this host cannot have one: the attributes the script reads."""
    package = tmp_path / "faketorch" / "torch"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "import types\n"
        f"__version__ = {version!r}\n"
        f"version = types.SimpleNamespace(cuda={cuda!r})\n"
        f"cuda = types.SimpleNamespace(is_available=lambda: {sees} > 0, "
        f"device_count=lambda: {sees})\n"
    )
    return str(package.parent)


def install(python: Path, bin_dir: Path | None, **env: str) -> subprocess.CompletedProcess:
    path = os.environ["PATH"] if bin_dir is None else f"{bin_dir}:{os.environ['PATH']}"
    given = {"PATH": path, "MESHRUN_INSTALL_DRY_RUN": "1", "PIP_NO_INDEX": "1", **env}
    clean = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    return subprocess.run(
        [SCRIPT, python],
        env={**clean, **given},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.parametrize(
    ("header", "gpus", "wanted"),
    [
        (R550_CUDA_12_4, [H100] * 8, f"torch>=2.11 --index-url {INDEX}/cu126"),
        (R570_CUDA_12_8, [B200] * 8, f"torch>=2.11 --index-url {INDEX}/cu128"),
        (R580_CUDA_13_0, [B200] * 8, "torch>=2.11"),
        (R610_CUDA_13_3, [B200] * 8, "torch>=2.11"),
        (R580_CUDA_13_0, [V100] * 4, f"torch>=2.11 --index-url {INDEX}/cu126"),
    ],
    ids=["h100-cuda12.4", "b200-cuda12.8", "b200-cuda13", "b200-r610", "v100-cuda13"],
)
def test_a_gpu_box_without_torch_gets_the_build_its_driver_runs(
    tmp_path, bare_python, header, gpus, wanted
):
    if os.uname().machine != "x86_64" and wanted == "torch>=2.11":
        wanted = f"torch>=2.11 --index-url {INDEX}/cu130"
    run = install(bare_python, stub_nvidia_smi(tmp_path / "bin", header, gpus))
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [f"would install: {wanted}"]


def test_a_driver_too_old_for_any_build_fails_saying_so(tmp_path, bare_python):
    run = install(bare_python, stub_nvidia_smi(tmp_path / "bin", R515_CUDA_11_7, [P100] * 4))
    assert run.returncode == 1
    assert "the driver runs CUDA up to 11.7; torch>=2.11 needs CUDA 12 (driver 525+)" in run.stderr
    assert "would install" not in run.stdout


def test_a_cpu_torch_on_a_gpu_box_is_replaced_and_said_so(tmp_path):
    """make install's own venv (torch 2.13.0+cpu) on an 8 x H100 box with driver 550."""
    run = install(
        Path(sys.executable), stub_nvidia_smi(tmp_path / "bin", R550_CUDA_12_4, [H100] * 8)
    )
    assert run.returncode == 0, run.stderr
    assert "is a CPU build and nvidia-smi lists 8 GPUs: replacing it with" in run.stderr
    assert run.stdout.splitlines() == [f"would install: torch>=2.11 --index-url {INDEX}/cu126"]


def test_a_cuda_torch_that_sees_the_gpus_is_kept(tmp_path, bare_python):
    bin_dir = stub_nvidia_smi(tmp_path / "bin", R580_CUDA_13_0, [H100] * 8)
    run = install(bare_python, bin_dir, PYTHONPATH=fake_torch(tmp_path, "2.13.0", "13.0", 8))
    assert run.returncode == 0, run.stderr
    assert "torch 2.13.0 (CUDA 13.0) already installed: kept" in run.stderr
    assert "torch 2.13.0 sees the 8 GPU(s) nvidia-smi lists" in run.stderr
    assert "would install" not in run.stdout


def test_a_cuda_torch_the_driver_cannot_run_fails_naming_the_spec_to_set(tmp_path, bare_python):
    """An image's torch for CUDA 13 on a driver that runs CUDA 12.4: kept (it satisfies the
    floor), then the check finds it sees no GPU and says what to set."""
    bin_dir = stub_nvidia_smi(tmp_path / "bin", R550_CUDA_12_4, [H100] * 8)
    run = install(bare_python, bin_dir, PYTHONPATH=fake_torch(tmp_path, "2.13.0+cu130", "13.0", 0))
    assert run.returncode == 1
    assert (
        "nvidia-smi lists 8 GPUs, torch 2.13.0+cu130 sees none: it is built for CUDA 13.0, and "
        "the driver runs CUDA up to 12.4 (CUDA 13 needs driver 580+)"
    ) in run.stderr
    assert f"MESHRUN_TORCH_SPEC='torch>=2.11 --index-url {INDEX}/cu126' make install" in run.stderr


def test_the_check_counts_the_gpus_cuda_visible_devices_leaves(tmp_path, bare_python):
    bin_dir = stub_nvidia_smi(tmp_path / "bin", R580_CUDA_13_0, [H100] * 8)
    sees_four = fake_torch(tmp_path, "2.13.0+cu130", "13.0", 4)
    run = install(bare_python, bin_dir, PYTHONPATH=sees_four)
    assert run.returncode == 1
    assert "nvidia-smi lists 8 GPUs, torch 2.13.0+cu130 sees 4" in run.stderr
    run = install(bare_python, bin_dir, PYTHONPATH=sees_four, CUDA_VISIBLE_DEVICES="0,1,2,3")
    assert run.returncode == 0, run.stderr


def test_meshrun_torch_spec_is_installed_over_the_torch_there(tmp_path, bare_python):
    bin_dir = stub_nvidia_smi(tmp_path / "bin", R550_CUDA_12_4, [H100] * 8)
    spec = f"torch==2.13.0+cu126 --index-url {INDEX}/cu126"
    run = install(
        bare_python,
        bin_dir,
        PYTHONPATH=fake_torch(tmp_path, "2.13.0+cu130", "13.0", 0),
        MESHRUN_TORCH_SPEC=spec,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [f"would install: {spec}"]


def test_without_nvidia_smi_the_cpu_wheel(bare_python):
    run = install(bare_python, None)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0] == "would install: torch==2.13.0+cpu"
