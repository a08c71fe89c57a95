"""Rank 0's progress bar shows, beside the steps, the last log step's loss and the tokens/s
of its timed steps."""

from __future__ import annotations

import io

from rich.console import Console

from meshrun.core.run_files.metrics import StepRow
from meshrun.rank import progress as progress_module
from meshrun.rank.progress import rank_progress


def test_the_bar_shows_loss_and_tokens_per_s(monkeypatch):
    out = io.StringIO()
    monkeypatch.setattr(
        progress_module, "console", Console(file=out, force_terminal=True, width=160)
    )
    with rank_progress(total=10, tokens_per_step=1024, enabled=True) as bar:
        bar.step(5)
        records = [
            StepRow(step=s, loss=2.5 - s / 10, step_time_s=t) for s, t in ((3, None), (4, 0.5))
        ]
        bar.show(records)
        bar._progress.refresh()
    drawn = out.getvalue()
    assert "5/10" in drawn
    assert "loss 2.1000" in drawn  # the last record's
    assert "2,048 tok/s" in drawn  # 1024 tokens in 0.5 s; the untimed step counts none
