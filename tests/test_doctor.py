"""`meshrun-doctor`: a clear report and exit 0 on this machine; a rank that never enters the
health check's collective becomes a named diagnosis with next steps, well before its grace period,
with no process left; the CUDA <-> nvidia-smi mapping logic on simulated boxes."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from meshrun.core.nvidia_smi import normalize_pci, parse_smi, visible_smi_indices
from meshrun.core.run_files.positions import read_positions
from meshrun.tools.doctor import main as doctor_main
from meshrun.tools.doctor.devices import CudaGpu, describe_link, explain, match, parse_topology
from tests.cli import CliRun, compose_command, run_console

# A mixed box as nvidia-smi lists it (PCI bus order): two A6000s around an A100.
SMI_CSV = """\
0, 00000000:17:00.0, NVIDIA RTX A6000, 49140, GPU-aaaa1111-0000-0000-0000-000000000000
1, 00000000:65:00.0, NVIDIA A100-SXM4-80GB, 81920, GPU-bbbb2222-0000-0000-0000-000000000000
2, 00000000:CA:00.0, NVIDIA RTX A6000, 49140, GPU-cccc3333-0000-0000-0000-000000000000
"""
SMI = parse_smi(SMI_CSV)


def cuda_view(smi_order: list[int]) -> list[CudaGpu]:
    """What torch would report if CUDA numbered nvidia-smi's GPUs in `smi_order`."""
    views = []
    for index, smi_index in enumerate(smi_order):
        gpu = SMI[smi_index]
        uuid = gpu.uuid.removeprefix("GPU-")
        views.append(CudaGpu(index, gpu.name, gpu.memory_mib / 1024, uuid, gpu.pci_bus_id))
    return views


@pytest.fixture
def doctor(tmp_path: Path) -> Callable[..., CliRun]:
    """The console script's `main` in this process (its health checks start their ranks in
    a process of their own, as from the shell)."""
    counter = iter(range(100))

    def run(*overrides: str) -> CliRun:
        return run_console(
            doctor_main.main, tmp_path / f"doctor{next(counter)}", None, *overrides, defaults=()
        )

    return run


def test_parse_smi_and_pci_ids():
    assert [g.index for g in SMI] == [0, 1, 2]
    assert SMI[2].pci_bus_id == "0000:ca:00.0"
    assert SMI[1].memory_mib == 81920
    assert normalize_pci("00000000:CA:00.0") == normalize_pci("0000:ca:00.0")


def test_visible_devices_renumber_in_listed_order():
    assert visible_smi_indices(SMI, "2,0", "PCI_BUS_ID") == ([2, 0], [])
    assert visible_smi_indices(SMI, None, "PCI_BUS_ID") == ([0, 1, 2], [])
    assert visible_smi_indices(SMI, "GPU-cccc,GPU-aaaa1111", None) == ([2, 0], [])
    assert visible_smi_indices(SMI, "", "PCI_BUS_ID") == ([], [])
    # indices count fastest-first unless PCI_BUS_ID: not knowable from nvidia-smi alone
    assert visible_smi_indices(SMI, "0,1", None)[0] is None


def test_invalid_visible_entry_hides_the_rest():
    indices, [note] = visible_smi_indices(SMI, "1,7,0", "PCI_BUS_ID")
    assert indices == [1]
    assert "entry '7'" in note and "ignores it and every entry after it (7,0)" in note


def test_mapping_under_visible_devices_is_explained():
    rows = match(cuda_view([2, 0]), SMI)
    assert [(r.cuda_index, r.smi_index) for r in rows] == [(0, 2), (1, 0)]
    [note] = explain(rows, "2,0", "PCI_BUS_ID")
    assert "cuda:0 is nvidia-smi GPU 2, cuda:1 is nvidia-smi GPU 0" in note
    assert "CUDA_VISIBLE_DEVICES=2,0 renumbers the devices it lists" in note


def test_fastest_first_on_a_mixed_box_is_explained():
    rows = match(cuda_view([1, 0, 2]), SMI)  # CUDA's default order: the A100 first
    notes = explain(rows, None, None)
    assert "cuda:0 is nvidia-smi GPU 1, cuda:1 is nvidia-smi GPU 0" in notes[0]
    assert "CUDA_DEVICE_ORDER=unset numbers the fastest device first" in notes[0]
    assert "mixed device types (1x NVIDIA A100-SXM4-80GB, 2x NVIDIA RTX A6000)" in notes[1]


