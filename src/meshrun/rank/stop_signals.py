"""A failing rank's last words, whole. When one rank dies its peers fail within milliseconds
(a closed connection) and write what the driver needs (their error, the steps no log step
flushed) while torch elastic is already stopping them with SIGTERM: a record cut off there is
lost, or torn. From `hold()` on, a stop signal is noted instead of acted on; `release()`
restores the handlers and delivers the first one noted, after the records are written."""

from __future__ import annotations

import signal
import threading
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)

_noted: list[int] = []
_before: dict[int, Any] = {}


def hold() -> None:
    """Note stop signals from now on (the main thread's handlers; idempotent)."""
    if _before or threading.current_thread() is not threading.main_thread():
        return
    for signum in STOP_SIGNALS:
        _before[signum] = signal.signal(signum, lambda got, _: _noted.append(got))


def release() -> None:
    """The handlers as they were, and the first stop signal noted delivered to them."""
    if not _before:
        return
    for signum, handler in _before.items():
        signal.signal(signum, handler)
    _before.clear()
    noted = _noted[:1]
    _noted.clear()
    for signum in noted:
        signal.raise_signal(signum)
