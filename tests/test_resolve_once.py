"""One resolution a run (driver/resolve.py): `meshrun` resolves once, reading a pretrained
directory and preparing data once, the profile's box and the ranks' host checked within
that one call; the RunPlan keeps the settings as composed beside the config the ranks get;
the record reads the prediction the resolution made; `meshrun-plan show=resolved` prints
the plan without launching."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import pytest

from meshrun.core.baseline import baseline_config
from meshrun.core.config import with_resolved
from meshrun.core.errors import ConfigError
from meshrun.core.hardware import CudaDevice, HostFacts
from meshrun.core.stages import with_layers
from meshrun.driver import cli
from meshrun.driver import resolve as resolve_module
from meshrun.driver.measured import RunMeta
from meshrun.driver.resolve import resolve
from meshrun.driver.results import config_fields, predicted_memory_fields, predicted_speed_fields
from meshrun.driver.run_plan import checkpoint_plan_fields, plain
from meshrun.plan import predict
from meshrun.plan.run_prediction import predict_checkpoint
from meshrun.tools.plan import command as plan_command
from tests.cli import compose_command, run_console
from tests.helpers import compose_config

H100 = CudaDevice("NVIDIA H100 80GB HBM3", 79.11)
TWO_GPUS = HostFacts([H100, H100], cpu_count=16, memory_gib=128.0)


class Counted:
    """`function`, its calls counted."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function, self.calls = function, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.function(*args, **kwargs)


def test_meshrun_resolves_once_and_reads_and_prepares_once(tmp_path, monkeypatch):
    resolves = Counted(cli.resolve)
    reads = Counted(resolve_module.read_pretrained)
    prepares = Counted(resolve_module.prepare_data)
    monkeypatch.setattr(cli, "resolve", resolves)
    monkeypatch.setattr(resolve_module, "read_pretrained", reads)
    monkeypatch.setattr(resolve_module, "prepare_data", prepares)
    started: list[Callable[[], Any]] = []  # the run itself is not what is counted here
    monkeypatch.setattr(cli, "reported", lambda run: started.append(run) or 0)
    composed = compose_command(
        "train", tmp_path / "run", f"store.path={tmp_path}/m.db", "logger=none", "train.steps=4"
    )
    assert cli.run(composed) == 0
    assert (resolves.calls, reads.calls, prepares.calls, len(started)) == (1, 1, 1, 1)


def test_the_profiles_box_is_checked_within_the_one_resolution():
    """cp=-1 is 8 on the profile's box (an H100 node) and 2 on this host: a sequence of 12
    tokens cuts into 2 x 2 chunks, not 2 x 8; the one call refuses it, as the run on the
    profile's box would."""
    layout = ("parallel=ddp", "parallel.dp_replicate=1", "parallel.cp=-1", "train.seq_len=12")
    cfg = compose_config("hardware=h100-80g", *layout, "metrics.baseline=off")
    with pytest.raises(ConfigError) as err:
        resolve(cfg, TWO_GPUS)
    assert (err.value.key, err.value.value) == ("train.seq_len", 12)
    on_host = compose_config("hardware=auto", *layout, "metrics.baseline=off")
    assert resolve(on_host, TWO_GPUS).config.parallel.cp == 2


def test_the_plan_keeps_the_settings_and_fills_the_config_the_ranks_get(tmp_path):
    settings = compose_config(f"run_dir={tmp_path}/run", f"store.path={tmp_path}/m.db")
    plan = resolve(settings, HostFacts.detect())
    assert plan.settings is settings and settings.backend.name == "auto"
    assert (plan.ranks, plan.prediction) == (2, plan.config.resolved.prediction)
    assert plan.config.backend.name == "gloo" and plan.config.launcher.nproc_per_node == 2
    assert plan.config.resolved.settings == plain(settings)
    assert plan.as_dict()["filled"]["backend.name"] == ["auto", "gloo"]
    assert config_fields(plan.config, RunMeta())["settings"] == plain(settings)


def test_the_record_reads_the_prediction_the_resolution_made(tmp_path):
    cfg = resolve(compose_config(f"store.path={tmp_path}/m.db"), HostFacts.detect()).config
    made = cfg.resolved.prediction
    assert made.memory == [m.as_dict() for m in predict.memory(cfg)]
    marked = dataclasses.replace(
        made, tokens_per_s=123.0, memory=[{**m, "peak": 7} for m in made.memory]
    )
    cfg = with_resolved(cfg, prediction=marked)
    fields = predicted_memory_fields(cfg) | predicted_speed_fields(cfg)
    assert (fields["predicted_peak_memory_bytes"], fields["predicted_tokens_per_s"]) == (7, 123.0)
    # a run that saves: its checkpoint, predicted with the rest and read by the record
    saves = compose_config(f"store.path={tmp_path}/m.db", "checkpoint.every_steps=2")
    cfg = resolve(saves, HostFacts.detect()).config
    made = cfg.resolved.prediction
    assert made.checkpoint_bytes_per_rank == predict_checkpoint(cfg).bytes_per_rank > 0
    cfg = with_resolved(cfg, prediction=dataclasses.replace(made, checkpoint_bytes_per_rank=9))
    assert checkpoint_plan_fields(cfg, None)["predicted_checkpoint_bytes_per_rank"] == 9
    # another layout's config carries none: predicted where it is recorded
    assert baseline_config(cfg).resolved.prediction is None
    assert with_layers(cfg, [1]).resolved.prediction is None


def test_meshrun_plan_show_resolved_prints_the_run_plan(tmp_path):
    out = tmp_path / "resolved.json"
    run = run_console(
        plan_command.main,
        tmp_path / "plan",
        tmp_path / "m.db",
        "show=resolved",
        f"json={out}",
        f"run_dir={tmp_path}/run",
        defaults=(),
    )
    assert run.returncode == 0, run.output
    shown = json.loads(out.read_text())
    assert (shown["layout"], shown["backend"], shown["ranks_per_node"]) == ("ddp2", "gloo", 2)
    assert shown["prediction"]["memory"] and "filled:" in run.output
    assert not (tmp_path / "run" / "results.json").exists()  # nothing launched
    refused = run_console(plan_command.main, tmp_path / "p2", None, "show=nope", defaults=())
    assert refused.returncode == 2 and "show" in refused.output
