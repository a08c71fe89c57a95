"""Library warnings (torch's, transformers') once per run, not once per rank and step.

Python shows a warning once per code location until any warning filter changes, which torch
and meshrun do as they run: the same warning came back every step on every rank. Each rank
here keeps each distinct warning (category and text) once and notes it in
`<run dir>/warnings/rank<N>.txt` (core/run_files/library_warnings.py); rank 0 also prints it as
Python would. After the run the driver prints those that other ranks raised and rank 0 did
not. A library's import that logs about what meshrun does not use is quietened where it is
imported (`quiet_loggers`)."""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
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


TORCHAO_IMPORT = ("torchao", "torch.utils._pytree")


@contextmanager
def quiet_loggers(names: tuple[str, ...]) -> Iterator[None]:
    """Only errors from these loggers meanwhile. torchao's import (TORCHAO_IMPORT) logs a
    warning for each kernel library it cannot load (its CUDA and mxfp8 extensions on a CPU
    build) and torch's pytree one for each Enum it registers: at every rank's start, about
    kernels that float8 training and the 8-bit optimizer do not use."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
