"""A launcher added from outside meshrun's source, as a user adds one: a class meeting the
Launcher protocol with a schema of its own, named by its import path in a config file of the
user's own config dir (`hydra.searchpath`), as a model kind from a user's module is. It starts
the ranks its own way (plain spawned processes, torchrun's environment, the real gloo
backend) and plain `meshrun` trains and records through it. And the rule that keeps
launchers in one room: no module outside driver/launch/ selects behaviour by the name
"slurm"."""

from __future__ import annotations

import ast
import json
import multiprocessing
import os
import socket
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest

from meshrun.core.config import LAUNCHER_SCHEMAS, ExperimentConfig, LauncherConfig
from meshrun.core.errors import ConfigError, fail
from meshrun.core.paths import REPO_ROOT
from meshrun.core.run_files.failures import first_failure
from meshrun.driver.launch import RankEntry, RankFailure
from meshrun.driver.launch.launcher import Launcher, ReplicaLauncher, Submitter
from meshrun.driver.launch.registry import BUILT_IN, launcher_for
from meshrun.driver.launch.torchrun import ATTACHED
from meshrun.driver.tool_config import CommRunConfig
from tests.cli import run_meshrun

SRC = REPO_ROOT / "src" / "meshrun"
LAUNCH_ROOM = SRC / "driver" / "launch"
PLAIN = "tests.test_launcher_extension:PlainLauncher"
# A preset naming no schema holds the keys a command line overrides (Hydra sets them before
# the launcher's schema types the node), as a model kind's does.
PLAIN_YAML = f"""\
# launcher=plain: ranks as plain processes of this host
name: {PLAIN}
nnodes: 1
nproc_per_node: null
port: 0
"""
TINY = ("model=tiny", "parallel=ddp", "train.steps=4", "train.untimed_steps=1")


@dataclass
class PlainLauncherConfig(LauncherConfig):
    """launcher=plain: `port` the ranks meet on (0: a free one)."""

    name: str = PLAIN
    port: int = 0


def _rank_main(
    entry: RankEntry, cfg_dict: dict[str, Any], env: dict[str, str], out: Connection | None
) -> None:
    os.environ.update(env)
    result = entry(cfg_dict)
    if out is not None:
        out.send(result)


