"""Checkpoints: a run resumed from one continues bit for bit (same layout) or within 1e-5
(another layout, DCP resharding), keeps its identity, and a bad resume is refused before
any process starts. Every run is real gloo ranks (the session's rank pool)."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode

from meshrun.core.checkpoints import (
    MANIFEST,
    Manifest,
    complete,
    find_restore,
    read_manifest,
    step_dir,
    write_manifest,
)
from meshrun.core.config import CheckpointConfig
from meshrun.core.errors import ConfigError
from meshrun.core.paths import CONF_DIR
from meshrun.core.rng_state import RngStateRefused, read_rng_state, rng_file
from meshrun.driver.experiment import RunFailed, measure, read_steps, run_experiment
from meshrun.driver.resume import in_run_dir_of_resume, names_run_dir
from meshrun.models import model_key, model_shape
from tests.cli import interrupted_meshrun
from tests.helpers import compose_config, resolved_config, transformers_first_loss
from tests.ranks import config_in, losses
from tests.tiers import tiered
from tests.wandb_records import read_offline_runs

STEPS, EVERY = 4, 2
COMMON = (
    "model=tiny",
    f"train.steps={STEPS}",
    "train.untimed_steps=1",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.seq_len=32",
    "train.seed=5",
    "metrics.baseline=off",
    "train.lr_schedule.decay=cosine",
    "train.lr_schedule.warmup_steps=2",
)
TIED = "model.tie_embeddings=true"
RESUMED_LAYOUTS = {
    "ddp": ("parallel=ddp",),
    "fsdp": ("parallel=fsdp",),
    "tp2": ("parallel=tp2",),
    "pp2": ("parallel=pp2",),
    "tp2_pp2": ("parallel=tp2_pp2",),
    # the routers' biases are state too: without them the resumed run routes otherwise
    "fsdp_moe_bias": (
        "parallel=fsdp",
        "model=tiny-moe",
        "model.moe.load_balance=bias",
        "model.moe.bias_update_rate=0.05",
    ),
    "ep2_moe_bias": (
        "parallel=ep2",
        "model=tiny-moe",
        "model.moe.load_balance=bias",
        "model.moe.bias_update_rate=0.05",
    ),
}
# In CI sharded state (fsdp) and an MoE's router biases; with -m slow replicated state (ddp),
# TP's DTensors and a pipeline's stages, whose loads the cross-layout test below makes too.
RESUMED_FAST = {"fsdp"}


def _run(tmp: Path, rank_pool, *overrides: str):
    model = [o for o in overrides if o.startswith("model=")]
    cfg = config_in(tmp, *(o for o in COMMON if not (model and o.startswith("model="))), *overrides)
    measured = measure(cfg, "run", rank_pool.launch)
    assert measured.ok, measured.meta.error
    return cfg, measured


@pytest.mark.parametrize(
    "layout",
    tiered(RESUMED_LAYOUTS, RESUMED_FAST),
)
def test_resumed_run_continues_bit_for_bit(tmp_path, rank_pool, layout):
    """The uninterrupted run saves after step 2; a run resumed from that checkpoint trains
    steps 2-3 again with exactly the losses (and LRs) the uninterrupted one had."""
    overrides = RESUMED_LAYOUTS[layout]
    cfg, whole = _run(tmp_path / "whole", rank_pool, *overrides, f"checkpoint.every_steps={EVERY}")
    saved = complete(Path(cfg.run_dir) / "checkpoints")
    assert [read_manifest(p).step for p in saved] == [EVERY, STEPS]
    more = f"checkpoint.dir={tmp_path}/more"
    _, resumed = _run(
        tmp_path / "resumed", rank_pool, *overrides, f"checkpoint.resume={saved[0]}", more
    )
    assert resumed.meta.resumed_from_step == EVERY  # a new run in a run dir of its own
    assert [s.step for s in resumed.steps] == list(range(EVERY, STEPS))
    tail = [(s.loss, s.lr) for s in resumed.steps]
    assert tail == [(s.loss, s.lr) for s in whole.steps[EVERY:]]


@pytest.mark.parametrize(
    ("saved_under", "resumed_under"),
    [
        (("parallel=fsdp",), ("parallel=tp2_pp2",)),
        pytest.param(("parallel=ddp",), ("parallel=fsdp",), marks=pytest.mark.slow),
        pytest.param(("parallel=tp2_pp2",), ("parallel=single",), marks=pytest.mark.slow),
        pytest.param(
            ("parallel=fsdp2_cp2", "launcher.nproc_per_node=4"),
            ("parallel=single",),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ("parallel=cp2",),
            ("parallel=cp2", "parallel.cp=4", "launcher.nproc_per_node=4"),
            marks=pytest.mark.slow,
        ),
        # experts split 2 ways, each half sharded 2 ways: resumed with them split 4 ways
        pytest.param(
            ("model=tiny-moe", "parallel=ep2", "launcher.nproc_per_node=4"),
            ("model=tiny-moe", "parallel=ep2", "parallel.ep=4", "launcher.nproc_per_node=4"),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ("model=tiny-moe", "parallel=ep2"),
            ("model=tiny-moe", "parallel=single"),
            marks=pytest.mark.slow,
        ),
        # a tied embedding: its head's copy on the last stage saved under the embedding's keys
        pytest.param(
            ("parallel=pp2", "parallel.dp_shard=2", "launcher.nproc_per_node=4", TIED),
            ("parallel=single", TIED),
            marks=pytest.mark.slow,
        ),
        pytest.param(("parallel=single", TIED), ("parallel=tp2_pp2", TIED), marks=pytest.mark.slow),
        pytest.param(  # each expert's hidden width split too: 2-D DTensors of the experts
            ("model=tiny-moe", "parallel=tp2_ep2", "parallel.etp=2", "launcher.nproc_per_node=4"),
            ("model=tiny-moe", "parallel=ep2"),
            marks=pytest.mark.slow,
        ),
        # GPT-2's fused q|k|v rows (and their AdamW moments) regrouped per TP rank: read in
        # the saved tp's order, refilled in the resumed one's
        (("model=hf/tiny-gpt2", "parallel=tp2"), ("model=hf/tiny-gpt2", "parallel=single")),
        pytest.param(
            ("model=hf/tiny-gpt2", "parallel=fsdp2_tp2", "launcher.nproc_per_node=4"),
            ("model=hf/tiny-gpt2", "parallel=tp4"),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            ("model=hf/tiny-gpt2", "parallel=single"),
            ("model=hf/tiny-gpt2", "parallel=tp2_pp2"),
            marks=pytest.mark.slow,
        ),
    ],
    ids=[
        "fsdp-to-tp2_pp2",
        "ddp-to-fsdp",
        "tp2_pp2-to-single",
        "fsdp2_cp2-to-single",
        "cp2-to-cp4",
        "moe_fsdp4_ep2-to-ep4",
        "moe_ep2-to-single",
        "tied_fsdp2_pp2-to-single",
        "tied_single-to-tp2_pp2",
        "moe_tp2_ep2_etp2-to-ep2",
        "gpt2_tp2-to-single",
        "gpt2_fsdp2_tp2-to-tp4",
        "gpt2_single-to-tp2_pp2",
    ],
)
def test_checkpoint_loads_under_another_layout(tmp_path, rank_pool, saved_under, resumed_under):
    cfg, whole = _run(
        tmp_path / "whole", rank_pool, *saved_under, f"checkpoint.every_steps={EVERY}"
    )
    first = complete(Path(cfg.run_dir) / "checkpoints")[0]
    _, resumed = _run(
        tmp_path / "resumed",
        rank_pool,
        *resumed_under,
        f"checkpoint.resume={first}",
        f"checkpoint.dir={tmp_path}/more",
    )
    for got, want in zip(resumed.steps, whole.steps[EVERY:], strict=True):
        assert abs(got.loss - want.loss) <= 1e-5 * abs(want.loss), (got, want)


@pytest.mark.slow
def test_interrupted_run_resumes_as_the_same_run(tmp_path, rank_pool, launch_host):
    """A rank fails at step 3 after the checkpoint of step 2; `resume=auto` in the same run
    dir continues the same run: its id, its store row, its metrics file, appended. (The
    failing attempt on the real launcher, in the launch host: on the rank pool a failure
    restarts the pool.)"""
    args = (
        *COMMON,
        "parallel=ddp",
        "checkpoint.every_steps=2",
        "checkpoint.async_save=false",
        "logger=wandb",
        "logger.mode=offline",
    )
    failing = config_in(tmp_path, *args, "debug.fail_rank=1", "debug.fail_step=3")
    with pytest.raises(RunFailed) as failed:
        run_experiment(failing, launch_host.launch)
    first = failed.value.results
    assert [r.step for r in read_steps(failing.run_dir)] == [0, 1]
    resumed = run_experiment(config_in(tmp_path, *args, "checkpoint.resume=auto"), rank_pool.launch)
    assert resumed.run_id == first.run_id and resumed.resumed_from_step == 2
    assert [r.step for r in read_steps(failing.run_dir)] == list(range(STEPS))
    with sqlite3.connect(tmp_path / "meshrun.db") as db:
        rows = db.execute("SELECT run_id, status FROM runs").fetchall()
    assert rows == [(first.run_id, "completed")]
    assert (
        resumed.checkpoints.checkpoint_blocked_s is not None and len(resumed.series.losses) == STEPS
    )
    # W&B: one run, continued: the resumed attempt logs under the same id from step 2 on.
    attempts = read_offline_runs(Path(failing.run_dir))
    assert [a["id"] for a in attempts] == [first.run_id] * 2
    logged = [[h["_step"] for h in a["history"] if "train/loss" in h] for a in attempts]
    assert logged[1] == [2, 3] and set(logged[0]) <= {0, 1, 2}


def test_checkpoint_cut_off_mid_write_is_never_loaded(tmp_path, rank_pool):
    every = f"checkpoint.every_steps={EVERY}"
    cfg, _ = _run(tmp_path / "whole", rank_pool, "parallel=single", every)
    root = Path(cfg.run_dir) / "checkpoints"
    (root / "step-00000004" / MANIFEST).unlink()  # as if the last save had died mid-write
    assert [p.name for p in complete(root)] == ["step-00000002"]
    with pytest.raises(ConfigError, match="cut off mid-write"):
        config_in(tmp_path / "again", *COMMON, f"checkpoint.resume={root}/step-00000004")
    again = config_in(
        tmp_path / "auto",
        *COMMON,
        "parallel=single",
        f"checkpoint.dir={root}",
        "checkpoint.resume=auto",
        "train.steps=8",
    )
    # in a run dir of its own: a new run from that checkpoint, saving into its own dir
    assert again.run_dir != cfg.run_dir and again.checkpoint.dir is None
    assert again.checkpoint.resume == str(root / "step-00000002")


class _RunsOnLoad:
    """Pickles as a call of open(marker, "w"): whatever unpickles it creates the marker."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _crafted(checkpoint: Path, rank: int, marker: Path) -> Path:
    """The rank's RNG state replaced by a pickle that runs code where it is loaded, proven
    live on a copy loaded as meshrun loaded it before (weights_only=False)."""
    crafted = rng_file(checkpoint, rank)
    torch.save({"cpu": _RunsOnLoad(marker)}, crafted)
    live = marker.with_name("live")
    torch.save({"cpu": _RunsOnLoad(live)}, crafted.with_name("copy"))
    torch.load(crafted.with_name("copy"), weights_only=False)
    assert live.exists()
    crafted.with_name("copy").unlink()
    return crafted


