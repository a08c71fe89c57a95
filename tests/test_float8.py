"""train.float8 (torchao): which linears convert; every layout against float8 on one device
within the recipe's tolerance (real gloo ranks, model=tiny); a checkpoint resumed across
precision and layout; the rules that refuse it; what the record and meshrun-verify say.
Skipped where torchao is not installed (`pip install 'meshrun[float8]'`); the rowwise
recipes where this torch's CPU matmul takes no per-row scales (torch 2.11)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchao")

import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import Replicate, Shard
from torch.nn import Parameter
from torchao.float8.float8_tensor_parallel import (
    Float8ColwiseParallel,
    Float8RowwiseParallel,
)
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

from benchmarks.speed_vs_published import cluster_config
from meshrun.core.baseline import baseline_key
from meshrun.core.checkpoints import checkpoint_root, complete
from meshrun.core.config import Float8Config
from meshrun.core.errors import ConfigError
from meshrun.core.hardware import CudaDevice, HostFacts, load_profile, target_facts
from meshrun.core.record import RunRecord
from meshrun.driver.experiment import measure
from meshrun.driver.float8 import float8_fields
from meshrun.driver.resolution import legal_on, resolved_layout
from meshrun.driver.sinks.console import console, print_summary
from meshrun.driver.tool_config import FLOAT8_LOSS_BOUND, FLOAT8_TOLERANCES
from meshrun.models import build_model, float8_coverage
from meshrun.models.float8 import float8_linears
from meshrun.plan import predict
from meshrun.plan.float8 import Float8Plan
from meshrun.plan.memory import predict_stages
from meshrun.plan.search import fitting_layouts
from meshrun.plan.speed import predict_speed
from meshrun.rank.parallel import float8 as rank_float8
from meshrun.rank.parallel.tensor import float8_styles, parallel_styles, sub_blocks
from meshrun.validate import float8 as rules
from tests.helpers import compose_config, resolved_config
from tests.ranks import assert_steps_match, config_in, losses
from tests.test_custom_model import NAMED
from tests.test_plan import meshrun_plan
from tests.test_verify import report, verify_run
from tests.tiers import tiered

STEPS = 4
COMMON = (
    "model=tiny",
    f"train.steps={STEPS}",
    "train.untimed_steps=1",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.seq_len=64",
    "train.seed=3",
    "metrics.baseline=off",
    "train.float8.enabled=true",
)
MICRO4 = "train.micro_batch_size=4"
BF16 = "train.precision=bf16"
ROWWISE = ("train.float8.recipe=rowwise", BF16)
LAYOUTS = {
    # FSDP2's float8 all-gather and its scales, torchao's float8 TP styles and SP's float8
    # all-gathers, on one 2-D mesh
    "fsdp2_tp2_sequence_parallel": (
        "parallel=fsdp2_tp2",
        "parallel.sequence_parallel=true",
        MICRO4,
    ),
    "ddp": ("parallel=ddp",),
    "fsdp": ("parallel=fsdp",),
    "hsdp": ("parallel=hsdp", "launcher.nproc_per_node=4"),
    "tp2_sequence_parallel": ("parallel=tp2", "parallel.sequence_parallel=true", MICRO4),
    "pp2": ("parallel=pp2",),
    "cp2": ("parallel=cp2", MICRO4),
    "dp2_tp2_pp2": ("parallel=dp2_tp2_pp2",),
    "fsdp_bf16": ("parallel=fsdp", BF16),
    "fsdp_rowwise": ("parallel=fsdp", *ROWWISE),
    "tp2_sequence_parallel_rowwise": (
        "parallel=tp2",
        "parallel.sequence_parallel=true",
        MICRO4,
        *ROWWISE,
    ),
    # a transformers model's plan and a user's, mapped onto the float8 styles alike
    "hf_tiny_llama_fsdp2_tp2_sequence_parallel": (
        "model=hf/tiny-llama",
        "parallel=fsdp2_tp2",
        "parallel.sequence_parallel=true",
        MICRO4,
    ),
    "custom_tp2": (
        *NAMED,
        "parallel=tp2",
        MICRO4,
        "train.steps=6",  # its loss turns down after step 4
    ),
}
FAST = {"fsdp2_tp2_sequence_parallel"}


def _with(*overrides: str) -> tuple[str, ...]:
    """COMMON and `overrides`, whose model=, if any, replaces COMMON's."""
    model = any(o.startswith("model=") for o in overrides)
    return (*(o for o in COMMON if not (model and o.startswith("model="))), *overrides)


