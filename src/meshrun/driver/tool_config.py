"""Typed schemas of the commands beside `meshrun`: meshrun-plan and meshrun-verify extend the
experiment's, meshrun-comm shares its backend, hardware, launcher and logger, meshrun-report
filters the store, meshrun-doctor checks the host."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from meshrun.core.choices import VerifyReference
from meshrun.core.config import (
    BackendConfig,
    DebugConfig,
    ExperimentConfig,
    HardwareConfig,
    LoggerConfig,
    StoreConfig,
    rebuild,
)
from meshrun.core.precision import matmul_precision


@dataclass
class PlanCommandConfig(ExperimentConfig):
    """`meshrun-plan`: the experiment, and the number of ranks to plan for. `show`: `plan`
    (every legal layout, ranked) or `resolved` (the plan of the one run `meshrun` would start
    with these overrides on this host, its RunPlan, without launching it)."""

    world_size: int | None = None
    json: str | None = None
    top: int = 20
    show: str = "plan"


# The largest relative deviation of loss and grad norm per step that meshrun-verify passes,
# by the precision its matmuls run at (core/precision.matmul_precision). fp32: reordered
# reductions over 10 steps stay near 1e-6 (the tests' layouts measure <= 2e-6), 1e-4 leaves
# room for longer runs. bf16: under autocast each matmul output is rounded to 8 significant
# bits, so two correct layouts, which round at different points (a TP partial sum, an FSDP
# reduce), may differ by one bf16 rounding of the result: the unit roundoff 2^-8 (measured
# on model=tiny: loss <= 3.5e-5, grad norm <= 6.2e-4 for tp2, fsdp, pp2); a layout that
# loses or double-counts a contribution is off by O(1). tf32 (fp32 on CUDA with
# train.tf32): the inputs of each matmul rounded to 11 significant bits, so by the same
# argument TF32's unit roundoff 2^-11.
TOLERANCES = {"fp32": 1e-4, "tf32": 2.0**-11, "bf16": 2.0**-8, "fp16": 2.0**-8}
# train.float8: two correct layouts cast the same tensors to float8, but their
# high-precision operands differ in the last bits (reordered sums: a TP partial sum, an FSDP
# reduce-scatter), so an element on a float8 rounding boundary lands a float8 step apart in
# one of them: 2 x the format's unit roundoff, e4m3's 2^-4 (operands) or e5m2's 2^-3
# (tensorwise's gradients). AdamW, dividing each update by the gradient's RMS, turns such a
# difference into a whole update of that weight, so the runs drift apart beyond one bf16
# rounding: measured over 10 steps of model=tiny under ddp, fsdp, hsdp, tp2 (SP), pp2, cp2
# and dp2_tp2_pp2, loss <= 4e-5 and grad norm <= 1.4e-3 (fp32 and bf16, every recipe). The
# tolerance is the recipe's coarsest float8 format's unit roundoff over 2^4: tensorwise
# (e5m2) 2^-7, rowwise recipes (e4m3 throughout) 2^-8; a layout that loses or double-counts
# a contribution is off by O(1).
FLOAT8_TOLERANCES = {"tensorwise": 2.0**-7, "rowwise": 2.0**-8, "rowwise_with_gw_hp": 2.0**-8}
# verify.reference=high_precision: float8's loss against the same run's in high precision,
# step by step. The casts change the math (operands rounded to 3 mantissa bits, e4m3), so
# the curves drift apart slowly: over 50 steps of model=small on one CPU in bf16 (global
# batch 8 x 128 tokens) tensorwise and rowwise stayed within 5.4e-3 of bf16's loss a step.
# The bound, 2^-6 (1.6%) a step, leaves three times that; a float8 run beyond it diverges
# from its high-precision counterpart (a scale that overflows, a linear that should stay out).
FLOAT8_LOSS_BOUND = 2.0**-6


@dataclass
class VerifyConfig:
    """`tolerance` null: TOLERANCES' for the run's precision (with train.float8,
    FLOAT8_TOLERANCES' for its recipe). `traced`: no run; the layout's ranks traced at its
    full size on a fake process group (plan/traced.py), which says whether it composes there
    and what each pipeline stage holds, without the devices. `reference`: `same`, the
    layout's settings on one device; `high_precision`, one device with train.float8 off:
    float8's losses against high precision's within FLOAT8_LOSS_BOUND a step (null
    tolerance), the gradient norms shown but not judged (float8 rounds their operands);
    `full_loss`, one device with train.loss=full: a chunked or vocab_parallel loss against
    the textbook one, within the precision's tolerance (the same math, summed otherwise)."""

    tolerance: float | None = None
    traced: bool = False
    reference: VerifyReference = VerifyReference["same"]


@dataclass
class VerifyExperimentConfig(ExperimentConfig):
    """`meshrun-verify`: the experiment plus the `verify` block."""

    verify: VerifyConfig = field(default_factory=VerifyConfig)


def verify_tolerance(verify: VerifyConfig, cfg: ExperimentConfig) -> float:
    """The largest relative deviation a step of the resolved run `cfg` may show."""
    if verify.tolerance is not None:
        return verify.tolerance
    if verify.reference == "high_precision":
        return FLOAT8_LOSS_BOUND
    if cfg.train.float8.enabled:
        return FLOAT8_TOLERANCES[cfg.train.float8.recipe]
    return TOLERANCES[matmul_precision(cfg)]


@dataclass
class CommConfig:
    """What `meshrun-comm` measures, in nccl-tests' terms: sizes from `min_bytes` to
    `max_bytes` multiplied by `step_factor` (-b/-e/-f), `warmup_iters` and `iters` (-w/-n),
    result check (-c), data types (-d) and reduction (-o). `record` false keeps a run out of
    the store and W&B (doctor's health checks)."""

    ops: list[str] = field(
        default_factory=lambda: [
            "all_reduce",
            "all_gather",
            "reduce_scatter",
            "broadcast",
            "all_to_all",
            "sendrecv",
        ]
    )
    dtypes: list[str] = field(default_factory=lambda: ["float32"])
    redop: str = "sum"
    min_bytes: int = 1024
    max_bytes: int = 16 * 2**20
    step_factor: int = 4
    warmup_iters: int = 5
    iters: int = 20
    check: bool = True
    record: bool = True


@dataclass
class CommRunConfig:
    """One `meshrun-comm` run: the training run's backend, hardware, launcher, logger, store
    and fault injection (debug.fail_step counts measurements), plus what to measure."""

    backend: BackendConfig = MISSING
    hardware: HardwareConfig = MISSING
    launcher: Any = MISSING  # as in ExperimentConfig
    logger: LoggerConfig = MISSING
    comm: CommConfig = field(default_factory=CommConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    run_dir: str = "."
    name: str | None = None


def comm_from_dict(data: dict[str, Any]) -> CommRunConfig:
    return rebuild(CommRunConfig, data)


@dataclass
class RunFilter:
    """Unset fields match everything. `layout` matches the layout's name (`fsdp2 x tp2`,
    core.naming.layout_name) or a preset run as shipped (`ddp`: not a ddp run whose degrees
    were overridden into another layout); dates are UTC days, both inclusive; `latest` as
    the sweep picks the newest sweep in the store."""

    sweep: str | None = None
    model: str | None = None
    layout: str | None = None
    since: str | None = None
    until: str | None = None
    baselines: bool = False


@dataclass
class ReportConfig(RunFilter):
    """The filters of RunFilter (unset: all runs), the store, and where the page goes
    (`html` unset: no page, the table only)."""

    store: StoreConfig = field(default_factory=StoreConfig)
    html: str | None = None
    title: str = "meshrun: run comparison"

    def selection(self, picked: str | None = None) -> str:
        """The filters in words; `picked`: the sweep that `sweep=latest` stood for."""
        chosen = {k: getattr(self, k) for k in ("sweep", "model", "layout", "since", "until")}
        if self.sweep == "latest" and picked:
            chosen["sweep"] = f"latest ({picked})"
        words = ", ".join(f"{k}={v}" for k, v in chosen.items() if v is not None)
        return f"{self.store.path} ({words or 'all runs'})"


@dataclass
class DoctorConfig:
    """`timeout_s` is each health check's collective timeout; a check still running
    `grace_s` after it (start-up included) is killed with all its ranks. `backends` empty:
    every backend this torch has."""

    timeout_s: float = 30.0
    grace_s: float = 60.0
    backends: list[str] = field(default_factory=list)


@dataclass
class DoctorRunConfig:
    doctor: DoctorConfig = field(default_factory=DoctorConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    run_dir: str = "."
