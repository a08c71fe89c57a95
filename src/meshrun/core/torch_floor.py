"""The oldest torch meshrun is tested on (scripts/test-torch-floor.sh, which CI runs: the
layouts that compose most of torch's distributed APIs, a resume and the CLI on it;
pyproject.toml's `torch>=` says the same, and a test holds the two together). An older torch
is refused before anything starts: its distributed APIs (FSDP2, DTensor, pipelining, DCP)
moved under meshrun between releases."""

from __future__ import annotations

import re
from importlib import metadata

from meshrun.core.errors import fail

TORCH_FLOOR = "2.11"


def release(version: str) -> tuple[int, ...]:
    """A version's release numbers: '2.12.0a0+git1a2b3c' -> (2, 12, 0), as packaging's
    Version.release (the standard library's own, for scripts/install-torch.sh: it reads the
    floor before anything else is installed)."""
    found = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in found[0].split(".")) if found else ()


def check_torch(installed: str | None = None) -> None:
    """ConfigError where the installed torch is older than the floor (a local build's
    version, `2.12.0a0+git...`, counts by its release)."""
    version = installed or _installed()
    if release(version) < release(TORCH_FLOOR):
        fail(
            "torch",
            version,
            f"is older than the oldest torch meshrun is tested on ({TORCH_FLOOR})",
            f"torch>={TORCH_FLOOR} (pip install 'torch>={TORCH_FLOOR}', or your CUDA build of it)",
        )


def _installed() -> str:
    """The installed torch's version from its package metadata (no import: a second of it),
    or from torch itself where it was installed without any (a source build)."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        import torch  # noqa: PLC0415

        return torch.__version__
