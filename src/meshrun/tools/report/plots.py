"""The report's plots (matplotlib, object API: no pyplot state, no display needed).

Each function takes the selected runs and returns a Figure, or None when the selection holds
nothing it could show (no pipeline runs for the bubble plot, ...).
"""

from __future__ import annotations

from collections import defaultdict
from statistics import mean
from typing import Any

from matplotlib.figure import Figure

from meshrun.core.record import MEMORY_CATEGORIES

MIB = 2**20
MAX_MEMORY_RUNS = 12  # the newest ones; more bars stop being readable
MAX_HEATMAPS = 4


def completed(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in runs if r["status"] == "completed"]


def run_label(run: dict[str, Any]) -> str:
    """By preset (short; the table has the layout name, core.layout.layout_name)."""
    batch = f"b{run['global_batch_size']}/m{run['micro_batch_size']}"
    return f"{run['parallel']} {batch} ({run['run_id'][:6]})"


def speedup_scaling(runs: list[dict[str, Any]]) -> Figure | None:
    """Speedup and scaling efficiency against devices, one line per layout preset through the
    mean of its runs, every run a point."""
    measured = [r for r in completed(runs) if r.get("speedup") is not None]
    if not measured:
        return None
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ax_speed, ax_eff = fig.subplots(1, 2)
    by_layout: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for run in measured:
        by_layout[run["parallel"]].append(run)
    for layout, group in sorted(by_layout.items()):
        for ax, key in ((ax_speed, "speedup"), (ax_eff, "scaling_efficiency")):
            xs = [r["devices"] for r in group]
            points = ax.scatter(xs, [r[key] for r in group], alpha=0.5)
            devices = sorted(set(xs))
            means = [mean(r[key] for r in group if r["devices"] == d) for d in devices]
            ax.plot(devices, means, marker="o", label=layout, color=points.get_facecolor()[0])
    top = max(r["devices"] for r in measured)
    ax_speed.plot([1, top], [1, top], ls="--", color="gray", label="ideal")
    ax_eff.axhline(1.0, ls="--", color="gray")
    for ax, ylabel in ((ax_speed, "speedup vs 1 device"), (ax_eff, "scaling efficiency")):
        ax.set_xlabel("devices")
        ax.set_ylabel(ylabel)
        ax.set_xticks(range(1, top + 1))
        ax.grid(alpha=0.3)
    ax_speed.legend(title="layout", fontsize="small")
    return fig


def _memory_bars(run: dict[str, Any]) -> list[tuple[int, dict[str, float], float | None]]:
    """(rank, MiB per category, predicted total MiB) per rank; without a breakdown the peak
    is one `peak` bar."""
    predicted = {p.get("rank", i): p for i, p in enumerate(run.get("memory_predicted") or [])}
    breakdown = run.get("memory_per_rank")
    if not breakdown:
        return [(rank, {"peak": peak / MIB}, None)
                for rank, peak in enumerate(run.get("peak_memory_bytes") or [])]  # fmt: skip
    bars = []
    for rank in breakdown:
        guess = predicted.get(rank["rank"])
        guess_mib = guess.get("peak") if guess else None
        bars.append(
            (
                rank["rank"],
                {c: rank.get(c, 0) / MIB for c in MEMORY_CATEGORIES},
                guess_mib / MIB if guess_mib is not None else None,
            )
        )
    return bars