def test_a_crafted_rng_state_is_refused_before_any_rank_starts(meshrun_here, tmp_path):
    """A real run's checkpoint with one rank's RNG state swapped for a pickle that would run
    code: `meshrun` exits 2 naming the file and what it holds, and nothing in it ran. The
    files the run wrote itself read back as tensors (as every meshrun has written them)."""
    args = ("model=tiny", "parallel=fsdp", "train.steps=2", "train.untimed_steps=1")
    saved = meshrun_here(*args, "checkpoint.every_steps=2", "metrics.baseline=off")
    assert saved.returncode == 0, saved.output
    checkpoint = complete(saved.run_dir / "checkpoints")[0]
    for rank in (0, 1):
        assert set(read_rng_state(rng_file(checkpoint, rank))) == {"cpu"}
    marker = tmp_path / "ran"
    crafted = _crafted(checkpoint, 1, marker)
    resumed = meshrun_here(*args, "train.steps=4", f"checkpoint.resume={checkpoint}")
    assert resumed.returncode == 2, resumed.output
    assert "config error checkpoint.resume=" in " ".join(resumed.output.split())
    said = " ".join(resumed.output.split())  # rich wraps long lines
    assert f"{crafted}: refused unread: it holds a pickled io.open" in said
    assert "Valid: resume from a checkpoint you trust, or from this one with" in said
    assert not marker.exists()
    assert len(saved.stored()) == 1  # no run started


