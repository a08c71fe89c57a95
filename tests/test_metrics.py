"""Step timing, throughput summaries, CPU peak-memory tracing and the CUDA peaks' logic."""

from __future__ import annotations

import random
import statistics
import threading
import time

import numpy as np
import pytest
import torch

from meshrun.core.config import ParallelConfig
from meshrun.core.step_stats import percentile, summarize_steps
from meshrun.rank.metrics import memory as memory_module
from meshrun.rank.metrics.cuda_peaks import Reading, RunPeaks, metered_devices
from meshrun.rank.metrics.memory import FWD_BWD_END, STEP_START, MemoryMeter
from meshrun.rank.metrics.memory_snapshot import raised
from meshrun.rank.metrics.step_clock import StepClock

MIB = 2**20
CPU = torch.device("cpu")


@pytest.mark.parametrize("seed", range(5))
def test_percentile_matches_numpy_linear_interpolation(seed):
    rng = random.Random(seed)
    values = [rng.uniform(0.0, 10.0) for _ in range(rng.randint(1, 40))]
    for q in (0, 1, 10, 25, 50, 90, 99, 100, rng.uniform(0, 100)):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_of_one_value_is_that_value_and_order_does_not_matter():
    assert percentile([3.5], 90) == 3.5
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([4.0, 1.0, 3.0, 2.0], 100) == 4.0


def test_summarize_steps_arithmetic():
    times = [0.5, 1.0, 1.5, 2.0]  # 5 s in all
    summary = summarize_steps(times, tokens_per_step=1000, samples_per_step=8)
    assert summary["step_time_s"] == pytest.approx(1.25)
    assert summary["step_time_p10_s"] == pytest.approx(np.percentile(times, 10))
    assert summary["step_time_p90_s"] == pytest.approx(np.percentile(times, 90))
    assert summary["step_time_cv"] == pytest.approx(np.std(times) / np.mean(times))
    assert summary["tokens_per_s"] == pytest.approx(4 * 1000 / 5)
    assert summary["samples_per_s"] == pytest.approx(4 * 8 / 5)


def test_summarize_steps_uses_the_median_not_the_mean():
    times = [1.0, 1.0, 1.0, 10.0, 1.0]
    summary = summarize_steps(times, tokens_per_step=10, samples_per_step=1)
    assert summary["step_time_s"] == statistics.median(times) == 1.0
    assert summary["tokens_per_s"] == pytest.approx(5 * 10 / 14)


def test_step_clock_returns_one_span_per_step_between_marks():
    clock = StepClock(CPU)
    assert clock.drain() == []
    clock.mark()
    assert clock.drain() == []  # one mark, no step yet
    for pause in (0.02, 0.01, 0.03):
        time.sleep(pause)
        clock.mark()
    spans = clock.drain()
    assert len(spans) == 3
    assert spans[0] >= 0.02 and spans[1] >= 0.01 and spans[2] >= 0.03
    assert all(span < 1.0 for span in spans)


def test_step_clock_keeps_the_last_mark_as_the_next_start():
    clock = StepClock(CPU)
    clock.mark()
    time.sleep(0.01)
    clock.mark()
    assert len(clock.drain()) == 1
    assert clock.drain() == []  # the kept mark alone is no step
    time.sleep(0.03)  # time since the kept mark counts towards the next step
    clock.mark()
    (span,) = clock.drain()
    assert span >= 0.03


def test_step_clock_restart_leaves_what_ran_since_the_last_mark_out():
    clock = StepClock(CPU)
    clock.mark()
    time.sleep(0.2)  # an evaluation after a step: no step's time
    clock.restart()
    time.sleep(0.01)
    clock.mark()
    (span,) = clock.drain()
    assert 0.01 <= span < 0.15


