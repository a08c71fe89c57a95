"""The planner: parameter arithmetic, the step-time model's terms, `meshrun-plan` (fit,
ranking, uneven splits for mixed boxes, JSON), the pre-launch fit check and `parallel=auto`.
Accuracy against measured runs is in test_plan_accuracy.py."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from meshrun.core.layout import Layout
from meshrun.models import build_model
from meshrun.plan.candidate import CP_TRACED_UNCOUNTED, CP_UNCOUNTED, cp_uncounted
from meshrun.plan.memory import _sac_saved, predict_stages
from meshrun.plan.probe import host_matmul_flops
from meshrun.plan.shapes import Dims, StageShare, layer_counts, local_param_elements
from meshrun.plan.speed import predict_speed
from meshrun.plan.split import proportional
from meshrun.plan.stage_time import formula_cost
from meshrun.plan.traced import traced_cost
from meshrun.tools.plan import command as plan_command
from tests.cli import CliRun, run_console
from tests.helpers import compose_config, resolved_config

GiB = 2**30


def plan_run(tmp_path: Path, *overrides: str) -> CliRun:
    """`meshrun-plan <overrides>` (its console script's main, in this process)."""
    return run_console(plan_command.main, tmp_path / "plan", None, *overrides, defaults=())


# issue 63's memory levers given as off: a plan of the devices' memory alone
NO_LEVERS = (
    "parallel.fsdp.offload=none",
    "parallel.activation_offload=none",
    "train.optimizer_states=fp32",
)


def meshrun_plan(tmp_path: Path, *overrides: str) -> tuple[CliRun, dict]:
    out = tmp_path / "plan.json"
    run = plan_run(tmp_path, f"json={out}", *overrides)
    assert run.returncode == 0, run.output
    return run, json.loads(out.read_text())


@pytest.mark.parametrize("model", ["tiny", "small", "gpt2-124m", "llama-7b", "llama-13b"])
def test_parameter_arithmetic_matches_the_built_model(model):
    cfg = compose_config(f"model={model}").model
    built = sum(p.numel() for p in build_model(cfg, 128, "meta").parameters())
    d = Dims.of(cfg)
    assert local_param_elements(d, StageShare(d.layers, True, True, 1), 1, 1) == built


HOST_FLOPS = 1e11  # a fixed CPU rate: these tests are about the model, not the probe


@pytest.mark.parametrize("layout", ["parallel=single", "parallel=fsdp", "parallel=tp2_pp2"])
def test_what_is_counted_costs_a_run_as_the_formulas_do(layout):
    """The speed of a model without formulas comes from its trace and torch's FLOP count;
    where both exist they agree (the formulas leave out the norms' and softmax's FLOPs)."""
    cfg = resolved_config("model=small", "model.n_layers=2", "train.seq_len=64", layout)
    formula, counted = formula_cost(cfg, Layout.of(cfg.parallel)), traced_cost(cfg)
    assert counted.rank_elements == pytest.approx(formula.rank_elements, rel=0.01)
    assert counted.flops_per_token == pytest.approx(formula.flops_per_token, rel=0.1)
    assert counted.width == formula.width
    by_formula = predict_speed(cfg, HOST_FLOPS)
    by_count = predict_speed(cfg, HOST_FLOPS, counted)
    assert by_count.step_time_s == pytest.approx(by_formula.step_time_s, rel=0.1)


def test_each_hop_of_a_collective_costs_the_links_latency():
    """tp2 of `small` (4 layers, 4 micro-batches of 2): per micro-batch 4 all-reduces a layer
    and the head's input gradient (2 ring steps each on 2 ranks), the embedding's all-reduce
    (2), the vocabulary-parallel loss's three all-reduces (2 each: train.loss=auto under
    TP)."""
    fast, slow = (
        predict_speed(
            resolved_config("parallel=tp2", f"hardware.intra_node.latency_us={us}"), HOST_FLOPS
        )
        for us in (500, 1500)
    )
    hops = 4 * (4 * 4 * 2 + 2 + 2 + 3 * 2)
    assert slow.comm_s - fast.comm_s == pytest.approx(hops * 1e-3)
    assert slow.compute_s == fast.compute_s


def test_op_checkpointing_keeps_less_than_selective_and_recomputes_less_than_full(tmp_path):
    """On a GPU profile (matmul shapes): memory full < op < selective < none, recompute
    selective (elementwise work) < op (and every other matmul) < full (the whole forward)."""
    activations, times = {}, {}
    for ckpt in ("none", "selective", "op", "full"):
        _, plan = meshrun_plan(
            tmp_path,
            "model=llama-7b",
            "hardware=a100-80g",
            "world_size=8",
            "parallel.dp_shard=8",
            "train.micro_batch_size=1",
            "plan.allow_oom=true",
            f"parallel.activation_checkpointing={ckpt}",
            "parallel.checkpoint_every=1",
        )
        (row,) = plan["layouts"]
        activations[ckpt] = row["memory_per_stage"][0]["activations"]
        times[ckpt] = row["speed"]["step_time_s"]
    assert activations["full"] < activations["op"] < activations["selective"] < activations["none"]
    assert times["none"] < times["selective"] < times["op"] < times["full"]


@pytest.mark.parametrize("ckpt", ["selective", "op"])
def test_sac_under_sequence_parallelism_keeps_the_reduce_scattered_outputs(ckpt):
    """o's and down's reduce-scattered outputs, h/tp each a token (checkpointing.py keeps
    SP's reduce-scatters, as torchtitan does)."""
    d = Dims.of(compose_config("model=small").model, tp=2)
    assert _sac_saved(d, 2, True, ckpt) - _sac_saved(d, 2, False, ckpt) == d.h


def test_fsdp_gathers_and_reduces_every_micro_batch():
    one, two = (
        predict_speed(resolved_config("parallel=fsdp", f"train.micro_batch_size={b}"), HOST_FLOPS)
        for b in (4, 2)
    )
    assert two.comm_s == pytest.approx(2 * one.comm_s)


def test_cpu_efficiency_defaults_to_the_device_types():
    default = predict_speed(resolved_config("parallel=single"), HOST_FLOPS)
    half = predict_speed(resolved_config("parallel=single", "plan.efficiency=0.35"), HOST_FLOPS)
    assert half.compute_s == pytest.approx(2 * default.compute_s)


def test_host_probe_measures_concurrent_streams():
    rate = host_matmul_flops(1, ranks=2, size=128, repeats=2)
    assert 1e8 < rate < 1e14


def test_llama_7b_ddp_does_not_fit_an_a6000_and_the_plan_names_layouts_that_do(tmp_path):
    run, plan = meshrun_plan(tmp_path, "model=llama-7b", "hardware=a6000", "world_size=8")
    layouts = {tuple(sorted(entry["degrees"].items())): entry for entry in plan["layouts"]}
    ddp = layouts[(("cp", 1), ("dp_replicate", 8), ("dp_shard", 1), ("pp", 1), ("tp", 1))]
    assert not ddp["fits"]
    # 16 bytes a parameter (fp32 weights, grads, AdamW) for 6.7e9 parameters alone: > 48 GiB
    assert ddp["peak_bytes"] > 6.7e9 * 16 > 47.5 * GiB
    fitting = [e for e in plan["layouts"] if e["fits"]]
    assert fitting and plan["layouts"][0]["fits"]  # fitting layouts are ranked first
    # fastest first, where 2% apart; closer than that, the one with the lower peak first
    top = max(e["speed"]["tokens_per_s"] for e in fitting)
    bands = [
        (math.floor(math.log(top / e["speed"]["tokens_per_s"]) / -math.log(0.98)), e["peak_bytes"])
        for e in fitting
    ]
    assert bands == sorted(bands) and len({b for b, _ in bands}) > 3
    assert all(e["peak_bytes"] <= min(e["capacity_bytes"]) for e in fitting)
    # an A6000's 47.5 GiB less 1 GiB of headroom, less the allocator's 10% of the rest
    assert ddp["capacity_bytes"] == [int(46.5 * GiB * 0.9)]
    not_fitting = next(line for line in run.output.splitlines() if line.startswith("do not fit"))
    closest = min((e for e in plan["layouts"] if not e["fits"]), key=lambda e: e["peak_bytes"])
    listed = not_fitting.split(": ", 1)[1]
    assert listed.startswith(f"{closest['layout']} ({closest['peak_bytes'] / GiB:.2f} > 41.85 GiB)")


@pytest.mark.parametrize("preset", ["ddp", "fsdp"])
def test_a_presets_minus_one_degree_fills_the_world_in_a_plan_as_in_a_run(tmp_path, preset):
    """parallel=ddp is dp_replicate=-1: the plan keeps the preset's layout with the rest of
    its 8 ranks, as a run would, and says whether it fits (it was an empty table)."""
    _, plan = meshrun_plan(
        tmp_path, "model=llama-13b", f"parallel={preset}", "hardware=a100-80g", "world_size=8"
    )
    dim = {"ddp": "dp_replicate", "fsdp": "dp_shard"}[preset]
    assert plan["layouts"], plan["ruled_out"]
    assert {e["degrees"][dim] for e in plan["layouts"]} == {8}
    assert not plan["layouts"][0]["fits"] if preset == "ddp" else plan["layouts"][0]["fits"]


def test_a_given_context_parallel_degree_is_kept_and_its_rows_say_what_is_not_counted(tmp_path):
    """parallel.cp=2 is kept (256 tokens is too short for the search to try CP), the other
    half of the world laid out around it, and each row says what its memory leaves out."""
    _, plan = meshrun_plan(
        tmp_path,
        "model=tiny",
        "parallel.cp=2",
        "hardware=cpu",
        "world_size=4",
        "train.seq_len=256",
    )
    assert plan["layouts"], plan["ruled_out"]
    assert {e["degrees"]["cp"] for e in plan["layouts"]} == {2}
    assert {math.prod(e["degrees"].values()) for e in plan["layouts"]} == {4}
    assert all(e["notes"] == [CP_UNCOUNTED["ring"]] for e in plan["layouts"])
    assert any(e["layout"] == "fsdp2 x cp2(ring)" for e in plan["layouts"])


@pytest.mark.slow
def test_a_long_context_plan_fits_only_with_context_parallelism(tmp_path):
    """128k tokens of LLaMA 3.1 8B on 8 H100s, with the full loss: no layout without CP fits
    (the activations of a whole sequence on a rank, its 128k x 128k logits); CP layouts do
    (cp8: the loss's 2V transient a token counted beside the recompute's since issue 63),
    each with the command that runs it. (With the default loss, tp8 with SP fits too: its
    logits sharded over the vocabulary, train.loss=vocab_parallel.)"""
    run, plan = meshrun_plan(
        tmp_path,
        "model=hf/llama-3.1-8b",
        "train.seq_len=131072",
        "hardware=h100-80g",
        "world_size=8",
        "train.loss=full",
    )
    fitting = [e for e in plan["layouts"] if e["fits"]]
    assert fitting, plan["layouts"]
    assert all(e["degrees"]["cp"] > 1 for e in fitting)
    assert any(e["degrees"]["cp"] == 1 for e in plan["layouts"])  # searched, not fitting
    assert f"parallel.cp={fitting[0]['degrees']['cp']}" in run.output
    # what the ring's rows leave out, said once for all of them
    assert run.output.count("block in flight") == 1
    said = re.search(rf"rows? ([\d, ]+): {re.escape(CP_UNCOUNTED['ring'])}", run.output)
    shown = plan["layouts"][: len(re.findall(r"^ +\d+  meshrun ", run.output, re.M))]
    cp_rows = [i for i, e in enumerate(shown, 1) if e["degrees"]["cp"] > 1]
    assert [int(n) for n in said.group(1).split(", ")] == cp_rows


def test_each_cp_method_says_what_its_memory_prediction_leaves_out():
    cfg = compose_config("parallel=cp2")
    for method in ("ring", "alltoall"):
        cfg.parallel.cp_method = method
        assert cp_uncounted(cfg) == CP_UNCOUNTED[method]
    cfg.parallel.cp_method = "allgather"
    assert cp_uncounted(cfg) == ""  # its gathered K/V are counted
    custom = compose_config("parallel=cp2", "model=custom", "model.target=tests.user_model:build")
    assert cp_uncounted(custom) == CP_TRACED_UNCOUNTED
    assert cp_uncounted(compose_config("parallel=fsdp")) == ""


MY_LLAMA = """defaults:
  - /schema/model/meshrun@_here_
  - _self_
name: my-llama
dim: 512
n_layers: 8
n_heads: 8
vocab_size: 32000
"""
MY_HF_LLAMA = """defaults:
  - /schema/model/hf@_here_
  - _self_
name: my-hf-llama
architecture: LlamaForCausalLM
config:
  vocab_size: 32000
  hidden_size: 512
  intermediate_size: 1408
  num_hidden_layers: 8
  num_attention_heads: 8
  max_position_embeddings: 3072
"""


def plan_own_preset(tmp_path: Path, preset: str, *overrides: str) -> CliRun:
    """`meshrun-plan --config-dir DIR model=<preset>` of a preset written to DIR/model."""
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True, exist_ok=True)
    name = re.search(r"^name: (.+)$", preset, re.MULTILINE).group(1)
    (conf / "model" / f"{name}.yaml").write_text(preset)
    return run_console(
        plan_command.main,
        tmp_path / "plan",
        None,
        f"model={name}",
        *overrides,
        defaults=(),
        flags=("--config-dir", str(conf)),
    )


