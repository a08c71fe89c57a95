"""scripts/gpu-check.sh's runner: meshrun's needs installed offline, then checks run to one
deadline over the GPUs this process sees, the table (a line per check: PASS, FAIL, SKIPPED
with why, or PENDING) and its JSON rewritten after every check.

The box it is for (../shared/gpu-node-image.md) runs one command of at most 600 s and brings
back at most 8 files from $OUT: so the deadline counts from the script's start
(GPU_CHECK_STARTED, set by gpu-check.sh; the install is inside it), a check's process group
gets 5 s after SIGTERM before SIGKILL, every check works in a folder of its own under
--work (/tmp), and $OUT holds only gpu-check.txt, gpu-check.json, gpu-check-logs.txt (the
install's and every check's output tail) and at most five artefacts the checks name (a
trace, a memory snapshot) in $OUT/artefacts/.

The GPUs are those torch sees (CUDA_VISIBLE_DEVICES and MIG honoured, as a rank sees them),
never nvidia-smi's list. Checks start in their list's order as soon as the GPUs they need
are free (on a box of several, side by side, each with CUDA_VISIBLE_DEVICES naming its own);
one that times something runs `alone`; none starts once the deadline leaves it under half
its budget. Stdlib only: it runs before anything is installed. The checks are
scripts/gpu_checks.py's, which calls `main` here (this module imports none of it).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

PASS, FAIL, SKIPPED, PENDING = "PASS", "FAIL", "SKIPPED", "PENDING"
TAIL_LINES = 60  # of each check's output, in the combined log
KILL_GRACE_S = 5.0  # after SIGTERM, then after SIGKILL
MAX_ARTEFACTS = 5  # with the table, the JSON and the log: the device tool's 8 files
MAX_ARTEFACT_BYTES = 15 * 2**20  # the tool brings back files of up to 16 MiB
DEFAULT_BUDGET_S = 540.0  # from the script's start: the tool's 600 s less a margin


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
    its outcome. `gpus`: how many it needs (0: CPU only). `keep`: globs under its folder of
    artefacts to bring back. `rehearse`: run by the rehearsal (a check needing no GPU whose
    figure means something on a CPU box)."""

    name: str
    argv: Callable[[Path], list[str]]
    judge: Callable[[Outcome], Verdict]
    gpus: int = 1
    budget_s: float = 120.0
    alone: bool = False
    keep: tuple[str, ...] = ()
    rehearse: bool = True


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


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_")[:80]


@dataclass
class _Running:
    check: Check
    proc: subprocess.Popen
    devices: list[int]
    started: float
    timeout: float
    log: Path


class Runner:
    """Starts checks in order as their GPUs free up, each to its timeout, until `deadline`
    (time.monotonic()); `report` is called with every result as it comes."""

    def __init__(
        self,
        n_gpus: int,
        deadline: float,
        work: Path,
        parent_visible: str | None,
        report: Callable[[Result], None] = lambda result: None,
    ):
        self.free = list(range(n_gpus))
        self.n_gpus = n_gpus
        self.deadline = deadline
        self.work = work
        self.parent_visible = parent_visible
        self.report = report
        self.running: list[_Running] = []

    def plan(self, check: Check) -> Verdict | None:
        """Why `check` cannot run on this box at all (None: it can)."""
        if check.gpus > self.n_gpus:
            here = (
                f"{self.n_gpus} here: NCCL refuses two ranks on one GPU, and a CUDA run "
                "places a rank per GPU (validate/launcher.check_placement)"
                if self.n_gpus
                else "none torch can use here"
            )
            return Verdict(SKIPPED, f"needs {check.gpus} GPU(s), {here}")
        return None

    def run(self, checks: list[Check]) -> None:
        pending = []
        for check in checks:
            refused = self.plan(check)
            if refused is None:
                pending.append(check)
            else:
                self.report(Result(check.name, refused.status, refused.detail))
        while pending or self.running:
            self._reap()
            while pending:
                head = pending[0]
                left = self.deadline - time.monotonic()
                if left < head.budget_s / 2:
                    pending.pop(0)
                    self.report(
                        Result(
                            head.name,
                            SKIPPED,
                            f"out of time: {max(left, 0):.0f} s left, it needs up to "
                            f"{head.budget_s:.0f} s (GPU_CHECK_BUDGET_S)",
                        )
                    )
                elif self._fits(head):
                    self._start(pending.pop(0))
                else:
                    break
            time.sleep(0.2)

    def folder(self, check: Check) -> Path:
        return self.work / slug(check.name)

    def _fits(self, check: Check) -> bool:
        """Its GPUs are free, and nothing it must not share the box with runs."""
        if check.alone or any(r.check.alone for r in self.running):
            return not self.running
        return len(self.free) >= check.gpus

    def _start(self, check: Check) -> None:
        devices, self.free = self.free[: check.gpus], self.free[check.gpus :]
        work = self.folder(check)
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        env = dict(os.environ)
        if check.gpus:
            env["CUDA_VISIBLE_DEVICES"] = child_visible(self.parent_visible, devices)
        log = work / "output.log"
        with log.open("w") as sink:
            proc = subprocess.Popen(
                check.argv(work),
                stdout=sink,
                stderr=subprocess.STDOUT,
                cwd=os.getcwd(),
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
                kill_group(run.proc)
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
            self.free = sorted(self.free + run.devices)
            self.running.remove(run)
            print(f"gpu-check: {verdict.status} {run.check.name}: {verdict.detail}", flush=True)
            self.report(
                Result(run.check.name, verdict.status, verdict.detail, round(elapsed, 1), shown)
            )


def kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the check's process group, then SIGKILL: at most 2 x KILL_GRACE_S."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=KILL_GRACE_S)
            return
        except (ProcessLookupError, subprocess.TimeoutExpired):
            continue


def table(results: list[Result], host: str) -> str:
    width = max([len(r.name) for r in results] + [5])
    lines = [host, f"{'check':<{width}}  {'status':<7}  {'s':>5}  detail"]
    for r in results:
        lines.append(f"{r.name:<{width}}  {r.status:<7}  {r.seconds:>5.0f}  {r.detail}")
    counts = {s: sum(r.status == s for r in results) for s in (PASS, FAIL, SKIPPED, PENDING)}
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items() if n or s != PENDING))
    return "\n".join(lines)


