"""The report as one self-contained HTML file: inline CSS, plots as base64 PNG data URIs, no
script and no external resource, so it can be mailed or archived as it is."""

from __future__ import annotations

import base64
import io
import re
from collections import Counter
from collections.abc import Callable
from html import escape
from typing import Any

from matplotlib import rc_context
from matplotlib.figure import Figure

from meshrun.driver.sinks.compare import FLAG, HEADERS, cells, flags
from meshrun.driver.sinks.selection import Selection, Sweep
from meshrun.driver.sinks.timeline import step_timelines
from meshrun.tools.report import plots
from meshrun.tools.report.budget_plot import budget_times

Plot = Callable[[list[dict[str, Any]]], Figure | None]
# (id, title, what it shows and how to read it, plot, what the page says without data)
SECTIONS: tuple[tuple[str, str, str, Plot, str], ...] = (
    (
        "speedup",
        "Speedup with its spread",
        "Each run against its single-device baseline; the bar is the ideal (its device count).",
        plots.speedup,
        "No completed run with a measured speedup.",
    ),
    (
        "step-times",
        "Step-time distributions",
        "Every timed step of each run; a wide box is a noisy measurement.",
        plots.step_times,
        "No run with timed steps.",
    ),
    (
        "losses",
        "Loss curves",
        "Same model, data, seed and global batch train on the same samples: under any layout "
        "the curves should lie on each other.",
        plots.loss_curves,
        "No run with losses.",
    ),
    (
        "memory",
        "Memory per rank by category",
        "Measured per rank; the black tick is the planner's predicted peak.",
        plots.memory_per_rank,
        "No completed run with memory figures.",
    ),
    (
        "bubble",
        "Pipeline bubble: measured vs theory",
        "The idle share of a pipeline step, per run and per rank, beside the schedule's theory.",
        plots.bubble,
        "No completed pipeline-parallel run.",
    ),
    (
        "timeline",
        "Inside a step: the traced step of each rank",
        "The newest profiled runs (debug.profile_steps): what each rank computed, the "
        "communication it had in flight, idle time, and a pipeline's micro-batches.",
        step_timelines,
        "No profiled run (debug.profile_steps=[a,b]).",
    ),
    (
        "budget",
        "The plan kept honest: the run's budget, predicted vs measured",
        "Each run's whole budget (plan.tokens, else its own steps) at the speed it measured "
        "against the plan's prediction for its layout; above the line, slower than planned. "
        "A hollow point was predicted on an uncalibrated host (the hardware profile's rates, "
        "not this host's: meshrun-plan calibrate measures them).",
        budget_times,
        "No completed run with a predicted and a measured speed.",
    ),
    (
        "heatmap",
        "Throughput over global batch x micro-batch",
        "tokens/s of each model and layout run at more than one batch point.",
        plots.throughput_heatmaps,
        "No model and layout run at more than one batch point.",
    ),
)
CELL_CLASS = {
    "run": "run nw",
    "status": "status nw",
    "sweep": "sweep",
    "ranks": "nw",
    "batch / micro": "nw",
    "tokens/s": "nw",
    "peak memory": "nw",
}
BREAKS = re.compile(r" (?!(?:ms|s|MiB|/)\b)")  # spaces a line may break at
NOTES = ("reason",)  # columns shown as a line under the run's row, not as a column
SHARED = ("sweep",)
MAX_SWEEPS = 20  # the newest; the terminal's list and the store hold the rest
FONT = {"font.size": 11}

STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5em 1.5em; color: #222; }
table { border-collapse: collapse; font-size: 0.76em; }
#runs { width: 100%; }
#runs td span, #runs td.nw { white-space: nowrap; }
#runs td.sweep span { white-space: normal; overflow-wrap: anywhere; }
td.run { font-family: ui-monospace, monospace; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.35em; text-align: left; vertical-align: top; }
th { background: #f0f0f0; }
tr.completed td.status { color: #17803d; }
tr.failed td.status { color: #b91c1c; }
tr.skipped td { color: #777; }
tr.skipped td.status { color: #a16207; }
tr.flagged td { background: #fffbeb; }
tr.notes td { border-top: none; padding-left: 2em; }
tr.notes ul { margin: 0; padding: 0; list-style: none; }
tr.notes li.flag { color: #92400e; background: #fef3c7; padding: 0.1em 0.4em; margin: 0.1em 0; }
#sweeps td.mark { color: #1d4ed8; }
figure { margin: 0.8em 0 1.5em; }
img { max-width: 100%; }
p.note { color: #555; margin: 0.2em 0; }
p.empty { color: #777; font-style: italic; }
"""


def png_data_uri(fig: Figure) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _cell(header: str, text: str) -> str:
    """Words kept whole (a browser would break `2026-12-02` or `(14.8-22.4)` at a dash), a
    number with its unit too: a narrow column wraps only between them."""
    words = BREAKS.split(text)
    content = " ".join(f"<span>{escape(word)}</span>" for word in words)
    return f'<td class="{CELL_CLASS.get(header, "")}">{content}</td>'


def _runs_table(runs: list[dict[str, Any]]) -> str:
    """A row per run; under it, in a row of its own across the table, a skipped or failed
    run's reason and a flagged run's flags. A column in SHARED that has one value for every
    run is said once above the table instead (a sweep's name would wrap over many lines)."""
    rows = [cells(run) for run in runs]
    same = [h for h in SHARED if len({row[h] for row in rows}) == 1]
    shown = [h for h in HEADERS if h not in NOTES and h not in same]
    once = "".join(
        f'<p class="note">{escape(h)}: {escape(rows[0][h])}, every run</p>'
        for h in same
        if rows[0][h]
    )
    head = "".join(f"<th>{escape(h)}</th>" for h in shown)
    body = []
    for run, row in zip(runs, rows, strict=True):
        said = flags(run)
        kind = f"{run['status']} flagged" if said else run["status"]
        tds = "".join(_cell(h, row[h]) for h in shown)
        body.append(f'<tr class="{escape(kind)}" data-run-id="{escape(run["run_id"])}">{tds}</tr>')
        notes = [f'<li class="reason">{escape(row[h])}</li>' for h in NOTES if row[h]]
        notes += [f'<li class="flag">{FLAG} {escape(flag)}</li>' for flag in said]
        if notes:
            of = escape(run["run_id"])
            items = "".join(notes)
            body.append(
                f'<tr class="notes {escape(kind)}" data-notes-of="{of}">'
                f'<td colspan="{len(shown)}"><ul>{items}</ul></td></tr>'
            )
    table = f'<table id="runs"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'
    return once + table


def _sweeps_table(selection: Selection) -> str:
    """The store's sweeps, newest first: which one `sweep=latest` picks, which one is shown."""
    if not selection.sweeps:
        return '<p class="empty" id="sweeps">The store has no sweep.</p>'
    latest = selection.sweeps[-1].name
    shown = list(reversed(selection.sweeps))[:MAX_SWEEPS]

    def row(s: Sweep) -> str:
        marks = [
            w
            for w, on in (("sweep=latest", s.name == latest), ("shown", s.name == selection.sweep))
            if on
        ]
        times = f"{s.first[:19].replace('T', ' ')} to {s.last[:19].replace('T', ' ')}"
        name = escape(s.name)
        return (
            f'<tr data-sweep="{name}"><td>{name}</td><td>{s.runs}</td>'
            f'<td>{escape(times)}</td><td class="mark">{", ".join(marks)}</td></tr>'
        )

    older = len(selection.sweeps) - len(shown)
    more = f'<p class="note">and {older} older sweeps</p>' if older else ""
    return (
        '<table id="sweeps"><thead><tr><th>sweep</th><th>runs</th><th>created (UTC)</th>'
        f"<th></th></tr></thead><tbody>{''.join(map(row, shown))}</tbody></table>{more}"
    )


def _section(anchor: str, title: str, note: str, fig: Figure | None, empty: str) -> str:
    head = f'<section id="{anchor}"><h2>{escape(title)}</h2>'
    if fig is None:
        return f'{head}<p class="empty">{escape(empty)}</p></section>'
    return (
        f'{head}<p class="note">{escape(note)}</p><figure><img alt="{escape(title)}" '
        f'src="{png_data_uri(fig)}"></figure></section>'
    )


def render(selection: Selection, title: str, described: str) -> str:
    """`described` says in words which filters chose the runs."""
    runs = selection.runs
    counts = Counter(run["status"] for run in runs)
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    with rc_context(FONT):
        sections = "".join(_section(a, t, n, plot(runs), e) for a, t, n, plot, e in SECTIONS)
    flagged = sum(bool(flags(run)) for run in runs)
    warning = (
        f'<p class="note">{FLAG} {flagged} run(s) flagged: their figures are not to be '
        "trusted as they stand (the reasons under each).</p>"
        if flagged
        else ""
    )
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>"
        f"<h1>{escape(title)}</h1>"
        f'<p id="selection">{escape(described)}: {len(runs)} runs ({escape(summary)})</p>'
        f"<h2>Runs</h2>{warning}{_runs_table(runs)}{sections}"
        f"<h2>Sweeps in the store</h2>{_sweeps_table(selection)}</body></html>\n"
    )
