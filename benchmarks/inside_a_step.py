"""What looking inside a step costs (issue 35), in one run on this host:

- **the hot path's additions, every step**: meshrun's named ranges (record_function, about a
  dozen a step with no profiler running) and the busy clock's two CPU-time reads: time of
  `--steps` steps' worth of them against a measured ddp step of the model: the share of a step.
- **the flight recorder**: 2 gloo ranks all-reducing 4 KiB `--collectives` times with
  torch's recorder off (TORCH_FR_BUFFER_SIZE=0) and on (meshrun's 2,000 entries), rounds
  alternating: time per collective, on over off.
- **a profiled step**: a pp2 run with `debug.profile_steps` over two of its timed steps: the
  profiled steps' time over the others' (the record's profile_overhead), and the unprofiled
  steps' tokens/s beside a run without profiling, `--rounds` of each alternating.

    .venv/bin/python -m benchmarks.inside_a_step     # ~4 min on 2 cores

Writes outputs/benchmarks/inside_a_step.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import meshrun_results
from meshrun.core.paths import REPO_ROOT
from meshrun.rank.profiling import phase

RANGES_A_STEP = 12  # data, forward/backward per micro-batch x 2, norm, clip, optimizer, ...

FR_RANK = """
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1024)
for _ in range(50):
    dist.all_reduce(t)
dist.barrier()
start = time.perf_counter()
for _ in range(int(sys.argv[1])):
    dist.all_reduce(t)
seconds = time.perf_counter() - start
dist.barrier()
dist.destroy_process_group()
if int(os.environ["RANK"]) == 0:
    print(seconds)
"""


def hot_path_seconds(steps: int) -> float:
    """A step's worth of ranges and CPU-time reads, `steps` times; seconds a step."""
    start = time.perf_counter()
    for _ in range(steps):
        for _ in range(RANGES_A_STEP):
            with phase("benchmark"):
                pass
        time.process_time()
        time.process_time()
    return (time.perf_counter() - start) / steps


def collective_seconds(entries: int, collectives: int, work: Path) -> float:
    script = work / "fr_rank.py"
    script.write_text(FR_RANK)
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": str(entries), "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         str(script), str(collectives)],
        capture_output=True, text=True, env=env, check=False, timeout=300,
    )  # fmt: skip
    if run.returncode:
        sys.exit(f"the flight-recorder ranks failed:\n{run.stdout}{run.stderr}")
    return float(run.stdout.strip().splitlines()[-1]) / collectives


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--collectives", type=int, default=2_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fr-rounds", type=int, default=7)
    args = parser.parse_args()
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        common = ["model=small", "train.steps=12", "train.untimed_steps=2", "metrics.baseline=off"]
        ddp = meshrun_results([*common, "parallel=ddp"], work / "ddp")
        per_step = hot_path_seconds(args.steps)
        out["hot_path"] = {
            "seconds_a_step": per_step,
            "ddp_step_s": ddp["step_time_s"],
            "share_of_a_step": per_step / ddp["step_time_s"],
        }
        off, on = [], []
        for _ in range(args.fr_rounds):
            off.append(collective_seconds(0, args.collectives, work))
            on.append(collective_seconds(2000, args.collectives, work))
        out["flight_recorder"] = {
            "off_us": [s * 1e6 for s in off],
            "on_us": [s * 1e6 for s in on],
            "on_over_off": statistics.median(on) / statistics.median(off),
        }
        pp = [*common, "parallel=pp2", "train.steps=14"]
        plain, traced = [], []
        for i in range(args.rounds):  # alternating, so drift hits both alike
            plain.append(meshrun_results(pp, work / f"pp2-{i}"))
            profiled = [*pp, "debug.profile_steps=[6,7]"]
            traced.append(meshrun_results(profiled, work / f"pp2-profiled-{i}"))
        pairs = zip(plain, traced, strict=True)
        speeds = [t["tokens_per_s"] / p["tokens_per_s"] for p, t in pairs]
        out["profiled_step"] = {
            "profile_overhead": statistics.median(t["profile_overhead"] for t in traced),
            "tokens_per_s_unprofiled_steps": [t["tokens_per_s"] for t in traced],
            "tokens_per_s_without_profiling": [p["tokens_per_s"] for p in plain],
            "ratios": speeds,
            "ratio": statistics.median(speeds),
        }
    hot, fr, prof = out["hot_path"], out["flight_recorder"], out["profiled_step"]
    print(
        f"hot path: {hot['seconds_a_step'] * 1e6:.1f} us a step = "
        f"{hot['share_of_a_step']:.3%} of a ddp step of model=small ({hot['ddp_step_s']:.3f} s)"
    )
    print(
        f"flight recorder: {statistics.median(fr['on_us']):.1f} us on vs "
        f"{statistics.median(fr['off_us']):.1f} us off a 4 KiB all-reduce "
        f"({fr['on_over_off']:.3f}x)"
    )
    print(
        f"profiled steps: {prof['profile_overhead']:+.1%} step time (median of the rounds); "
        f"the run's other steps against a run without profiling, tokens/s: "
        f"{', '.join(f'{r:.3f}x' for r in prof['ratios'])} (median {prof['ratio']:.3f}x)"
    )
    path = REPO_ROOT / "outputs" / "benchmarks" / "inside_a_step.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