@pytest.mark.slow
def test_a_crafted_rng_state_is_refused_on_the_ranks_too(tmp_path, rank_pool, launch_host):
    """Where the file changed after the driver's check (or a requeued job restores on its
    own): the rank refuses it before anything in it runs, and the run fails saying why.
    (On the real launcher: on the rank pool a failure restarts the pool.)"""
    every = f"checkpoint.every_steps={EVERY}"
    cfg, _ = _run(tmp_path / "whole", rank_pool, "parallel=fsdp", every)
    checkpoint = complete(Path(cfg.run_dir) / "checkpoints")[0]
    resumed = config_in(
        tmp_path / "resumed", *COMMON, "parallel=fsdp", f"checkpoint.resume={checkpoint}"
    )
    marker = tmp_path / "ran"
    crafted = _crafted(checkpoint, 1, marker)
    with pytest.raises(RngStateRefused, match="refused unread"):
        read_rng_state(crafted)
    failed = measure(resumed, "run", launch_host.launch)
    assert not failed.ok and failed.meta.failed_rank == 1
    assert f"RngStateRefused: {crafted}: refused unread" in failed.meta.error
    assert not marker.exists()


def test_resume_of_another_model_is_refused(tmp_path, rank_pool):
    every = f"checkpoint.every_steps={EVERY}"
    cfg, _ = _run(tmp_path / "whole", rank_pool, "parallel=single", every)
    with pytest.raises(ConfigError, match=r"another model \(model.dim"):
        config_in(
            tmp_path / "b", *COMMON, "model.dim=128", f"checkpoint.resume={cfg.run_dir}/checkpoints"
        )


