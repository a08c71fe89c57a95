"""Library warnings (torch's, transformers') once per run, not once per rank and step.

Python shows a warning once per code location until any warning filter changes, which torch
and meshrun do as they run: the same warning came back every step on every rank. Each rank
here keeps each distinct warning (category and text) once and notes it in
`<run dir>/warnings/rank<N>.txt` (core/run_files/library_warnings.py); rank 0 also prints it as
Python would. After the run the driver prints those that other ranks raised and rank 0 did
not."""

from __future__ import annotations

import sys
import warnings
from typing import TextIO

from meshrun.core.run_files.library_warnings import warnings_file


def show_once(run_dir: str, rank: int) -> None:
    """Routes this process's warnings (the filters stay as they are: what is ignored stays
    ignored)."""
    seen: set[str] = set()
    path = warnings_file(run_dir, rank)
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
