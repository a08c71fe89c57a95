"""A stand-in `nvidia-smi` for a GPU box on a host without one: a script on PATH answering
the queries meshrun and scripts/install-torch.sh make, with the header lines of real
nvidia-smi output (quoted from the issue threads named beside each) and each GPU as
nvidia-smi prints it."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from meshrun.core.nvidia_smi import SMI_FIELDS

# The first line of the header table, as each driver prints it.
R515_CUDA_11_7 = (  # wookayin/gpustat#130
    "| NVIDIA-SMI 515.65.01    Driver Version: 515.65.01    CUDA Version: 11.7     |"
)
R550_CUDA_12_4 = (  # wilicc/gpu-burn#114
    "| NVIDIA-SMI 550.90.07              Driver Version: 550.90.07      CUDA Version: 12.4     |"
)
R570_CUDA_12_8 = (  # NVIDIA/GPUStressTest#13
    "| NVIDIA-SMI 570.133.20             Driver Version: 570.133.20     CUDA Version: 12.8     |"
)
R580_CUDA_13_0 = (  # NVIDIA/TensorRT-LLM#10278
    "| NVIDIA-SMI 580.95.05              Driver Version: 580.95.05      CUDA Version: 13.0     |"
)
R610_CUDA_13_3 = (  # sgl-project/sglang#27487: R610 renamed the fields
    "| NVIDIA-SMI 610.43.02              KMD Version: 610.43.02     CUDA UMD Version: 13.3     |"
)
RULE = "+-----------------------------------------------------------------------------------------+"


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_mib: int
    capability: str


H100 = Gpu("NVIDIA H100 80GB HBM3", 81559, "9.0")
B200 = Gpu("NVIDIA B200", 183359, "10.0")
V100 = Gpu("Tesla V100-SXM2-32GB", 32768, "7.0")


def _uuid(index: int) -> str:
    return f"GPU-{index:08x}-1b61-3830-a437-b874d88d0000"


def _outputs(header: str, gpus: list[Gpu], mig: bool) -> dict[str, str]:
    table = [RULE, header, RULE]
    for i, gpu in enumerate(gpus):
        table.append(
            f"|   {i}  {gpu.name:<31}On  |   00000000:{0x19 + i:02X}:00.0 Off |"
            f"                    0 |"
        )
        table.append(
            f"| N/A   39C    P0            145W /  700W |"
            f"       0MiB / {gpu.memory_mib:>6}MiB |      0%      Default |"
        )
    listing = []
    for i, gpu in enumerate(gpus):
        listing.append(f"GPU {i}: {gpu.name} (UUID: {_uuid(i)})")
        if mig:
            listing.append(f"  MIG 3g.40gb     Device  0: (UUID: MIG-{i:08x}-0000-0000-0000)")
    return {
        "": "\n".join(table),
        "-L": "\n".join(listing),
        f"--query-gpu={SMI_FIELDS} --format=csv,noheader,nounits": "\n".join(
            f"{i}, 00000000:{0x19 + i:02X}:00.0, {g.name}, {g.memory_mib}, {_uuid(i)}"
            for i, g in enumerate(gpus)
        ),
        "--query-gpu=compute_cap --format=csv,noheader": "\n".join(g.capability for g in gpus),
    }


def stub_nvidia_smi(bin_dir: Path, header: str, gpus: list[Gpu], mig: bool = False) -> Path:
    """`bin_dir`/nvidia-smi answering as this box's would; other arguments fail, as
    nvidia-smi does on a field it does not know. Returns `bin_dir` (to put first on PATH)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    cases = "\n".join(
        f"  {shlex.quote(args)}) cat <<'OUT'\n{text}\nOUT\n  ;;"
        for args, text in _outputs(header, gpus, mig).items()
    )
    script = bin_dir / "nvidia-smi"
    script.write_text(
        f'#!/bin/sh\ncase "$*" in\n{cases}\n  *) echo "invalid: $*" >&2; exit 2 ;;\nesac\n'
    )
    script.chmod(0o755)
    return bin_dir
