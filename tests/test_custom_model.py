"""A user's own nn.Module (model=custom) under meshrun's layouts: its own forward and init run
unchanged; every kind of layout trains it like one device from the names and TP plan the
config gives; meshrun-verify passes its plan and fails a sabotaged one; what a layout needs
and the config does not say is refused before launch, with the key and what would be valid."""

from __future__ import annotations

import json

import pytest
import torch

from meshrun.core.errors import ConfigError
from meshrun.core.hardware import HostFacts
from meshrun.driver.resolve import resolve
from meshrun.models import build_model, model_shape
from meshrun.plan.speed import predict_speed
from meshrun.plan.stage_time import ModelCost
from meshrun.plan.traced import traced_memory
from meshrun.rank.parallel.pipeline import cut_stage
from meshrun.validate import custom as custom_rules
from tests.helpers import compose_config, resolved_config
from tests.ranks import losses
from tests.test_plan import meshrun_plan, plan_run
from tests.test_verify import report, verify_run
from tests.tiers import tiered

MODEL = ("model=custom", "model.target=tests.user_model:build")
NAMED = (
    *MODEL,
    "model.layers=blocks",
    "model.embedding=embed",
    "model.norm=norm",
    "model.head=head",
    "model.tp_plan=tests.user_model:tp_plan",
)
STEPS = 6
COMMON = (
    f"train.steps={STEPS}",
    "train.untimed_steps=1",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.seq_len=64",
    "train.seed=3",
    "metrics.baseline=off",
)
# In CI: FSDP units on the user's blocks with their recompute, a pipeline of the named parts,
# and (in verify, below) TP on a YAML plan. The rest with -m slow (make test-all).
FAST = {"pp2_1f1b"}
LAYOUTS = {
    "ddp": ("parallel=ddp",),
    "fsdp": ("parallel=fsdp",),
    "fsdp_full_checkpointing": ("parallel=fsdp", "parallel.activation_checkpointing=full"),
    "hsdp": ("parallel=hsdp", "launcher.nproc_per_node=4"),
    "tp2": ("parallel=tp2",),
    "pp2_1f1b": ("parallel=pp2",),
    "pp2_gpipe": ("parallel=pp2", "parallel.schedule=gpipe"),
    "pp2_interleaved": ("parallel=pp2_interleaved",),
    "tp2_pp2": ("parallel=tp2_pp2",),
    "dp2_tp2_pp2": ("parallel=dp2_tp2_pp2",),
}


def custom(*overrides: str):
    return compose_config(*NAMED, *overrides).model


def test_the_module_is_the_users_own_forward_and_init():
    from tests.user_model import build  # noqa: PLC0415 (the user's code, as meshrun imports it)

    model = build_model(custom(), 64, "meta")
    model.to_empty(device="cpu")
    model.init_weights(seed=5)
    torch.manual_seed(5)
    theirs = build()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), theirs(tokens), rtol=0, atol=0)
    shape = model_shape(custom())
    assert (shape.n_layers, shape.vocab_size, shape.dim, shape.tied) == (4, 256, 64, False)
    assert not shape.formula  # no widths to plan by formula


def test_pipeline_stages_run_the_named_parts_in_sequence_under_the_whole_models_names():
    full = build_model(custom(), 64, "meta")
    first, last = cut_stage(full, 0, [2, 2]), cut_stage(full, 1, [2, 2])
    assert list(first.layers) == ["0", "1"] and list(last.layers) == ["2", "3"]
    assert first.output is None and last.tok_embeddings is None
    names = {n for part in (first, last) for n, _ in part.named_parameters()}
    assert names == {n for n, _ in full.named_parameters()}
    for part in (full, first, last):
        part.to_empty(device="cpu")
        part.init_weights(seed=1)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(last(first(tokens)), full(tokens), rtol=1e-6, atol=1e-6)


@pytest.fixture(scope="module")
def single(tmp_path_factory, rank_pool) -> list[float]:
    from meshrun.driver.experiment import measure  # noqa: PLC0415
    from tests.ranks import config_in  # noqa: PLC0415

    cfg = config_in(tmp_path_factory.mktemp("single"), "parallel=single", *NAMED, *COMMON)
    measured = measure(cfg, "run", rank_pool.launch)
    assert measured.ok, measured.meta.error
    return losses(measured)