def test_a_gpu_plan_of_ones_own_preset_without_a_context_asks_for_the_sequence(tmp_path):
    """Not the CPU's 128, which made the top row a 1,024-micro-batch pipeline."""
    run = plan_own_preset(tmp_path, MY_LLAMA, "hardware=a100-80g", "world_size=8")
    assert run.returncode == 2, run.output
    assert "config error" in run.output and "train.seq_len" in run.output
    assert "model.context_len" in run.output and "Valid: train.seq_len=" in run.output
    given = plan_own_preset(
        tmp_path, MY_LLAMA, "hardware=a100-80g", "world_size=8", "train.seq_len=2048", "top=1"
    )
    assert given.returncode == 0, given.output
    assert "x seq 2048 (train.seq_len)" in given.output
    context = plan_own_preset(
        tmp_path, MY_LLAMA, "hardware=a100-80g", "world_size=8", "+model.context_len=1024"
    )
    assert "x seq 1024 (model.context_len)" in context.output
    cpu = plan_own_preset(tmp_path, MY_LLAMA, "hardware=cpu", "top=1")  # the CPU's default
    assert cpu.returncode == 0 and "x seq 128 (train.seq_len)" in cpu.output


def test_a_gpu_plan_of_ones_own_transformers_preset_takes_its_max_positions(tmp_path):
    out = tmp_path / "plan.json"
    run = plan_own_preset(
        tmp_path, MY_HF_LLAMA, "hardware=a100-80g", "world_size=8", "top=1", f"json={out}"
    )
    assert run.returncode == 0, run.output
    assert json.loads(out.read_text())["train"]["seq_len"] == 3072
    assert "x seq 3072 (max_position_embeddings)" in run.output


