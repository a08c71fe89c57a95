"""The traced step as a picture: one row per rank, what it computed, the communication it had
in flight (exposed where nothing computed), the idle time between, and a pipeline's
micro-batches as labelled boxes (F3: micro-batch 3's forward), so the bubble and the exposed
collectives are seen rather than read. The run writes its own (`<run dir>/profile/
timeline.png`); meshrun-report draws the newest profiled runs' in its page. Matplotlib's
object API: no pyplot state, no display needed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from meshrun.core.run_files.profiles import PROFILE_DIR, TIMELINE_FILE

MAX_RUNS = 3  # the newest profiled runs a report draws
WIDTH = 14.5  # inches, as the report's other plots
COMPUTE, COMM, IDLE = "#1f77b4", "#ff7f0e", "#eeeeee"
FORWARD, BACKWARD = "#2ca02c", "#9467bd"


def profiled(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The newest runs with a traced step, newest first."""
    traced = [r for r in runs if r.get("profile")]
    return sorted(traced, key=lambda r: r.get("created_at") or "", reverse=True)[:MAX_RUNS]


def step_timelines(runs: list[dict[str, Any]]) -> Figure | None:
    """The newest profiled runs' last traced steps, one panel each; None without any."""
    shown = profiled(runs)
    if not shown:
        return None
    rows = [len(r["profile"]) for r in shown]
    fig = Figure(figsize=(WIDTH, sum(1.4 + 0.55 * n for n in rows)), layout="constrained")
    axes = fig.subplots(len(shown), 1, squeeze=False, height_ratios=[1 + n for n in rows])
    for ax, run in zip(axes[:, 0], shown, strict=True):
        _draw(ax, run)
    fig.legend(handles=_legend(), loc="outside upper center", ncol=5, frameon=False)
    return fig


def write_timeline(run: dict[str, Any]) -> Path | None:
    """The run's own picture, beside its traces; None where nothing was traced."""
    if not run.get("profile") or not run.get("run_dir"):
        return None
    path = Path(run["run_dir"]) / PROFILE_DIR / TIMELINE_FILE
    ranks = len(run["profile"])
    fig = Figure(figsize=(WIDTH, 1.8 + 0.55 * ranks), layout="constrained")
    _draw(fig.subplots(), run)
    fig.legend(handles=_legend(), loc="outside upper center", ncol=5, frameon=False)
    fig.savefig(path, dpi=90)
    return path


def _draw(ax: Any, run: dict[str, Any]) -> None:
    profiles = run["profile"]
    start = min(p["timeline"]["start_ms"] for p in profiles)  # the host's clock: ranks align
    end = 0.0
    for y, p in enumerate(profiles):
        line = p["timeline"]
        offset = line["start_ms"] - start
        end = max(end, offset + line["length_ms"])
        ax.add_patch(Rectangle((offset, y - 0.4), line["length_ms"], 0.8, color=IDLE, lw=0))
        for a, b in line["comm"]:
            ax.add_patch(Rectangle((offset + a, y - 0.4), b - a, 0.3, color=COMM, lw=0))
        for a, b in line["compute"]:
            ax.add_patch(Rectangle((offset + a, y - 0.1), b - a, 0.5, color=COMPUTE, lw=0))
        for a, b, label in line["micro_batches"]:
            edge = FORWARD if label.startswith("F") else BACKWARD
            ax.add_patch(Rectangle((offset + a, y - 0.45), b - a, 0.9, fill=False, ec=edge, lw=1.2))
            ax.text(
                offset + (a + b) / 2,
                y - 0.47,  # above the box (the rows run down)
                label.split()[0],
                ha="center",
                va="bottom",
                fontsize="x-small",
                color=edge,
            )
    ax.set_xlim(0, end)
    ax.set_ylim(len(profiles) - 0.5, -0.85)
    ax.set_yticks(range(len(profiles)), [_rank_label(p) for p in profiles])
    ax.set_xlabel("ms from the earliest rank's start of the step")
    steps = run.get("profiled_steps") or ["?", "?"]
    ax.set_title(
        f"{run.get('layout_name')}  {str(run.get('run_id'))[:6]}: step {steps[1]} "
        f"(profiled {steps[0]}-{steps[1]})",
        loc="left",
        fontsize="medium",
    )


def _rank_label(p: dict[str, Any]) -> str:
    total = p["step_s"]
    return (
        f"rank {p['rank']}  compute {p['compute_s'] / total:.0%}"
        f" · exposed comm {p['exposed_comm_s'] / total:.0%} · idle {p['idle_s'] / total:.0%}"
    )


def _legend() -> list[Patch]:
    return [
        Patch(color=COMPUTE, label="compute"),
        Patch(color=COMM, label="communication in flight"),
        Patch(color=IDLE, label="idle (neither)"),
        Patch(fill=False, ec=FORWARD, label="micro-batch forward (F)"),
        Patch(fill=False, ec=BACKWARD, label="micro-batch backward (B)"),
    ]
