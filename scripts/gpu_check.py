"""scripts/gpu-check.sh's runner: the checks of scripts/gpu_checks.py run to one deadline over
the GPUs this process sees, then one table (a line per check: PASS, FAIL or SKIPPED with
why) and the same as JSON.

The GPUs are those torch sees (CUDA_VISIBLE_DEVICES and MIG honoured, as a rank sees them),
never nvidia-smi's list: a MIG slice or a hidden GPU is not a rank's device. Checks start in
their list's order as soon as the GPUs they need are free (on an 8-GPU box several run side
by side, each with CUDA_VISIBLE_DEVICES naming its own); one that times something runs
`alone`. Each has its own time budget, and none starts once the run's deadline
(GPU_CHECK_BUDGET_S, 570 s: the lent device's 10-minute command limit less the install)
leaves it under half of it: the rest are SKIPPED, saying so. Stdlib only: it runs before
anything is installed on a bare image.

    python3 scripts/gpu_check.py [--out DIR] [--budget-s S] [--only SUBSTRING] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

PASS, FAIL, SKIPPED = "PASS", "FAIL", "SKIPPED"
TAIL_LINES = 60  # of each check's output, in the combined log


@dataclass(frozen=True)
class Verdict:
    status: str
    detail: str


@dataclass(frozen=True)
class Outcome:
    """What a check's command left: its exit status, output, folder and time taken."""

    rc: int
    output: str
    work: Path
    seconds: float


@dataclass(frozen=True)
class Check:
    """One line of the table: `argv` run in `work` (its own folder), judged by `judge` from
    its outcome. `gpus`: how many it needs (0: CPU only)."""

    name: str
    argv: Callable[[Path], list[str]]
    judge: Callable[[Outcome], Verdict]
    gpus: int = 1
    budget_s: float = 120.0
    alone: bool = False


@dataclass
class Result:
    name: str
    status: str
    detail: str
    seconds: float = 0.0
    devices: list[str] = field(default_factory=list)


def count_gpus(torch_count: int, smi_list: str, cuda_visible: str | None) -> tuple[int, str]:
    """The GPUs the checks may use (torch's count: what a rank can open) and a line saying
    how that relates to nvidia-smi -L's list, where they differ."""
    listed = len(re.findall(r"^GPU \d+:", smi_list, re.MULTILINE))
    migs = len(re.findall(r"^\s+MIG ", smi_list, re.MULTILINE))
    seen = [f"nvidia-smi lists {listed} GPU(s)"] if listed or smi_list else ["no nvidia-smi"]
    if migs:
        seen.append(f"{migs} MIG device(s) (a process opens one)")
    if cuda_visible is not None:
        seen.append(f"CUDA_VISIBLE_DEVICES={cuda_visible!r}")
    seen.append(f"torch sees {torch_count}")
    if torch_count == 0 and listed:
        seen.append("a CPU build of torch, or a driver it cannot use?")
    return torch_count, "; ".join(seen)


def child_visible(parent: str | None, picked: list[int]) -> str:
    """CUDA_VISIBLE_DEVICES for a check given devices `picked` of the parent's numbering:
    entries of the parent's own list where it has one (indices, UUIDs or MIG names)."""
    if parent is None:
        return ",".join(map(str, picked))
    entries = [e.strip() for e in parent.split(",") if e.strip()]
    return ",".join(entries[i] for i in picked)


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")


@dataclass
class _Running:
    check: Check
    proc: subprocess.Popen
    devices: list[int]
    started: float
    timeout: float
    log: Path


