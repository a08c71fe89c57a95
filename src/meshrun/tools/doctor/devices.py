"""CUDA device numbers against nvidia-smi's, peer access and NVLink.

nvidia-smi numbers GPUs in PCI bus order. CUDA numbers the devices it sees: those listed in
CUDA_VISIBLE_DEVICES, renumbered from 0 in the listed order, where an index in that list
counts in CUDA's enumeration order: fastest device first unless CUDA_DEVICE_ORDER=PCI_BUS_ID.
On a mixed box cuda:0 is therefore often not nvidia-smi's GPU 0. The functions here are pure
(text and lists in, facts and sentences out) so the mapping logic is tested without a GPU;
`query_*` read the live system. nvidia-smi's own listing and CUDA_VISIBLE_DEVICES are read by
core/nvidia_smi.py, which the installer and meshrun's hardware detection share.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from meshrun.core import nvidia_smi
from meshrun.core.nvidia_smi import SmiGpu, normalize_pci, uuid_key

# nvidia-smi topo -m legend, worst to best for peer traffic.
LINK_KINDS = {
    "SYS": "across the CPU interconnect (QPI/UPI/Infinity Fabric): slowest",
    "NODE": "PCIe through host bridges within one NUMA node",
    "PHB": "PCIe through a host bridge (the CPU)",
    "PXB": "PCIe through several PCIe switches, not the CPU",
    "PIX": "PCIe through a single switch",
    "NV": "NVLink",
}


@dataclass(frozen=True)
class CudaGpu:
    """torch's view of one CUDA device (`index` is cuda:<index>)."""

    index: int
    name: str
    memory_gib: float
    uuid: str | None
    pci_bus_id: str | None


@dataclass(frozen=True)
class DeviceRow:
    cuda_index: int
    smi_index: int | None
    name: str
    pci_bus_id: str | None
    memory_gib: float


def match(cuda: list[CudaGpu], smi: list[SmiGpu]) -> list[DeviceRow]:
    """Each CUDA device with its nvidia-smi number, by UUID, else by PCI bus id."""
    rows = []
    for dev in cuda:
        found = [
            g
            for g in smi
            if (dev.uuid and uuid_key(g.uuid) == uuid_key(dev.uuid))
            or (dev.pci_bus_id and g.pci_bus_id == normalize_pci(dev.pci_bus_id))
        ]
        smi_index = found[0].index if found else None
        bus = dev.pci_bus_id or (found[0].pci_bus_id if found else None)
        rows.append(DeviceRow(dev.index, smi_index, dev.name, bus, dev.memory_gib))
    return rows


def explain(rows: list[DeviceRow], visible: str | None, order: str | None) -> list[str]:
    """Sentences on how cuda:N relates to nvidia-smi's GPU N, and on mixed device types."""
    notes = []
    moved = [r for r in rows if r.smi_index is not None and r.smi_index != r.cuda_index]
    if moved:
        pairs = ", ".join(f"cuda:{r.cuda_index} is nvidia-smi GPU {r.smi_index}" for r in moved)
        why = []
        if visible is not None:
            why.append(
                f"CUDA_VISIBLE_DEVICES={visible} renumbers the devices it lists from 0, in the "
                "listed order"
            )
        if order != "PCI_BUS_ID":
            why.append(
                f"CUDA_DEVICE_ORDER={order or 'unset'} numbers the fastest device first, not "
                "in PCI bus order as nvidia-smi does; set CUDA_DEVICE_ORDER=PCI_BUS_ID "
                "(meshrun sets it for its own processes when it is unset)"
            )
        notes.append(
            f"CUDA numbers differ from nvidia-smi's: {pairs}. "
            + ("; ".join(why) or "the order differs")
            + ". Tools that read NVML (nvidia-smi -i, DCGM) use nvidia-smi's numbers; torch "
            "and meshrun use cuda:N."
        )
    unmatched = [r.cuda_index for r in rows if r.smi_index is None]
    if unmatched:
        notes.append(
            f"cuda:{', cuda:'.join(map(str, unmatched))} matched no nvidia-smi GPU by UUID or "
            "PCI bus id (a MIG instance, or nvidia-smi sees another set of devices)"
        )
    kinds = Counter(r.name for r in rows)
    if len(kinds) > 1:
        mix = ", ".join(f"{count}x {name}" for name, count in kinds.items())
        notes.append(
            f"mixed device types ({mix}): a layout spread over both runs at the pace of the "
            "slowest; pick a hardware profile that lists them in this order, or restrict "
            "CUDA_VISIBLE_DEVICES to one kind"
        )
    return notes


def parse_topology(text: str) -> dict[tuple[int, int], str]:
    """GPU pairs -> link kind from `nvidia-smi topo -m` (NV<n>, PIX, PXB, PHB, NODE, SYS)."""
    lines = [line.split() for line in text.splitlines() if line.strip()]
    header = next((cells for cells in lines if cells and cells[0] == "GPU0"), None)
    if header is None:
        return {}
    gpus = [cell for cell in header if cell.startswith("GPU") and cell[3:].isdigit()]
    links = {}
    for cells in lines:
        if cells[0] not in gpus or cells == header:
            continue
        row = int(cells[0][3:])
        for col, kind in enumerate(cells[1 : len(gpus) + 1]):
            if col != row:
                links[(row, col)] = kind
    return links


def describe_link(kind: str) -> str:
    if kind.startswith("NV") and kind[2:].isdigit():
        return f"NVLink x{kind[2:]}"
    return f"{kind}: {LINK_KINDS.get(kind, 'unknown link')}"


def query_topology() -> dict[tuple[int, int], str]:
    text = nvidia_smi.smi("topo", "-m")
    return parse_topology(text) if text else {}


def query_cuda() -> list[CudaGpu]:
    import torch  # noqa: PLC0415 (the nvidia-smi side of the doctor works without torch)

    devices = []
    if not torch.cuda.is_available():
        return devices
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        bus = getattr(props, "pci_bus_id", None)
        pci = None
        if bus is not None:
            domain, device = getattr(props, "pci_domain_id", 0), getattr(props, "pci_device_id", 0)
            pci = f"{domain:04x}:{bus:02x}:{device:02x}.0"
        uuid = str(props.uuid) if getattr(props, "uuid", None) else None
        devices.append(CudaGpu(index, props.name, props.total_memory / 2**30, uuid, pci))
    return devices


def query_peer_access(count: int) -> dict[tuple[int, int], bool]:
    import torch  # noqa: PLC0415 (the nvidia-smi side of the doctor works without torch)

    return {
        (a, b): torch.cuda.can_device_access_peer(a, b)
        for a in range(count)
        for b in range(count)
        if a != b
    }
