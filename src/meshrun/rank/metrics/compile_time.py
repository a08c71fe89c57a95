"""The seconds a rank spends compiling (train.compile), apart from its step times.

torch.compile compiles a block's forward on its first call and its backward on the first
backward through it (deferred), both inside the untimed steps. Dynamo's compile callbacks
mark the start and end of each outermost compilation (forward frames and deferred backward
graphs alike), so the clock sums exactly the wall time spent compiling: tracing, AOT
autograd, inductor's code generation and its C++ builds; not the first run of the compiled
kernels, nor the rest of the warm-up that uncompiled runs pay too."""

from __future__ import annotations

import time

from torch._dynamo.callback import CallbackArgs, callback_handler


class CompileClock:
    """Sums compile seconds from construction until `stop()` (idempotent)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._since: float | None = None
        self._running = True
        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)

    def _start(self, _: CallbackArgs) -> None:
        self._since = time.perf_counter()

    def _end(self, _: CallbackArgs) -> None:
        if self._since is not None:
            self.seconds += time.perf_counter() - self._since
            self._since = None

    def stop(self) -> float:
        if self._running:
            callback_handler.remove_start_callback(self._start)
            callback_handler.remove_end_callback(self._end)
            self._running = False
        return self.seconds
