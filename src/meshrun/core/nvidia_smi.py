"""What the NVIDIA driver says through nvidia-smi, read without CUDA or torch.

torch sees the GPUs only through a CUDA build that this driver can run; nvidia-smi sees them
whatever torch is installed. So the installer (scripts/install-torch.sh, before anything but
the standard library is installed: this module imports nothing else) and meshrun itself ask
nvidia-smi what is there, and compare. The parsers are pure (text in, facts out), tested on
nvidia-smi's real output; `smi` and `read_driver` run it, with a timeout: a wedged driver makes
nvidia-smi hang, and absent nvidia-smi means no GPU.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

SMI_FIELDS = "index,pci.bus_id,name,memory.total,uuid"
TIMEOUT_S = 10.0
# The header's driver CUDA version: "CUDA Version: 12.4" until R580, "CUDA UMD Version: 13.3"
# from R610 on (docs.nvidia.com/deploy/nvidia-smi: "deprecated ... CUDA Version in favor of
# ... CUDA UMD Version").
CUDA_VERSION = re.compile(r"CUDA (?:UMD )?Version:\s*(\d+)\.(\d+)")


@dataclass(frozen=True)
class SmiGpu:
    """nvidia-smi's view of one GPU; `index` is its PCI-bus-order number."""

    index: int
    pci_bus_id: str
    name: str
    memory_mib: int
    uuid: str


@dataclass(frozen=True)
class DriverView:
    """The GPUs this process may use as nvidia-smi lists them (`CUDA_VISIBLE_DEVICES`
    applied), the highest CUDA version the driver runs, each GPU's compute capability (empty
    where this nvidia-smi cannot say), and whether any GPU is split into MIG instances (CUDA
    then sees instances, not GPUs)."""

    gpus: int
    names: tuple[str, ...]
    cuda: tuple[int, int] | None
    capabilities: tuple[tuple[int, int], ...] = ()
    mig: bool = False


def normalize_pci(bus_id: str) -> str:
    """'00000000:17:00.0' (nvidia-smi) and '0000:17:00.0' name one device: 4-digit domain."""
    domain, rest = bus_id.strip().lower().split(":", 1)
    return f"{int(domain, 16):04x}:{rest}"


def parse_smi(csv_text: str) -> list[SmiGpu]:
    """Lines of `nvidia-smi --query-gpu=SMI_FIELDS --format=csv,noheader,nounits`."""
    gpus = []
    for line in csv_text.strip().splitlines():
        index, bus, name, memory, uuid = (part.strip() for part in line.split(","))
        gpus.append(SmiGpu(int(index), normalize_pci(bus), name, int(float(memory)), uuid))
    return gpus


def uuid_key(text: str) -> str:
    """A GPU's UUID as both nvidia-smi ('GPU-8932f937-...') and torch ('8932f937-...') give it."""
    return text.lower().removeprefix("gpu-")


def visible_smi_indices(
    smi: list[SmiGpu], visible: str | None, order: str | None
) -> tuple[list[int] | None, list[str]]:
    """nvidia-smi numbers of cuda:0, cuda:1, ... under CUDA_VISIBLE_DEVICES, and notes on
    entries CUDA ignores. None when the numbers cannot be known without asking CUDA (indices
    under the fastest-first order)."""
    if visible is None:
        return ([g.index for g in smi] if order == "PCI_BUS_ID" else None), []
    chosen: list[int] = []
    notes: list[str] = []
    entries = [e.strip() for e in visible.split(",")] if visible.strip() else []
    for position, entry in enumerate(entries):
        if entry.isdigit():
            if order != "PCI_BUS_ID":
                return None, notes
            found = [g.index for g in smi if g.index == int(entry)]
        else:
            found = [g.index for g in smi if uuid_key(g.uuid).startswith(uuid_key(entry))]
        if len(found) != 1 or found[0] in chosen:
            ignored = ",".join(entries[position:])
            notes.append(
                f"CUDA_VISIBLE_DEVICES entry {entry!r} names no single unused device, so CUDA "
                f"ignores it and every entry after it ({ignored}): only "
                f"{len(chosen)} device(s) are visible"
            )
            break
        chosen.append(found[0])
    return chosen, notes


def visible_gpus(smi: list[SmiGpu], visible: str | None) -> list[SmiGpu]:
    """The GPUs CUDA_VISIBLE_DEVICES leaves this process (how many does not depend on the
    order CUDA numbers them in, so PCI order stands for it)."""
    indices, _ = visible_smi_indices(smi, visible, "PCI_BUS_ID")
    return [smi[i] for i in indices or []]


def cuda_version(header: str) -> tuple[int, int] | None:
    """The highest CUDA version the driver runs, from plain `nvidia-smi`'s header."""
    found = CUDA_VERSION.search(header)
    return (int(found[1]), int(found[2])) if found else None


def parse_capabilities(csv_text: str) -> tuple[tuple[int, int], ...]:
    """Lines of `nvidia-smi --query-gpu=compute_cap --format=csv,noheader` ('9.0')."""
    caps = []
    for line in csv_text.split():
        major, _, minor = line.strip().partition(".")
        if not (major.isdigit() and minor.isdigit()):
            return ()  # an older nvidia-smi without the field: unknown
        caps.append((int(major), int(minor)))
    return tuple(caps)


def has_mig(listing: str) -> bool:
    """Whether `nvidia-smi -L` lists MIG instances ('  MIG 1g.10gb  Device  0: (UUID: ...')."""
    return any(line.strip().startswith("MIG ") for line in listing.splitlines())


def smi(*args: str, timeout: float = TIMEOUT_S) -> str | None:
    """nvidia-smi's output, or None where it is absent, fails or hangs past `timeout`."""
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        proc = subprocess.run(
            ["nvidia-smi", *args], capture_output=True, text=True, timeout=timeout, check=False
        )
    except (subprocess.TimeoutExpired, OSError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def query_smi() -> tuple[list[SmiGpu], str | None]:
    """nvidia-smi's GPUs and the driver version ([] and None without nvidia-smi)."""
    gpus = smi(f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits")
    driver = smi("--query-gpu=driver_version", "--format=csv,noheader")
    return (parse_smi(gpus) if gpus else []), (driver.splitlines()[0].strip() if driver else None)


def read_driver(visible: str | None) -> DriverView | None:
    """What the driver offers a process with CUDA_VISIBLE_DEVICES=`visible`; None without
    nvidia-smi or where it lists no GPU for it (one call then, four otherwise)."""
    listed = smi(f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits")
    mine = visible_gpus(parse_smi(listed) if listed else [], visible)
    if not mine:
        return None
    caps = parse_capabilities(smi("--query-gpu=compute_cap", "--format=csv,noheader") or "")
    return DriverView(
        gpus=len(mine),
        names=tuple(g.name for g in mine),
        cuda=cuda_version(smi() or ""),
        capabilities=caps,
        mig=has_mig(smi("-L") or ""),
    )
