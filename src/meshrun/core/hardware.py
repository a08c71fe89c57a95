"""What this host has, and which hardware profile (conf/hardware) describes it.

Detection matches torch's device names in PCI bus order (CUDA_DEVICE_ORDER=PCI_BUS_ID, the
order nvidia-smi shows) against each profile's `match` patterns, each the whole model name
(an H100 PCIe is not the SXM part, a GH200 not an H200): where two profiles' names match, the
one whose memory is closest to the device's. A device no profile knows gets a profile
without peak FLOP/s and torch's figure for its memory, so MFU is reported as unknown rather
than another device's. Where nvidia-smi lists GPUs that torch cannot see (a CPU build of
torch, a driver too old for the build), `hardware=auto` refuses rather than train on CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import os
import platform
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from meshrun.core.config import (
    BackendConfig,
    DeviceSpec,
    HardwareConfig,
    LauncherConfig,
)
from meshrun.core.errors import fail
from meshrun.core.nvidia_smi import DriverView, read_driver
from meshrun.core.paths import CONF_DIR
from meshrun.core.torch_build import fix, unseen


@dataclass(frozen=True)
class CudaDevice:
    name: str
    memory_gib: float
    capability: tuple[int, int] | None = None  # (major, minor); None: a profile's device


@dataclass(frozen=True)
class HostFacts:
    """torch's CUDA devices, the CPUs and memory; `unseen` is what nvidia-smi lists where
    torch sees no CUDA device (None where it sees some, or nvidia-smi lists none for this
    process): then torch cannot see this host's GPUs."""

    cuda_devices: list[CudaDevice] = field(default_factory=list)
    cpu_count: int = 1
    memory_gib: float = 0.0
    unseen: DriverView | None = None

    @classmethod
    def detect(cls) -> HostFacts:
        os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        devices = []
        if torch.cuda.is_available():
            for index in range(torch.cuda.device_count()):
                props = torch.cuda.get_device_properties(index)
                capability = (props.major, props.minor)  # torch's _CudaDeviceProperties
                devices.append(CudaDevice(props.name, props.total_memory / 2**30, capability))
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        # nvidia-smi only where torch sees nothing: a host whose torch works pays no call
        unseen = None if devices else read_driver(os.environ.get("CUDA_VISIBLE_DEVICES"))
        return cls(devices, len(os.sched_getaffinity(0)), memory, unseen)

    def unseen_gpus(self) -> tuple[str, str] | None:
        """Why torch sees none of the GPUs nvidia-smi lists here, and what to do; None where
        it sees them (or there are none)."""
        if self.cuda_devices or self.unseen is None:
            return None
        problem = unseen(self.unseen, torch.__version__, torch.version.cuda, 0)
        if problem is None:
            return None
        return problem, fix(self.unseen, platform.machine())


def device_for_rank(devices: list[DeviceSpec], local_rank: int) -> DeviceSpec | None:
    """The spec of the local_rank-th device of a box (devices listed in PCI bus order)."""
    index = local_rank
    for spec in devices:
        if index < spec.count:
            return spec
        index -= spec.count
    return None


def _profile_node(name: str) -> DictConfig:
    """conf/hardware/<name>.yaml merged over the profiles its defaults list extends (a
    cluster preset names the node profile it puts on another network), as Hydra composes it."""
    raw = OmegaConf.load(CONF_DIR / "hardware" / f"{name}.yaml")
    bases = [_profile_node(base) for base in raw.pop("defaults", []) if base != "_self_"]
    return OmegaConf.merge(*bases, raw) if bases else raw


def load_profile(name: str) -> HardwareConfig:
    merged = OmegaConf.merge(OmegaConf.structured(HardwareConfig), _profile_node(name))
    return OmegaConf.to_object(merged)


def profile_names() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "hardware").glob("*.yaml") if p.stem != "auto")


def is_model(spec: DeviceSpec, name: str) -> bool:
    """Whether torch's device name `name` is the model `spec` describes: one of its `match`
    patterns is the whole name (case aside), not a part of it."""
    return any(re.fullmatch(pattern, name.strip(), re.IGNORECASE) for pattern in spec.match)


def _matches(profile: HardwareConfig, devices: list[CudaDevice]) -> bool:
    for index, device in enumerate(devices):
        spec = device_for_rank(profile.devices, index)
        if spec is None or not is_model(spec, device.name):
            return False
    return True


def _unused_kinds(profile: HardwareConfig, n_devices: int) -> int:
    """Device kinds of a profile that this host has none of (a 2-GPU A100 box is not the
    mixed box whose first two slots are A100s)."""
    first_index = 0
    unused = 0
    for spec in profile.devices:
        unused += first_index >= n_devices
        first_index += spec.count
    return unused


LINK_FIELDS = ("intra_node", "network")
UNKNOWN = "unknown"


def detect_profile(facts: HostFacts) -> HardwareConfig:
    if not facts.cuda_devices:
        cpu = load_profile("cpu")
        spec = dataclasses.replace(cpu.devices[0], memory_gib=round(facts.memory_gib, 1))
        return dataclasses.replace(cpu, devices=[spec])
    candidates = [p for p in map(load_profile, profile_names()) if p.device_type == "cuda"]
    matching = [p for p in candidates if _matches(p, facts.cuda_devices)]
    if matching:
        first = facts.cuda_devices[0].memory_gib
        return min(
            matching,
            key=lambda p: (
                _unused_kinds(p, len(facts.cuda_devices)),
                abs(p.devices[0].memory_gib - first),
            ),
        )
    return _unknown_profile(facts.cuda_devices)


