"""scripts/build-gpu-wheels.sh's work: the wheels an offline GPU image needs beyond what it has.

The image (../shared/gpu-node-image.md: its packages, `==` where the version was seen) keeps
its own CUDA torch and everything around it; meshrun's needs are resolved here against the
image's versions (a constraints file), and only what the image lacks, or has too old, is
carried. Each resolved package falls in one of these kinds:

  cuda      torch, triton, nvidia-*, cuda-*: the image's CUDA stack, never carried (an
            offline install must not touch it)
  torch     needed only by the CUDA stack (sympy, networkx, jinja2, ...): there with torch
  image     on the image at the resolved version (pinned by the constraints)
  newer     on the image, older than meshrun needs (NEWER: said why): carried
  assumed   on the image, its version unknown, a large wheel: not carried, assumed to satisfy
            (named in the summary: the first place to look if the offline install fails)
  fallback  on the image, its version unknown, a small wheel: carried; pip keeps the
            image's copy where it satisfies, so this is used only where it does not
  new       not on the image: carried

Stdlib only, with uv (`uv pip compile`) resolving and pip downloading.

    python3 scripts/gpu_wheels.py DIR [--image FILE] [--python-version 3.12] [--uv UV]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
IMAGE = ROOT.parent / "shared" / "gpu-node-image.md"
MiB = 2**20
LIMIT_MIB = 60.0  # the tree and the set: the device tool carries 64 MiB, 4 left spare
FALLBACK_MAX = 1 * MiB  # an unknown-version image package's wheel carried below this size
CUDA_PREFIXES = ("nvidia-", "cuda-")
CUDA_NAMES = {"torch", "triton"}
# The image's packages meshrun needs newer than the image has, and why (the resolution then
# leaves their pins out and carries what it picks).
NEWER = {"transformers": "pyproject.toml's hf extra needs transformers>=5.18; the image has 5.17"}
# meshrun's core needs not on the image: installed first, apart, and checked by import before
# any check runs (gpu-check.sh stops at once without them).
CORE = ("hydra-core", "omegaconf", "submitit")
PLATFORMS = ("manylinux_2_28", "manylinux_2_27", "manylinux_2_17", "manylinux2014", "linux")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_packages(text: str) -> dict[str, str | None]:
    """The image's packages from its description's fenced list: name -> version (None where
    the list gives none), a local label (+cu130) dropped."""
    block = re.search(r"^```\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    if block is None:
        raise SystemExit("gpu_wheels: the image description has no fenced package list")
    found: dict[str, str | None] = {}
    for line in block.group(1).split():
        name, _, version = line.partition("==")
        found[norm(name)] = version.split("+")[0] or None
    return found


def constraints(image: dict[str, str | None]) -> list[str]:
    """The image's versions as pip constraints, but for the packages meshrun needs newer."""
    return [f"{n}=={v}" for n, v in sorted(image.items()) if v and n not in NEWER]


def requirements(pyproject: dict) -> tuple[list[str], list[str]]:
    """(core, extras): meshrun's dependencies without torch, and what the checks need beyond
    them: the hf, ft, float8 and liger extras, pytest and pytest-timeout."""
    project = pyproject["project"]
    extras = project["optional-dependencies"]
    core = [r for r in project["dependencies"] if _name(r) != "torch"]
    more = [*extras["hf"], *extras["ft"], *extras["float8"], *extras["liger"]]
    more += [r for r in extras["dev"] if _name(r) in {"pytest", "pytest-timeout"}]
    return core, more


def _name(requirement: str) -> str:
    return norm(re.match(r"[A-Za-z0-9_.-]+", requirement)[0])


def parse_lock(text: str) -> tuple[dict[str, str], dict[str, set[str]]]:
    """`uv pip compile`'s output: name -> version, and name -> the packages it is there for
    ('-r ...' for a requirement of ours)."""
    pins: dict[str, str] = {}
    parents: dict[str, set[str]] = {}
    current = None
    for line in text.splitlines():
        pin = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line)
        if pin:
            current = norm(pin[1])
            pins[current] = pin[2]
            parents[current] = set()
            inline = re.search(r"#\s*via (\S+)", line)
            if inline:
                parents[current].add(norm(inline[1]))
            continue
        via = re.match(r"^\s+#\s+(?:via )?(\S+)", line)
        if via and current and via[1] != "via":
            parents[current].add(via[1] if via[1].startswith("-") else norm(via[1]))
    return pins, parents