def test_float8_takes_the_block_linears_never_the_head_routers_or_odd_widths():
    """torchtitan's filter on each kind of model, on meta: q, k, v, o and the MLP's of every
    block (a shared expert's too), never the head, a router or a linear 16 does not divide."""
    llama = build_model(compose_config("model=tiny").model, 64, "meta")
    names = float8_linears(llama)
    assert len(names) == 4 * 7 and "output" not in names
    assert sorted(float8_linears(llama, ["attention"])) == [
        f"layers.{i}.feed_forward.w{j}" for i in range(4) for j in (1, 2, 3)
    ]
    moe = float8_linears(build_model(compose_config("model=tiny-moe").model, 64, "meta"))
    assert not any(n.endswith(".gate") for n in moe)  # the router stays fp32 (models/moe.py)
    assert len(moe) == 4 * (4 + 3)  # attention and the shared expert
    hf = float8_linears(build_model(compose_config("model=hf/tiny-llama").model, 64, "meta"))
    assert hf and not any("lm_head" in n or "output" in n for n in hf)
    # a user's module whose head is not named: its linear to the vocabulary is the head
    custom = compose_config("model=custom", "model.target=tests.user_model:build").model
    assert len(float8_linears(build_model(custom, 64, "meta"))) == 4 * 6
    odd = compose_config("model=tiny", "model.dim=40", "model.n_heads=5", "model.n_kv_heads=5")
    assert float8_coverage(odd.model, 64, ()) == (0, 0)


def _refused(*overrides: str, facts: HostFacts | None = None) -> ConfigError:
    cfg = compose_config("train.float8.enabled=true", *overrides)
    if facts is None:
        facts = HostFacts.detect()
        if cfg.hardware.name != "auto":
            facts = target_facts(load_profile(cfg.hardware.name), facts)
    with pytest.raises(ConfigError) as refused:
        resolved_layout(cfg, facts)
    return refused.value


A100S = HostFacts([CudaDevice("NVIDIA A100-SXM4-80GB", 79.15, (8, 0))] * 8, 16, 512)
H100S = HostFacts([CudaDevice("NVIDIA H100 80GB HBM3", 79.11, (9, 0))] * 8, 16, 512)


@pytest.mark.parametrize(
    ("overrides", "facts", "key", "said"),
    [
        (("train.precision=fp16",), None, "train.precision", "trains in bf16 or fp32"),
        (("train.float8.recipe=rowwise",), None, "train.precision", "trains in bf16"),
        (("model.dim=40", "model.n_heads=5", "model.n_kv_heads=5"), None, "train.float8.enabled",
         "no linear float8 takes"),
        (("train.float8.skip=[layers]",), None, "train.float8.enabled", "train.float8.skip"),
        (("train.float8.recipe=rowwise", "train.float8.fsdp_all_gather=true", BF16), None,
         "train.float8.fsdp_all_gather", "tensorwise recipe only"),
        ((BF16, "parallel=fsdp"), A100S, "train.float8.enabled", "A100-SXM4-80GB is sm80"),
        ((BF16, "parallel=fsdp", "hardware=a100-80g"), None, "train.float8.enabled",
         "A100-80G has no float8 tensor cores"),
        ((BF16, "parallel=dataparallel"), H100S, "parallel", "DataParallel's replicas"),
    ],
    ids=["fp16", "rowwise_fp32", "no_linear", "all_skipped", "rowwise_all_gather", "sm80",
         "a100_profile", "dataparallel"],
)  # fmt: skip
def test_what_float8_cannot_run_is_refused_naming_the_key(overrides, facts, key, said):
    refused = _refused(*overrides, facts=facts)
    assert refused.key == key
    assert said in str(refused)


def test_a_missing_torchao_is_named_with_its_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        rules.importlib.util, "find_spec", lambda name: None if name == "torchao" else real(name)
    )
    refused = _refused()
    assert refused.key == "train.float8.enabled"
    assert "pip install 'meshrun[float8]'" in str(refused)


def test_an_sm89_gpu_and_torch_2_12_cpus_run_every_recipe():
    cfg = compose_config("train.float8.enabled=true", BF16, "parallel=fsdp")
    assert resolved_layout(cfg, H100S).train.float8.enabled
    assert not rules.cpu_scales_rows("2.11.0+cu130")
    assert rules.cpu_scales_rows("2.12.1") and rules.cpu_scales_rows("2.13.0+cpu")