def test_an_moe_checkpoint_resumes_whichever_way_its_experts_compute(tmp_path):
    """model.moe.grouped_mm is how the experts compute, not what they hold: a checkpoint
    saved before it existed (no such key in its model) resumes with it false; another
    expert count is still another model."""
    moe = ("model=tiny-moe", "train.steps=4")
    saved = json.loads(model_key(compose_config(*moe).model)[1])
    del saved["moe"]["grouped_mm"]
    [path] = _fake_checkpoints(tmp_path / "ckpt", str(tmp_path / "old"), 2)
    write_manifest(path, replace(read_manifest(path), model=json.dumps(saved)))
    resumed = config_in(tmp_path, *moe, "model.moe.grouped_mm=false", f"checkpoint.resume={path}")
    assert resumed.checkpoint.resume == str(path.absolute())
    with pytest.raises(ConfigError, match=r"another model \(model.moe differ"):
        config_in(tmp_path, *moe, "model.moe.experts=4", f"checkpoint.resume={path}")


@pytest.mark.slow
def test_ctrl_c_saves_and_resume_auto_continues(tmp_path, rank_pool):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) mid-run: every
    rank saves, `meshrun` exits 130 with the run recorded as interrupted; the same run with
    `checkpoint.resume=auto` (here on the rank pool) finishes it with the uninterrupted
    run's losses."""
    steps = 12
    args = (
        *COMMON,
        "parallel=ddp",
        f"train.steps={steps}",
        "checkpoint.every_steps=100",
        "train.log_every=2",
    )
    run_dir, store = tmp_path / "run", tmp_path / "meshrun.db"
    code, output = interrupted_meshrun(run_dir, store, *args, "debug.slow_step_s=0.2")
    assert code == 130, output
    interrupted = json.loads((run_dir / "results.json").read_text())
    assert interrupted["status"] == "interrupted" and "SIGINT" in interrupted["error"], output
    saved = complete(run_dir / "checkpoints")
    assert len(saved) == 1 and 4 <= read_manifest(saved[0]).step < steps
    again = config_in(tmp_path, *args, "checkpoint.resume=auto")
    assert again.run_dir == str(run_dir)
    finished = run_experiment(again, rank_pool.launch)
    assert finished.run_id == interrupted["run_id"]
    assert finished.resumed_from_step == read_manifest(saved[0]).step
    _, whole = _run(tmp_path / "whole", rank_pool, *args)
    assert finished.series.losses == losses(whole)


