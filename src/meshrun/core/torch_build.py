"""Which torch build an NVIDIA driver can run, and whether the installed one sees the GPUs.

PyTorch's CUDA builds (torch 2.11 to 2.13; pytorch/pytorch RELEASE.md and the RFCs #172663,
#178665): CUDA 13.0 on PyPI (Turing, sm75, and newer), CUDA 12.6 on
download.pytorch.org/whl/cu126 (Maxwell to Hopper: the only one with Volta and older), CUDA
12.8 on /whl/cu128 for 2.11 alone (Turing to Blackwell; dropped from 2.12). A driver runs a
build of its own CUDA major version or older: CUDA 13.x needs driver 580+, 12.x driver 525+
(NVIDIA's CUDA Compatibility guide, "Minor Version Compatibility", table 1).

`python -m meshrun.core.torch_build choose|check` is scripts/install-torch.sh's side: it runs
before anything but the standard library is installed, so this module (and what it imports)
import nothing else; `check` imports torch inside.
"""

from __future__ import annotations

import os
import platform
import sys
from dataclasses import dataclass

from meshrun.core.nvidia_smi import DriverView, read_driver
from meshrun.core.torch_floor import TORCH_FLOOR, release

PYTORCH_INDEX = "https://download.pytorch.org/whl"
OLDEST_CUDA_13 = (7, 5)  # CUDA 13 builds start at Turing
BLACKWELL = (10, 0)  # CUDA 12.6 builds end at Hopper


class NoBuild(Exception):
    """No torch build at the floor runs on this driver (the message says why and what to do)."""


@dataclass(frozen=True)
class TorchBuild:
    """pip's arguments for a torch build, and why it is the one."""

    args: tuple[str, ...]
    why: str

    @property
    def spec(self) -> str:
        """As MESHRUN_TORCH_SPEC takes it (the installer splits it into pip's arguments)."""
        return " ".join(self.args)


def _indexed(cuda: str, why: str) -> TorchBuild:
    return TorchBuild((f"torch>={TORCH_FLOOR}", "--index-url", f"{PYTORCH_INDEX}/{cuda}"), why)


def choose(driver: DriverView, machine: str) -> TorchBuild:
    """The newest torch build at the floor that `driver` runs on these GPUs (`machine` as
    platform.machine() says: PyPI's default CUDA build is x86_64's)."""
    if driver.cuda is None:
        raise NoBuild("nvidia-smi shows no CUDA version in its header (is the driver loaded?)")
    runs = f"the driver runs CUDA up to {'.'.join(map(str, driver.cuda))}"
    if driver.cuda < (12, 0):
        raise NoBuild(f"{runs}; torch>={TORCH_FLOOR} needs CUDA 12 (driver 525+): update it")
    if any(cap < OLDEST_CUDA_13 for cap in driver.capabilities):
        return _indexed("cu126", "the CUDA 12.6 build, the last with kernels for pre-Turing GPUs")
    if driver.cuda >= (13, 0) and machine == "x86_64":
        return TorchBuild((f"torch>={TORCH_FLOOR}",), f"PyPI's CUDA 13.0 build: {runs}")
    if driver.cuda >= (13, 0):
        return _indexed("cu130", f"the CUDA 13.0 build for {machine}: {runs}")
    if not any(cap >= BLACKWELL for cap in driver.capabilities):
        return _indexed("cu126", f"the CUDA 12.6 build: {runs}, and CUDA 13 needs driver 580+")
    if driver.cuda < (12, 8):
        raise NoBuild(f"{runs}; Blackwell GPUs need CUDA 12.8 (driver 570+): update it")
    return _indexed(
        "cu128", f"torch 2.11's CUDA 12.8 build, the last for Blackwell on CUDA 12: {runs}"
    )