def test_memory_meter_on_cpu_measures_a_known_allocation():
    meter = MemoryMeter([CPU])
    meter.start()
    tensor = torch.ones(64 * MIB // 4, dtype=torch.float32)
    meter.stop_tracing()
    assert tensor.nbytes == 64 * MIB
    peak = meter.peaks()[0]
    assert 64 * MIB <= peak < 72 * MIB


def test_memory_meter_on_cpu_does_not_double_count_freed_memory():
    meter = MemoryMeter([CPU])
    meter.start()
    first = torch.ones(32 * MIB // 4)
    del first
    second = torch.ones(32 * MIB // 4)
    meter.stop_tracing()
    peak = meter.peaks()[0]
    assert second.nbytes == 32 * MIB
    assert 32 * MIB <= peak < 48 * MIB


def test_memory_meter_peak_bytes_stops_tracing_itself_and_is_stable():
    meter = MemoryMeter([CPU])
    meter.start()
    tensor = torch.ones(16 * MIB // 4)
    peak = meter.peaks()[0]  # no stop_tracing() first
    later = torch.ones(16 * MIB // 4)  # after tracing ended: not counted
    assert 16 * MIB <= peak < 24 * MIB
    assert meter.peaks()[0] == peak
    del tensor, later


def test_memory_meter_on_cpu_sees_frees_on_other_threads():
    """A collective's work often drops the last reference to its tensors on a gloo worker
    thread; the profiler records only its own thread's events, so the meter must not rely
    on them alone."""
    meter = MemoryMeter([CPU])
    meter.start()
    held = [torch.ones(32 * MIB // 4)]
    worker = threading.Thread(target=held.clear)  # the last reference dies on that thread
    worker.start()
    worker.join()
    meter.mark(STEP_START)
    after = torch.ones(16 * MIB // 4)
    meter.mark(FWD_BWD_END)
    meter.stop_tracing()
    assert meter.steps[0].step_start is not None and meter.steps[0].step_start < 1 * MIB
    assert 32 * MIB <= meter.peaks()[0] < 40 * MIB
    del after


def test_memory_meter_without_the_c10_counter_warns_and_still_measures(monkeypatch):
    monkeypatch.setattr(memory_module, "_counter_flag", lambda: None)
    meter = MemoryMeter([CPU])
    with pytest.warns(UserWarning, match="process-wide counter was not found"):
        meter.start()
    tensor = torch.ones(16 * MIB // 4)
    assert 16 * MIB <= meter.peaks()[0] < 24 * MIB
    del tensor


class SimulatedAllocator:
    """CUDA's caching allocator's counters as torch.cuda reads them, on a host without one:
    reset_peak_memory_stats sets every peak of a device, reserved's too, to its current
    value (c10's DeviceCachingAllocator::resetPeakStats)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, n_devices: int) -> None:
        self.now = [(0, 0)] * n_devices  # (allocated, reserved)
        self.peak = [(0, 0)] * n_devices
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: self.now[d.index][0])
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: self.peak[d.index][0])
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: self.peak[d.index][1])
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self._reset)

    def _reset(self, device: torch.device) -> None:
        self.peak[device.index] = self.now[device.index]

    def hold(self, device: int, allocated: int, reserved: int) -> None:
        allocated_peak, reserved_peak = self.peak[device]
        self.now[device] = (allocated, reserved)
        self.peak[device] = (max(allocated, allocated_peak), max(reserved, reserved_peak))


def _cuda_meter(allocator: SimulatedAllocator) -> MemoryMeter:
    """Two warmup steps, the breakdown's marks in the second; the first device's cache given
    back (empty_cache, or an allocation retried after freeing it) between the two; a second
    device (DataParallel's replica) holds 300 in the second step's forward and backward."""
    replicas = range(1, len(allocator.now))
    meter = MemoryMeter([torch.device("cuda", i) for i in range(len(allocator.now))])
    meter.start()
    allocator.hold(0, 500, 900)  # step 0's peak
    allocator.hold(0, 100, 600)
    meter.mark(STEP_START)
    allocator.hold(0, 400, 600)
    for device in replicas:
        allocator.hold(device, 300, 400)
    meter.mark(FWD_BWD_END)
    allocator.hold(0, 100, 600)
    for device in replicas:
        allocator.hold(device, 0, 400)
    return meter


def test_the_reported_reserved_bytes_are_the_runs_peak_across_the_breakdowns_resets(monkeypatch):
    """Each breakdown mark resets torch's peak counters, reserved's with allocated's: the
    reserved peak before it was lost where the cache shrank since (900 MiB read as 600)."""
    allocator = SimulatedAllocator(monkeypatch, 1)
    meter = _cuda_meter(allocator)
    meter.hold()
    allocator.hold(0, 800, 1200)  # the baseline's, trained on the same device
    [split] = meter.breakdowns(memory_module.ModelState(50, 50, 0))
    assert (split["peak"], split["reserved"], split["activations"]) == (500, 900, 300)
    assert meter.peaks() == [500]


def test_dataparallel_reports_every_devices_peak_its_model_state_on_the_first(monkeypatch):
    meter = _cuda_meter(SimulatedAllocator(monkeypatch, 2))
    first, second = meter.breakdowns(memory_module.ModelState(50, 50, 0))
    assert (first["peak"], first["params"]) == (500, 50)
    assert (second["peak"], second["params"], second["activations"]) == (300, 0, 300)
    assert second["reserved"] == 400


def test_dataparallel_meters_each_of_its_devices():
    dataparallel = ParallelConfig(data_parallel="dataparallel", dataparallel_devices=3)
    cuda0 = torch.device("cuda", 0)
    assert metered_devices(cuda0, dataparallel) == [torch.device("cuda", i) for i in range(3)]
    assert metered_devices(cuda0, ParallelConfig()) == [cuda0]


def test_a_memory_snapshot_is_written_where_the_runs_own_peak_rose():
    """The baseline's steps on rank 0's device raise torch's counter, not the run's held peaks;
    a DataParallel device whose peak rose alone counts."""
    peaks = RunPeaks(2)
    peaks.fold([Reading(0, 500, 600), Reading(0, 200, 300)])
    written = tuple(peaks.allocated)
    peaks.hold()
    peaks.fold([Reading(0, 900, 1000), Reading(0, 200, 300)])  # the baseline's step
    assert not raised(peaks.allocated, written)
    assert raised([500, 250], written)
    assert raised([1], ())