def test_short_sequences_plan_no_context_parallelism(tmp_path):
    _, plan = meshrun_plan(tmp_path, "model=llama-7b", "hardware=a100-80g", "world_size=8")
    assert plan["layouts"]
    assert {e["degrees"]["cp"] for e in plan["layouts"]} == {1}


def test_a_vocabulary_no_tp_degree_divides_still_plans_tensor_parallel_layouts(tmp_path):
    """gpt3-175b: 50257 tokens, padded per TP degree (and counted so)."""
    _, plan = meshrun_plan(tmp_path, "model=gpt3-175b", "hardware=a100-80g", "world_size=8")
    tp = [e for e in plan["layouts"] if e["degrees"]["tp"] > 1]
    assert {e["degrees"]["tp"] for e in tp} >= {2, 4, 8}
    assert all(e["peak_bytes"] > 0 for e in tp)


def test_mixed_box_gets_an_uneven_split_with_more_layers_on_the_faster_devices(tmp_path):
    run, plan = meshrun_plan(
        tmp_path,
        "model=llama-7b",
        "hardware=2xa100-6xa6000",
        "train.precision=bf16",
        *NO_LEVERS,  # offloaded layouts that fit would rank above the uneven pipelines
    )
    assert plan["world_size"] == 8
    uneven = [e for e in plan["layouts"] if e["pp_layers"]]
    assert uneven
    pp4 = next(e for e in uneven if e["degrees"]["pp"] == 4 and e["degrees"]["tp"] == 2)
    # stage 0 runs on the two A100s (312 bf16 TFLOP/s), the others on A6000s (154.8)
    first, *rest = pp4["pp_layers"]
    assert sum(pp4["pp_layers"]) == 32 and all(first > n for n in rest)
    assert "uneven split" in pp4["notes"][0] and "A100" in pp4["notes"][0]
    assert "uneven split" in run.output


