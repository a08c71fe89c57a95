"""Peak tensor memory of one rank, and what it is made of.

CUDA: the caching allocator's own counters (allocated now, peak allocated, peak reserved),
on each device the rank computes on, across the breakdown's resets (cuda_peaks.py).
CPU: torch has no allocator statistics there, so the profiler records the CPU allocator's
events (profile_memory) from before the model is built to the end of the warmup steps.
It records only the events of the thread that started it, and a tensor whose last holder is
a collective's work is freed on a gloo worker thread: a running sum of the recorded events
would keep such a tensor live for ever (one whole FSDP block or TP output more or less,
depending on which thread won the race). So c10's process-wide CPU memory counter is switched
on while tracing (its `caffe2_report_cpu_memory_usage` flag), and live bytes at any moment are
that counter as of the latest recorded event, which counts every thread's allocations and
frees. Steady-state steps repeat the warmup steps' pattern, and keeping the profiler out of
timed steps keeps timings honest.

The breakdown splits the peak into the model state (parameters, gradients, optimizer state:
exact sizes of the tensors this rank holds), activations (what the last warmup step's
forward and backward add on top of the live bytes at its start, at their highest: tensors
saved for backward with the transients at that moment) and other (the rest of the peak:
communication buckets, buffers, optimizer-step temporaries). The loop keeps gradients
allocated between steps, so the step start already holds the whole model state.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._C._profiler import _ExtraFields_Allocation, _ProfilerEvent
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from meshrun.models.shards import local_tensor
from meshrun.rank.metrics import cuda_peaks
from meshrun.rank.quiet_profiler import quiet_stderr

STEP_START = "meshrun/step_start"
FWD_BWD_END = "meshrun/fwd_bwd_end"


def _counter_flag() -> ctypes.c_bool | None:
    """c10 counts CPU allocations of every thread only while this flag is set (otherwise only
    on threads the profiler runs on); it is a plain exported bool of libc10."""
    for library in sorted(Path(torch.__file__).parent.joinpath("lib").glob("libc10.*")):
        with contextlib.suppress(OSError, ValueError):
            return ctypes.c_bool.in_dll(
                ctypes.CDLL(str(library)), "FLAGS_caffe2_report_cpu_memory_usage"
            )
    return None


@contextlib.contextmanager
def _process_wide_cpu_counter() -> Iterator[None]:
    flag = _counter_flag()
    if flag is None:
        warnings.warn(
            "CPU memory: c10's process-wide counter was not found in this torch "
            "build; frees on other threads (gloo's) go unseen and the peak may be "
            "overstated",
            stacklevel=2,
        )
        yield
        return
    saved = flag.value
    flag.value = True
    try:
        yield
    finally:
        flag.value = saved


def _walk(roots: list[_ProfilerEvent]) -> Iterator[_ProfilerEvent]:
    stack = list(roots)
    while stack:
        event = stack.pop()
        yield event
        stack.extend(event.children)


def tensor_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the storages behind `tensors`, each storage once (views share one); a
    tensor subclass's, its inner tensors' (torchao's 8-bit optimizer state: the codes, a
    scale a block and the code book)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is None:
            continue
        for storage in _storages(local_tensor(tensor)):
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def _storages(tensor: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    if not is_traceable_wrapper_subclass(tensor):
        yield tensor.untyped_storage()
        return
    names, _ = tensor.__tensor_flatten__()
    for name in names:
        yield from _storages(getattr(tensor, name))


@dataclass
class ModelState:
    params: int
    grads: int
    optimizer: int

    @classmethod
    def of(cls, params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> ModelState:
        states = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        return cls(tensor_bytes(params), tensor_bytes(p.grad for p in params), tensor_bytes(states))


@dataclass
class StepMarks:
    """One device's live bytes at a warmup step's start, and its peak from there to the end
    of the step's forward and backward. The last pair wins: the last warmup step, in steady
    state."""

    step_start: int | None = None
    fwd_bwd_peak: int | None = None

    def on_mark(self, label: str, live: int, peak_since_last: int) -> None:
        if label == STEP_START:
            self.step_start = live
        elif label == FWD_BWD_END and self.step_start is not None:
            self.fwd_bwd_peak = peak_since_last


class MemoryMeter:
    """`devices`: those whose memory is the rank's (cuda_peaks.metered_devices); CPU: one."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = list(devices)
        self._profiler: profile | None = None
        self._counter: contextlib.ExitStack | None = None
        self._cpu_peak: int | None = None
        self._cuda = cuda_peaks.RunPeaks(len(self.devices))
        self.steps = [StepMarks() for _ in self.devices]

    @property
    def cuda(self) -> bool:
        return self.devices[0].type == "cuda"

    def start(self) -> None:
        if self.cuda:
            cuda_peaks.reset(self.devices)
            return
        self._counter = contextlib.ExitStack()
        self._counter.enter_context(_process_wide_cpu_counter())
        self._profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with quiet_stderr():
            self._profiler.__enter__()

    def mark(self, label: str) -> None:
        """A point of the warmup step whose live bytes the breakdown needs. A step starts
        after a garbage collection: tensors kept only by reference cycles (autograd graphs,
        FSDP hooks) are not the step's memory, and whether the collector ran before it or not
        would otherwise move the breakdown by whole blocks."""
        if label == STEP_START:
            gc.collect()
        if self.cuda:
            readings = cuda_peaks.read(self.devices)
            self._cuda.fold(readings)  # before the reset that starts the next span
            for step, reading in zip(self.steps, readings, strict=True):
                step.on_mark(label, reading.live, reading.allocated_peak)
            cuda_peaks.reset(self.devices)
        elif self._profiler is not None:
            with record_function(label):
                torch.empty(1)  # an event that reads the counter, in case other threads freed

    def stop_tracing(self) -> None:
        """End CPU allocation tracing (call after the warmup steps)."""
        if self._profiler is None:
            return
        with quiet_stderr():
            self._profiler.__exit__(None, None, None)
        if self._counter is not None:
            self._counter.close()
        roots = self._profiler.profiler.kineto_results.experimental_event_tree()
        self._profiler = self._counter = None
        totals, marks = [], []
        for event in _walk(roots):
            fields = event.extra_fields
            if isinstance(fields, _ExtraFields_Allocation) and fields.device.type == "cpu":
                totals.append((event.start_time_ns, fields.total_allocated, fields.alloc_size))
            elif event.name.startswith("meshrun/"):
                marks.append((event.end_time_ns, event.name))
        totals.sort()
        self._read_cpu_marks(totals, sorted(marks))

    def _read_cpu_marks(self, totals: list[tuple[int, int, int]], marks: list) -> None:
        """`totals`: (time, process-wide allocated after the event, the event's size); live
        bytes are counted from the counter's value when tracing began."""
        base = totals[0][1] - totals[0][2] if totals else 0
        live = peak = since_mark = 0
        totals_iter = iter(totals)
        pending = next(totals_iter, None)
        for at, label in [*marks, (float("inf"), "")]:
            while pending is not None and pending[0] <= at:
                live = pending[1] - base
                peak = max(peak, live)
                since_mark = max(since_mark, live)
                pending = next(totals_iter, None)
            self.steps[0].on_mark(label, live, since_mark)
            since_mark = live
        self._cpu_peak = peak

    def hold(self) -> None:
        """The run's figures are final: what this process allocates from here on (the
        single-device baseline trained beside the run) is not the run's."""
        self.stop_tracing()
        if self.cuda:
            self._cuda.fold(cuda_peaks.read(self.devices))
            self._cuda.hold()

    def peaks(self) -> list[int]:
        """The run's peak bytes so far on each of its devices (CPU: traced, so final once
        tracing stops, which this does)."""
        self.stop_tracing()
        if self.cuda:
            self._cuda.fold(cuda_peaks.read(self.devices))
            return list(self._cuda.allocated)
        return [int(self._cpu_peak or 0)]

    def breakdowns(self, state: ModelState) -> list[dict[str, int]] | None:
        """Each device's peak split by category (bytes); None without a measured warmup
        step. The model state is the first device's: DataParallel's replicas on the others
        are copies made and freed within each step (activations there)."""
        peaks = self.peaks()
        if any(s.step_start is None or s.fwd_bwd_peak is None for s in self.steps):
            return None
        nothing = ModelState(0, 0, 0)
        return [self._split(i, peak, state if i == 0 else nothing) for i, peak in enumerate(peaks)]

    def _split(self, device: int, peak: int, state: ModelState) -> dict[str, int]:
        marks = self.steps[device]
        activations = max(0, marks.fwd_bwd_peak - marks.step_start)
        split = {
            "peak": peak,
            "params": state.params,
            "grads": state.grads,
            "optimizer": state.optimizer,
            "activations": activations,
        }
        split["other"] = peak - state.params - state.grads - state.optimizer - activations
        if self.cuda:
            split["allocated"] = peak
            split["reserved"] = self._cuda.reserved[device]
        return split
