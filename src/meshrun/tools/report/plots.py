"""The report's plots (matplotlib, object API: no pyplot state, no display needed).

Each function takes the selected runs and returns a Figure, or None when the selection holds
nothing it could show (no pipeline runs for the bubble plot, ...). Runs are compared by their
canonical layout name (core.naming.layout_name), never by the preset they were started
from, and each layout keeps its colour in every plot. Figures are WIDTH wide, so that at the
page's resolution they fit a 1400 px window unscaled; runs are rows with their label beside
them (horizontal bars and boxes), and legends sit outside the axes, never over the data.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from statistics import mean
from typing import Any, NamedTuple

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.image import AxesImage
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, MaxNLocator

from meshrun.core.record import MEMORY_CATEGORIES
from meshrun.driver.sinks.compare import FLAG, flags
from meshrun.driver.sinks.selection import layout_of

MIB = 2**20
WIDTH = 14.5  # inches: 1305 px at the page's 90 dpi
MAX_MEMORY_RUNS = 12  # the newest ones; more bars stop being readable
MAX_CURVES = 12  # loss curves in one plot (the newest); more lines stop being told apart
MAX_HEATMAPS = 8
HEATMAPS_PER_ROW = 4
PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
LINESTYLES = ("-", "--", "-.", ":")
LOG_RATIO = 4  # step-time medians this many times apart: a log axis
FLAGGED = "#b45309"  # the tick label of a flagged run
LABEL_SPAN = 0.08  # of the axis: how wide a speedup label is, to keep it off the ideal's bar


def completed(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in runs if r["status"] == "completed"]


def run_label(run: dict[str, Any]) -> str:
    """Layout name first (what is compared), then batch / micro-batch and the run id."""
    batch = f"b{run['global_batch_size']}/m{run['micro_batch_size']}"
    flag = f"{FLAG} " if flags(run) else ""
    return f"{flag}{layout_of(run)}  {batch}  {run['run_id'][:6]}"


def layout_colours(runs: list[dict[str, Any]]) -> dict[str, str]:
    """One colour per layout name, in the order the layouts appear."""
    names = list(dict.fromkeys(layout_of(run) for run in runs))
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(names)}


def _height(rows: int) -> float:
    return max(3.2, 1.5 + 0.42 * rows)


def _label_rows(ax, runs: list[dict[str, Any]], labels: list[str] | None = None) -> None:
    """The runs as rows from the top, flagged ones' labels in the flag colour."""
    ax.set_yticks(range(len(runs)), labels or [run_label(r) for r in runs])
    for tick, run in zip(ax.get_yticklabels(), runs, strict=True):
        if flags(run):
            tick.set_color(FLAGGED)
    ax.set_ylim(len(runs) - 0.5, -0.5)


def speedup(runs: list[dict[str, Any]]) -> Figure | None:
    """Speedup over the single-device baseline per run with its spread (whiskers: the 10th
    to 90th percentile over the alternating rounds; a hollow point where the run has no
    spread), the ideal (its device count) as a bar; scaling efficiency beside it."""
    measured = [r for r in completed(runs) if r.get("speedup") is not None]
    if not measured:
        return None
    colours = layout_colours(runs)
    fig = Figure(figsize=(WIDTH, _height(len(measured))), layout="constrained")
    ax_speed, ax_eff = fig.subplots(1, 2, sharey=True, width_ratios=(3, 2))
    rows = [
        _speedup_row(ax_speed, y, run, colours[layout_of(run)]) for y, run in enumerate(measured)
    ]
    _efficiency_points(ax_eff, measured, colours)
    right = max(1.0, *(x for row in rows for x in row.reach)) * 1.15
    ax_speed.set_xlim(0, right)
    _speedup_labels(ax_speed, rows, right)
    ax_eff.axvline(1.0, ls="--", color="#555")
    ax_eff.set_xlim(0, max(1.1, *(r.get("scaling_efficiency") or 0 for r in measured)) * 1.08)
    _label_rows(ax_speed, measured)
    ax_speed.set_xlabel("speedup vs 1 device (x)")
    ax_eff.set_xlabel("scaling efficiency (speedup / devices)")
    for ax in (ax_speed, ax_eff):
        ax.grid(axis="x", alpha=0.3)
    fig.legend(handles=_speedup_legend(), loc="outside upper center", ncol=3, frameon=False)
    return fig