def is_cuda(name: str) -> bool:
    return name in CUDA_NAMES or name.startswith(CUDA_PREFIXES)


def torch_only(parents: dict[str, set[str]]) -> set[str]:
    """Packages there only for the CUDA stack, transitively (sympy for torch, mpmath for
    sympy)."""
    only: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, via in parents.items():
            if name in only or is_cuda(name) or not via:
                continue
            if all(is_cuda(p) or p in only for p in via):
                only.add(name)
                changed = True
    return only


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    kind: str  # cuda | torch | image | newer | assumed | fallback | new
    wheel: str | None = None
    size: int = 0

    @property
    def carried(self) -> bool:
        return self.kind in {"newer", "fallback", "new"}


def kind_of(name: str, version: str, image: dict[str, str | None], only: set[str]) -> str:
    """The kind before sizes are known (an unknown-version image package: `unknown`)."""
    if is_cuda(name):
        return "cuda"
    if name in only:
        return "torch"
    if name not in image:
        return "new"
    if name in NEWER:
        return "newer"
    if image[name] is None:
        return "unknown"
    if image[name] != version:  # the constraints pinned it: a resolution that moved it is wrong
        raise SystemExit(f"gpu_wheels: {name} resolved to {version}, the image has {image[name]}")
    return "image"


def sized(name: str, version: str, kind: str, wheel: Path) -> Package:
    size = wheel.stat().st_size
    if kind == "unknown":
        kind = "fallback" if size <= FALLBACK_MAX else "assumed"
    return Package(name, version, kind, wheel.name, size)