class Report:
    """The files under $OUT, rewritten whole after every result: a run cut short by the box
    still leaves its table, with what never ran PENDING."""

    def __init__(self, out: Path, host: str, n_gpus: int, names: list[str], work: Path):
        self.out, self.host, self.n_gpus, self.work = out, host, n_gpus, work
        self.results = {n: Result(n, PENDING, "not run yet") for n in names}
        self.artefacts: list[str] = []
        out.mkdir(parents=True, exist_ok=True)

    def add(self, result: Result) -> None:
        self.results[result.name] = result
        self.write()

    def write(self, finished: bool = False) -> None:
        results = list(self.results.values())
        text = table(results, self.host)
        _replace(self.out / "gpu-check.txt", text + "\n")
        report = {
            "host": self.host,
            "gpus": self.n_gpus,
            "finished": finished,
            "artefacts": self.artefacts,
            "checks": [asdict(r) for r in results],
        }
        _replace(self.out / "gpu-check.json", json.dumps(report, indent=1) + "\n")
        self._write_logs(results)

    def _write_logs(self, results: list[Result]) -> None:
        """The install's log and every check's output tail in one file (the device tool
        brings back few files)."""
        parts = []
        install = self.work / "install.log"
        if install.exists():
            parts.append("===== install =====\n" + _tail(install))
        for r in results:
            log = self.work / slug(r.name) / "output.log"
            if log.exists():
                parts.append(f"===== {r.name} ({r.status}) =====\n" + _tail(log))
        _replace(self.out / "gpu-check-logs.txt", "\n\n".join(parts) + "\n")

    def keep(self, check: Check, folder: Path) -> None:
        """The check's named artefacts into $OUT/artefacts (gzipped), while slots remain; one
        over the tool's size limit is left out."""
        for pattern in check.keep:
            for found in sorted(folder.glob(pattern)):
                if len(self.artefacts) >= MAX_ARTEFACTS or not found.is_file():
                    return
                name = f"{slug(check.name)[:40]}-{found.name}"
                name += "" if name.endswith(".gz") else ".gz"
                target = self.out / "artefacts" / name
                target.parent.mkdir(exist_ok=True)
                if found.name.endswith(".gz"):
                    shutil.copyfile(found, target)
                else:
                    with found.open("rb") as src, gzip.open(target, "wb") as dst:
                        shutil.copyfileobj(src, dst)
                if target.stat().st_size > MAX_ARTEFACT_BYTES:
                    target.unlink()
                    continue
                self.artefacts.append(f"artefacts/{name}")


def _tail(log: Path) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-TAIL_LINES:])


def _replace(path: Path, text: str) -> None:
    """Written beside and renamed over: a reader never sees half a file."""
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    part.replace(path)


def install(python: str, wheels: Path, log: Path) -> Result:
    """meshrun's needs from the carried wheels, offline, in two steps: the core (hydra-core,
    omegaconf, submitit: without them no check can run, so their import is checked at
    once), then the extras (transformers, torchao, torchft, wandb, pytest...: a check that
    needs one that failed fails by itself). The versions are the ones resolved with the
    wheels (constraints.txt); the image's own packages are kept where they satisfy."""
    started = time.monotonic()
    pip = [python, "-m", "pip", "install", "--no-index", "--no-compile",
           "--disable-pip-version-check", "--find-links", str(wheels),
           "-c", str(wheels / "constraints.txt")]  # fmt: skip
    with log.open("w") as sink:
        core = subprocess.run([*pip, "-r", str(wheels / "core.txt")], stdout=sink,
                              stderr=subprocess.STDOUT, check=False)  # fmt: skip
        imports = subprocess.run([python, "-c", "import hydra, omegaconf, submitit"],
                                 stdout=sink, stderr=subprocess.STDOUT, check=False)  # fmt: skip
        if core.returncode or imports.returncode:
            return Result("install: meshrun's needs, offline", FAIL,
                          f"the core needs (hydra-core, omegaconf, submitit) do not import "
                          f"(pip exit {core.returncode}): {_last_line(log)}",
                          round(time.monotonic() - started, 1))  # fmt: skip
        extras = subprocess.run([*pip, "-r", str(wheels / "extras.txt")], stdout=sink,
                                stderr=subprocess.STDOUT, check=False)  # fmt: skip
    seconds = round(time.monotonic() - started, 1)
    if extras.returncode:
        return Result("install: meshrun's needs, offline", FAIL,
                      f"the extras failed (pip exit {extras.returncode}): {_last_line(log)}; "
                      "checks that need them fail", seconds)  # fmt: skip
    return Result(
        "install: meshrun's needs, offline", PASS, f"from {wheels} in {seconds:.0f} s", seconds
    )


