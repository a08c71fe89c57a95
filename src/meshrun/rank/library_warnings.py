"""Library warnings (torch's, transformers') once per run, not once per rank and step.

Python shows a warning once per code location until any warning filter changes, which torch
and meshrun do as they run: the same warning came back every step on every rank. Each rank
here keeps each distinct warning (category and text) once and notes it in
`<run dir>/warnings/rank<N>.txt`; rank 0 also prints it as Python would. After the run the
driver prints those that other ranks raised and rank 0 did not (`other_ranks_warnings`)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import TextIO

WARNINGS_DIR = "warnings"


def show_once(run_dir: str, rank: int) -> None:
    """Routes this process's warnings (the filters stay as they are: what is ignored stays
    ignored)."""
    seen: set[str] = set()
    path = Path(run_dir) / WARNINGS_DIR / f"rank{rank}.txt"
    path.unlink(missing_ok=True)  # an earlier attempt's (a job SLURM requeued)

    def show(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> None:
        text = f"{category.__name__}: {message}".replace("\n", " ")
        if text in seen:
            return
        seen.add(text)
        if rank == 0:
            sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(text + "\n")

    warnings.showwarning = show


def other_ranks_warnings(run_dir: str) -> dict[str, list[int]]:
    """The warnings that ranks other than 0 raised and rank 0 did not, with those ranks."""
    ranks: dict[str, list[int]] = {}
    for path in (Path(run_dir) / WARNINGS_DIR).glob("rank*.txt"):
        for text in set(path.read_text().splitlines()):
            ranks.setdefault(text, []).append(int(path.stem.removeprefix("rank")))
    return {text: sorted(r) for text, r in sorted(ranks.items()) if 0 not in r}