class Runner:
    """Starts checks in order as their GPUs free up, each to its timeout, until the deadline."""

    def __init__(self, n_gpus: int, budget_s: float, out: Path, parent_visible: str | None):
        self.free = list(range(n_gpus))
        self.n_gpus = n_gpus
        self.deadline = time.monotonic() + budget_s
        self.out = out
        self.parent_visible = parent_visible
        self.running: list[_Running] = []
        self.results: dict[str, Result] = {}

    def plan(self, check: Check) -> Verdict | None:
        """Why `check` cannot run on this box at all (None: it can)."""
        if check.gpus > self.n_gpus:
            here = f"{self.n_gpus} here" if self.n_gpus else "none torch can use here"
            return Verdict(SKIPPED, f"needs {check.gpus} GPU(s), {here}")
        return None

    def run(self, checks: list[Check]) -> list[Result]:
        pending = []
        for check in checks:
            refused = self.plan(check)
            if refused is None:
                pending.append(check)
            else:
                self.results[check.name] = Result(check.name, refused.status, refused.detail)
        while pending or self.running:
            self._reap()
            while pending:
                head = pending[0]
                left = self.deadline - time.monotonic()
                if left < head.budget_s / 2:
                    self.results[head.name] = Result(
                        head.name,
                        SKIPPED,
                        f"out of time: {left:.0f} s left, it needs up to "
                        f"{head.budget_s:.0f} s (GPU_CHECK_BUDGET_S)",
                    )
                    pending.pop(0)
                elif self._fits(head):
                    self._start(pending.pop(0))
                else:
                    break
            time.sleep(0.2)
        return [self.results[c.name] for c in checks]

    def _fits(self, check: Check) -> bool:
        """Its GPUs are free, and nothing it must not share the box with runs."""
        if check.alone or any(r.check.alone for r in self.running):
            return not self.running
        return len(self.free) >= check.gpus

    def _start(self, check: Check) -> None:
        devices, self.free = self.free[: check.gpus], self.free[check.gpus :]
        work = self.out / "work" / _slug(check.name)
        work.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        if check.gpus:
            env["CUDA_VISIBLE_DEVICES"] = child_visible(self.parent_visible, devices)
        log = work / "output.log"
        with log.open("w") as sink:
            proc = subprocess.Popen(
                check.argv(work),
                stdout=sink,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # its ranks and their children end with it
            )
        now = time.monotonic()
        timeout = min(check.budget_s, self.deadline - now)
        self.running.append(_Running(check, proc, devices, now, timeout, log))
        print(f"gpu-check: started {check.name} (devices {devices or 'none'})", flush=True)

    def _reap(self) -> None:
        for run in list(self.running):
            elapsed = time.monotonic() - run.started
            rc = run.proc.poll()
            if rc is None and elapsed < run.timeout:
                continue
            if rc is None:
                _kill(run.proc)
                cut = run.timeout < run.check.budget_s
                verdict = Verdict(
                    SKIPPED if cut else FAIL,
                    f"cut at the run's deadline after {elapsed:.0f} s"
                    if cut
                    else f"timed out after {elapsed:.0f} s (its budget)",
                )
            else:
                output = run.log.read_text(errors="replace")
                try:
                    verdict = run.check.judge(Outcome(rc, output, run.log.parent, elapsed))
                except Exception as err:  # a judge's own failure is the check's FAIL
                    verdict = Verdict(FAIL, f"could not judge: {type(err).__name__}: {err}")
            shown = [child_visible(self.parent_visible, [d]) for d in run.devices]
            self.results[run.check.name] = Result(
                run.check.name, verdict.status, verdict.detail, round(elapsed, 1), shown
            )
            print(f"gpu-check: {verdict.status} {run.check.name}: {verdict.detail}", flush=True)
            self.free = sorted(self.free + run.devices)
            self.running.remove(run)


def _kill(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=10)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def table(results: list[Result], host: str) -> str:
    width = max([len(r.name) for r in results] + [5])
    lines = [host, f"{'check':<{width}}  {'status':<7}  {'s':>5}  detail"]
    for r in results:
        lines.append(f"{r.name:<{width}}  {r.status:<7}  {r.seconds:>5.0f}  {r.detail}")
    counts = {s: sum(r.status == s for r in results) for s in (PASS, FAIL, SKIPPED)}
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)


def write_logs(results: list[Result], out: Path) -> None:
    """Every check's output tail in one file (the device tool brings back few files)."""
    parts = []
    for r in results:
        log = out / "work" / _slug(r.name) / "output.log"
        if log.exists():
            tail = log.read_text(errors="replace").splitlines()[-TAIL_LINES:]
            parts.append(f"===== {r.name} ({r.status}) =====\n" + "\n".join(tail))
    (out / "gpu-check-logs.txt").write_text("\n\n".join(parts) + "\n")


def _torch_count() -> int:
    try:
        import torch  # noqa: PLC0415 (the runner itself needs no torch)
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _smi_list() -> str:
    try:
        done = subprocess.run(
            ["nvidia-smi", "-L"], check=False, capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    from gpu_checks import checks  # noqa: PLC0415 (beside this file)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    n_gpus, seen = count_gpus(_torch_count(), _smi_list(), visible)
    host = f"gpu-check on {os.cpu_count()} cores: {seen}"
    chosen = [c for c in checks(n_gpus) if args.only in c.name]
    runner = Runner(n_gpus, args.budget_s, out, visible)
    if args.dry_run:
        results = [
            Result(c.name, *asdict(runner.plan(c) or Verdict("-", "would run")).values())
            for c in chosen
        ]
    else:
        results = runner.run(chosen)
        write_logs(results, out)
    report = table(results, host)
    print(report, flush=True)
    (out / "gpu-check.txt").write_text(report + "\n")
    (out / "gpu-check.json").write_text(
        json.dumps({"host": host, "gpus": n_gpus, "checks": [asdict(r) for r in results]}, indent=1)
        + "\n"
    )
    return 1 if any(r.status == FAIL for r in results) else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "outputs/gpu-check"))
    parser.add_argument(
        "--budget-s", type=float, default=float(os.environ.get("GPU_CHECK_BUDGET_S", "570"))
    )
    parser.add_argument("--only", default="", help="run the checks whose name contains this")
    parser.add_argument("--dry-run", action="store_true", help="list what would run, run none")
    return parser


if __name__ == "__main__":
    sys.exit(main())
