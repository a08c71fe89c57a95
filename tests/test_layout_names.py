"""One name per layout (core.naming.layout_name), from the resolved config through the record
to the store and the report; the overrides that run a layout again (layout_overrides) compose
back to the same name; the micro-batch count follows from train.micro_batch_size alone."""

from __future__ import annotations

import dataclasses
import shlex

import pytest

from meshrun.core.batch import n_microbatches
from meshrun.core.config import ParallelConfig
from meshrun.core.errors import ConfigError
from meshrun.core.hardware import HostFacts
from meshrun.core.naming import layout_name, layout_overrides, rerun_overrides
from meshrun.driver.measured import Measured, RunMeta
from meshrun.driver.resolution import legal_on
from meshrun.driver.results import assemble
from meshrun.driver.sinks.compare import cells
from meshrun.driver.sinks.console import console, print_summary
from meshrun.driver.sinks.selection import select_runs
from meshrun.driver.sinks.store import ResultsStore
from meshrun.driver.tool_config import RunFilter
from meshrun.plan.search import Box, search
from tests.helpers import compose_config, resolved_config

TINY = ("model=tiny", "train.global_batch_size=8", "train.micro_batch_size=2")

NAMES = {
    ("parallel=single",): "single",
    ("parallel=ddp",): "ddp2",
    ("parallel=ddp_bucket_view",): "ddp2(bucket-view)",
    ("parallel=fsdp",): "fsdp2",
    ("parallel=hsdp", "launcher.nproc_per_node=4"): "hsdp2x2",
    ("parallel=dp2_tp2",): "fsdp-replicate2 x tp2",
    ("parallel=fsdp2_tp2", "parallel.sequence_parallel=true"): "fsdp2 x tp2(sp)",
    ("parallel=tp2_pp2",): "pp2(1f1b, m=4) x tp2",
    ("parallel=dp2_pp2",): "pp2(1f1b, m=2) x fsdp-replicate2",
    (
        "parallel=pp2_interleaved",
        "train.micro_batch_size=1",
        "parallel.pp_layers=[1,1,1,1]",
    ): "pp2(interleaved_1f1b, 2 stages/rank, m=8, layers=[1,1,1,1])",
    ("parallel=pp2", "parallel.schedule=gpipe", "train.micro_batch_size=8"): "pp2(gpipe, m=1)",
    ("parallel=tp2", "parallel.activation_checkpointing=full"): "tp2, ckpt=full",
    ("parallel=fsdp", "parallel.fsdp.offload=cpu"): "fsdp2(offload)",  # issue 63's levers
    ("parallel=single", "parallel.fsdp.offload=cpu"): "fsdp1(offload)",
    ("parallel=tp2", "parallel.fsdp.offload=cpu"): "fsdp1(offload) x tp2",
    ("parallel=tp2", "parallel.activation_offload=cpu"): "tp2, activation offload",
    ("parallel=tp2", "parallel.activation_checkpointing=op"): "tp2, ckpt=op",
    ("parallel=ddp", "parallel.activation_checkpointing=full", "parallel.checkpoint_every=2"): (
        "ddp2, ckpt=full/2"
    ),
    ("parallel=cp2",): "cp2(ring)",
    ("parallel=fsdp2_cp2", "launcher.nproc_per_node=4"): "fsdp2 x cp2(ring)",
    ("parallel=tp2_cp2", "launcher.nproc_per_node=4"): "cp2(ring) x tp2(sp)",
    ("parallel=cp2", "parallel.cp_method=alltoall", "parallel.dp_replicate=2"): (
        "fsdp-replicate2 x cp2(alltoall)"
    ),
}


@pytest.mark.parametrize(("overrides", "name"), NAMES.items(), ids=str)
def test_canonical_name_of_a_resolved_layout(overrides, name):
    assert layout_name(resolved_config(*TINY, *overrides)) == name


MOE_NAMES = {
    ("parallel=ep2",): "fsdp2 x ep2",
    ("parallel=ep2", "launcher.nproc_per_node=4"): "fsdp4 x ep2",
    ("parallel=tp2_ep2", "parallel.etp=2", "launcher.nproc_per_node=4"): "fsdp2 x ep2 x tp2(etp)",
    ("parallel=pp2_ep2", "launcher.nproc_per_node=4"): "pp2(1f1b, m=2) x fsdp2 x ep2",
}


@pytest.mark.parametrize(("overrides", "name"), MOE_NAMES.items(), ids=str)
def test_an_expert_parallel_layout_names_its_ep_and_etp(overrides, name):
    moe = ("model=tiny-moe", *TINY[1:])
    assert layout_name(resolved_config(*moe, *overrides)) == name


def test_dataparallel_is_named_by_its_devices():
    cfg = compose_config(*TINY, "parallel=single")
    parallel = ParallelConfig(
        name="dataparallel", data_parallel="dataparallel", dataparallel_devices=4
    )
    assert layout_name(dataclasses.replace(cfg, parallel=parallel)) == "dataparallel4"