def memory_per_rank(runs: list[dict[str, Any]]) -> Figure | None:
    """Stacked bars per rank: params, grads, optimizer state, activations, other (where the
    run measured the breakdown), the predicted peak as a marker where there is one."""
    with_memory = [r for r in completed(runs) if r.get("peak_memory_bytes")][-MAX_MEMORY_RUNS:]
    if not with_memory:
        return None
    labels, stacks, predicted = [], [], []
    for run in with_memory:
        for rank, parts, guess in _memory_bars(run):
            labels.append(f"{run_label(run)} r{rank}")
            stacks.append(parts)
            predicted.append(guess)
    fig = Figure(figsize=(11, 1.2 + 0.32 * len(labels)), layout="constrained")
    ax = fig.subplots()
    categories = [c for c in (*MEMORY_CATEGORIES, "peak") if any(c in s for s in stacks)]
    left = [0.0] * len(stacks)
    for category in categories:
        widths = [s.get(category, 0.0) for s in stacks]
        ax.barh(labels, widths, left=left, label=category)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    guessed = [(label, g) for label, g in zip(labels, predicted, strict=True) if g is not None]
    if guessed:
        ax.scatter([g for _, g in guessed], [label for label, _ in guessed], marker="|",
                   s=300, color="black", label="predicted peak", zorder=3)  # fmt: skip
    ax.invert_yaxis()
    ax.set_xlabel("MiB")
    ax.legend(fontsize="small", loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    return fig


def throughput_heatmaps(runs: list[dict[str, Any]]) -> Figure | None:
    """tokens/s over global batch x micro-batch, one map per model and layout that was run at
    more than one point; skipped points are marked as such, failed ones as failed."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        groups[(run["model"], run["parallel"])].append(run)
    grids = [
        (key, group)
        for key, group in sorted(groups.items())
        if len({(r["global_batch_size"], r["micro_batch_size"]) for r in group}) > 1
    ]
    grids = grids[:MAX_HEATMAPS]
    if not grids:
        return None
    fig = Figure(figsize=(5.5 * len(grids), 4.5), layout="constrained")
    axes = fig.subplots(1, len(grids), squeeze=False)[0]
    for ax, ((model, layout), group) in zip(axes, grids, strict=True):
        batches = sorted({r["global_batch_size"] for r in group})
        micros = sorted({r["micro_batch_size"] for r in group})
        cells: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
        for r in group:
            cells[
                (batches.index(r["global_batch_size"]), micros.index(r["micro_batch_size"]))
            ].append(r)
        grid = [[float("nan")] * len(micros) for _ in batches]
        for (i, j), cell in cells.items():
            done = [r["tokens_per_s"] for r in cell if r.get("tokens_per_s") is not None]
            if done:
                grid[i][j] = mean(done)
        image = ax.imshow(grid, cmap="viridis", origin="lower", aspect="auto")
        fig.colorbar(image, ax=ax, label="tokens/s")
        for (i, j), cell in cells.items():
            text = f"{grid[i][j]:,.0f}" if grid[i][j] == grid[i][j] else cell[-1]["status"]
            ax.text(j, i, text, ha="center", va="center", fontsize="small",
                    color="white" if grid[i][j] == grid[i][j] else "black")  # fmt: skip
        ax.set_xticks(range(len(micros)), [str(m) for m in micros])
        ax.set_yticks(range(len(batches)), [str(b) for b in batches])
        ax.set_xlabel("micro-batch")
        ax.set_ylabel("global batch")
        ax.set_title(f"{model} / {layout}")
    return fig


def bubble(runs: list[dict[str, Any]]) -> Figure | None:
    """Pipeline bubble per run: measured (mean over ranks) beside the schedule's theory."""
    piped = [r for r in completed(runs) if r.get("bubble_theoretical") is not None]
    if not piped:
        return None
    fig = Figure(figsize=(max(6, 1.1 * len(piped) + 2), 4.2), layout="constrained")
    ax = fig.subplots()
    xs = range(len(piped))
    measured = [r.get("bubble_measured") or 0.0 for r in piped]
    ax.bar([x - 0.2 for x in xs], measured, width=0.4, label="measured")
    ax.bar([x + 0.2 for x in xs], [r["bubble_theoretical"] for r in piped], width=0.4,
           label="theory (p-1)/(v·m+p-1)")  # fmt: skip
    labels = [f"{r['pp_schedule']} m={r['n_microbatches']}\n{run_label(r)}" for r in piped]
    ax.set_xticks(list(xs), labels, fontsize="x-small", rotation=20, ha="right")
    ax.set_ylabel("bubble fraction of the step")
    ax.set_ylim(0, 1)
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    return fig