def _last_line(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if "ERROR" in ln or "Error" in ln]
    return (errors or lines or ["no output"])[-1].strip()[:200]


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


def chosen_checks(listed: list[Check], only: list[str]) -> list[Check]:
    """The checks whose name has one of `only` in it, in any case (all where none is given)."""
    wanted = [o.casefold() for o in only]
    return [c for c in listed if not wanted or any(o in c.name.casefold() for o in wanted)]


def only_refused(listed: list[Check], only: list[str]) -> str | None:
    """What is wrong with --only where one of `only` names no check, else None."""
    unmatched = [o for o in only if not chosen_checks(listed, [o])]
    if not unmatched:
        return None
    names = "\n  ".join(c.name for c in listed)
    return f"gpu-check: --only {', '.join(unmatched)} names no check; the checks:\n  {names}"


def main(checks: Callable[[int, float], list[Check]], argv: list[str] | None = None) -> int:
    """Install, then `checks(n_gpus, seconds_left)` to the deadline; exit 1 on any FAIL, 3
    where meshrun's core needs do not install, 2 (before the install) where an --only names
    no check."""
    args = _parser().parse_args(argv)
    started = float(os.environ.get("GPU_CHECK_STARTED", time.time()))
    deadline = time.monotonic() + args.budget_s - (time.time() - started)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    n_gpus, seen = count_gpus(_torch_count(), _smi_list(), visible)  # the image's torch
    refused = only_refused(checks(n_gpus, args.budget_s), args.only)
    if refused:  # the node's one command is not spent on an install for nothing
        print(refused)
        return 2
    out, work = Path(args.out).resolve(), Path(args.work).resolve()
    os.environ["OUT"] = str(out)  # the checks' own, wherever they run
    work.mkdir(parents=True, exist_ok=True)
    installed = None if args.dry_run else _install_carried(Path(args.wheels), work)
    host = f"gpu-check on {os.cpu_count()} cores: {seen}"
    listed = checks(n_gpus, deadline - time.monotonic())
    chosen = chosen_checks(listed, args.only)
    report = Report(
        out, host, n_gpus, ([installed.name] if installed else []) + [c.name for c in chosen], work
    )
    if installed:
        report.add(installed)
        if installed.status == FAIL and "core needs" in installed.detail:
            print(table(list(report.results.values()), host), flush=True)
            return 3
    runner = Runner(n_gpus, deadline, work, visible, report.add)
    if args.dry_run:
        for c in chosen:
            report.add(
                Result(c.name, *asdict(runner.plan(c) or Verdict("-", "would run")).values())
            )
    else:
        by_name = {c.name: c for c in chosen}

        def add(result: Result) -> None:
            if result.status != SKIPPED or result.seconds:
                report.keep(by_name[result.name], runner.folder(by_name[result.name]))
            report.add(result)

        runner.report = add
        runner.run(chosen)
    report.write(finished=True)
    print(table(list(report.results.values()), host), flush=True)
    return 1 if any(r.status == FAIL for r in report.results.values()) else 0


def _install_carried(wheels: Path, work: Path) -> Result | None:
    """install() where wheels were carried (a core.txt among them); None where none were."""
    if not (wheels / "core.txt").exists():
        return None
    print(f"gpu-check: installing meshrun's needs offline from {wheels}", flush=True)
    installed = install(sys.executable, wheels, work / "install.log")
    print(f"gpu-check: {installed.status} {installed.name}: {installed.detail}", flush=True)
    return installed


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "outputs/gpu-check"))
    parser.add_argument(
        "--work",
        default=os.environ.get("GPU_CHECK_WORK", "/tmp/meshrun-gpu-check"),
        help="the checks' own folders (runs, stores, logs): not brought back",
    )
    parser.add_argument("--wheels", default=os.environ.get("WHEELS", "outputs/gpu-wheels"))
    parser.add_argument(
        "--budget-s",
        type=float,
        default=float(os.environ.get("GPU_CHECK_BUDGET_S", DEFAULT_BUDGET_S)),
        help="seconds from the script's start (GPU_CHECK_STARTED) to the last check's end",
    )
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        help="run the checks whose name has this, in any case (exit 2 where none has)",
    )
    parser.add_argument("--dry-run", action="store_true", help="list what would run, run none")
    return parser