@pytest.mark.parametrize(
    ("model", "architecture", "trained_under", "resumed_under"),
    [
        (("model=tiny", "model.vocab_size=251"), "LlamaForCausalLM", "tp2", "single"),
        # with -m slow: test_hf_auto.py exports a transformers family in CI
        pytest.param(
            ("model=hf/tiny-gpt2",), "GPT2LMHeadModel", "tp2", "tp2", marks=pytest.mark.slow
        ),
        # a tied embedding trained across pipeline stages: one tensor exported
        pytest.param(
            ("model=tiny", "model.tie_embeddings=true"),
            "LlamaForCausalLM",
            "tp2_pp2",
            "single",
            marks=pytest.mark.slow,
        ),
    ],
    ids=["meshrun-llama", "gpt2", "meshrun-llama-tied-tp2_pp2"],
)
def test_export_is_the_trained_model_that_transformers_loads(
    tmp_path, rank_pool, model, architecture, trained_under, resumed_under
):
    """Trained under tp2 (vocabulary padded, GPT-2's q|k|v regrouped) or a pipeline of a
    tied embedding, exported as HF: the model transformers' from_pretrained loads gives, on
    the batch of the next step, the loss that meshrun's own run resumed from the final
    checkpoint trains that step with (under single, the padded vocabulary resharded; GPT-2
    under tp2, whose row order it keeps)."""
    transformers = pytest.importorskip("transformers")
    cfg = config_in(
        tmp_path / "a",
        *COMMON,
        *model,
        f"parallel={trained_under}",
        "train.steps=4",
        "checkpoint.export=hf",
    )
    exported = Path(run_experiment(cfg, rank_pool.launch).checkpoints.export_path)
    hf = getattr(transformers, architecture).from_pretrained(exported)
    assert type(hf).__name__ == architecture and hf.config.vocab_size == model_vocab(cfg)
    final = complete(Path(cfg.run_dir) / "checkpoints")[-1]
    resume = (
        f"parallel={resumed_under}",
        "train.steps=5",
        f"checkpoint.resume={final}",
        f"checkpoint.dir={tmp_path}/b",
    )
    later, resumed = _run(tmp_path / "b", rank_pool, *model, *resume)
    [step4] = [s.loss for s in resumed.steps if s.step == 4]
    assert abs(transformers_first_loss(later, hf, step=4) - step4) <= 1e-5 * step4


def model_vocab(cfg) -> int:
    return model_shape(cfg.model).vocab_size


def _cut_after(cfg, step: int) -> Path:
    """The run as if cut off during the save after `step`: the later checkpoints' manifests
    removed (a checkpoint without one is never loaded); its own metrics.jsonl stays the
    uninterrupted run's, to compare a continuation with. The root of its checkpoints."""
    root = Path(cfg.checkpoint.dir or Path(cfg.run_dir) / "checkpoints")
    for path in complete(root):
        if read_manifest(path).step > step:
            (path / MANIFEST).unlink()
    return root