def _unknown_profile(devices: list[CudaDevice]) -> HardwareConfig:
    """A box no profile describes: each run of alike devices (PCI order) with torch's memory
    and no peak FLOP/s, so that MFU is n/a rather than another device's."""
    specs = [
        DeviceSpec(name=name, count=len(run), memory_gib=round(run[0].memory_gib, 1))
        for name, run in ((n, list(r)) for n, r in itertools.groupby(devices, lambda d: d.name))
    ]
    names = ", ".join(dict.fromkeys(d.name for d in devices))
    return HardwareConfig(name=f"{UNKNOWN} ({names})", device_type="cuda", devices=specs)


def unknown_device_note(hardware: HardwareConfig) -> str | None:
    """The warning for a box no profile describes: its devices, and how to add one."""
    if not hardware.name.startswith(f"{UNKNOWN} ("):
        return None
    box = ", ".join(f"{spec.count} x {spec.name!r}" for spec in hardware.devices)
    patterns = ", ".join(f'"{name}"' for name in dict.fromkeys(s.name for s in hardware.devices))
    return (
        f"warning: no hardware profile describes this box ({box}): each device's memory is "
        "torch's, MFU and the planner's speeds are n/a. To add a profile, copy the closest "
        "conf/hardware/*.yaml with the datasheet's figures and match: "
        f"[{patterns}] (torch's names), or name one: hardware=<profile>"
    )


def resolve_hardware(hw: HardwareConfig, facts: HostFacts) -> HardwareConfig:
    unseen_gpus = facts.unseen_gpus()
    if hw.name == "auto" and unseen_gpus:  # not CPU ranks in place of the GPUs
        problem, todo = unseen_gpus
        fail("hardware", "auto", problem, f"{todo}; or hardware=cpu to train on CPU on purpose")
    if hw.name == "auto":
        return _detected(hw, facts)
    if hw.device_type == "cuda" and unseen_gpus:
        problem, todo = unseen_gpus
        fail("hardware", hw.name, f"{problem}, and this profile describes CUDA devices", todo)
    if hw.device_type == "cuda" and not facts.cuda_devices:
        fail(
            "hardware",
            hw.name,
            "no CUDA device here, and this profile describes CUDA devices",
            "cpu, or auto",
        )
    return hw


def _detected(hw: HardwareConfig, facts: HostFacts) -> HardwareConfig:
    """The detected profile, with the link figures given beside hardware=auto (overrides)
    winning over its own."""
    detected, blank = detect_profile(facts), HardwareConfig()
    links = {}
    for name in LINK_FIELDS:
        mine, unset = getattr(hw, name), getattr(blank, name)
        given = {
            f.name: getattr(mine, f.name)
            for f in dataclasses.fields(mine)
            if getattr(mine, f.name) != getattr(unset, f.name)
        }
        links[name] = dataclasses.replace(getattr(detected, name), **given)
    return dataclasses.replace(detected, **links)


def backend_name(backend: BackendConfig, hardware: HardwareConfig) -> str:
    """`backend=auto` for `hardware` (resolved): nccl on CUDA devices, else gloo."""
    if backend.name != "auto":
        return backend.name
    return "nccl" if hardware.device_type == "cuda" else "gloo"


def rank_threads(launcher: LauncherConfig, nproc: int, facts: HostFacts) -> int:
    """A rank's CPU threads: the given ones, the CPUs a scheduler gives each rank (SLURM's
    cpus_per_task), else an equal share of the host's cores among its `nproc` ranks."""
    return launcher.threads_per_rank or launcher.task_cpus() or max(1, facts.cpu_count // nproc)


def target_facts(hardware: HardwareConfig, host: HostFacts) -> HostFacts:
    """The box a profile describes, as `validate` would see it there."""
    if hardware.device_type != "cuda" or hardware.name == "auto":
        return host
    devices = [CudaDevice(s.name, s.memory_gib) for s in hardware.devices for _ in range(s.count)]
    return HostFacts(devices, host.cpu_count, host.memory_gib)


def oom_kills() -> int | None:
    """How many processes the kernel's OOM killer has taken from this process's memory cgroup
    (v2 memory.events, v1 memory.oom_control; a container sees its own as the root), or None
    where no counter is readable (no root needed where it is)."""
    paths = []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if not controllers:
            paths.append(Path(f"/sys/fs/cgroup{path}") / "memory.events")
        elif "memory" in controllers.split(","):
            paths.append(Path(f"/sys/fs/cgroup/memory{path}") / "memory.oom_control")
    paths.append(Path("/sys/fs/cgroup/memory/memory.oom_control"))
    for path in paths:
        with contextlib.suppress(OSError):
            for key, value in (line.split() for line in path.read_text().splitlines()):
                if key == "oom_kill":
                    return int(value)
    return None


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def host_fingerprint(threads_per_rank: int | None) -> dict[str, object]:
    """What a measurement's speed depends on beyond the config: the host, its devices and the
    software that drives them, and the CPU threads of a rank. A stored baseline is reused only
    where all of it is the same (metrics.baseline=stored)."""
    facts = HostFacts.detect()
    cuda = torch.cuda.is_available()
    return {
        "host": socket.gethostname(),
        "cpu": _cpu_model(),
        "cpus": facts.cpu_count,
        "devices": [d.name for d in facts.cuda_devices],
        "torch": torch.__version__,
        "cuda": torch.version.cuda if cuda else None,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
        "threads_per_rank": threads_per_rank,
    }


def fingerprint_key(fingerprint: dict[str, object]) -> str:
    return hashlib.sha1(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]
