"""torch.profiler's start and stop without kineto's lines: it prints `USDT: ...
profiler_start` / `profiler_stop` from C++ to fd 2 whatever KINETO_LOG_LEVEL says (torch
2.13), one pair a rank at every profiled window, calibration's and the memory meter's too.
Only CPU profiles are quieted: on CUDA, kineto's stderr also carries CUPTI's errors."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """fd 2 to /dev/null for the block (Python's own stderr flushed first)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
