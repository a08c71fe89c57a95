"""The failure a rank injects into itself (debug.fail_rank, fail_step, fail_mode: an
exception, a hang, a SIGKILL), so that the failure paths (records, diagnosis, teardown) run
on real runs; training's ranks and meshrun-comm's alike."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

from meshrun.core.config import DebugConfig


def fault_injector(debug: DebugConfig, rank: int) -> Callable[[int], None] | None:
    if debug.fail_rank != rank:
        return None

    def inject(step: int) -> None:
        if step != debug.fail_step:
            return
        if debug.fail_mode == "hang":
            threading.Event().wait()  # the peers' collectives must time out
        if debug.fail_mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)  # no exception, no record: as the OOM killer
        raise RuntimeError(f"injected failure on rank {rank} at step {step} (debug.fail_rank)")

    return inject