@pytest.mark.parametrize("layout", tiered(LAYOUTS, FAST))
def test_every_kind_of_layout_trains_the_users_module_like_one_device(experiment, single, layout):
    _, measured = experiment(*LAYOUTS[layout], *NAMED, *COMMON)
    assert measured.ok, measured.meta.error
    got = losses(measured)
    assert len(got) == len(single) == STEPS
    for step, (loss, ref) in enumerate(zip(got, single, strict=True)):
        assert abs(loss - ref) <= 1e-4 * abs(ref), f"step {step}: {loss} vs {ref}"
    assert got[-1] < got[0]


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(("parallel=fsdp",), marks=pytest.mark.slow),
        pytest.param(("parallel=tp2",), marks=pytest.mark.slow),
        ("parallel=tp2", "model.tp_plan={blocks.*.up:colwise,blocks.*.down:rowwise}"),
        # its attention shared by the ring through SDPA, its positions by keyword
        pytest.param(
            ("parallel=cp2", "model.positions=positions", "train.micro_batch_size=4"),
            marks=pytest.mark.slow,
        ),
        # and under a pipeline: the stages give the embedding, whose forward takes the
        # keyword, the CP rank's positions
        pytest.param(
            (
                "parallel=cp2",
                "parallel.pp=2",
                "model.positions=positions",
                "train.micro_batch_size=4",
            ),
            marks=pytest.mark.slow,
        ),
    ],
    ids=" ".join,
)
def test_verify_passes_the_users_module_with_its_own_plan(tmp_path, on_pool, overrides):
    assert verify_run(tmp_path, *NAMED, *overrides) == 0
    assert report(tmp_path)["passed"] is True


@pytest.mark.slow  # test_verify.py's wrong plan fails on the numbers in CI
def test_verify_fails_a_sabotaged_plan_on_the_numbers(tmp_path, on_pool):
    code = verify_run(
        tmp_path, *NAMED, "parallel=tp2", "model.tp_plan=tests.user_model:sabotaged_tp_plan"
    )
    result = report(tmp_path)
    assert code == 1 and result["error"] is None and result["passed"] is False
    assert result["max_grad_norm_deviation"] > 1e-2


STREAM_OUTSIDE = (
    "model=custom",
    "model.target=tests.user_model:StreamOutside",
    "model.layers=blocks",
    "model.embedding=emb",
    "model.head=head",
)
STAGED_CAUSE = "the module's forward is not its named parts in sequence"
STAGED_FIX = "or train without a pipeline (parallel.pp=1)"


def test_a_pipeline_refuses_a_module_whose_forward_is_not_its_parts_before_launch(
    meshrun_here,
):
    """The residual adds live in the module's forward: the staged parts would train another
    model (meshrun-verify showed the loss off by 3.8e-2). The driver probes the module (small
    enough to build on its CPU) as the ranks would, and refuses before any starts."""
    run = meshrun_here("parallel=pp2", *STREAM_OUTSIDE, *COMMON)
    assert run.returncode == 2, run.output
    said = " ".join(run.output.split())
    assert "config error parallel.pp=2: model=custom under a pipeline:" in said
    assert STAGED_CAUSE in said and "Valid: put what the forward does between" in said
    assert STAGED_FIX in said
    assert "Traceback" not in run.output
    assert not run.store_path.exists()  # nothing ran, nothing recorded


def test_a_module_too_big_for_the_drivers_probe_is_refused_by_the_ranks_without_a_traceback(
    meshrun_here, monkeypatch
):
    """Beyond the driver's probe the ranks refuse it before step 0: the console says the
    cause and the fix once, the traceback stays in the rank's failure record."""
    monkeypatch.setattr(custom_rules, "DRIVER_PROBE_PARAMS", 0)
    run = meshrun_here("parallel=pp2", *STREAM_OUTSIDE, *COMMON)
    assert run.returncode == 1, run.output
    said = " ".join(run.output.split())
    assert f"StagedForwardDiffers: model=custom under a pipeline: {STAGED_CAUSE}" in said
    assert STAGED_FIX in said
    assert "Traceback" not in run.output
    assert run.results["steps_completed"] == 0  # refused before any step
    records = [json.loads(p.read_text()) for p in run.run_dir.glob("failures/rank*.json")]
    assert records and all(r["refused"] for r in records)
    assert all(r["traceback"].startswith("Traceback (most recent call last):") for r in records)