def tree_bytes(root: Path) -> int:
    """What the device tool carries of the tree: tracked files and untracked ones git does not
    ignore."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=root, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    return sum((root / p).stat().st_size for p in listed if p and (root / p).is_file())


def over_limit(carried: list[Package], tree: int, limit_mib: float = LIMIT_MIB) -> str | None:
    """Why the set and the tree do not fit what is carried (None: they do)."""
    total = sum(p.size for p in carried) + tree
    if total <= limit_mib * MiB:
        return None
    largest = sorted(carried, key=lambda p: -p.size)[:5]
    named = ", ".join(f"{p.wheel} {p.size / MiB:.1f}" for p in largest)
    return (
        f"the set ({len(carried)} wheels) and the tree ({tree / MiB:.1f} MiB) make "
        f"{total / MiB:.1f} MiB, over {limit_mib:.0f}; the largest wheels (MiB): {named}"
    )


def _run(argv: list[str], **kw) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=False, **kw)
    if done.returncode:
        raise SystemExit(f"gpu_wheels: {' '.join(argv[:4])} ... failed:\n{done.stderr[-3000:]}")
    return done.stdout


def resolve(uv: str, reqs: list[str], cons: list[str], python: str, work: Path) -> str:
    (work / "requirements.in").write_text("\n".join(reqs) + "\n")
    (work / "image-constraints.txt").write_text("\n".join(cons) + "\n")
    return _run([
        uv, "pip", "compile", "--quiet", "--python-version", python,
        "--python-platform", "x86_64-manylinux_2_28", "-c", str(work / "image-constraints.txt"),
        str(work / "requirements.in"), "--no-header",
    ])  # fmt: skip


def download(pins: dict[str, str], python: str, into: Path) -> dict[str, Path]:
    """Each pinned package's wheel for the image's platform (pip, no dependencies: the
    resolution is uv's). A package on PyPI as a source archive only (antlr4, hydra-core's
    parser) is built into a wheel here."""
    platforms = [a for p in PLATFORMS for a in ("--platform", f"{p}_x86_64")]
    wanted = [f"{n}=={v}" for n, v in sorted(pins.items())]
    _run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
         "--python-version", python, "--implementation", "cp", *platforms, "-d", str(into),
         *[w for w in wanted if not w.startswith("antlr4")]],
    )  # fmt: skip
    for source_only in (w for w in wanted if w.startswith("antlr4")):
        _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(into),
              source_only])  # fmt: skip
    wheels = {norm(w.name.split("-")[0]): w for w in into.glob("*.whl")}
    missing = sorted(set(pins) - set(wheels))
    if missing:
        raise SystemExit(f"gpu_wheels: no wheel downloaded for {', '.join(missing)}")
    return wheels


def build(out: Path, image_file: Path, python: str, uv: str) -> list[Package]:
    if not image_file.is_file():
        raise SystemExit(f"gpu_wheels: no description of the GPU image at {image_file} (--image)")
    image = image_packages(image_file.read_text())
    core, extras = requirements(tomllib.loads((ROOT / "pyproject.toml").read_text()))
    with tempfile.TemporaryDirectory(prefix="meshrun-gpu-wheels.") as tmp:
        work = Path(tmp)
        lock = resolve(uv, core + extras, constraints(image), python, work)
        pins, parents = parse_lock(lock)
        only = torch_only(parents)
        kinds = {n: kind_of(n, v, image, only) for n, v in pins.items()}
        fetch = {n: v for n, v in pins.items() if kinds[n] in {"new", "newer", "unknown"}}
        wheels = download(fetch, python, work / "wheels")
        packages = [
            sized(n, v, kinds[n], wheels[n]) if n in fetch else Package(n, v, kinds[n])
            for n, v in sorted(pins.items())
        ]
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        for p in packages:
            if p.carried:
                shutil.copy2(work / "wheels" / p.wheel, out / p.wheel)
    _write_lists(out, packages, core, extras)
    return packages


def _write_lists(out: Path, packages: list[Package], core: list[str], extras: list[str]) -> None:
    """core.txt and extras.txt (what gpu-check.sh installs, in two steps), constraints.txt
    (every version resolved here, so pip there takes the same), manifest.json (each package's
    kind, for the rehearsal and the reader)."""
    (out / "core.txt").write_text("\n".join(r for r in core if _name(r) in CORE) + "\n")
    (out / "extras.txt").write_text("\n".join([*core, *extras]) + "\n")
    pinned = [f"{p.name}=={p.version}" for p in packages if not is_cuda(p.name)]
    (out / "constraints.txt").write_text("\n".join(pinned) + "\n")
    (out / "manifest.json").write_text(json.dumps([asdict(p) for p in packages], indent=1) + "\n")


def summary(packages: list[Package], tree: int) -> str:
    carried = [p for p in packages if p.carried]
    total = sum(p.size for p in carried)
    by = lambda kind: ", ".join(p.name for p in packages if p.kind == kind) or "none"  # noqa: E731
    lines = [
        f"carried: {len(carried)} wheels, {total / MiB:.1f} MiB; with the tree "
        f"({tree / MiB:.1f} MiB) {(total + tree) / MiB:.1f} MiB of {LIMIT_MIB:.0f}",
        *[f"newer than the image's: {n} ({why})" for n, why in NEWER.items()],
        f"assumed on the image (version unknown, not carried): {by('assumed')}",
        f"carried in case the image's is too old (version unknown): {by('fallback')}",
        f"the image's at the same version: {by('image')}",
        f"left to the image's torch: {by('cuda')}; {by('torch')}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default="outputs/gpu-wheels")
    parser.add_argument("--image", default=str(IMAGE))
    parser.add_argument("--python-version", default=os.environ.get("GPU_PYTHON_VERSION", "3.12"))
    parser.add_argument("--uv", default=shutil.which("uv") or str(ROOT / ".venv" / "bin" / "uv"))
    args = parser.parse_args(argv)
    packages = build(Path(args.out), Path(args.image), args.python_version, args.uv)
    tree = tree_bytes(ROOT)
    print(summary(packages, tree))
    why = over_limit([p for p in packages if p.carried], tree)
    if why:
        print(f"gpu_wheels: {why}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