def fix(driver: DriverView, machine: str) -> str:
    """What to do: install the build this driver runs (MESHRUN_TORCH_SPEC), or why none."""
    try:
        build = choose(driver, machine)
    except NoBuild as none:
        return str(none)
    return f"install a CUDA build: MESHRUN_TORCH_SPEC='{build.spec}' make install ({build.why})"


def unseen(driver: DriverView, torch_version: str, torch_cuda: str | None, seen: int) -> str | None:
    """What is wrong where torch sees another number of GPUs than nvidia-smi lists for this
    process; None where they agree (under MIG CUDA sees instances, not GPUs: any will do)."""
    if driver.gpus in (0, seen) or (driver.mig and seen):
        return None
    listed = f"nvidia-smi lists {driver.gpus} GPU{'s' * (driver.gpus > 1)}, torch {torch_version}"
    if torch_cuda is None:
        return f"{listed} sees none: a CPU build"
    if seen:
        return f"{listed} sees {seen}: CUDA cannot use the others (meshrun-doctor maps them)"
    build = release(torch_cuda)
    if driver.cuda is not None and driver.cuda[0] < build[0]:
        needs = 580 if build[0] >= 13 else 525
        return (
            f"{listed} sees none: it is built for CUDA {torch_cuda}, and the driver runs CUDA "
            f"up to {'.'.join(map(str, driver.cuda))} (CUDA {build[0]} needs driver {needs}+)"
        )
    return (
        f"{listed} sees none: CUDA does not start (python -c 'import torch; torch.cuda.init()' "
        "says why; meshrun-doctor reports the devices)"
    )


def _installed_torch() -> tuple[str, str | None] | None:
    """The version and CUDA version of the torch this python imports, None where there is none."""
    try:
        import torch  # noqa: PLC0415 (the installer runs this before torch may exist)
    except ImportError:
        return None
    return torch.__version__, torch.version.cuda


def plan_install(
    driver: DriverView, installed: tuple[str, str | None] | None, machine: str
) -> tuple[TorchBuild | None, str]:
    """The build to install on a GPU host (None: keep the installed one), and what to say."""
    if installed is not None:
        version, cuda = installed
        if cuda is not None and release(version) >= release(TORCH_FLOOR):
            return None, f"torch {version} (CUDA {cuda}) already installed: kept"
    build = choose(driver, machine)
    if installed is None:
        return build, f"installing {build.spec}: {build.why}"
    version, cuda = installed
    what = "a CPU build" if cuda is None else f"older than torch {TORCH_FLOOR}"
    return build, (
        f"torch {version} here is {what} and nvidia-smi lists {driver.gpus} GPUs: replacing it "
        f"with {build.spec} ({build.why})"
    )


def main(argv: list[str]) -> int:
    """`choose` prints the decision, one a line: `cpu` (no GPU visible: the installer's CPU
    path), `keep` (the installed torch), or `install` and pip's arguments; it says why on
    stderr and exits 1 where no build fits. `check` exits 1 where the installed torch does not
    see the GPUs nvidia-smi lists, saying what to set."""
    driver = read_driver(os.environ.get("CUDA_VISIBLE_DEVICES"))
    machine = platform.machine()
    if argv == ["choose"]:
        if driver is None:
            print("cpu")
            return 0
        try:
            build, say = plan_install(driver, _installed_torch(), machine)
        except NoBuild as none:
            print(f"install-torch: no torch build for this driver: {none}", file=sys.stderr)
            return 1
        print(say, file=sys.stderr)
        print("\n".join(("install", *build.args) if build else ("keep",)))
        return 0
    if driver is None:
        return 0
    import torch  # noqa: PLC0415 (installed by now)

    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    problem = unseen(driver, torch.__version__, torch.version.cuda, seen)
    if problem is not None:
        print(f"install-torch: {problem}; {fix(driver, machine)}", file=sys.stderr)
        return 1
    print(f"torch {torch.__version__} sees the {seen} GPU(s) nvidia-smi lists", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