def test_matching_order_needs_no_explanation():
    rows = match(cuda_view([0]), SMI[:1])
    assert explain(rows, None, "PCI_BUS_ID") == []


def test_match_by_pci_when_uuid_is_unknown():
    cuda = [CudaGpu(0, SMI[1].name, 80.0, None, "0000:65:00.0")]
    assert match(cuda, SMI)[0].smi_index == 1


def test_topology_links():
    topo = (
        "\tGPU0\tGPU1\tGPU2\tCPU Affinity\tNUMA Affinity\n"
        "GPU0\t X \tNV12\tSYS\t0-31\t0\n"
        "GPU1\tNV12\t X \tPHB\t0-31\t0\n"
        "GPU2\tSYS\tPHB\t X \t32-63\t1\n"
        "\nLegend:\n  X    = Self\n"
    )
    links = parse_topology(topo)
    assert links[(0, 1)] == links[(1, 0)] == "NV12"
    assert links[(1, 2)] == "PHB" and links[(0, 2)] == "SYS"
    assert describe_link("NV12") == "NVLink x12"
    assert describe_link("SYS").startswith("SYS: across the CPU interconnect")


@pytest.mark.slow
def test_doctor_on_this_machine_exits_zero_with_a_report(doctor):
    run = doctor()
    assert run.returncode == 0, run.output
    for section in ("versions", "host", "gloo available"):
        assert section in run.output
    assert "gloo: ok: 2 rank(s), all results correct" in run.output
    if torch.cuda.is_available():
        assert f"nccl: ok: {torch.cuda.device_count()} rank(s)" in run.output
    else:
        assert "devices: no GPU (CPU only)" in run.output
    report = json.loads((run.run_dir / "doctor.json").read_text())
    assert report["versions"]["torch"]
    assert report["health"][0]["backend"] == "gloo"
    assert all(h["ok"] for h in report["health"])


def doctor_run(tmp_path: Path, monkeypatch, env: dict[str, str], *overrides: str) -> int:
    """`meshrun-doctor <overrides>`'s exit code, its `run` in-process (the health checks start
    their ranks as from the console script, with `env` for them to inherit)."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return doctor_main.run(compose_command("doctor", tmp_path / "doctor", *overrides))


@pytest.mark.waits  # on doctor.timeout_s
def test_hung_health_check_is_diagnosed_within_timeout(tmp_path, monkeypatch, marked_env, capsys):
    timeout = 5
    code = doctor_run(
        tmp_path,
        monkeypatch,
        marked_env,
        f"doctor.timeout_s={timeout}",
        "doctor.grace_s=120",
        "doctor.backends=[gloo]",
        "debug.fail_rank=1",
        "debug.fail_mode=hang",
    )
    ended = time.time()
    output = capsys.readouterr().out
    assert code == 1
    assert "gloo: hang:" in output
    assert "rank 0 waited in all_reduce of 4096 B float32 at step 0" in output
    assert "rank 1 never entered it" in output
    assert "next: GLOO_SOCKET_IFNAME=" in output
    assert "gloo failed the health check" in output
    hang_started = read_positions(str(tmp_path / "doctor" / "health" / "gloo"))[1].since
    # diagnosed, ranks killed and reported well before the 120 s grace: 8-23 s after the hang
    # began on this 2-core box beside another test worker
    assert ended - hang_started < timeout + 40


@pytest.mark.waits  # on the check's hard limit
def test_check_past_its_hard_limit_is_killed_with_all_ranks(
    tmp_path, monkeypatch, marked_env, capsys
):
    code = doctor_run(
        tmp_path,
        monkeypatch,
        marked_env,
        "doctor.timeout_s=3",
        "doctor.grace_s=2",
        "doctor.backends=[gloo]",
        "debug.fail_rank=1",
        "debug.fail_mode=hang",
    )
    output = capsys.readouterr().out
    assert code == 1
    assert "gloo: hung: no result within 5 s" in output
    assert "all its processes were killed" in output


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("doctor.timeout_s=0", "doctor.timeout_s=0.0: must be positive"),
        ("doctor.backends=[smoke]", "doctor.backends='smoke': unknown choice"),
    ],
)
def test_config_errors(tmp_path, monkeypatch, capsys, override, message):
    assert doctor_run(tmp_path, monkeypatch, {}, override) == 2
    assert message in capsys.readouterr().out
    assert not (tmp_path / "doctor" / "doctor.json").exists()
