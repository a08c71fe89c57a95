"""`meshrun-doctor`: what this host has for distributed training, and whether each backend
works, in one command.

Reports versions (torch, CUDA, NCCL, driver; gloo/NCCL/MPI support), the host (cores, memory,
container, /dev/shm, network interfaces, relevant env), the devices (CUDA index against
nvidia-smi's number and PCI bus id, memory, mixed types, peer access, NVLink), then runs a
short health check of each backend under a hard time limit (`health.py`). Exit 0 when every
check passed, 1 when one failed or hung (with next steps), 2 on a config error.

Unlike meshrun's other commands, the doctor leaves CUDA_DEVICE_ORDER as the user has it, so
cuda:N below is what a plain torch program in this environment calls cuda:N.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from rich.table import Table
from rich.text import Text

from meshrun.core import nvidia_smi
from meshrun.core.errors import ConfigError, choice, positive
from meshrun.core.hardware import HostFacts
from meshrun.driver.command import hydra_command
from meshrun.driver.sinks.console import console, print_error
from meshrun.driver.tool_config import DoctorRunConfig
from meshrun.tools.doctor import devices
from meshrun.tools.doctor.health import Health, check

REPORT_FILE = "doctor.json"
ENV_PREFIXES = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "NCCL_",
    "TORCH_NCCL_",
    "GLOO_",
    "TORCH_DISTRIBUTED_",
    "MASTER_ADDR",
    "MASTER_PORT",
)
BACKENDS = ("gloo", "nccl")


def versions(driver: str | None) -> dict[str, Any]:
    nccl = None
    if torch.cuda.is_available() and dist.is_nccl_available():
        found = torch.cuda.nccl.version()  # a tuple in current torch, an int in old ones
        nccl = ".".join(map(str, found)) if isinstance(found, tuple) else str(found)
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda (torch build)": torch.version.cuda,
        "nvidia driver": driver,
        "nccl": nccl,
        "gloo available": dist.is_gloo_available(),
        "nccl available": dist.is_nccl_available(),
        "mpi available": dist.is_mpi_available(),
    }


def _shm_gib() -> float | None:
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return None
    return stat.f_frsize * stat.f_blocks / 2**30


def _interfaces() -> list[str]:
    net = Path("/sys/class/net")
    return sorted(p.name for p in net.iterdir() if p.name != "lo") if net.exists() else []


def host(facts: HostFacts) -> dict[str, Any]:
    shm = _shm_gib()
    return {
        "cpu cores (usable)": facts.cpu_count,
        "memory (GiB)": round(facts.memory_gib, 1),
        "in a container": Path("/.dockerenv").exists() or Path("/run/.containerenv").exists(),
        "/dev/shm (GiB)": None if shm is None else round(shm, 1),
        "network interfaces": ", ".join(_interfaces()),
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}
        | {"CUDA_DEVICE_ORDER": os.environ.get("CUDA_DEVICE_ORDER", "unset (fastest first)")},
    }


def device_report() -> dict[str, Any]:
    smi, driver = nvidia_smi.query_smi()
    cuda = devices.query_cuda()
    visible, order = os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("CUDA_DEVICE_ORDER")
    predicted, notes = nvidia_smi.visible_smi_indices(smi, visible, order)
    rows = devices.match(cuda, smi)
    notes += devices.explain(rows, visible, order)
    if smi and not cuda:
        would = f"; CUDA would see nvidia-smi GPU(s) {predicted}" if predicted is not None else ""
        notes.append(
            f"nvidia-smi sees {len(smi)} GPU(s) but torch sees none (torch's CUDA build: "
            f"{torch.version.cuda}, CUDA_VISIBLE_DEVICES={visible!r}){would}"
        )
    peers = devices.query_peer_access(len(cuda)) if cuda else {}
    links = devices.query_topology() if len(smi) > 1 else {}
    return {
        "driver": driver,
        "cuda": [asdict(r) for r in rows],
        "nvidia_smi": [asdict(g) for g in smi],
        "notes": notes,
        "peer_access": {f"{a}->{b}": ok for (a, b), ok in peers.items()},
        "links": {f"GPU{a}-GPU{b}": devices.describe_link(k) for (a, b), k in links.items()},
    }


def _section(title: str, rows: list[tuple[str, Any]]) -> None:
    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for key, value in rows:
        table.add_row(key, Text("n/a" if value is None else str(value)))
    console.print(table)


def _print_devices(report: dict[str, Any]) -> None:
    if not report["cuda"] and not report["nvidia_smi"]:
        console.print("devices: no GPU (CPU only): gloo is the backend here", highlight=False)
        return
    rows = [
        (
            f"cuda:{d['cuda_index']}",
            f"nvidia-smi GPU {d['smi_index']}, {d['name']}, PCI {d['pci_bus_id']}, "
            f"{d['memory_gib']:.1f} GiB",
        )
        for d in report["cuda"]
    ]
    rows += [(f"peer {pair}", "yes" if ok else "NO") for pair, ok in report["peer_access"].items()]
    rows += [(f"link {pair}", kind) for pair, kind in report["links"].items()]
    _section("devices", rows)


def _print_health(results: list[Health]) -> None:
    for h in results:
        style = "bold green" if h.ok else "bold red"
        line = Text(f"{h.backend}: ", style=style) + Text(f"{h.verdict} ({h.seconds:.1f} s)")
        if h.peak_busbw_gbs is not None:
            line += Text(f", peak busbw {h.peak_busbw_gbs:.3f} GB/s")
        console.print(line, soft_wrap=True)
        for step in h.next_steps:
            console.print(f"    next: {step}", soft_wrap=True, highlight=False)


def _validate(cfg: DoctorRunConfig) -> None:
    positive("doctor.timeout_s", cfg.doctor.timeout_s)
    positive("doctor.grace_s", cfg.doctor.grace_s)
    for backend in cfg.doctor.backends:
        choice("doctor.backends", backend, BACKENDS)


def _backends(cfg: DoctorRunConfig, cuda_devices: int) -> list[str]:
    if cfg.doctor.backends:
        return list(cfg.doctor.backends)
    available = ["gloo"] if dist.is_gloo_available() else []
    if dist.is_nccl_available() and cuda_devices:
        available.append("nccl")
    return available


def run(dict_cfg: DictConfig) -> int:
    cfg: DoctorRunConfig = OmegaConf.to_object(dict_cfg)
    try:
        _validate(cfg)
    except ConfigError as err:
        print_error("config error", str(err))
        return 2
    facts = HostFacts.detect()
    device_info = device_report()
    report: dict[str, Any] = {
        "versions": versions(device_info["driver"]),
        "host": host(facts),
        "devices": device_info,
    }
    _section("versions", list(report["versions"].items()))
    host_rows = [(k, v) for k, v in report["host"].items() if k != "env"]
    _section("host", host_rows + list(report["host"]["env"].items()))
    _print_devices(device_info)
    for note in device_info["notes"]:
        console.print(Text("note: ", style="bold yellow") + Text(note), soft_wrap=True)
    if dist.is_mpi_available():
        console.print("mpi: available; it needs an mpirun launch, so it is not checked here")
    results = []
    for backend in _backends(cfg, len(facts.cuda_devices)):
        run_dir = Path(cfg.run_dir) / "health" / backend
        console.print(f"checking {backend} (timeout {cfg.doctor.timeout_s:g} s) ...")
        results.append(
            check(
                backend,
                run_dir,
                cfg.doctor,
                cfg.debug,
                _interfaces(),
                report["host"]["/dev/shm (GiB)"],
            )
        )
        _print_health(results[-1:])
    report["health"] = [asdict(h) for h in results]
    (Path(cfg.run_dir) / REPORT_FILE).write_text(json.dumps(report, indent=2))
    failed = [h.backend for h in results if not h.ok]
    if failed:
        print_error("doctor", f"{', '.join(failed)} failed the health check; next steps above")
        return 1
    console.print(Text("meshrun-doctor: all checks passed", style="bold green"))
    return 0


main = hydra_command("doctor", run)


if __name__ == "__main__":
    main()