def measured(run_id: str) -> Measured:
    """A completed run that measured nothing."""
    meta = RunMeta(run_id=run_id, created_at="2026-01-02T03:04:05+00:00", duration_s=1.0)
    return Measured(meta, [])


def test_ddp_bucket_view_fsdp_and_dp2_tp2_have_different_names_in_store_and_report(tmp_path):
    store = ResultsStore(tmp_path / "meshrun.db")
    presets = ("ddp", "ddp_bucket_view", "fsdp", "dp2_tp2")
    for preset in presets:
        cfg = resolved_config(*TINY, f"parallel={preset}")
        store.record(assemble(cfg, measured(preset), None))
    stored = {r.parallel: r.layout_name for r in store.records()}
    assert len(set(stored.values())) == len(presets), stored
    shown = {run["parallel"]: cells(run)["layout"] for run in store.runs()}
    assert (
        shown
        == stored
        == {
            "ddp": "ddp2",
            "ddp_bucket_view": "ddp2(bucket-view)",
            "fsdp": "fsdp2",
            "dp2_tp2": "fsdp-replicate2 x tp2",
        }
    )
    # the report's filter takes the preset or the canonical name
    for preset, name in stored.items():
        for wanted in (preset, name):
            chosen = select_runs(store.runs(), RunFilter(layout=wanted)).runs
            assert [r["run_id"] for r in chosen] == [preset]


RERUN = [
    (*TINY, "parallel=ddp"),
    (*TINY, "parallel=ddp_bucket_view"),
    (*TINY, "parallel=ddp_bucket_view", "parallel.ddp.gradient_as_bucket_view=false"),
    (*TINY, "parallel=hsdp", "launcher.nproc_per_node=4"),
    (*TINY, "parallel=fsdp2_tp2", "parallel.sequence_parallel=true"),
    (*TINY, "parallel=pp2", "parallel.pp_layers=[3,1]", "parallel.schedule=gpipe"),
    (*TINY, "parallel=pp2_interleaved", "train.micro_batch_size=1"),
    (*TINY, "parallel=tp2_pp2", "parallel.activation_checkpointing=selective"),
]


@pytest.mark.parametrize("overrides", RERUN, ids=str)
def test_printed_overrides_run_the_same_layout_again(overrides):
    cfg = resolved_config(*overrides)
    again = resolved_config(
        "model=tiny", "train.global_batch_size=8", *layout_overrides(cfg).split()
    )
    assert layout_name(again) == layout_name(cfg)
    assert again.parallel == cfg.parallel
    assert again.train.micro_batch_size == cfg.train.micro_batch_size


def test_run_again_keeps_what_was_given_and_writes_out_the_resolved_layout():
    given = (
        "model=hf/tiny-llama",
        "train.global_batch_size=8",
        "name=my run",
        "parallel=auto",
        "parallel.pp_layers=auto",
        "train.micro_batch_size=2",
        "hydra.run.dir=/tmp/x",
    )
    cfg = resolved_config(
        *given[:2], "parallel=pp2", "parallel.pp_layers=[3,1]", "train.micro_batch_size=2"
    )
    again = shlex.split(rerun_overrides(given, cfg))
    assert again[:3] == ["model=hf/tiny-llama", "train.global_batch_size=8", "name=my run"]
    assert again[3:] == layout_overrides(cfg).split()  # auto resolved, stated once
    rerun = resolved_config(*again)
    assert (rerun.model, rerun.name, rerun.parallel) == (cfg.model, "my run", cfg.parallel)


@pytest.mark.slow
def test_planner_rows_rerun_as_themselves():
    ranked = search(
        resolved_config(*TINY, "parallel=single", "hardware=cpu"),
        Box(1, 4),
        legal_on(HostFacts.detect()),
    ).ranked
    assert len({c.label for c in ranked}) == len(ranked)  # one name per planner row
    for c in ranked:
        again = resolved_config(*TINY[:2], "hardware=cpu", *c.overrides().split())
        assert layout_name(again) == c.label, c.overrides()
        assert c.as_dict()["overrides"] == c.overrides()


def test_console_summary_shows_the_name_and_the_rerun(tmp_path):
    run_dir = tmp_path / ("a-long-run-dir-name-" * 5)  # 100 columns: wider than a log's 80
    cfg = resolved_config(*TINY, "parallel=pp2", f"run_dir={run_dir}")
    record = assemble(cfg, measured("r1"), None)
    with console.capture() as out:
        print_summary(record)
    text = out.get()
    assert "pp2(1f1b, m=4)" in text
    assert "run again: meshrun parallel=pp2" in text
    assert f"run dir: {run_dir}\n" in text  # whole, not wrapped, where the output is a log
    assert "bubble (1f1b, m=4)" in text


def test_micro_batch_size_is_the_one_knob():
    assert n_microbatches(resolved_config(*TINY, "parallel=pp2")) == 4
    assert n_microbatches(resolved_config(*TINY, "parallel=dp2_pp2")) == 2  # 8 / dp 2 / 2
    with pytest.raises(ConfigError) as caught:
        compose_config("parallel=pp2", "parallel.microbatches=4")
    assert caught.value.key == "parallel.microbatches"
