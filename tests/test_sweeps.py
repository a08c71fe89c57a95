"""The ready sweeps in sweeps/: each composes as `+sweeps=<name>` and declares a grid whose
points meshrun either accepts or refuses for a swept key; the W&B sweep definition expands,
the way a W&B agent expands it, into commands meshrun accepts; a sweep's job that fails or is
refused does not stop the sweep, a single run's bad config still does (test_config_errors)."""

from __future__ import annotations

import itertools
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from hydra import compose, initialize_config_dir
from wandb.sdk.launch.sweeps.utils import create_sweep_command, create_sweep_command_args

import meshrun.driver.cli  # noqa: F401  (registers the `sweep` group, as the entrypoint does)
from meshrun.core.errors import ConfigError
from meshrun.core.paths import CONF_DIR
from meshrun.driver.sinks.wandb_sink import SUMMARY_KEYS
from meshrun.driver.sweep import SWEEPS_DIR
from tests.cli import MULTIRUN, run_meshrun
from tests.helpers import resolved_config
from tests.wandb_records import read_offline_run

SWEEPS = sorted(p.stem for p in SWEEPS_DIR.glob("*.yaml"))
WANDB_SWEEP = SWEEPS_DIR / "wandb" / "batch_microbatch.yaml"
TINY = ("model=tiny", "train.steps=3", "train.untimed_steps=1", "train.seq_len=32")


def hydra_grid(name: str) -> dict[str, list[str]]:
    """hydra.sweeper.params of `meshrun -m +sweeps=<name>`, as composed by Hydra."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            "train", overrides=[f"+sweeps={name}", "logger=none"], return_hydra_config=True
        )
    assert Path(str(cfg.hydra.sweep.dir)).name.startswith(f"{name}_")
    return {k: str(v).split(",") for k, v in cfg.hydra.sweeper.params.items()}


def points(grid: dict[str, list[Any]]) -> list[tuple[str, ...]]:
    return [
        tuple(f"{k}={v}" for k, v in zip(grid, values, strict=True))
        for values in itertools.product(*grid.values())
    ]


def accepted(point: tuple[str, ...], swept: set[str]) -> bool:
    """True if meshrun's validation accepts the point; a refusal must name a swept key."""
    try:
        resolved_config(*point)
    except ConfigError as err:
        assert err.key in swept or err.key.split(".")[0] in swept, err
        return False
    return True


def test_a_sweep_is_named_by_the_sweep_key_beside_a_ready_sweep():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["+sweeps=layouts", "sweep=my-grid", "logger=none"])
    assert cfg.sweep == "my-grid"


@pytest.mark.parametrize("name", SWEEPS)
def test_each_sweep_composes_and_its_points_are_accepted_or_refused_for_a_swept_key(name):
    grid = hydra_grid(name)
    assert grid and all(len(values) > 1 for values in grid.values())
    verdicts = [accepted(point, set(grid)) for point in points(grid)]
    assert any(verdicts)  # every ready sweep runs something on this CPU host


def wandb_sweep() -> dict[str, Any]:
    return yaml.safe_load(WANDB_SWEEP.read_text())


def agent_command(definition: dict[str, Any], values: dict[str, Any]) -> list[str]:
    """The command line a W&B agent runs for one point (wandb_agent.Agent._command_run)."""
    args = create_sweep_command_args({"args": {k: {"value": v} for k, v in values.items()}})
    macros = {
        **args,
        "env": ["/usr/bin/env"],
        "interpreter": ["python"],
        "program": [definition["program"]],
    }
    command = []
    for part in create_sweep_command(definition["command"]):
        command += macros[part[2:-1]] if part.startswith("${") else [part]
    return command


def wandb_points() -> list[dict[str, Any]]:
    params = wandb_sweep()["parameters"]
    return [
        dict(zip(params, values, strict=True))
        for values in itertools.product(*(p["values"] for p in params.values()))
    ]


def test_wandb_sweep_is_the_hydra_grid_and_optimizes_a_logged_metric():
    definition = wandb_sweep()
    assert definition["method"] == "grid"
    assert definition["metric"]["name"] in SUMMARY_KEYS
    hydra = hydra_grid("batch_microbatch")
    assert {k: [str(v) for v in p["values"]] for k, p in definition["parameters"].items()} == hydra


def test_wandb_agent_commands_are_meshrun_overrides_it_accepts():
    definition = wandb_sweep()
    swept = set(definition["parameters"])
    verdicts = []
    for values in wandb_points():
        command = agent_command(definition, values)
        assert command[:2] == ["/usr/bin/env", "meshrun"]
        assert command[2:] == [f"{k}={v}" for k, v in values.items()]  # Hydra overrides
        verdicts.append(accepted((*TINY, *command[2:]), swept))
    assert any(verdicts) and not all(verdicts)


@pytest.mark.slow
def test_wandb_agent_runs_record_one_sweep_and_skip_invalid_points(tmp_path):
    """The agent's command for real, in the agent's environment (meshrun on PATH, the sweep id
    in WANDB_SWEEP_ID): a valid point runs, an invalid one is recorded as skipped (exit 0, so
    the agent does not count it as a crash), both under the sweep's name."""
    definition = wandb_sweep()
    valid, invalid = [], []
    for values in wandb_points():
        cmd = agent_command(definition, values)
        (valid if accepted((*TINY, *cmd[2:]), set(values)) else invalid).append(cmd)
    sweep_id = uuid.uuid4().hex[:8]
    env = {
        "WANDB_SWEEP_ID": sweep_id,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    runs = [
        run_meshrun(
            tmp_path / name,
            tmp_path / "meshrun.db",
            *TINY,
            *cmd[2:],
            "metrics.baseline=off",  # the speedup is not what this test is about
            "logger=wandb",
            "logger.mode=offline",
            entrypoint=tuple(cmd[:2]),
            env=env,
        )
        for name, cmd in (("valid", valid[0]), ("invalid", invalid[0]))
    ]
    for run in runs:
        assert run.returncode == 0, run.output
        assert read_offline_run(run.run_dir)["run"]["group"] == f"wandb-{sweep_id}"
    by_status = {r["status"]: r for r in runs[0].stored() if r["role"] == "run"}
    assert set(by_status) == {"completed", "skipped"}
    assert {r["sweep"] for r in by_status.values()} == {f"wandb-{sweep_id}"}
    assert by_status["skipped"]["error"] in runs[1].output


def test_a_failing_job_does_not_stop_the_sweep_which_still_prints_its_table(tmp_path):
    grid = ("parallel=single", "debug.fail_rank=0,null", "debug.fail_step=1")
    forked = "launcher.start_method=forkserver"  # the ranks of both jobs from one server
    run = run_meshrun(
        tmp_path / "unused", tmp_path / "meshrun.db", *TINY, *grid, forked, entrypoint=MULTIRUN
    )
    assert run.returncode == 1
    assert "injected failure" in run.output
    assert "SweepJobFailed" in run.output
    rows = run.stored()
    assert sorted(r["status"] for r in rows) == ["completed", "failed"]
    [sweep_dir] = tmp_path.glob("multirun/*")
    assert {r["sweep"] for r in rows} == {sweep_dir.name}
    assert {Path(r["run_dir"]).parent for r in rows} == {sweep_dir}
    # Hydra skips the sweep's end after a failed job: the table is printed before the error
    table = run.output.index(f"sweep {sweep_dir.name}: 2 runs")
    assert all(r["run_id"] in run.output[table:] for r in rows)
    assert table < run.output.index("SweepJobFailed")
