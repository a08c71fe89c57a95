"""What the trials of `parallel=auto plan.trials=K` tell (driver/trials.py runs them): each
trial's predicted and measured speed, the fastest measured, how well the prediction ranked
them (Spearman's rank correlation) and what trusting the prediction alone would have cost."""

from __future__ import annotations

from dataclasses import dataclass

from meshrun.core.record import RunRecord


@dataclass
class Trial:
    """One layout tried: its own run (store row, run dir), in the planner's order."""

    run_id: str
    layout_name: str
    overrides: str
    status: str
    predicted_tokens_per_s: float | None
    tokens_per_s: float | None
    error: str | None = None
    nodes: list[str] | None = None  # the nodes its ranks ran on, where it reported them
    calibrated_at: str | None = None  # the host calibration its prediction used, if any

    @property
    def measured(self) -> bool:
        return self.status == "completed" and bool(self.tokens_per_s)

    @classmethod
    def of(cls, record: RunRecord) -> Trial:
        """From a trial's RunRecord."""
        return cls(
            run_id=record.run_id,
            layout_name=record.layout_name,
            overrides=record.overrides,
            status=record.status,
            predicted_tokens_per_s=record.prediction.predicted_tokens_per_s,
            tokens_per_s=record.speed.tokens_per_s,
            error=record.error,
            nodes=sorted(set(record.host.host_per_rank)) if record.host.host_per_rank else None,
            calibrated_at=record.prediction.predicted_calibrated_at,
        )


def calibration_said(calibrated_at: list[str | None], model: str | None, world: int) -> str:
    """What predicted figures printed beside measured ones rest on: this host's calibration
    (of when), or the hardware profile's rates, with the command that measures the host."""
    if calibrated_at and all(calibrated_at):
        return f"predicted on this host's calibration of {', '.join(sorted(set(calibrated_at)))}"
    return (
        "predicted uncalibrated: the hardware profile's rates, not this host's measured ones "
        f"(`meshrun-plan calibrate model={model} world_size={world}` measures them)"
    )


def fastest(trials: list[Trial]) -> int | None:
    """The index of the fastest measured trial; None where none completed."""
    measured = [i for i, t in enumerate(trials) if t.measured]
    return max(measured, key=lambda i: trials[i].tokens_per_s) if measured else None


def rank_correlation(trials: list[Trial]) -> float | None:
    """Spearman's rho between predicted and measured tokens/s over the trials that have both;
    None under 2 or where either side is all ties."""
    pairs = [(t.predicted_tokens_per_s, t.tokens_per_s) for t in trials if t.measured]
    pairs = [(p, m) for p, m in pairs if p is not None]
    return spearman([p for p, _ in pairs], [m for _, m in pairs])


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rho (ties take their mean rank); None under 2 pairs or all ties."""
    if len(xs) < 2:
        return None
    xs, ys = _ranks(xs), _ranks(ys)
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    cov = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    vx, vy = sum((x - mx) ** 2 for x in xs), sum((y - my) ** 2 for y in ys)
    return cov / (vx * vy) ** 0.5 if vx and vy else None


def _ranks(values: list[float]) -> list[float]:
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for k in range(start, end + 1):
            ranks[order[k]] = (start + end) / 2 + 1
        start = end + 1
    return ranks


def first_choice_loss(trials: list[Trial]) -> float | None:
    """The share of the fastest measured speed that the planner's first choice (the first
    trial) lacked: what running its prediction untried would have lost. None where the
    first choice did not complete (its status says why) or nothing did."""
    best = fastest(trials)
    if best is None or not trials[0].measured:
        return None
    return 1 - trials[0].tokens_per_s / trials[best].tokens_per_s


def node_sets(trials: list[Trial]) -> list[list[str]]:
    """The distinct sets of nodes the measured trials ran on, in order: more than one says
    their speeds were not measured on the same hardware."""
    seen: list[list[str]] = []
    for t in trials:
        if t.measured and t.nodes and t.nodes not in seen:
            seen.append(t.nodes)
    return seen
