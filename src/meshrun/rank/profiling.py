"""debug.profile_steps=[a,b]: torch.profiler over steps a..b on every rank, written as
`<run dir>/profile/rank<N>.trace.json.gz` (Perfetto and chrome://tracing open it). meshrun's
phases are named in the trace by `record_function` ranges prefixed `meshrun:` (the step, the
data wait, each micro-batch's forward and backward, a pipeline stage's per micro-batch
(rank/parallel/pipeline.annotate_stages), the gradient norm, clipping, the optimizer, each
collective meshrun issues itself: rank/watchdog's phases); core/run_files/profiles.py reads
them back. The profiled steps (and the one after, which pays for the profiler's stop) are
marked in the step records and left out of the run's timing: their overhead is reported,
not averaged in."""

from __future__ import annotations

import contextlib
import gc

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

from meshrun.core.run_files.profiles import PHASE, STEP_PHASE, trace_path
from meshrun.rank.quiet_profiler import quiet_stderr


def phase(name: str) -> record_function:
    """A named range in the trace (a few microseconds when no profiler runs)."""
    return record_function(PHASE + name)


class StepProfiler:
    """Starts torch.profiler before step `first`, stops it and writes the trace after
    `last`."""

    def __init__(self, run_dir: str, rank: int, steps: list[int], device: torch.device) -> None:
        self.first, self.last = steps
        self.path = trace_path(run_dir, rank)
        self.activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(ProfilerActivity.CUDA)
        self._profile: profile | None = None

    def covers(self, step: int) -> bool:
        return self.first <= step <= self.last

    def disturbs(self, step: int) -> bool:
        """The profiled steps and the one after: it pays for the profiler's stop (pp2 of
        model=small here: 0.30 s against 0.245 s a step before and after it)."""
        return self.first <= step <= self.last + 1

    def before(self, step: int) -> None:
        if step == self.first:
            self._profile = profile(
                activities=self.activities, record_shapes=True, profile_memory=True
            )
            with self._quiet():
                self._profile.start()

    def _quiet(self) -> contextlib.AbstractContextManager:
        """kineto's start/stop lines silenced on CPU ranks; a CUDA rank's stderr kept whole,
        where CUPTI says why a trace would hold no kernels."""
        if ProfilerActivity.CUDA in self.activities:
            return contextlib.nullcontext()
        return quiet_stderr()

    def after(self, step: int) -> bool:
        """True where this step ended the profile (and its trace was written)."""
        if step != self.last or self._profile is None:
            return False
        with self._quiet():
            self._profile.stop()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._profile.export_chrome_trace(str(self.path))  # gzipped: the name ends .gz
        self._profile = None
        gc.collect()  # the trace's events, now, not in a later step's collection
        return True


def step_range(step: int) -> record_function:
    return record_function(f"{STEP_PHASE}{step}")
