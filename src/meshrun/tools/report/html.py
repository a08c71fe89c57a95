"""The report as one self-contained HTML file: inline CSS, plots as base64 PNG data URIs, no
script and no external resource, so it can be mailed or archived as it is."""

from __future__ import annotations

import base64
import io
from collections import Counter
from html import escape
from typing import Any

from matplotlib.figure import Figure

from meshrun.tools.report import plots
from meshrun.tools.report.table import HEADERS, cells

# (id, title, plot, what the page says when the selection has nothing to plot)
SECTIONS = (
    ("speedup", "Speedup and scaling efficiency by layout and devices", plots.speedup_scaling,
     "No completed run with a measured speedup."),
    ("memory", "Memory per rank by category", plots.memory_per_rank,
     "No completed run with memory figures."),
    ("heatmap", "Throughput over global batch x micro-batch", plots.throughput_heatmaps,
     "No model and layout run at more than one batch point."),
    ("bubble", "Pipeline bubble: measured vs theory", plots.bubble,
     "No completed pipeline-parallel run."),
)  # fmt: skip

STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; font-size: 0.85em; }
td { white-space: nowrap; }
td:last-child { white-space: normal; min-width: 24em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.5em; text-align: left; vertical-align: top; }
th { background: #f0f0f0; }
tr.completed td.status { color: #17803d; }
tr.failed td.status { color: #b91c1c; }
tr.skipped td { color: #777; }
tr.skipped td.status { color: #a16207; }
figure { margin: 1.5em 0; }
img { max-width: 100%; }
p.empty { color: #777; font-style: italic; }
"""


def png_data_uri(fig: Figure) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _runs_table(runs: list[dict[str, Any]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in HEADERS)
    body = []
    for run in runs:
        tds = "".join(
            f'<td class="{"status" if h == "status" else ""}">{escape(c)}</td>'
            for h, c in cells(run).items()
        )
        body.append(
            f'<tr class="{escape(run["status"])}" data-run-id="{escape(run["run_id"])}">{tds}</tr>'
        )
    return f'<table id="runs"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _section(anchor: str, title: str, fig: Figure | None, empty: str) -> str:
    head = f'<section id="{anchor}"><h2>{escape(title)}</h2>'
    if fig is None:
        return f'{head}<p class="empty">{escape(empty)}</p></section>'
    return f'{head}<figure><img alt="{escape(title)}" src="{png_data_uri(fig)}"></figure></section>'


def render(runs: list[dict[str, Any]], title: str, selection: str) -> str:
    """`selection` says in words which filters chose the runs."""
    counts = Counter(run["status"] for run in runs)
    summary = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
    sections = "".join(_section(a, t, plot(runs), e) for a, t, plot, e in SECTIONS)
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{STYLE}</style></head><body>"
        f"<h1>{escape(title)}</h1>"
        f'<p id="selection">{escape(selection)}: {len(runs)} runs ({escape(summary)})</p>'
        f"<h2>Runs</h2>{_runs_table(runs)}{sections}</body></html>\n"
    )