def test_proportional_split_keeps_every_stage_and_all_layers():
    assert proportional(32, [312.0, 154.8, 154.8, 154.8]) == [13, 7, 6, 6]
    assert proportional(4, [100.0, 1.0, 1.0]) == [2, 1, 1]
    assert sum(proportional(7, [1.0, 1.0])) == 7


def test_planner_predicts_pp_layers_auto_with_the_formula_split():
    """A 16k vocabulary's head costs more than a `tiny` block's matmuls: the planner's auto
    split (it cannot time) gives the last stage fewer layers, and predicts that split."""
    auto = resolved_config(
        "model=tiny", "model.vocab_size=16384", "parallel=pp2", "parallel.pp_layers=auto"
    )
    explicit = resolved_config(
        "model=tiny", "model.vocab_size=16384", "parallel=pp2", "parallel.pp_layers=[3,1]"
    )
    assert layer_counts(auto.model, auto.parallel, 2, 1) == [3, 1]
    assert predict_stages(auto) == predict_stages(explicit)
    assert predict_speed(auto, HOST_FLOPS) == predict_speed(explicit, HOST_FLOPS)


def test_plan_rejects_a_bad_world_size_before_planning(tmp_path):
    run = plan_run(tmp_path, "world_size=0")
    assert run.returncode == 2
    assert "world_size=0" in run.output


