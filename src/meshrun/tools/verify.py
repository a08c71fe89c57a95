"""`meshrun-verify`: run a layout and its single-device reference from the same seed and global
batch, and compare loss and gradient norm step by step.

A correct layout computes the single device's math (in fp32 to ~1e-6 relative), so the largest
deviation says whether a new layout, or a user's own TP plan (`parallel.tp_plan`), can be
trusted before it spends cluster hours. The config is `meshrun`'s (conf/verify.yaml includes
train.yaml) plus a `verify` block. Both runs go under the run dir; neither is recorded in the
results store or W&B, since they are checks, not measurements.

Where the layout deviates by more than its tolerance, the reference's own noise is measured
before any verdict: the reference again with each step's micro-batches summed last to first
(`noise_config`: the same math and float8 scales, its sums in another order, as a layout's
are; 8-bit optimizer states in other blocks, as a layout's shards group them), and each step
judged against NOISE_FACTOR times the largest deviation that run showed up to it, at least
one rounding of the run's high precision (TOLERANCES). Two correct runs drift apart by what
their roundings do to training, which grows with the steps and with what float8 rounds
(model=small under tensorwise float8: one device's micro-batches of 1 and 2 drift 2.3e-2
apart in grad norm over 10 steps, fsdp 1.3e-2 from one device), while a layout that loses or
double-counts a contribution is off from the first step, before any drift (a planted 1%
error in the last parameter's gradient, debug.grad_error).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # before anything touches CUDA

from omegaconf import DictConfig, OmegaConf
from rich.table import Table
from rich.text import Text

from meshrun.core.choices import LossKernel, LossMethod
from meshrun.core.config import DebugConfig, ExperimentConfig, ParallelConfig, settings_of
from meshrun.core.errors import ConfigError, fail, positive
from meshrun.core.hardware import HostFacts, target_facts
from meshrun.core.layout import Layout
from meshrun.core.naming import layout_name
from meshrun.core.record import MEMORY_CATEGORIES
from meshrun.core.run_files.metrics import StepRow
from meshrun.driver.command import hydra_command
from meshrun.driver.experiment import measure
from meshrun.driver.launch.dispatch import launch
from meshrun.driver.measured import Measured
from meshrun.driver.resolution import legal
from meshrun.driver.resolve import resolve
from meshrun.driver.sinks.console import console, print_error, print_note
from meshrun.driver.tool_config import VerifyExperimentConfig, verify_tolerance
from meshrun.models.loss import chunked_loss_kernel, loss_method
from meshrun.plan import predict
from meshrun.plan.candidate import traced_or_why

REPORT_FILE = "verify.json"
GiB = 2**30
# How far beyond the reference's own noise a correct layout may drift: the layout and the
# noise run are two reorderings of the same sums, each a draw of the same divergence; measured
# on model=small under float8 (10 steps), fsdp and tp2 drifted 0.57x-0.79x as far as the noise
# run did, so twice leaves room for the spread of two draws.
NOISE_FACTOR = 2.0


def reference_config(cfg: ExperimentConfig, reference: str = "same") -> ExperimentConfig:
    """The single-device baseline with the SAME global batch (unlike the weak-scaling baseline).

    Model, data, seed, steps, micro-batch and threads per rank stay; the layout's own options
    (TP plan, schedule, checkpointing) and fault injection do not apply to one device.
    `reference` (verify.reference): `high_precision`, without train.float8; `full_loss`,
    with train.loss=full.
    """
    train = cfg.train
    if reference == "high_precision":
        float8 = dataclasses.replace(train.float8, enabled=False)
        train = dataclasses.replace(train, float8=float8)
    if reference == "full_loss":  # no chunks: no chunked loss's kernel
        train = dataclasses.replace(train, loss=LossMethod["full"], loss_kernel=LossKernel["torch"])
    return dataclasses.replace(
        cfg,
        train=train,
        parallel=ParallelConfig(name="single"),
        launcher=dataclasses.replace(cfg.launcher, nproc_per_node=1),
        debug=DebugConfig(),
        run_dir=f"{cfg.run_dir}/reference",
        name=f"{cfg.name}-reference",
    )


def noise_config(reference: ExperimentConfig) -> ExperimentConfig | None:
    """The reference with each step's micro-batches summed last to first: the same math, the
    same float8 scales (each micro-batch's own), its sums in another order, as a layout's
    are; with 8-bit optimizer states, those quantized in other blocks, as a layout's shards
    group them (a row split by TP cuts torchao's blocks of 256 elsewhere than one device's:
    model=small's 384-wide rows under tp2 moved the grad norm 3.6e-4; blocks of 128 on one
    device moved it 4.9e-4 over 10 steps). None where neither applies."""
    train = reference.train
    several = (train.global_batch_size or train.micro_batch_size) > train.micro_batch_size
    regroup = train.optimizer_states == "8bit"
    if not (several or regroup):
        return None
    return dataclasses.replace(
        reference,
        debug=dataclasses.replace(
            reference.debug, reverse_micro_batches=several, regroup_states=regroup
        ),
        run_dir=f"{reference.run_dir.removesuffix('/reference')}/noise",
        name=f"{reference.name.removesuffix('-reference')}-noise",
    )


def envelope(reference: list[StepRow], other: list[StepRow], key: str) -> list[float]:
    """The largest relative deviation of `key` between two runs up to each step."""
    most, out = 0.0, []
    for ref, row in zip(reference, other, strict=True):
        most = max(most, relative_deviation(getattr(row, key), getattr(ref, key)))
        out.append(most)
    return out


def relative_deviation(value: float, reference: float) -> float:
    """|value - reference| / |reference|; a NaN or inf on either side is infinitely far."""
    if not (math.isfinite(value) and math.isfinite(reference)):
        return math.inf
    return abs(value - reference) / max(abs(reference), 1e-30)


def compare(
    reference: list[StepRow],
    layout: list[StepRow],
    tolerance: float,
    grad_norms: bool = True,
    noise: list[StepRow] | None = None,
) -> dict[str, Any]:
    """Per-step records of both runs (metrics.jsonl) -> the report verify.json holds;
    `grad_norms` false: the losses alone judged (float8 against high precision); `noise`:
    the reference summed in another order, whose drift up to each step (times NOISE_FACTOR)
    that step may show where it exceeds `tolerance`."""
    allowed = {
        key: [max(tolerance, NOISE_FACTOR * e) for e in envelope(reference, noise, key)]
        if noise is not None
        else [tolerance] * len(reference)
        for key in ("loss", "grad_norm")
    }
    steps = [
        {
            "step": ref.step,
            "loss_reference": ref.loss,
            "loss_layout": lay.loss,
            "loss_deviation": relative_deviation(lay.loss, ref.loss),
            "loss_allowed": allowed["loss"][i],
            "grad_norm_reference": ref.grad_norm,
            "grad_norm_layout": lay.grad_norm,
            "grad_norm_deviation": relative_deviation(lay.grad_norm, ref.grad_norm),
            "grad_norm_allowed": allowed["grad_norm"][i],
        }
        for i, (ref, lay) in enumerate(zip(reference, layout, strict=True))
    ]
    within = all(
        s["loss_deviation"] <= s["loss_allowed"]
        and (s["grad_norm_deviation"] <= s["grad_norm_allowed"] or not grad_norms)
        for s in steps
    )
    return {
        "passed": within,
        "grad_norms_judged": grad_norms,
        "tolerance": tolerance,
        "noise_floor": noise is not None,
        "max_loss_deviation": max(s["loss_deviation"] for s in steps),
        "max_grad_norm_deviation": max(s["grad_norm_deviation"] for s in steps),
        "failed_run": None,
        "error": None,
        "steps": steps,
    }


def _print_report(report: dict[str, Any]) -> None:
    tolerance, judged = report["tolerance"], report["grad_norms_judged"]
    against = "single device" if judged else "single device without float8"
    table = Table(title=f"layout vs {against}, per step")
    headers = (
        "step",
        "loss\nref",
        "loss\nlayout",
        "rel\ndiff",
        "grad norm\nref",
        "grad norm\nlayout",
        "rel\ndiff",
    )
    for header in headers:
        table.add_column(header, justify="right", no_wrap=True)

    def deviation(value: float, allowed: float, judged: bool = True) -> Text:
        style = "dim" if not judged else "red" if value > allowed else "green"
        return Text(f"{value:.1e}", style=style)

    for s in report["steps"]:
        table.add_row(
            str(s["step"]),
            f"{s['loss_reference']:.6f}",
            f"{s['loss_layout']:.6f}",
            deviation(s["loss_deviation"], s["loss_allowed"]),
            f"{s['grad_norm_reference']:.6f}",
            f"{s['grad_norm_layout']:.6f}",
            deviation(s["grad_norm_deviation"], s["grad_norm_allowed"], judged),
        )
    console.print(table)
    if report["noise_floor"]:
        _print_allowed(report)
    verdict = Text("PASS", style="bold green") if report["passed"] else Text("FAIL", "bold red")
    unjudged = "" if judged else ", not judged"
    against = (
        f"above the tolerance {tolerance:g}, so each step judged against the reference's own "
        f"noise: within {NOISE_FACTOR:g}x its deviation up to that step, at least {tolerance:g}"
        if report["noise_floor"]
        else f"tolerance {tolerance:g} relative"
    )
    console.print(
        Text(
            f"largest deviation: loss {report['max_loss_deviation']:.2e}, grad norm "
            f"{report['max_grad_norm_deviation']:.2e}{unjudged} ({against}): "
        )
        + verdict,
        soft_wrap=True,
    )


def _print_allowed(report: dict[str, Any]) -> None:
    """Each step's allowed deviation, from the reference split otherwise."""
    table = Table(title=f"allowed: {NOISE_FACTOR:g}x the noise run's drift so far")
    for header in ("step", "loss", "grad norm"):
        table.add_column(header, justify="right")
    for s in report["steps"]:
        table.add_row(str(s["step"]), f"{s['loss_allowed']:.1e}", f"{s['grad_norm_allowed']:.1e}")
    console.print(table)


def _experiment(composed: VerifyExperimentConfig) -> ExperimentConfig:
    """Without the `verify` block: the ranks rebuild the schema they know from a plain dict."""
    return settings_of(composed)


def traced(composed: VerifyExperimentConfig) -> int:
    """verify.traced: 0 where the layout composes at its size (every pipeline stage's rank
    parallelized and stepped on fake tensors), 1 where it does not, 2 for a config error."""
    experiment = _experiment(composed)
    try:
        cfg = legal(experiment, target_facts(experiment.hardware, HostFacts.detect()))
    except ConfigError as err:
        print_error("config error", str(err))
        return 2
    world = Layout.of(cfg.parallel).world_size
    what = f"{cfg.model.name} on {layout_name(cfg)} ({world:,} ranks)"
    stages = traced_or_why(cfg)
    if isinstance(stages, str):
        print_error("does not compose", f"{what}: {stages}")
        return 1
    formula = predict.stage_memory(cfg)
    said = f"meshrun-verify: {what} composes: each stage's rank traced on fake tensors"
    console.print(said, soft_wrap=True, highlight=False)
    table = Table(title="GiB a rank, by pipeline stage")
    for column in ("stage", *MEMORY_CATEGORIES, "peak", "formula's peak"):
        table.add_column(column, justify="right")
    for index, (got, predicted) in enumerate(zip(stages, formula, strict=True)):
        cells = [f"{getattr(got, k) / GiB:.2f}" for k in MEMORY_CATEGORIES]
        table.add_row(str(index), *cells, f"{got.peak / GiB:.2f}", f"{predicted.peak / GiB:.2f}")
    console.print(table)
    return 0


def _judged(
    reference: ExperimentConfig, measured: dict[str, Measured], tolerance: float, judged: bool
) -> dict[str, Any]:
    """The comparison; where the layout is beyond the tolerance, against the reference's own
    noise, measured then (module docstring)."""
    steps = measured["reference"].steps, measured["layout"].steps
    report = compare(*steps, tolerance, judged)
    noise = noise_config(reference)
    if report["passed"] or noise is None:
        return report
    how = {
        "its micro-batches summed last to first": noise.debug.reverse_micro_batches,
        "its 8-bit states in blocks of half the size": noise.debug.regroup_states,
    }
    console.print(
        f"meshrun-verify: beyond the tolerance {tolerance:g}; measuring the reference's own "
        f"noise ({', '.join(what for what, done in how.items() if done)})",
        soft_wrap=True,
    )
    measured["noise"] = measure(noise, "noise", launch)
    if not measured["noise"].ok:
        return report | {"failed_run": "noise", "error": measured["noise"].meta.error}
    return compare(*steps, tolerance, judged, measured["noise"].steps)


def run(dict_cfg: DictConfig) -> int:
    """0: the layout matches the single device; 1: it does not, or a run failed; 2: bad config."""
    composed: VerifyExperimentConfig = OmegaConf.to_object(dict_cfg)
    if composed.verify.traced:
        return traced(composed)
    reference = str(composed.verify.reference)
    high_precision = reference == "high_precision"
    try:
        positive("verify.tolerance", composed.verify.tolerance, allow_none=True)
        if high_precision and not composed.train.float8.enabled:
            fail(
                "verify.reference",
                "high_precision",
                "compares a float8 run with the same run in high precision; this one has no float8",
                "train.float8.enabled=true, or verify.reference=same",
            )
        cfg = resolve(_experiment(composed), HostFacts.detect(), say=print_note).config
        method = loss_method(cfg)[0]
        if reference == "full_loss" and method == "full":
            fail(
                "verify.reference",
                "full_loss",
                "compares a chunked or vocab_parallel loss with the full one; this run's is full",
                "train.loss=chunked (one device, FSDP, DDP, PP) or vocab_parallel (TP)",
            )
    except ConfigError as err:
        print_error("config error", str(err))
        return 2
    tolerance = verify_tolerance(composed.verify, cfg)
    runs = {
        "layout": dataclasses.replace(cfg, run_dir=f"{cfg.run_dir}/layout"),
        "reference": reference_config(cfg, reference),
    }
    world, f8 = cfg.launcher.nproc_per_node, cfg.train.float8
    float8 = f", float8 {f8.recipe}" if f8.enabled else ""
    kernel = chunked_loss_kernel(cfg)
    on = " on Liger's kernel" if kernel == "liger" else ""
    against = {"high_precision": " without float8", "full_loss": " with the full loss"}
    console.print(
        f"meshrun-verify: {cfg.model.name} on {layout_name(cfg)} ({world} rank(s)){float8}, "
        f"{method} loss{on}, against one device{against.get(reference, '')}, "
        f"{cfg.train.steps} steps of global batch {cfg.train.global_batch_size}",
        soft_wrap=True,
    )
    measured: dict[str, Measured] = {}
    for role, run_cfg in runs.items():  # the layout first: if it crashes, skip the reference
        measured[role] = measure(run_cfg, role, launch)
        if not measured[role].ok:
            error = measured[role].meta.error
            report = {"passed": False, "tolerance": tolerance, "failed_run": role, "error": error}
            break
    else:
        report = _judged(runs["reference"], measured, tolerance, judged=not high_precision)
    report |= {
        "model": cfg.model.name,
        "parallel": cfg.parallel.name,
        "layout": layout_name(cfg),
        "tp_plan": cfg.parallel.tp_plan,
        "float8": str(cfg.train.float8.recipe) if cfg.train.float8.enabled else None,
        "reference": reference,
        "loss": method,
        "loss_kernel": kernel,
        **{f"{role}_dir": run_cfg.run_dir for role, run_cfg in runs.items()},
    }
    (Path(cfg.run_dir) / REPORT_FILE).write_text(json.dumps(report, indent=2))
    if report["error"]:
        print_error(f"{report['failed_run']} run failed", report["error"])
        return 1
    _print_report(report)
    return 0 if report["passed"] else 1


main = hydra_command("verify", run)


if __name__ == "__main__":
    main()