def _converted(recipe: str, under_fsdp: bool = False):
    model = build_model(compose_config("model=tiny").model, 64, "meta")
    rank_float8.convert(model, Float8Config(enabled=True, recipe=recipe), under_fsdp)
    return model


def test_tensorwise_maps_the_models_tp_plan_onto_torchaos_float8_styles():
    """Each colwise/rowwise entry's float8 linears get Float8ColwiseParallel /
    Float8RowwiseParallel (with the entry's output layout), and a sub-block whose column-wise
    matrices are all float8 casts its shared input before SP's all-gather; rowwise keeps
    torch's styles (its all-gathers in high precision)."""
    model = _converted("tensorwise")
    plan = model.tp_plan()
    styles = parallel_styles(plan, sequence_parallel=True)
    found = float8_styles(model, plan, styles)
    assert set(found) == {k for k, v in plan.items() if v in ("colwise", "rowwise")}
    assert isinstance(
        found["layers.*.attention.wq"]["layers.0.attention.wq"], Float8ColwiseParallel
    )
    wo = found["layers.*.attention.wo"]["layers.3.attention.wo"]
    assert isinstance(wo, Float8RowwiseParallel) and wo.output_layouts == (Shard(1),)
    shared = sub_blocks(model, "layers.*.attention", plan, sequence_parallel=True)
    assert all(s.cast is not None for s in shared.values())
    rowwise = _converted("rowwise")
    assert float8_styles(rowwise, plan, parallel_styles(plan, sequence_parallel=False)) == {}
    shared = sub_blocks(rowwise, "layers.*.feed_forward", plan, sequence_parallel=False)
    assert all(s.cast is None and s.stream == Replicate() for s in shared.values())


def test_only_tensorwise_under_fsdp_gathers_float8_weights():
    wq = _converted("tensorwise", under_fsdp=True).layers["0"].attention.wq.weight
    assert isinstance(wq, Parameter) and isinstance(wq.data, WeightWithDynamicFloat8CastTensor)
    for recipe, under_fsdp in (("tensorwise", False), ("rowwise", True)):
        weight = _converted(recipe, under_fsdp).layers["0"].attention.wq.weight
        assert not isinstance(weight.data, WeightWithDynamicFloat8CastTensor)


@pytest.fixture(scope="module")
def single_float8(tmp_path_factory, rank_pool):
    """One device's float8 steps, by the extra overrides of a layout (its model, precision,
    recipe)."""
    cache: dict[tuple[str, ...], list[dict]] = {}

    def steps(*extra: str) -> list[dict]:
        if extra not in cache:
            tmp = tmp_path_factory.mktemp("single")
            measured = measure(
                config_in(tmp, *_with("parallel=single", *extra)), "run", rank_pool.launch
            )
            assert measured.ok, measured.meta.error
            cache[extra] = measured.steps
        return cache[extra]

    return steps


@pytest.mark.parametrize("layout", tiered(LAYOUTS, FAST))
def test_float8_layout_matches_float8_on_one_device(experiment, single_float8, layout):
    """Within the recipe's tolerance (driver/tool_config.py FLOAT8_TOLERANCES: a cast a
    reordered sum tips over a float8 boundary), where a lost or doubled contribution is
    off by O(1)."""
    overrides = LAYOUTS[layout]
    if "train.float8.recipe=rowwise" in overrides and not rules.cpu_scales_rows(torch.__version__):
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm takes no per-row scales")
    cfg, measured = experiment(*_with(*overrides))
    assert measured.ok, measured.meta.error
    kept = ("model", "train.precision", "train.float8", "train.steps")  # the reference's too
    same = tuple(o for o in overrides if o.startswith(kept))
    tolerance = FLOAT8_TOLERANCES[cfg.train.float8.recipe]
    assert_steps_match(measured.steps, single_float8(*same), rel=tolerance)
    got = losses(measured)
    assert got[-1] < got[0]


def _run(tmp: Path, rank_pool, *overrides: str):
    cfg = config_in(tmp, *(o for o in COMMON if o != "train.float8.enabled=true"), *overrides)
    measured = measure(cfg, "run", rank_pool.launch)
    assert measured.ok, measured.meta.error
    return cfg, measured


