"""A layout's ranks traced at its full size (issue 34, item 6): one process stands as one rank
of a fake process group of 1,024, runs the rank's real parallelize and a step on fake tensors
(plan/traced.py), for each pipeline stage; meshrun-plan (plan.trace) and meshrun-verify
(verify.traced) report it without the devices."""

from __future__ import annotations

import json
import re

import pytest

from meshrun.tools import verify
from meshrun.tools.plan import command as plan_command
from tests.cli import run_console

# 1,024 A100s: 128 nodes of 8
CLUSTER = ("hardware=a100-80g", "launcher=slurm", "launcher.nnodes=128")
THREE_D = (
    "model=llama-1b",
    "model.tie_embeddings=false",  # a pipeline cannot split tied weights
    "model.n_layers=4",
    "train.precision=bf16",
    "train.seq_len=2048",
    "parallel=single",
    "parallel.pp=2",
    "parallel.dp_shard=256",
    "parallel.tp=2",
    "train.global_batch_size=1024",
    "train.micro_batch_size=1",
)


def test_verify_traced_says_a_1024_rank_3d_layout_composes_and_what_each_stage_holds(tmp_path):
    run = run_console(
        verify.main,
        tmp_path / "verify",
        None,
        *THREE_D,
        *CLUSTER,
        "verify.traced=true",
        defaults=(),
    )
    assert run.returncode == 0, run.output
    assert "(1,024 ranks) composes" in run.output
    rows = [line for line in run.output.splitlines() if line.startswith("│")]
    assert len(rows) == 2  # a row a pipeline stage
    for row in rows:
        traced_peak, formula_peak = (float(c) for c in row.strip("│ ").split("│")[-2:])
        # the trace and the formulas are two predictions of one rank: here 2.33 and 1.90 GiB
        # (the trace counts what a 4-layer stage's FSDP2 gathers and buffers hold at once)
        assert traced_peak == pytest.approx(formula_peak, rel=0.3)


def test_verify_traced_refuses_a_bad_layout_before_tracing(tmp_path):
    bad = (*THREE_D, "parallel.tp=3")  # 1,536 ranks on 1,024
    run = run_console(
        verify.main, tmp_path / "verify", None, *bad, *CLUSTER, "verify.traced=true", defaults=()
    )
    assert run.returncode == 2, run.output
    assert "Valid:" in run.output
    assert "composes" not in run.output


@pytest.mark.slow  # the verify test above traces at this size in CI
def test_plan_trace_traces_the_shown_rows_at_1024_ranks(tmp_path):
    out = tmp_path / "plan.json"
    run = run_console(
        plan_command.main,
        tmp_path / "plan",
        None,
        "model=small",
        "hardware=a100-80g",
        "train.seq_len=128",  # a CPU preset: no context of its own
        "launcher.nnodes=128",
        "parallel.pp=2",
        "plan.trace=true",
        "top=2",
        f"json={out}",
        defaults=(),
    )
    assert run.returncode == 0, run.output
    # the table's traced column (its header wraps over two lines since the run-time columns)
    assert re.search(r"┃\s+traced\s+┃", run.output), run.output
    rows = json.loads(out.read_text())["layouts"]
    for row in rows[:2]:
        traced = row["traced_memory_per_stage"]
        assert len(traced) == 2 and all(stage["peak"] > 0 for stage in traced)
    assert rows[2]["traced_memory_per_stage"] is None  # beyond `top`: not traced