class _SpeedupRow(NamedTuple):
    """What a run's row drew, for its label and for the axis to take in every mark."""

    value: float  # the speedup
    end: float  # the whisker's right end: the p90 where the run has one, else the value
    ideal: float
    reach: tuple[float, ...]  # the x of each mark drawn


def _speedup_row(ax: Axes, y: int, run: dict[str, Any], colour: str) -> _SpeedupRow:
    """The run's speedup and its ideal; whiskers need both percentiles, else the point is
    hollow: one measurement has no spread to show. The whiskers span p10-p90 of the paired
    rounds' ratios and the point is the ratio of the medians' throughputs, which a bimodal
    run puts outside them (0.181x beside 0.205-1.01 in CI): drawn apart, each where it is."""
    value = run["speedup"]
    low, high = run.get("speedup_p10"), run.get("speedup_p90")
    reach: tuple[float, ...] = ()
    if low is not None and high is not None:
        middle = (low + high) / 2
        ax.errorbar(middle, y, xerr=high - middle, fmt="none", ecolor=colour, capsize=5, lw=2)
        ax.plot(value, y, "o", ms=8, color=colour)
        reach = (high,)
    else:
        ax.plot(value, y, "o", ms=8, mfc="white", mec=colour, mew=2)
    ideal = run.get("devices") or run.get("world_size") or 1
    ax.plot(ideal, y, "|", ms=22, mew=2.5, color="#555")
    end = high if high is not None else value
    return _SpeedupRow(value, end, ideal, (*reach, value, ideal))


def _efficiency_points(ax: Axes, runs: list[dict[str, Any]], colours: dict[str, str]) -> None:
    """On the speedup's rows (the axes share y); a run without an efficiency keeps its row empty."""
    for y, run in enumerate(runs):
        if run.get("scaling_efficiency") is not None:
            ax.plot(run["scaling_efficiency"], y, "o", ms=8, color=colours[layout_of(run)])


def _speedup_labels(ax: Axes, rows: list[_SpeedupRow], right: float) -> None:
    """The value right of its whisker, or right of the ideal's bar where it would cross it."""
    for y, row in enumerate(rows):
        at = row.ideal if 0 <= row.ideal - row.end < LABEL_SPAN * right else row.end
        ax.annotate(
            f"{row.value:.2f}x",
            (at, y),
            xytext=(8, 0),
            textcoords="offset points",
            ha="left",
            va="center",
            fontsize="small",
        )


def _speedup_legend() -> list[Line2D]:
    """Keys in grey: the colours are the layouts', which the rows' labels name."""
    return [
        Line2D(
            [], [], marker="o", color="#333", ms=8, label="speedup, whiskers p10-p90 over rounds"
        ),
        Line2D(
            [],
            [],
            marker="o",
            ls="",
            ms=8,
            mfc="white",
            mec="#333",
            mew=2,
            label="speedup, spread n/a (one measurement)",
        ),
        Line2D(
            [],
            [],
            marker="|",
            ls="",
            ms=16,
            mew=2.5,
            color="#555",
            label="ideal (the run's device count)",
        ),
    ]