def _saved(cfg) -> dict[str, tuple]:
    """The first checkpoint's tensors: name -> (dtype, shape)."""
    first = complete(checkpoint_root(cfg.checkpoint, cfg.run_dir))[0]
    metadata = dcp.FileSystemReader(first).read_metadata().state_dict_metadata
    return {
        k: (v.properties.dtype, tuple(v.size))
        for k, v in metadata.items()
        if k.startswith(("model.", "optim."))
    }


RESUMES = {
    "float8_fsdp-to-bf16_single": (
        ("parallel=fsdp", BF16, "train.float8.enabled=true"),
        ("parallel=single", BF16),
    ),
    "bf16_ddp-to-float8_tp2": (
        ("parallel=ddp", BF16),
        ("parallel=tp2", BF16, "train.float8.enabled=true"),
    ),
}


@pytest.mark.parametrize("case", tiered(RESUMES, set()))
def test_a_checkpoint_resumes_with_float8_on_or_off_under_another_layout(tmp_path, rank_pool, case):
    """Weights and optimizer state stay high precision and keep their names: the same keys
    and dtypes with float8 or without (a float8 all-gather weight's values, not its empty
    wrapper's: before, 1e37 where they were 0.02, and NaN losses on resuming), and the
    resumed run trains on from them within float8's tolerance of the run it continues."""
    saved_under, resumed_under = RESUMES[case]
    every = "checkpoint.every_steps=2"
    cfg, whole = _run(tmp_path / "whole", rank_pool, *saved_under, every)
    first = complete(Path(cfg.run_dir) / "checkpoints")[0]
    again, resumed = _run(
        tmp_path / "resumed",
        rank_pool,
        *resumed_under,
        every,
        f"checkpoint.resume={first}",
        f"checkpoint.dir={tmp_path}/more",
    )
    assert resumed.meta.resumed_from_step == 2
    assert _saved(cfg) == _saved(again)
    for got, want in zip(resumed.steps, whole.steps[2:], strict=True):
        assert abs(got.loss - want.loss) <= FLOAT8_TOLERANCES["tensorwise"] * want.loss


def test_the_record_says_what_ran_in_float8_and_its_mfu_against_both_peaks():
    """tiny: 28 linears; their share of a token's training FLOPs is 6 x their weights over
    PaLM's count; an MoE says its experts stayed in high precision; the baseline's key
    has float8 in it."""
    cfg = resolved_config("train.float8.enabled=true", BF16)
    fields = float8_fields(cfg, tokens_per_s=1000.0)
    linears, elements = float8_coverage(cfg.model, cfg.train.seq_len, ())
    assert fields["float8_linears"] == linears == 28 and fields["float8_recipe"] == "tensorwise"
    share = 6 * elements / predict.training_flops_per_token(cfg)
    assert fields["float8_flops_share"] == pytest.approx(share) and 0.5 < share < 1
    assert fields["float8_note"] is None
    moe = float8_fields(resolved_config("train.float8.enabled=true", "model=tiny-moe"), 1000.0)
    assert "experts' matmuls stay in fp32" in moe["float8_note"]
    assert float8_fields(resolved_config(), 1000.0) == {}
    # a stored baseline of the run in bf16 is no baseline of it in float8
    assert baseline_key(cfg) != baseline_key(resolved_config(BF16))
    fields |= {"mfu": 0.4, "mfu_fp8_peak": 0.2}
    record = RunRecord.from_dict({"status": "completed", "precision": "bf16", **fields})
    with console.capture() as captured:
        print_summary(record)
    said = " ".join(captured.get().split())
    assert "0.4 of the bf16 peak, 0.2 of the fp8 peak" in said
    assert "tensorwise: 28 linears," in said and f"{share:.0%} of a" in said


@pytest.mark.slow
def test_verify_judges_float8_layouts_by_the_recipes_rounding(tmp_path, on_pool):
    assert verify_run(tmp_path, "parallel=fsdp", "train.float8.enabled=true") == 0
    result = report(tmp_path)
    assert (
        result["tolerance"] == FLOAT8_TOLERANCES["tensorwise"] and result["float8"] == "tensorwise"
    )
    assert result["grad_norms_judged"] is True


