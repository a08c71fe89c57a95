"""What a `meshrun` command's ranks spend importing the driver's main module again: the same
short run (model=tiny, DDP on 2 gloo ranks, forkserver) started through the console script,
whose main module imports nothing (meshrun/entrypoints.py), and through
`python -m meshrun.driver.cli`, whose main module is the command (as the console script's was
before), in ABAB... rounds.

multiprocessing starts every rank by importing the driver's main module as `__mp_main__`;
the difference of the two commands' CPU seconds (the driver's, its forkserver's and the
ranks', all waited for) is that import, times the ranks. Writes
outputs/benchmarks/rank_start.json.

    .venv/bin/python benchmarks/rank_start.py              # ~1 min on 2 idle cores
    .venv/bin/python benchmarks/rank_start.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from meshrun.core.paths import REPO_ROOT

RANKS = 2
COMMANDS = {
    "console script": [str(Path(sys.executable).with_name("meshrun"))],
    "python -m meshrun.driver.cli": [sys.executable, "-m", "meshrun.driver.cli"],
}
RUN = (
    "model=tiny",
    "parallel=ddp",
    f"launcher.nproc_per_node={RANKS}",
    "train.steps=2",
    "train.untimed_steps=1",
    "metrics.baseline=off",
    "logger=none",
    "train.progress_bar=false",
)


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def cpu_s(command: list[str]) -> float:
    """CPU seconds of one run: the driver, its forkserver and the ranks (the launcher waits
    for the server at exit, so the ranks' time reaches the driver's rusage, and ours)."""
    with tempfile.TemporaryDirectory() as work:
        before = _children_cpu_s()
        subprocess.run(
            [*command, f"hydra.run.dir={work}/run", f"store.path={work}/meshrun.db", *RUN],
            check=True,
            capture_output=True,
            cwd=REPO_ROOT,
        )
        return _children_cpu_s() - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--out", type=Path, default=REPO_ROOT / "outputs/benchmarks/rank_start.json"
    )
    args = parser.parse_args()
    rounds: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.rounds):
        for name, command in COMMANDS.items():
            rounds[name].append(cpu_s(command))
    light, heavy = (statistics.median(rounds[name]) for name in COMMANDS)
    summary = {
        "rounds": rounds,
        "median_cpu_s": {name: statistics.median(values) for name, values in rounds.items()},
        "ratio": light / heavy,
        "saved_per_rank_cpu_s": (heavy - light) / RANKS,
    }
    for name, values in rounds.items():
        print(f"{name:30s} CPU s per run: {' '.join(f'{v:.2f}' for v in values)}")
    print(
        f"ratio {summary['ratio']:.3f}; saved per rank {summary['saved_per_rank_cpu_s']:.2f} CPU s"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