@pytest.mark.parametrize(
    "custom_dir",
    [False, pytest.param(True, marks=pytest.mark.slow)],  # the recorded dir: -m slow
    ids=["checkpoints", "checkpoint.dir"],
)
def test_resume_from_a_run_dir_continues_its_run(tmp_path, rank_pool, custom_dir):
    """`checkpoint.resume=<run dir>`: the run dir's latest complete checkpoint, in its
    `checkpoints/` or in the `checkpoint.dir` its run recorded; resumed in that run dir, the
    run continues (its id, its steps before the checkpoint kept, its checkpoint dir)."""
    own = (f"checkpoint.dir={tmp_path}/ck",) if custom_dir else ()
    args = (*COMMON, "parallel=single", f"checkpoint.every_steps={EVERY}")
    cut = config_in(tmp_path, *args, *own)
    whole = run_experiment(cut, rank_pool.launch)
    root = _cut_after(cut, EVERY)
    again = config_in(tmp_path, *args, f"checkpoint.resume={cut.run_dir}")
    assert again.run_dir == cut.run_dir and again.checkpoint.dir == cut.checkpoint.dir
    resumed = run_experiment(again, rank_pool.launch)
    assert (resumed.run_id, resumed.parent_run_id) == (whole.run_id, None)
    assert resumed.resumed_from_step == EVERY
    assert resumed.resumed_from_checkpoint == str(root / "step-00000002")
    assert [r.step for r in read_steps(cut.run_dir)] == list(range(STEPS))
    assert resumed.series.losses == whole.series.losses  # the same layout: bit for bit
    assert [read_manifest(p).step for p in complete(root)] == [EVERY, STEPS]  # saved again
    assert custom_dir != (Path(cut.run_dir) / "checkpoints").exists()


@pytest.mark.slow
def test_resume_into_a_run_dir_of_ones_own_is_a_new_run(tmp_path, rank_pool):
    """A ddp run's checkpoint continued under tp2 in another run dir: a new run there (its
    id, metrics.jsonl from the checkpoint's step on, results.json, store row, W&B run and
    checkpoints), linked to the run it started from, whose files and row stay as they
    were; its losses continue the original's."""
    store = f"store.path={tmp_path}/meshrun.db"
    original = resolved_config(
        f"run_dir={tmp_path}/cut", store, *COMMON, "parallel=ddp", f"checkpoint.every_steps={EVERY}"
    )
    whole = run_experiment(original, rank_pool.launch)
    root = _cut_after(original, EVERY)
    kept = {p: p.read_bytes() for p in Path(original.run_dir).rglob("*") if p.is_file()}
    row = _store_rows(tmp_path)[whole.run_id]
    relayout = resolved_config(
        f"run_dir={tmp_path}/relayout",
        store,
        *COMMON,
        "parallel=tp2",
        f"checkpoint.every_steps={EVERY}",
        f"checkpoint.resume={root}",
        "logger=wandb",
        "logger.mode=offline",
    )
    new = run_experiment(relayout, rank_pool.launch)
    step2 = str(root / "step-00000002")
    assert new.run_id != whole.run_id and new.run_dir == f"{tmp_path}/relayout"
    assert (new.parent_run_id, new.resumed_from_checkpoint) == (whole.run_id, step2)
    assert new.resumed_from_step == EVERY
    assert new.overrides.endswith(f"hydra.run.dir={new.run_dir}")  # again: a new run
    assert json.loads(Path(new.run_dir, "results.json").read_text())["run_id"] == new.run_id
    assert [r.step for r in read_steps(new.run_dir)] == list(range(EVERY, STEPS))
    for got, want in zip(new.series.losses, whole.series.losses[EVERY:], strict=True):
        assert abs(got - want) <= 1e-5 * abs(want), (new.series.losses, whole.series.losses)
    saved = complete(Path(new.run_dir) / "checkpoints")  # its own, never the parent's
    assert [(read_manifest(p).step, read_manifest(p).run_dir) for p in saved] == [
        (STEPS, new.run_dir)
    ]
    [wandb] = read_offline_runs(Path(new.run_dir))
    assert wandb["id"] == new.run_id
    assert [h["_step"] for h in wandb["history"] if "train/loss" in h] == [2, 3]
    # nothing of the original changed: its files, checkpoints and store row
    assert {p: p.read_bytes() for p in Path(original.run_dir).rglob("*") if p.is_file()} == kept
    rows = _store_rows(tmp_path)
    assert rows[whole.run_id] == row and rows[new.run_id][1] == whole.run_id