@pytest.mark.slow
def test_a_module_with_one_embedding_needs_no_name_for_it_and_is_told_so(experiment, single):
    """Neither model.vocab_size nor model.embedding: the module's one nn.Embedding gives the
    vocabulary, the run says so and trains as with the embedding named."""
    notes: list[str] = []
    cfg = resolve(
        compose_config(*MODEL, "model.layers=blocks"), HostFacts.detect(), notes.append
    ).config
    assert model_shape(cfg.model).vocab_size == 256
    assert notes == [
        "model=custom: the vocabulary is 256, that of the module's one nn.Embedding "
        "(embed.tokens); model.vocab_size or model.embedding would say so"
    ]
    _, measured = experiment("parallel=fsdp", *MODEL, "model.layers=blocks", *COMMON)
    assert measured.ok, measured.meta.error
    assert losses(measured) == pytest.approx(single, rel=1e-4)


@pytest.mark.parametrize(
    ("overrides", "key", "fragment"),
    [
        (["model.target=tests.user_model:nothing"], "model.target", "no attribute 'nothing'"),
        (["model.pretrained=/tmp"], "model.pretrained", "load them in model.target's callable"),
        (
            ["model.target=tests.user_model:not_a_module"],
            "model.target",
            "returned a str, not a torch.nn.Module",
        ),
        (["+model.kwargs.width=3"], "model.target", "unexpected keyword argument 'width'"),
        (["model.layers=block"], "model.layers", "Valid: blocks |"),
        (["model.layers=norm"], "model.layers", "is a LayerNorm"),
        (["model.tp_plan={blocks.*.qq:colwise}"], "model.tp_plan", "matches no module"),
        (["model.tp_plan={blocks.*.q:columnwise}"], "model.tp_plan.blocks.*.q", "colwise |"),
        (
            ["model.embedding=null", "+model.kwargs.learned_positions=true"],
            "model.vocab_size",
            "holds 2 nn.Embedding (embed.tokens, embed.learned)",
        ),
        (["model.embedding=blocks.0"], "model.vocab_size", "(blocks.0) holds no nn.Embedding"),
        (
            ["parallel=tp2", "model.tp_plan=null"],
            "parallel.tp",
            "needs a TP plan and model=custom has none",
        ),
        (
            ["parallel=tp4", "+model.kwargs.dim=66", "+model.kwargs.heads=2"],
            "parallel.tp",
            "blocks.0.q (colwise) has 66 output features, which tp does not divide",
        ),
        (["parallel=pp2", "model.head=null"], "parallel.pp", "model.head is not set"),
        (
            ["parallel=fsdp", "parallel.activation_checkpointing=full", "model.layers=null"],
            "parallel.activation_checkpointing",
            "model.layers, which is not set",
        ),
        (
            ["train.compile=true", "model.layers=null"],
            "train.compile",
            "model.layers, which is not set",
        ),
        (  # the plan has no SP entries (the planner searched SP and crashed tracing it)
            ["parallel=tp2", "parallel.sequence_parallel=true"],
            "parallel.sequence_parallel",
            "model.tp_plan has no sequence_parallel or gather_input entry",
        ),
        (["parallel=cp2"], "parallel.cp", "model.positions (the keyword its forward takes"),
        (
            ["parallel=cp2", "model.positions=position_ids"],
            "model.positions",
            "is not a keyword of TinyGPT.forward(ids: 'torch.Tensor', positions:",
        ),
        (
            ["parallel=cp2", "model.positions=positions", "model.layers=null"],
            "parallel.cp",
            "inside each block of model.layers, which is not set",
        ),
        (  # under a pipeline the embedding is a part, and takes no `positions` keyword
            [
                "parallel=cp2",
                "parallel.pp=2",
                "model.positions=positions",
                "model.target=tests.user_model:build_positions_by_another_name",
            ],
            "parallel.pp",
            "the module's forward is not its named parts in sequence",
        ),
        (  # attention written out: it would see each CP rank's own tokens only
            ["parallel=cp2", "model.positions=positions", "+model.kwargs.attention_by_hand=true"],
            "parallel.cp",
            "model=custom's blocks call none (probed on the meta device)",
        ),
    ],
    ids=str,
)
def test_config_mistakes_are_refused_before_launch(overrides, key, fragment):
    with pytest.raises(ConfigError) as caught:
        resolve(compose_config(*NAMED, *overrides), HostFacts.detect())
    assert caught.value.key == key
    assert fragment in str(caught.value)


