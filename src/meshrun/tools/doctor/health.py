"""Health check of one backend: a short meshrun-comm run in its own process group (session),
under a hard time limit, turned into a verdict with concrete next steps.

The backend's collective timeout (`doctor.timeout_s`) ends most hangs inside the check; the
hard limit (timeout + `doctor.grace_s`) ends the rest, NCCL blocked in a container included,
by killing the check's whole session, so no rank outlives the doctor.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from meshrun.core.config import DebugConfig
from meshrun.driver.tool_config import DoctorConfig
from meshrun.tools.comm.report import REPORT_FILE

CHECK = (
    "comm.ops=[all_reduce,all_gather,broadcast]",
    "comm.dtypes=[float32]",
    "comm.min_bytes=4096",
    "comm.max_bytes=1048576",
    "comm.step_factor=16",
    "comm.warmup_iters=1",
    "comm.iters=3",
    "comm.record=false",
    "logger=none",
)


@dataclass
class Health:
    backend: str
    ok: bool
    verdict: str
    seconds: float
    next_steps: list[str] = field(default_factory=list)
    peak_busbw_gbs: float | None = None


def next_steps(backend: str, interfaces: list[str], shm_gib: float | None) -> list[str]:
    """What to try, most telling first; each line is runnable as written."""
    iface = interfaces[0] if interfaces else "<interface>"
    here = f" (here: {', '.join(interfaces)})" if interfaces else ""
    if backend == "nccl":
        shm = f" (/dev/shm here: {shm_gib:.1f} GiB)" if shm_gib is not None else ""
        return [
            "NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P,SHM,NET meshrun-comm backend=nccl "
            "comm.ops=[all_reduce]   # which transport it stops in",
            "NCCL_P2P_DISABLE=1 meshrun-doctor   # passes now? GPU peer-to-peer is broken: check "
            "the host's PCI settings (PCIe ACS must be off between GPUs: `sudo lspci -vvv | grep "
            "ACSCtl` shows SrcValid-; IOMMU passthrough: iommu=pt), typical of VMs and "
            "docker hosts",
            f"NCCL_SHM_DISABLE=1 meshrun-doctor   # passes now? shared memory is too small{shm}: "
            "run the container with --ipc=host or --shm-size=16g",
            "NCCL_IB_DISABLE=1 meshrun-doctor   # no or broken InfiniBand: stay on sockets",
            f"NCCL_SOCKET_IFNAME={iface} meshrun-doctor   # pin the interface NCCL talks over"
            f"{here}",
            "TORCH_NCCL_TRACE_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1   # flight recorder "
            "of the last collectives per rank, dumped on a timeout",
        ]
    return [
        f"GLOO_SOCKET_IFNAME={iface} meshrun-doctor   # pin the interface gloo talks over{here}",
        "check that MASTER_ADDR resolves to this host and that no firewall blocks its ports",
        "TORCH_DISTRIBUTED_DEBUG=DETAIL meshrun-comm backend=gloo   # reports ranks that call "
        "different collectives",
        f"meshrun-comm backend={backend}   # the full benchmark, to see which op and size fail",
    ]


def _kill_session(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def command(backend: str, run_dir: Path, cfg: DoctorConfig, debug: DebugConfig) -> list[str]:
    ranks = "null" if backend == "nccl" else "2"  # nccl: every visible GPU, one rank each
    overrides = [
        f"hydra.run.dir={run_dir}",
        f"backend={backend}",
        f"backend.timeout_s={cfg.timeout_s}",
        f"launcher.nproc_per_node={ranks}",
        *CHECK,
        f"debug.fail_step={debug.fail_step}",
        f"debug.fail_mode={debug.fail_mode}",
    ]
    if debug.fail_rank is not None:
        overrides.append(f"debug.fail_rank={debug.fail_rank}")
    return [sys.executable, "-m", "meshrun.tools.comm", *overrides]


def check(
    backend: str,
    run_dir: Path,
    cfg: DoctorConfig,
    debug: DebugConfig,
    interfaces: list[str],
    shm_gib: float | None,
) -> Health:
    limit = cfg.timeout_s + cfg.grace_s
    steps = next_steps(backend, interfaces, shm_gib)
    started = time.monotonic()
    proc = subprocess.Popen(
        command(backend, run_dir, cfg, debug),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        verdict = (
            f"hung: no result within {limit:g} s (backend timeout {cfg.timeout_s:g} s + "
            f"{cfg.grace_s:g} s); all its processes were killed. The backend's own timeout did "
            "not fire, as when NCCL blocks inside a container (or start-up is slow here: raise "
            "doctor.grace_s)"
        )
        return Health(backend, False, verdict, time.monotonic() - started, steps)
    seconds = time.monotonic() - started
    report_file = run_dir / REPORT_FILE
    if not report_file.exists():  # stopped before launching: a config error
        lines = [line for line in output.splitlines() if "meshrun:" in line] or [output[-500:]]
        return Health(backend, False, f"did not run: {lines[-1].strip()}", seconds)
    report = json.loads(report_file.read_text())
    if report["error"]:
        kind = "hang" if "collective hang" in report["error"] else "failure"
        return Health(backend, False, f"{kind}: {report['error']}", seconds, steps)
    if report["wrong"]:
        return Health(
            backend,
            False,
            f"{report['wrong']} wrong values in the results: data is corrupted in transit",
            seconds,
            steps,
        )
    ranks = report["world_size"]
    return Health(
        backend,
        True,
        f"ok: {ranks} rank(s), all results correct",
        seconds,
        [],
        report["peak_busbw_gbs"],
    )
