"""scripts/gpu-check.sh --rehearse: the GPU box's one command, rehearsed here first.

An offline GPU node may be lent once, for one command of 600 s: it must work the first time.
So this builds what would be carried (scripts/build-gpu-wheels.sh), makes a venv like the
image (../shared/gpu-node-image.md: CPython 3.12 where this machine has it, else the
closest; PyPI's torch 2.11.0; the image's packages that the resolution meets, at the image's
versions where it gives them), then runs gpu-check.sh there as the node would: the carried
set installed with --no-index, every module meshrun imports imported, the checks that need
no GPU, and planted ones (scripts/gpu_checks.planted: a failure, a look at the table on disk
while the run goes on, a hang that ignores SIGTERM past the deadline). It passes (exit 0)
where the install, the deadline, the files under $OUT (at most 8, at most two folders down),
the exit status and the table written after each check are what the node needs.

    scripts/gpu-check.sh --rehearse [--budget-s 240] [--wheels DIR] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from gpu_check import FAIL, KILL_GRACE_S, MAX_ARTEFACTS, PASS, SKIPPED
from gpu_wheels import IMAGE, image_packages

ROOT = Path(__file__).resolve().parents[1]
IMAGE_TORCH = "torch==2.11.0"  # the image's 2.11.0+cu130: PyPI's build, run on the CPU here
MAX_FILES = 3 + MAX_ARTEFACTS  # the device tool brings back 8
MAX_DEPTH = 3  # $OUT/a/b/file


def find_python(want: tuple[int, int] = (3, 12)) -> tuple[str, tuple[int, int]]:
    """The interpreter nearest CPython `want` on this machine: on PATH, pyenv's, or this
    one."""
    roots = [Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"]
    candidates = [f"python{want[0]}.{want[1]}"]
    candidates += [str(p) for root in roots for p in sorted(root.glob("3.*/bin/python3"))]
    candidates.append(sys.executable)
    found = {}
    for candidate in candidates:
        try:
            done = subprocess.run(
                [candidate, "-c", "import sys; print(*sys.version_info[:2])"],
                capture_output=True, text=True, timeout=30, check=True,
            )  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            continue
        version = tuple(int(v) for v in done.stdout.split())
        found.setdefault(version, candidate)
    best = min(found, key=lambda v: (abs(v[1] - want[1]) if v[0] == want[0] else 99, -v[1]))
    return found[best], best


def image_like(venv: Path, python: str, manifest: list[dict], uv: str) -> list[str]:
    """A venv holding what the image holds of the resolution: torch 2.11.0 and each package
    the image lists, at the image's version where it gives one (else the version resolved
    with the wheels: an assumption the build names). Returns what was installed."""
    image = image_packages(IMAGE.read_text())
    on_image = [
        f"{p['name']}=={image.get(p['name']) or p['version']}"
        for p in manifest
        if p["kind"] in {"image", "newer", "assumed", "fallback"}
    ]
    shutil.rmtree(venv, ignore_errors=True)
    subprocess.run([uv, "venv", "--quiet", "--seed", "-p", python, str(venv)], check=True)
    subprocess.run(
        [uv, "pip", "install", "--quiet", "--python", str(venv / "bin" / "python"),
         IMAGE_TORCH, *on_image],
        check=True,
    )  # fmt: skip
    return [IMAGE_TORCH, *on_image]


def files_under(out: Path) -> list[Path]:
    return sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())


def verify(out: Path, rc: int, seconds: float, budget_s: float) -> list[str]:
    """What is wrong with the run gpu-check.sh left in `out` (nothing: the rehearsal
    passes)."""
    wrong = []
    files = files_under(out)
    if len(files) > MAX_FILES or any(len(f.parts) > MAX_DEPTH for f in files):
        wrong.append(f"{len(files)} files under $OUT (at most {MAX_FILES}, 2 folders down)")
    report = json.loads((out / "gpu-check.json").read_text())
    rows = {c["name"]: c for c in report["checks"]}
    status = {name: row["status"] for name, row in rows.items()}
    expected = {
        "planted: a check that fails": FAIL,
        "planted: a hang that ignores SIGTERM, past the deadline": SKIPPED,
        "planted: the table on disk holds the checks that ended": PASS,
    }
    for name, want in expected.items():
        if status.get(name) != want:
            wrong.append(f"{name!r}: {status.get(name)}, not {want}")
    hang = rows.get("planted: a hang that ignores SIGTERM, past the deadline", {})
    if "cut at the run's deadline" not in hang.get("detail", ""):
        wrong.append(f"the hang was not cut at the deadline: {hang.get('detail')}")
    others = {n: r for n, r in rows.items() if n not in expected}
    for name, row in others.items():
        cpu = row["status"] == PASS
        gpu = row["status"] == SKIPPED and "none torch can use here" in row["detail"]
        if not (cpu or gpu):
            wrong.append(f"{name!r}: {row['status']}: {row['detail'][:300]}")
    if rc != 1:
        wrong.append(f"gpu-check.sh exited {rc}, not 1 (the planted failure)")
    if not report["finished"]:
        wrong.append("the JSON does not say the run finished")
    kept = report["artefacts"]
    if len(kept) != 1 or not (out / kept[0]).is_file():
        wrong.append(f"artefacts {kept}: the planted check's one is not there")
    if seconds > budget_s + 2 * KILL_GRACE_S + 10:
        wrong.append(f"ended {seconds:.0f} s after its start, past the deadline of {budget_s}")
    return wrong


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    started = time.monotonic()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    uv = shutil.which("uv") or str(ROOT / ".venv" / "bin" / "uv")
    wheels = Path(args.wheels) if args.wheels else work / "wheels"
    if not args.wheels:
        subprocess.run([str(ROOT / "scripts" / "build-gpu-wheels.sh"), str(wheels)], check=True)
    manifest = json.loads((wheels / "manifest.json").read_text())
    python, version = find_python()
    print(
        f"rehearsal: CPython {version[0]}.{version[1]} ({python}), the image's packages", flush=True
    )
    venv = work / "image"
    installed = image_like(venv, python, manifest, uv)
    took = time.monotonic() - started
    print(f"rehearsal: an image-like venv of {len(installed)} packages in {took:.0f} s", flush=True)
    out = Path(os.environ.get("OUT", "outputs/gpu-check"))
    shutil.rmtree(out, ignore_errors=True)
    env = {
        **os.environ,
        "PYTHON": str(venv / "bin" / "python"),
        "OUT": str(out),
        "WHEELS": str(wheels),
        "GPU_CHECK_WORK": str(work / "checks"),
        "GPU_CHECK_BUDGET_S": str(args.budget_s),
        "GPU_CHECK_REHEARSAL": "1",
        "CUDA_VISIBLE_DEVICES": "",  # a CPU box, even under a torch that could see a GPU
    }
    env.pop("GPU_CHECK_STARTED", None)
    env.pop("VIRTUAL_ENV", None)
    began = time.monotonic()
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh")], env=env, check=False)
    seconds = time.monotonic() - began
    wrong = verify(out, done.returncode, seconds, args.budget_s)
    print((out / "gpu-check.txt").read_text())
    print(
        f"rehearsal: $OUT {out} holds {len(files_under(out))} files; gpu-check.sh took "
        f"{seconds:.0f} s (deadline {args.budget_s:.0f}), "
        f"all told {time.monotonic() - started:.0f} s"
    )
    for line in wrong:
        print(f"rehearsal: FAIL: {line}", file=sys.stderr)
    print("rehearsal: " + ("FAIL" if wrong else "PASS"), flush=True)
    return 1 if wrong else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-s", type=float, default=240.0, help="gpu-check.sh's deadline")
    parser.add_argument("--wheels", help="a set already built (else built into --work)")
    parser.add_argument("--work", default="/tmp/meshrun-gpu-rehearsal")
    return parser


if __name__ == "__main__":
    sys.exit(main())