def test_the_planner_traces_a_module_without_formulas():
    """Each rank's memory from its parallel module run on fake tensors (plan/traced.py)."""
    model = build_model(custom(), 64, "meta")
    params = sum(p.numel() for p in model.parameters()) * 4
    buffers = sum(b.numel() for b in model.buffers()) * 4
    # plan.allow_oom: no pre-launch check, whose trace would be the one measured here
    fsdp, tp2 = (
        traced_memory(resolved_config(*NAMED, p, "train.seq_len=64", "plan.allow_oom=true"))
        for p in ("parallel=fsdp", "parallel=tp2")
    )
    # fp32 weights and AdamW's two moments: half the model on each rank under FSDP, more under
    # TP (the plan leaves the embedding, the head and the norms whole); the buffers whole
    assert fsdp[0].params == pytest.approx(params / 2 + buffers, rel=0.02)
    assert fsdp[0].optimizer == pytest.approx(params, rel=0.02)
    assert params / 2 < tp2[0].params - buffers < params
    assert tp2[0].optimizer == pytest.approx(2 * (tp2[0].params - buffers), rel=0.01)
    assert all(m.activations > 0 for m in (*fsdp, *tp2))


def test_the_trace_counts_each_optimizer_states_bytes():
    """The planner tries lighter states where a module does not fit (plan/levers.py): the
    trace steps bf16's AdamW on fake tensors (its step counter was data a trace cannot read:
    a pre-launch traceback, exit 1), and counts 8-bit's at memory.py's bytes a parameter
    (torchao's compiled update does not run on fake tensors)."""
    fp32, bf16, eight = (
        traced_memory(
            resolved_config(
                *NAMED, "parallel=fsdp", "train.seq_len=64", f"train.optimizer_states={m}"
            )
        )[0]
        for m in ("fp32", "bf16", "8bit")
    )
    assert bf16.optimizer == pytest.approx(fp32.optimizer / 2, rel=0.01)
    assert eight.optimizer == pytest.approx(fp32.optimizer * 2 * (1 + 4 / 256) / 8, rel=0.01)
    assert eight.params == bf16.params == fp32.params


@pytest.mark.slow
def test_the_planner_traces_a_context_parallel_rank_over_its_share_of_the_sequence():
    """cp2 against fsdp on two ranks: the same parameter shards (FSDP over dp_shard x cp), a
    micro-batch of half the tokens each: half the activations but for what does not scale
    with tokens (the blocks FSDP gathers), 0.60 of fsdp's here (1.0 traced over the whole
    sequence)."""
    fsdp, cp2 = (
        traced_memory(resolved_config(*NAMED, *p, "train.seq_len=64", "plan.allow_oom=true"))[0]
        for p in (("parallel=fsdp",), ("parallel=cp2", "model.positions=positions"))
    )
    assert cp2.params == fsdp.params and cp2.optimizer == fsdp.optimizer
    assert 0.3 * fsdp.activations < cp2.activations < 0.7 * fsdp.activations


def test_meshrun_plan_refuses_a_target_that_does_not_import(tmp_path):
    run = plan_run(tmp_path, "model=custom", "model.target=no_such_module:build", "world_size=2")
    assert run.returncode == 2
    assert "model.target='no_such_module:build': cannot be imported" in run.output


@pytest.mark.slow
def test_meshrun_plan_lists_every_layout_of_a_module_without_formulas(tmp_path):
    _, plan = meshrun_plan(tmp_path, *NAMED, "world_size=2")
    kinds = {
        (e["degrees"]["dp_shard"], e["degrees"]["tp"], e["degrees"]["pp"]) for e in plan["layouts"]
    }
    assert {(2, 1, 1), (1, 2, 1), (1, 1, 2)} <= kinds
    assert all(e["speed"]["tokens_per_s"] > 0 and e["peak_bytes"] > 0 for e in plan["layouts"])


@pytest.mark.slow
def test_a_module_predicted_not_to_fit_is_refused_before_launch(meshrun_here):
    run = meshrun_here(*NAMED, "parallel=fsdp", "plan.headroom_gib=1e6")
    assert run.returncode == 2, run.output
    assert "predicted peak memory" in run.output and "exceeds the" in run.output


def test_op_checkpointing_of_a_module_without_formulas_recomputes_every_other_matmul():
    """The module's matmul sizes are unknown (no heads, no FFN width): ckpt=op is costed as
    half its matmul FLOPs again, between selective (elementwise work only) and full."""
    cost = ModelCost(flops_per_token=6e6, rank_elements=10**6, width=64)

    def recompute(policy: str) -> float:
        cfg = compose_config(
            *NAMED,
            "parallel=fsdp",
            f"parallel.activation_checkpointing={policy}",
            "train.global_batch_size=8",
        )
        return predict_speed(cfg, host_flops=1e11, cost=cost).breakdown["recompute"]

    selective, op, full = recompute("selective"), recompute("op"), recompute("full")
    assert selective < op < full
