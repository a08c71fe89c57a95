"""What torchft's replicas cost and buy (issue 36), in one run on this host:

- **a step without a fault**: `parallel=ddp` on 2 ranks against the same run as 2 torchft
  replicas (parallel.fault_tolerance=torchft: a synchronous quorum through the lighthouse,
  the gradients' all-reduce after the backward, the commit), `--rounds` of each alternating:
  median step time, torchft over DDP, for model=tiny (where the quorum's fixed cost shows
  most) and model=small.
- **a killed replica**: replica 1 SIGKILLed mid-run: the step it died in (the live replica's
  wait for its heartbeat to lapse), the steps trained with one replica, the time from the
  kill to the restarted replica's first step beside the live one.

    .venv/bin/python -m benchmarks.fault_tolerance     # ~3 min on 2 cores

Writes outputs/benchmarks/fault_tolerance.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from benchmarks.common import meshrun_results
from meshrun.core.paths import REPO_ROOT

COMMON = ["parallel=ddp", "launcher.nproc_per_node=2", "train.untimed_steps=2"]
TORCHFT = "parallel.fault_tolerance=torchft"


def step_cost(model: str, steps: int, rounds: int, work: Path) -> dict:
    plain, replicas = [], []
    for i in range(rounds):  # alternating, so drift hits both alike
        common = [*COMMON, f"model={model}", f"train.steps={steps}"]
        plain.append(meshrun_results(common, work / f"{model}-ddp-{i}")["step_time_s"])
        replicas.append(
            meshrun_results([*common, TORCHFT], work / f"{model}-ft-{i}")["step_time_s"]
        )
    return {
        "ddp_step_s": plain,
        "torchft_step_s": replicas,
        "torchft_over_ddp": statistics.median(replicas) / statistics.median(plain),
        "added_ms": (statistics.median(replicas) - statistics.median(plain)) * 1e3,
    }


def kill_cost(work: Path) -> dict:
    kill_step, steps = 10, 80
    run = meshrun_results(
        [*COMMON, TORCHFT, "model=tiny", f"train.steps={steps}", "train.log_every=5",
         "debug.fail_rank=1", f"debug.fail_step={kill_step}", "debug.fail_mode=kill",
         "debug.slow_step_s=0.05"],
        work / "kill",
    )  # fmt: skip
    records = [json.loads(line) for line in (work / "kill" / "meshrun" / "metrics.jsonl").open()]
    times = {r["step"]: r["step_time_s"] for r in records}
    back = next(r["step"] for r in records if r["step"] > kill_step and r["replicas"] == 2)
    others = [t for s, t in times.items() if t is not None and s != kill_step]
    return {
        "failures": run["replica_failures"],
        "kill_step_s": times[kill_step],
        "median_step_s": statistics.median(others),
        "steps_with_one_replica": run["steps_with_fewer_replicas"],
        "kill_to_rejoin_s": sum(times[s] for s in range(kill_step, back)),
        "rejoined_at_step": back,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        out["tiny"] = step_cost("tiny", 40, args.rounds, work)
        out["small"] = step_cost("small", 12, args.rounds, work)
        out["kill"] = kill_cost(work)
    for model in ("tiny", "small"):
        cost = out[model]
        ft, ddp = statistics.median(cost["torchft_step_s"]), statistics.median(cost["ddp_step_s"])
        print(
            f"model={model}: torchft {ft:.4f} s vs ddp {ddp:.4f} s a step "
            f"({cost['torchft_over_ddp']:.3f}x, {cost['added_ms']:+.1f} ms)"
        )
    kill = out["kill"]
    print(
        f"killed replica: its step took {kill['kill_step_s']:.2f} s (median step "
        f"{kill['median_step_s']:.3f} s incl. 0.05 s sleep); {kill['steps_with_one_replica']} "
        f"steps with one replica; rejoined at step {kill['rejoined_at_step']}, "
        f"{kill['kill_to_rejoin_s']:.2f} s after the kill"
    )
    path = REPO_ROOT / "outputs" / "benchmarks" / "fault_tolerance.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