class PlainLauncher:
    """One spawned process per rank with torchrun's environment; rank 0's return value comes
    back through a pipe. Writes the ranks' pids to the run dir, to show whose ranks ran."""

    name = PLAIN
    schema = PlainLauncherConfig
    ranks_here = True

    def check(self, cfg: ExperimentConfig | CommRunConfig) -> LauncherConfig:
        if cfg.launcher.nnodes != 1:
            fail("launcher.nnodes", cfg.launcher.nnodes, "launcher=plain starts ranks here", "1")
        return cfg.launcher

    def waits(self, launcher: LauncherConfig, in_sweep: bool) -> bool:
        return True

    def run(self, cfg: ExperimentConfig | CommRunConfig, entry: RankEntry) -> Any:
        world = cfg.launcher.nproc_per_node
        common = {
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(cfg.launcher.port or _free_port()),
        }
        context = multiprocessing.get_context("spawn")
        result_in, result_out = context.Pipe(duplex=False)
        ranks = [
            context.Process(
                target=_rank_main,
                args=(
                    entry,
                    asdict(cfg),
                    {**common, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                    result_out if rank == 0 else None,
                ),
            )
            for rank in range(world)
        ]
        for process in ranks:
            process.start()
        result_out.close()
        (Path(cfg.run_dir) / "plain_ranks.json").write_text(json.dumps([p.pid for p in ranks]))
        try:
            result = result_in.recv()
        except EOFError:  # rank 0 ended without a result
            result = None
        for process in ranks:
            process.join()
        failed = [rank for rank, process in enumerate(ranks) if process.exitcode != 0]
        if failed:
            recorded = first_failure(cfg.run_dir)
            raise RankFailure(*recorded) if recorded else RankFailure(failed[0], "exited")
        return result


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _plain_meshrun(tmp_path: Path, *overrides: str):
    conf = tmp_path / "my_conf"
    (conf / "launcher").mkdir(parents=True)
    (conf / "launcher" / "plain.yaml").write_text(PLAIN_YAML)
    return run_meshrun(
        tmp_path / "run",
        tmp_path / "meshrun.db",
        f"hydra.searchpath=[file://{conf}]",
        "launcher=plain",
        *overrides,
        env={"PYTHONPATH": str(REPO_ROOT)},  # the user's module, importable by the ranks too
    )


@pytest.mark.slow
def test_a_launcher_from_a_test_module_trains_and_records_a_run(tmp_path: Path):
    assert isinstance(PlainLauncher(), Launcher)
    run = _plain_meshrun(tmp_path, *TINY)
    assert run.returncode == 0, run.output
    results = run.results
    assert results["status"] == "completed" and results["world_size"] == 2
    assert len(json.loads((run.run_dir / "plain_ranks.json").read_text())) == 2
    stored = [r for r in run.stored() if r["run_id"] == results["run_id"]]
    assert [r["status"] for r in stored] == ["completed"]


def test_a_launchers_own_rule_refuses_before_any_rank_starts(tmp_path: Path):
    run = _plain_meshrun(tmp_path, *TINY, "launcher.nnodes=2", "launcher.nproc_per_node=1")
    assert run.returncode == 2, run.output
    assert "launcher.nnodes=2: launcher=plain starts ranks here" in run.output
    assert not (run.run_dir / "plain_ranks.json").exists()


def test_meshruns_own_launchers_meet_the_protocol_under_their_schemas_names():
    assert isinstance(ATTACHED, Launcher) and not isinstance(ATTACHED, Submitter)
    assert isinstance(BUILT_IN["slurm"], Submitter)
    assert all(isinstance(launcher, ReplicaLauncher) for launcher in BUILT_IN.values())
    for name, launcher in BUILT_IN.items():
        assert isinstance(launcher, Launcher)
        assert launcher.name == name == launcher.schema.name
        assert LAUNCHER_SCHEMAS[name] is launcher.schema


def test_torchft_with_a_launcher_that_cannot_start_replica_groups_is_refused(tmp_path: Path):
    run = _plain_meshrun(tmp_path, *TINY, "parallel.fault_tolerance=torchft")
    assert run.returncode == 2, run.output
    assert f"launcher.name='{PLAIN}': cannot start torchft's replica groups" in run.output
    assert "Valid: local | slurm, or parallel.fault_tolerance=none" in run.output


def test_a_launcher_name_naming_nothing_is_refused_with_what_would_be_valid():
    assert isinstance(launcher_for(PLAIN), PlainLauncher)
    for name, problem in [
        ("pbs", "unknown choice"),
        ("nowhere.launchers:Pbs", "is no launcher of meshrun's, nor an importable Launcher"),
        (f"{PLAIN}Config", "is no launcher of meshrun's, nor an importable Launcher"),
    ]:
        with pytest.raises(ConfigError, match=f"launcher.name='{name}': {problem}") as caught:
            launcher_for(name)
        assert "Valid: local | slurm" in str(caught.value)


def names_slurm(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and str(node.value).lower() == "slurm"


def slurm_branches(tree: ast.AST) -> list[int]:
    """Lines that select behaviour by the name "slurm": a comparison with it (`==`, `in`
    a literal holding it), a dict key, a subscript or a `case` of it."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            listed = [
                e for o in operands if isinstance(o, ast.Tuple | ast.List | ast.Set) for e in o.elts
            ]
            hit = any(names_slurm(o) for o in operands + listed)
        elif isinstance(node, ast.Dict):
            hit = any(key is not None and names_slurm(key) for key in node.keys)
        elif isinstance(node, ast.Subscript):
            hit = names_slurm(node.slice)
        elif isinstance(node, ast.MatchValue):
            hit = names_slurm(node.value)
        else:
            hit = False
        if hit:
            lines.append(node.lineno)
    return lines


def test_no_module_outside_the_launch_room_branches_on_slurm():
    found = [
        f"{path.relative_to(SRC)}:{line}"
        for path in sorted(SRC.rglob("*.py"))
        if LAUNCH_ROOM not in path.parents
        for line in slurm_branches(ast.parse(path.read_text()))
    ]
    assert found == []


def test_no_module_outside_the_launch_room_asks_whether_a_launcher_is_slurms():
    """Beside the name: SLURM's schema is only defined (core/config.py, with what the layers
    below the driver ask of any launcher's settings) and used in the launch room; elsewhere
    an isinstance on it would be a SLURM branch by another name (4 on 752fbf4: trials' node
    pinning and wait check, rank threads, the planner's several nodes)."""
    schema_home = SRC / "core" / "config.py"
    found = [
        f"{path.relative_to(SRC)}:{node.lineno}"
        for path in sorted(SRC.rglob("*.py"))
        if LAUNCH_ROOM not in path.parents and path != schema_home
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Name) and node.id == "SlurmLauncherConfig"
    ]
    assert found == []


def test_the_walk_sees_each_form_of_a_slurm_branch():
    forms = [
        'if name == "slurm": pass',
        'ok = name in ("local", "slurm")',
        'table = {"slurm": 1}',
        'x = table["slurm"]',
        'match name:\n    case "slurm": pass',
    ]
    assert [len(slurm_branches(ast.parse(form))) for form in forms] == [1] * len(forms)
    assert (
        slurm_branches(ast.parse('fail("launcher", "slurm", "no sbatch", "launcher=local")')) == []
    )