@pytest.mark.slow
def test_verify_compares_float8_with_high_precision_by_the_loss(tmp_path, on_pool, capsys):
    """verify.reference=high_precision: one device without float8, the losses within
    FLOAT8_LOSS_BOUND, the gradient norms shown, not judged."""
    code = verify_run(
        tmp_path, "train.float8.enabled=true", "verify.reference=high_precision", BF16
    )
    assert code == 0, capsys.readouterr().out
    result = report(tmp_path)
    assert result["tolerance"] == FLOAT8_LOSS_BOUND and result["grad_norms_judged"] is False
    assert 0 < result["max_loss_deviation"] < FLOAT8_LOSS_BOUND
    assert "without float8" in capsys.readouterr().out
    assert verify_run(tmp_path / "off", "verify.reference=high_precision") == 2


LLAMA_7B_H100 = (
    "model=llama-7b",
    "hardware=h100-80g",
    "train.seq_len=4096",
    "train.global_batch_size=64",
    "train.micro_batch_size=1",
)
FLOAT8_COMPILED = ("train.float8.enabled=true", "train.compile=true")


def test_the_planner_costs_float8_gemms_casts_and_one_byte_gathers():
    """fsdp8 of llama-7b on H100s: the matmuls at the fp8 peak with their casts on top
    (eager's op-by-op casts cost more than compile's fused ones), FSDP2's all-gather and its
    copies at one byte a float8 weight, attention untouched; a gathered block lighter."""
    bf16 = predict_speed(cluster_config(*LLAMA_7B_H100, nodes=1, dp_shard=8))
    f8 = predict_speed(cluster_config(*LLAMA_7B_H100, *FLOAT8_COMPILED, nodes=1, dp_shard=8))
    on = cluster_config(*LLAMA_7B_H100, "train.float8.enabled=true", nodes=1, dp_shard=8)
    eager = predict_speed(on)
    assert 0.5 * bf16.breakdown["matmul"] < f8.breakdown["matmul"] < 0.75 * bf16.breakdown["matmul"]
    assert f8.breakdown["matmul"] < eager.breakdown["matmul"]
    assert f8.breakdown["attention"] == bf16.breakdown["attention"]
    assert f8.breakdown["dp"] < 0.8 * bf16.breakdown["dp"]
    assert f8.breakdown["fsdp_copies"] < 0.8 * bf16.breakdown["fsdp_copies"]
    compiled_on = cluster_config(*LLAMA_7B_H100, *FLOAT8_COMPILED, nodes=1, dp_shard=8)
    [with_f8], [without] = (
        predict_stages(c)
        for c in (compiled_on, cluster_config(*LLAMA_7B_H100, nodes=1, dp_shard=8))
    )
    assert with_f8.activations < without.activations  # two gathered blocks' weights at a byte
    # torchao's roofline bytes a tensorwise cast: input 2w+2, weight 3w+2, gradient 2w+2
    compiled = Float8Plan("tensorwise", True, False, False, 1)
    assert compiled.cast_bytes(10, 3, 2, width=2) == (10 * 2 * 6 + 3 * 2 * 8, 10 * 3 * 6)


def test_an_h100_plan_has_float8_rows_beside_bf16_with_their_gain_an_a100_plan_says_why_not(
    tmp_path,
):
    run, plan = meshrun_plan(
        tmp_path / "h100", "model=llama-7b", "hardware=h100-80g", "world_size=8", "parallel=fsdp"
    )
    by_float8 = {row["float8"]: row for row in plan["layouts"]}
    assert set(by_float8) == {None, "tensorwise"}
    float8, bf16 = by_float8["tensorwise"], by_float8[None]
    assert float8["float8_gain"] == pytest.approx(
        float8["speed"]["tokens_per_s"] / bf16["speed"]["tokens_per_s"]
    )
    assert 1.1 < float8["float8_gain"] < 1.6
    assert "train.compile=true train.float8.enabled=true" in float8["command"]
    said = " ".join(run.output.split())
    assert "float8 rows: train.float8 (tensorwise, torchao) with train.compile" in said
    run, plan = meshrun_plan(
        tmp_path / "a100", "model=llama-7b", "hardware=a100-80g", "world_size=8", "parallel=fsdp"
    )
    assert {row["float8"] for row in plan["layouts"]} == {None}
    assert "float8: none planned: A100-80G has no float8 tensor cores" in " ".join(
        run.output.split()
    )


def test_parallel_auto_picks_a_layout_not_a_precision():
    cfg = compose_config(*LLAMA_7B_H100, "parallel=auto", "train.precision=bf16")
    facts = target_facts(load_profile("h100-80g"), HostFacts.detect())
    ranked = fitting_layouts(cfg, 8, legal_on(facts))
    assert ranked and not any(c.cfg.train.float8.enabled for c in ranked)
