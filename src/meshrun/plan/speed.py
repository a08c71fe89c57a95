"""Predicted step time of a layout: each pipeline stage's compute and exposed communication
for one micro-batch, the pipeline's schedule around them, the data-parallel sync where the
implementations overlap it with compute, and the optimizer step. O(pipeline stages x device
kinds): nothing loops over ranks, so 8,192-rank plans cost what 8-rank ones do.

The terms: plan/stage_time.py (compute, recompute, the optimizer), plan/comm_time.py (each
parallelism's communication, its overlap, FSDP2's copies, SM contention), plan/host_time.py
(the offloads' copies to and from the host, the optimizer on the host).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from meshrun.core.batch import n_microbatches
from meshrun.core.calibration import Calibration
from meshrun.core.config import DeviceSpec, ExperimentConfig
from meshrun.core.layout import Layout
from meshrun.core.stages import theoretical_bubble
from meshrun.plan.collectives import Fabric
from meshrun.plan.comm_time import (
    cp_time,
    dp_time,
    ep_time,
    fsdp_copies,
    pp_time,
    sm_contention,
    tied_time,
    tp_time,
)
from meshrun.plan.compute import DeviceRates, optimizer_time
from meshrun.plan.host_time import host_parts
from meshrun.plan.placement import stage_devices
from meshrun.plan.shapes import StageShare, micro_batching, stage_shares
from meshrun.plan.stage_time import (
    COMPUTE_KINDS,
    DEFAULT_EFFICIENCY,
    ModelCost,
    StageTime,
    calibrated_rates,
    device_peak,
    device_rates,
    formula_cost,
    stage_by_flops,
    stage_by_shapes,
)

STEP_PARTS = (
    "optimizer",
    "fsdp_copies",
    "host_copies",
)  # a stage's parts once a step, not a micro-batch


@dataclass(frozen=True)
class SpeedPrediction:
    """Seconds a step: `compute_s` on the slowest stage (recomputation and the optimizer
    included), `comm_s` all its collectives and transfers take, `exposed_comm_s` what of
    them compute does not hide; `bubble` the pipeline's idle fraction; `breakdown` seconds by
    kind; `model_tflops_per_device` the model FLOPs (PaLM's, no recomputation) a device
    achieves, which over its peak is the MFU."""

    compute_s: float
    comm_s: float
    bubble: float
    step_time_s: float
    tokens_per_s: float
    exposed_comm_s: float = 0.0
    model_tflops_per_device: float = 0.0
    breakdown: dict[str, float] = field(default_factory=dict)

    def step_parts(self) -> dict[str, float]:
        """The step's seconds by what the slowest stage's clock waits for, which add up to
        `step_time_s`: compute by kind, recompute, the exposed share of each parallelism's
        communication, the bubble, the optimizer."""
        b = self.breakdown
        parts = {kind: b[kind] for kind in COMPUTE_KINDS if kind in b}
        parts |= {"recompute": b["recompute"], "tp": b["tp"], "cp": b["cp_exposed"]}
        parts |= {"ep": b["ep"], "pp": b["pp"], "dp": b["dp_exposed"]}
        parts |= {"contention": b["contention"], "bubble": b["bubble"]}
        parts |= {"optimizer": b["optimizer"], "fsdp_copies": b["fsdp_copies"]}
        return parts | {"host_copies": b["host_copies"]}

    def as_dict(self) -> dict:
        return {**asdict(self), "step_parts": self.step_parts()}


def predict_speed(
    cfg: ExperimentConfig,
    host_flops: float | None = None,
    cost: ModelCost | None = None,
    calibration: Calibration | None = None,
) -> SpeedPrediction | None:
    """None when a device's peak is unknown (and no host measurement stands in for it).
    `cost`: what was counted of a model without formulas (formula_cost's otherwise).
    `calibration`: this host's measured rates and links (costed by shapes with them)."""
    layout = Layout.of(cfg.parallel)
    by_shapes = cost is None and cfg.plan.efficiency is None
    cost = cost or formula_cost(cfg, layout)
    fabric = Fabric.of(cfg, calibration)
    m, micro = micro_batching(cfg, layout)
    shares = stage_shares(cfg.model, cfg.parallel, layout)
    host: float | Calibration | None = host_flops
    if calibration is not None and by_shapes:
        host = calibration
    slowest = _slowest_stage(cfg, layout, fabric, shares, micro, cost, host, by_shapes)
    if slowest is None:
        return None
    stage, rates = slowest
    pp = pp_time(cfg, layout, fabric, micro, cost)
    tied = tied_time(cfg, layout, fabric)
    n_units = max(s.layers for s in shares) + 1  # FSDP2 units: the blocks and the root
    dp = dp_time(cfg, layout, fabric, cost, stage, m, n_units)
    if cfg.hardware.device_type == "cpu":  # gloo copies and reduces on the computing cores
        dp, stage.cp = (dp[0], dp[0]), stage.cp_total
    stage.parts["fsdp_copies"] = fsdp_copies(cfg, layout, cost, m, rates)
    return _prediction(cfg, layout, cost, m, stage, pp, tied, dp, sm_contention(dp, rates))


def _slowest_stage(
    cfg: ExperimentConfig,
    layout: Layout,
    fabric: Fabric,
    shares: list[StageShare],
    micro: int,
    cost: ModelCost,
    host: float | Calibration | None,
    by_shapes: bool,
) -> tuple[StageTime, DeviceRates | None] | None:
    """The stage and device kind every other waits for, with the shape model's rates where it
    was costed by them; None where a device's peak is unknown. Stages x device kinds, never
    ranks."""
    slowest: tuple[StageTime, DeviceRates | None] | None = None
    for pp_rank, share in enumerate(shares):
        specs = (
            stage_devices(cfg, layout, pp_rank) if cfg.hardware.device_type == "cuda" else [None]
        )
        if not specs:
            return None
        for spec in specs:
            timed = _stage_on(cfg, layout, fabric, share, micro, cost, spec, host, by_shapes)
            if timed is None:
                return None
            if slowest is None or _clock(timed[0]) > _clock(slowest[0]):
                slowest = timed
    return slowest


def _stage_on(
    cfg: ExperimentConfig,
    layout: Layout,
    fabric: Fabric,
    share: StageShare,
    micro: int,
    cost: ModelCost,
    spec: DeviceSpec | None,
    host: float | Calibration | None,
    by_shapes: bool,
) -> tuple[StageTime, DeviceRates | None] | None:
    """One micro-batch of the stage on one kind of device (None: the host's CPU), `host` this
    host's calibration or its CPU's matmul FLOP/s: by matmul shapes where a calibration or a
    datasheet gives the rates, else by FLOPs at the expected share of the peak; None where
    that peak is unknown."""
    rates = device_rates(cfg, spec, layout.cp) if by_shapes and spec else None
    if isinstance(host, Calibration):
        rates = calibrated_rates(host, spec)
    if rates:
        stage = stage_by_shapes(cfg, layout, share, micro, rates)
    else:
        peak = host if spec is None else device_peak(cfg, spec)
        if not peak:
            return None
        efficiency = cfg.plan.efficiency or DEFAULT_EFFICIENCY[cfg.hardware.device_type]
        stage = stage_by_flops(cfg, layout, share, micro, cost, peak * efficiency)
    stage.tp = tp_time(cfg, layout, fabric, share, micro, cost)
    stage.cp_total, stage.cp = cp_time(cfg, layout, fabric, share, micro, stage, cost)
    stage.ep = ep_time(cfg, layout, fabric, share, micro)
    if rates:
        stage.parts["optimizer"] = optimizer_time(cost.rank_elements // layout.dp_shard, rates)
    if spec is not None:  # the offloads' copies; an offloaded optimizer's step on the host
        m = micro_batching(cfg, layout)[0]
        compute = m * stage.compute
        stage.parts |= host_parts(cfg, layout, share, micro, m, cost.rank_elements, compute, spec)
    return stage, rates


def _prediction(
    cfg: ExperimentConfig,
    layout: Layout,
    cost: ModelCost,
    m: int,
    stage: StageTime,
    pp: float,
    tied: float,
    dp: tuple[float, float],
    contention: float,
) -> SpeedPrediction:
    """The step: m micro-batches of the slowest stage stretched by the schedule's bubble
    (`pp` a micro-batch's transfers), then the tied embedding's sum between the pipeline's
    ends (`tied`), what of the data-parallel sync is exposed, its SM contention and the
    optimizer."""
    dp_total, dp_exposed = dp
    bubble = 0.0
    if layout.pp > 1:
        bubble = theoretical_bubble(layout.pp, n_microbatches(cfg), cfg.parallel.stages_per_rank)
    optimizer = stage.parts.get("optimizer", 0.0)
    copies = stage.parts.get("fsdp_copies", 0.0)
    host = stage.parts.get("host_copies", 0.0)
    pipeline = m * (stage.compute + stage.tp + stage.cp + stage.ep + pp)
    step = pipeline / (1 - bubble) + tied + dp_exposed + contention + optimizer + copies + host
    tokens_per_s = cfg.train.tokens_per_step / step
    breakdown = {
        **{k: m * v for k, v in stage.parts.items() if k not in STEP_PARTS},
        "recompute": m * stage.recompute,
        "optimizer": optimizer,
        "fsdp_copies": copies,
        "host_copies": host,
        "tp": m * stage.tp,
        "cp": m * stage.cp_total,
        "cp_exposed": m * stage.cp,
        "ep": m * stage.ep,
        "pp": m * pp + tied,
        "dp": dp_total,
        "dp_exposed": dp_exposed,
        "contention": contention,
        "bubble": pipeline / (1 - bubble) - pipeline,
    }
    return SpeedPrediction(
        compute_s=m * stage.compute + optimizer + copies,
        comm_s=m * (stage.tp + stage.cp_total + stage.ep + pp) + tied + dp_total,
        bubble=bubble,
        step_time_s=step,
        tokens_per_s=tokens_per_s,
        exposed_comm_s=m * (stage.tp + stage.cp + stage.ep + pp)
        + tied
        + dp_exposed
        + contention
        + host,
        model_tflops_per_device=tokens_per_s * cost.flops_per_token / layout.world_size / 1e12,
        breakdown=breakdown,
    )


def _clock(stage: StageTime) -> float:
    return stage.compute + stage.tp + stage.cp + stage.ep + stage.parts.get("optimizer", 0.0)
