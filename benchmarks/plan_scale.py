"""Planning time of `meshrun-plan` against the cluster's size: the whole space searched for
1, 8, 64, 512 and 1,024 nodes of 8 GPUs, in this process (the interpreter's and Hydra's start
left out: the same for every size), each size planned `--rounds` times, the median kept.

Prints per size: ranks, layouts ranked, variants ruled out by the rules, the median
seconds, the top row; writes outputs/benchmarks/plan_scale.json.

    .venv/bin/python benchmarks/plan_scale.py                      # gpt3-175b on a100-80g
    .venv/bin/python benchmarks/plan_scale.py --model llama-13b --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from rich.console import Console
from rich.table import Table

from meshrun.core.hardware import HostFacts
from meshrun.core.paths import CONF_DIR, REPO_ROOT
from meshrun.driver.schemas import register_schemas
from meshrun.tools.plan.command import given_keys, plan

NODES = (1, 8, 64, 512, 1024)


def plan_once(model: str, hardware: str, nodes: int) -> tuple[float, Any, Any]:
    overrides = [f"model={model}", f"hardware={hardware}", f"launcher.nnodes={nodes}"]
    paths = ["run_dir=/tmp/meshrun-plan-scale", "store.path=/tmp/meshrun-plan-scale.db"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = OmegaConf.to_object(compose("plan", overrides=[*overrides, *paths]))
    started = time.perf_counter()
    box, found, _ = plan(cfg, HostFacts.detect(), given_keys(overrides))
    return time.perf_counter() - started, box, found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt3-175b")
    parser.add_argument("--hardware", default="a100-80g")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    register_schemas()
    rows = []
    for nodes in NODES:
        times = []
        for _ in range(args.rounds):
            seconds, box, found = plan_once(args.model, args.hardware, nodes)
            times.append(seconds)
        fitting = [c for c in found.ranked if c.fits]
        rows.append(
            {
                "nodes": nodes,
                "ranks": box.world,
                "ranked": len(found.ranked),
                "fit": len(fitting),
                "ruled_out": sum(found.ruled_out.values()),
                "seconds": statistics.median(times),
                "rounds": times,
                "top": fitting[0].label if fitting else None,
            }
        )
    table = Table(title=f"meshrun-plan: {args.model} on N x {args.hardware}, whole space")
    for column in (
        "nodes",
        "ranks",
        "layouts ranked",
        "fit",
        "variants ruled out",
        "seconds",
        "top row",
    ):
        table.add_column(column, justify="left" if column == "top row" else "right")
    for r in rows:
        table.add_row(
            str(r["nodes"]),
            str(r["ranks"]),
            str(r["ranked"]),
            str(r["fit"]),
            str(r["ruled_out"]),
            f"{r['seconds']:.2f}",
            r["top"] or "-",
        )
    Console(width=160).print(table)
    out = REPO_ROOT / "outputs" / "benchmarks" / "plan_scale.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"model": args.model, "hardware": args.hardware, "rows": rows}, indent=2)
    )
    print(f"written: {Path(out).relative_to(REPO_ROOT)}")


if __name__ == "__main__":
    main()