def _store_rows(tmp: Path) -> dict[str, tuple]:
    """run_id -> (results_json, parent_run_id) of every row of the store under `tmp`."""
    with sqlite3.connect(tmp / "meshrun.db") as db:
        names = {r[1] for r in db.execute("PRAGMA table_info(runs)")}
        parent = "parent_run_id" if "parent_run_id" in names else "NULL"
        rows = db.execute(f"SELECT run_id, results_json, {parent} FROM runs").fetchall()
    return {run_id: (results, parent_id) for run_id, results, parent_id in rows}


def _fake_checkpoints(root: Path, run_dir: str, *steps: int) -> list[Path]:
    """Complete checkpoints as far as resolving one goes: a step dir with its manifest."""
    made = []
    for step in steps:
        path = step_dir(root, step)
        path.mkdir(parents=True)
        manifest = Manifest(step, run_dir, "{}", "single", {}, 0, {}, "", 0.0, 0.0)
        write_manifest(path, manifest)
        made.append(path)
    return made


@pytest.fixture
def hydra_job():
    """Set Hydra's job config as `meshrun <overrides>` would have it (its overrides, the
    multirun mode); forgotten after the test."""

    def given(*overrides: str, multirun: bool = False) -> None:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("train", overrides=list(overrides), return_hydra_config=True)
        cfg.hydra.mode = RunMode.MULTIRUN if multirun else RunMode.RUN
        HydraConfig.instance().set_config(cfg)

    yield given
    HydraConfig.instance().cfg = None


def test_a_resume_naming_no_run_dir_continues_in_the_checkpoints(tmp_path, hydra_job):
    """The command's run dir decides: none named (Hydra's generated one, or torchrun's that
    `meshrun` adds): the checkpoint's; one named, or a sweep job's: its own."""
    [saved] = _fake_checkpoints(tmp_path / "cut" / "checkpoints", str(tmp_path / "cut"), 2)
    cfg = compose_config(f"checkpoint.resume={saved.parent}", "model=tiny")
    resume = f"checkpoint.resume={saved.parent}"
    hydra_job(resume, "parallel=tp2")
    assert in_run_dir_of_resume(cfg).run_dir == str(tmp_path / "cut")
    for named in ("hydra.run.dir=outputs/relayout", "run_dir=outputs/relayout"):
        hydra_job(resume, named)
        assert in_run_dir_of_resume(cfg) is cfg
    hydra_job(resume, "parallel=tp2", multirun=True)
    assert in_run_dir_of_resume(cfg) is cfg
    added = "hydra.run.dir=outputs/torchrun/abc"
    assert not names_run_dir([added, resume], added) and names_run_dir([added, resume])


def test_a_requeued_job_continues_from_its_own_last_save(tmp_path):
    """SLURM requeued the job: a run that names no checkpoint takes its latest (auto); one
    resumed from a path takes its own later save where it saves, else that path again."""
    own = str(tmp_path / "run")
    parent, later = _fake_checkpoints(tmp_path / "run" / "checkpoints", own, 2, 4)
    resume = CheckpointConfig(every_steps=2, resume=str(parent))
    assert find_restore(resume, own, requeued=False) == parent
    assert find_restore(resume, own, requeued=True) == later
    assert find_restore(replace(resume, every_steps=0), own, requeued=True) == parent
    assert find_restore(CheckpointConfig(), own, requeued=True) == later
    assert find_restore(CheckpointConfig(), own, requeued=False) is None
