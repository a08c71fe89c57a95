"""The report's plot of the plan kept honest: each run's whole budget (plan.tokens, else its
own steps) at the speed it measured against the plan's time for its layout, a point a run,
coloured by layout (hollow where the prediction used no calibration of the host), beside the
line where the two agree; log axes where the runs' times span a wide range."""

from __future__ import annotations

from typing import Any

from matplotlib.figure import Figure

from meshrun.driver.sinks.selection import layout_of
from meshrun.tools.report.plots import LOG_RATIO, WIDTH, completed, layout_colours

HEIGHT = 6.0


def budget_times(runs: list[dict[str, Any]]) -> Figure | None:
    """Measured over predicted seconds of each completed run's budget; None without any."""
    both = [
        r for r in completed(runs) if r.get("predicted_budget_s") and r.get("measured_budget_s")
    ]
    if not both:
        return None
    colours = layout_colours(runs)
    fig = Figure(figsize=(WIDTH * 0.6, HEIGHT), layout="constrained")
    ax = fig.subplots()
    for name in dict.fromkeys(layout_of(r) for r in both):
        for calibrated in (True, False):
            mine = [
                r
                for r in both
                if layout_of(r) == name and bool(r.get("predicted_calibrated_at")) == calibrated
            ]
            if not mine:
                continue
            ax.scatter(
                [r["predicted_budget_s"] for r in mine],
                [r["measured_budget_s"] for r in mine],
                edgecolors=colours[name],
                facecolors=colours[name] if calibrated else "none",
                label=name if calibrated else f"{name} (uncalibrated)",
                s=40,
                zorder=3,
            )
    every = [r[k] for r in both for k in ("predicted_budget_s", "measured_budget_s")]
    low, high = min(every) / 1.5, max(every) * 1.5
    line = [low, high]
    ax.plot(line, line, color="#555", ls="--", lw=1, label="measured = predicted")
    if high / low > LOG_RATIO:
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_xlabel("predicted time of the run's budget (s): the plan's speed for its layout")
    ax.set_ylabel("measured time of the budget (s): at the run's own speed")
    ax.grid(alpha=0.3, which="both")
    fig.legend(loc="outside right upper", fontsize="small")
    return fig