def test_llama_13b_ddp_on_a100_is_refused_before_launch_with_the_prediction(meshrun_here):
    """Submitted to SLURM from a host without the GPUs, the plan is checked on the profile's
    box (here, without SLURM, a GPU profile is refused first: no CUDA device)."""
    run = meshrun_here("model=llama-13b", "parallel=ddp", "hardware=a100-80g", "launcher=slurm")
    assert run.returncode == 2
    assert "predicted peak memory" in run.output and "GiB" in run.output
    assert "exceeds the 70.4 GiB usable" in run.output  # (79.2 - 1) x 0.9
    assert "plan.headroom_gib=1 and plan.fragmentation=0.1" in run.output
    assert "parallel.tp=" in run.output  # names layouts that would fit
    assert not (run.run_dir / "results.json").exists()
    assert not run.store_path.exists() or run.stored() == []


def test_allow_oom_launches_a_run_predicted_not_to_fit_and_stores_the_prediction(meshrun_here):
    refused = meshrun_here("parallel=single", "model=tiny", "plan.headroom_gib=1e6")
    assert refused.returncode == 2 and "plan.allow_oom=true" in refused.output
    run = meshrun_here(
        "parallel=single",
        "model=tiny",
        "plan.headroom_gib=1e6",
        "plan.allow_oom=true",
        "train.steps=3",
    )
    assert run.returncode == 0, run.output
    row = run.stored()[0]
    assert row["predicted_peak_memory_bytes"] > 0 and row["peak_memory_max_bytes"] > 0
    assert row["memory_predicted"][0]["params"] == row["memory_per_rank"][0]["params"]


def test_parallel_auto_runs_the_best_predicted_layout(meshrun_here):
    run = meshrun_here("parallel=auto", "model=tiny", "train.steps=3", "metrics.baseline=off")
    assert run.returncode == 0, run.output
    results = run.results
    # the preset asked for stays `auto`; the layout it resolved to is named like any other
    assert results["parallel"] == "auto" and results["world_size"] == 2
    assert results["layout_name"] not in ("auto", "single")
    # run again: the overrides given, `parallel=auto` replaced by what it chose
    given, layout = results["overrides"].split(" parallel=single ")
    assert given.endswith(" model=tiny train.steps=3 metrics.baseline=off")
    assert layout.startswith("parallel.")
    assert results["predicted_step_time_s"] > 0
    # the console says what it chose and why, with the overrides that run it again
    chose = next(line for line in run.output.splitlines() if "parallel=auto chose" in line)
    assert results["layout_name"] in chose and f"parallel=single {layout}" in chose
    assert "predicted" in chose and "layouts that fit" in chose


def test_fsdp_under_a_pipeline_holds_its_stage_gathered_with_unsharded_gradients():
    """torch's pipeline schedule reshards and syncs FSDP2 only after a step's last backward:
    each rank holds its whole stage gathered (bf16) and its gradients unsharded (fp32)."""
    cfg = resolved_config(
        "model=llama-7b",
        "parallel=pp2",
        "parallel.dp_shard=2",
        "train.precision=bf16",
        "plan.allow_oom=true",
    )
    first = predict_stages(cfg)[0]
    d = Dims.of(cfg.model)
    stage = local_param_elements(d, StageShare(d.layers // 2, True, False, 1), 1, 1)
    assert first.activations > stage * (2 + 4)  # what the two gathered copies alone take
    assert first.params == pytest.approx(stage * 4 / 2, rel=0.01)  # the sharded state