def step_times(runs: list[dict[str, Any]]) -> Figure | None:
    """Each run's timed steps as a horizontal box (quartiles, median; whiskers to the
    outermost steps within the 10th-90th percentile, the table's spread) with every step as a
    dot; a log axis where the
    runs' medians differ LOG_RATIO-fold, so that a fast run's box stays readable beside a slow
    one."""
    timed = [r for r in runs if r.get("step_times")]
    if not timed:
        return None
    colours = layout_colours(runs)
    every = [t for r in timed for t in r["step_times"]]
    scale, unit = (1e3, "ms") if max(every) < 2 else (1.0, "s")
    data = [[t * scale for t in r["step_times"]] for r in timed]
    fig = Figure(figsize=(WIDTH, _height(len(timed))), layout="constrained")
    ax = fig.subplots()
    boxes = ax.boxplot(
        data,
        orientation="horizontal",
        positions=range(len(timed)),
        whis=(10, 90),
        widths=0.55,
        patch_artist=True,
        showfliers=False,
        medianprops={"color": "black", "lw": 2},
    )
    for box, run in zip(boxes["boxes"], timed, strict=True):
        box.set(facecolor=colours[layout_of(run)], alpha=0.45)
    for y, values in enumerate(data):
        offsets = [(i % 5 - 2) * 0.05 for i in range(len(values))]
        ax.plot(values, [y + o for o in offsets], ".", color="#222", ms=5, alpha=0.7)
    medians = [sorted(v)[len(v) // 2] for v in data]
    logged = max(medians) > LOG_RATIO * min(medians) > 0
    if logged:
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.xaxis.set_minor_formatter(FuncFormatter(_minor_label))
    _label_rows(ax, timed)
    ax.set_xlabel(
        f"step time ({unit}{', log scale' if logged else ''}): box quartiles and "
        "median, whiskers to the outermost steps within p10-p90, a dot per timed "
        "step"
    )
    ax.grid(axis="x", alpha=0.3, which="both")
    return fig


def _minor_label(value: float, _: int) -> str:
    """A log axis' minor ticks labelled at 2, 3 and 5 times a power of ten only, so that the labels
    between 60 and 100 do not run into each other."""
    leading = value / 10 ** math.floor(math.log10(value))
    return f"{value:g}" if round(leading) in (2, 3, 5) else ""


def loss_curves(runs: list[dict[str, Any]]) -> Figure | None:
    """Training loss per step of each run (its colour its layout's, its line style its own),
    the legend outside the axes. Runs of one model, data, seed and global batch train on the
    same samples, so their curves should lie on each other under every layout: each run's
    hollow markers are a size smaller than the previous run's, so that coinciding points
    show as rings, one per run, rather than as the last run drawn."""
    every = [r for r in runs if r.get("losses")]
    if not every:
        return None
    newest = sorted(every, key=lambda r: r["created_at"])[-MAX_CURVES:]
    curves = [r for r in every if r in newest]  # in the table's order
    colours = layout_colours(runs)
    fig = Figure(figsize=(WIDTH, 5.2), layout="constrained")
    ax = fig.subplots()
    legend = []
    for i, run in enumerate(curves):
        style = {
            "color": colours[layout_of(run)],
            "ls": LINESTYLES[i % len(LINESTYLES)],
            "lw": 1.6,
            "marker": "o",
            "mfc": "none",
            "mew": 1.6,
        }
        ax.plot(
            range(1, len(run["losses"]) + 1),
            run["losses"],
            alpha=0.9,
            **style,
            ms=5 + 2.5 * (len(curves) - 1 - i),
            markevery=max(1, len(run["losses"]) // 12),
        )
        legend.append(Line2D([], [], ms=7, label=run_label(run), **style))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.grid(alpha=0.3)
    title = f"newest {len(curves)} of {len(every)} runs" if len(every) > len(curves) else None
    fig.legend(handles=legend, loc="outside right upper", title=title, fontsize="small")
    return fig


def _memory_bars(run: dict[str, Any]) -> list[tuple[int, dict[str, float], float | None]]:
    """(rank, MiB per category, predicted total MiB) per rank; a rank without the breakdown
    (a row of an older meshrun, or a run with no measured warmup step) is one `peak` bar."""
    predicted = {
        p.get("rank", i): p.get("peak") for i, p in enumerate(run.get("memory_predicted") or [])
    }
    measured = run.get("memory_per_rank") or [
        {"rank": rank, "peak": peak} for rank, peak in enumerate(run["peak_memory_bytes"])
    ]
    bars = []
    for rank in measured:
        parts = [c for c in MEMORY_CATEGORIES if c in rank] or ["peak"]
        guess = predicted.get(rank["rank"])
        bars.append(
            (
                rank["rank"],
                {c: rank[c] / MIB for c in parts},
                guess / MIB if guess is not None else None,
            )
        )
    return bars


def memory_per_rank(runs: list[dict[str, Any]]) -> Figure | None:
    """Stacked bars per rank: params, grads, optimizer state, activations, other (where the
    run measured the breakdown), the predicted peak as a marker where there is one."""
    newest = sorted(
        (r for r in completed(runs) if r.get("peak_memory_bytes")), key=lambda r: r["created_at"]
    )[-MAX_MEMORY_RUNS:]
    with_memory = [r for r in runs if r in newest]
    if not with_memory:
        return None
    labels, stacks, predicted, owners = [], [], [], []
    for run in with_memory:
        for rank, parts, guess in _memory_bars(run):
            labels.append(f"{run_label(run)}  r{rank}")
            stacks.append(parts)
            predicted.append(guess)
            owners.append(run)
    fig = Figure(figsize=(WIDTH, _height(0.75 * len(labels))), layout="constrained")
    ax = fig.subplots()
    categories = [c for c in (*MEMORY_CATEGORIES, "peak") if any(c in s for s in stacks)]
    left = [0.0] * len(stacks)
    rows = range(len(labels))
    for category in categories:
        widths = [s.get(category, 0.0) for s in stacks]
        ax.barh(rows, widths, left=left, label=category, height=0.7)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    guessed = [(y, g) for y, g in zip(rows, predicted, strict=True) if g is not None]
    if guessed:
        ax.scatter(
            [g for _, g in guessed],
            [y for y, _ in guessed],
            marker="|",
            s=300,
            color="black",
            label="predicted peak",
            zorder=3,
        )
    _label_rows(ax, owners, labels)
    for y in range(1, len(owners)):
        if owners[y] is not owners[y - 1]:
            ax.axhline(y - 0.5, color="#888", lw=0.8)
    ax.set_xlabel("MiB")
    ax.grid(axis="x", alpha=0.3)
    fig.legend(loc="outside upper center", ncol=len(categories) + 1, frameon=False)
    return fig


def _family(name: str) -> str:
    """A layout name without its pipeline micro-batch count, which a batch grid varies."""
    return re.sub(r"(, )?m=\d+(, )?", lambda m: ", " if m[1] and m[2] else "", name)


def _maps(runs: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """The runs by (model, layout family). A point skipped before its degrees were known
    (named by its preset) joins the one family its preset ran as in the selection, if one."""
    ran_as: dict[tuple[str, str], set[str]] = defaultdict(set)
    for run in runs:
        if run.get("layout") is not None:
            ran_as[(run["model"], run.get("parallel"))].add(_family(layout_of(run)))
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        families = ran_as[(run["model"], run.get("parallel"))]
        unnamed = run.get("layout") is None and len(families) == 1
        family = next(iter(families)) if unnamed else _family(layout_of(run))
        groups[(run["model"], family)].append(run)
    return groups


def throughput_heatmaps(runs: list[dict[str, Any]]) -> Figure | None:
    """tokens/s over global batch x micro-batch, one map per model and layout that was run at
    more than one point and completed at one at least, HEATMAPS_PER_ROW to a row; skipped
    points are marked as such, failed ones as failed. Each map has its own colour scale
    (layouts differ tenfold)."""
    grids = _grids(runs)
    if not grids:
        return None
    shown = grids[:MAX_HEATMAPS]
    ncols = min(HEATMAPS_PER_ROW, len(shown))
    nrows = math.ceil(len(shown) / ncols)
    fig = Figure(figsize=(min(WIDTH, 3.6 * ncols), 3.6 * nrows + 0.4), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax in axes[len(shown) :]:
        ax.set_axis_off()
    for col, (ax, ((model, layout), group)) in enumerate(zip(axes, shown, strict=False)):
        _heatmap(fig, ax, group)
        if col % ncols == 0:
            ax.set_ylabel("global batch")
        ax.set_title(f"{model} / {layout}", fontsize="medium")
    more = len(grids) - len(shown)
    fig.suptitle(
        "tokens/s" + (f" (the first {len(shown)} of {len(grids)} maps)" if more else ""),
        fontsize="medium",
    )
    return fig


def _grids(runs: list[dict[str, Any]]) -> list[tuple[tuple[str, str], list[dict[str, Any]]]]:
    """The groups a map says something of: a grid of one point is a single number, and one
    with no throughput is all blank."""
    return [
        (key, group)
        for key, group in _maps(runs).items()
        if len({(r["global_batch_size"], r["micro_batch_size"]) for r in group}) > 1
        and any(r.get("tokens_per_s") is not None for r in group)
    ]


def _heatmap(fig: Figure, ax: Axes, group: list[dict[str, Any]]) -> None:
    """One group's map: global batches up, micro-batches across, only the sizes it ran."""
    batches = sorted({r["global_batch_size"] for r in group})
    micros = sorted({r["micro_batch_size"] for r in group})
    cells: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for r in group:
        at = (batches.index(r["global_batch_size"]), micros.index(r["micro_batch_size"]))
        cells[at].append(r)
    grid = _mean_throughput(cells, len(batches), len(micros))
    image = ax.imshow(grid, cmap="viridis", origin="lower", aspect="auto")
    fig.colorbar(image, ax=ax, shrink=0.9)
    _label_cells(ax, image, cells, grid)
    ax.set_xticks(range(len(micros)), [str(m) for m in micros])
    ax.set_yticks(range(len(batches)), [str(b) for b in batches])
    ax.set_xlabel("micro-batch")


def _mean_throughput(
    cells: dict[tuple[int, int], list[dict[str, Any]]], rows: int, cols: int
) -> list[list[float]]:
    """A point run more than once shows its mean; NaN, which imshow leaves blank, where no
    run of it measured any."""
    grid = [[float("nan")] * cols for _ in range(rows)]
    for (i, j), cell in cells.items():
        done = [r["tokens_per_s"] for r in cell if r.get("tokens_per_s") is not None]
        if done:
            grid[i][j] = mean(done)
    return grid


def _label_cells(
    ax: Axes,
    image: AxesImage,
    cells: dict[tuple[int, int], list[dict[str, Any]]],
    grid: list[list[float]],
) -> None:
    """Each cell's tokens/s in a colour that reads on its shade; a blank cell says why (its
    last run's status)."""
    for (i, j), cell in cells.items():
        value = grid[i][j]
        if math.isnan(value):  # no run of this point completed
            ax.text(j, i, cell[-1]["status"], ha="center", va="center", fontsize="small")
            continue
        dark = image.norm(value) < 0.6  # viridis: dark blue to yellow
        ax.text(
            j,
            i,
            f"{value:,.0f}",
            ha="center",
            va="center",
            fontsize="small",
            color="white" if dark else "black",
        )


def bubble(runs: list[dict[str, Any]]) -> Figure | None:
    """Pipeline bubble per run: measured (mean over ranks, each rank a dot) beside the
    schedule's theory."""
    piped = [r for r in completed(runs) if r.get("bubble_theoretical") is not None]
    if not piped:
        return None
    fig = Figure(figsize=(WIDTH, _height(1.3 * len(piped))), layout="constrained")
    ax = fig.subplots()
    ys = range(len(piped))
    measured = [r.get("bubble_measured") or 0.0 for r in piped]
    ax.barh(
        [y - 0.2 for y in ys],
        measured,
        height=0.38,
        color="#1f77b4",
        label="measured (mean over ranks)",
    )
    ax.barh(
        [y + 0.2 for y in ys],
        [r["bubble_theoretical"] for r in piped],
        height=0.38,
        color="#bbb",
        label="theory (p-1)/(v·m+p-1)",
    )
    for y, run in enumerate(piped):
        per_rank = run.get("bubble_per_rank") or []
        ax.plot(
            per_rank,
            [y - 0.2] * len(per_rank),
            "o",
            color="black",
            ms=5,
            label="a rank's measured bubble" if y == 0 and per_rank else None,
        )
    _label_rows(ax, piped)
    ax.set_xlabel("bubble: idle fraction of the step")
    ax.set_xlim(0, 1)
    ax.grid(axis="x", alpha=0.3)
    fig.legend(loc="outside upper center", ncol=3, frameon=False)
    return fig
