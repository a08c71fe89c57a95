"""Step timing, throughput summaries and CPU peak-memory tracing."""

from __future__ import annotations

import random
import statistics
import threading
import time

import numpy as np
import pytest
import torch

from meshrun.core.step_stats import percentile, summarize_steps
from meshrun.rank.metrics import memory as memory_module
from meshrun.rank.metrics.memory import FWD_BWD_END, STEP_START, MemoryMeter
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
    meter = MemoryMeter(CPU)
    meter.start()
    tensor = torch.ones(64 * MIB // 4, dtype=torch.float32)
    meter.stop_tracing()
    assert tensor.nbytes == 64 * MIB
    peak = meter.peak_bytes()
    assert 64 * MIB <= peak < 72 * MIB


def test_memory_meter_on_cpu_does_not_double_count_freed_memory():
    meter = MemoryMeter(CPU)
    meter.start()
    first = torch.ones(32 * MIB // 4)
    del first
    second = torch.ones(32 * MIB // 4)
    meter.stop_tracing()
    peak = meter.peak_bytes()
    assert second.nbytes == 32 * MIB
    assert 32 * MIB <= peak < 48 * MIB


def test_memory_meter_peak_bytes_stops_tracing_itself_and_is_stable():
    meter = MemoryMeter(CPU)
    meter.start()
    tensor = torch.ones(16 * MIB // 4)
    peak = meter.peak_bytes()  # no stop_tracing() first
    later = torch.ones(16 * MIB // 4)  # after tracing ended: not counted
    assert 16 * MIB <= peak < 24 * MIB
    assert meter.peak_bytes() == peak
    del tensor, later


def test_memory_meter_on_cpu_sees_frees_on_other_threads():
    """A collective's work often drops the last reference to its tensors on a gloo worker
    thread; the profiler records only its own thread's events, so the meter must not rely
    on them alone."""
    meter = MemoryMeter(CPU)
    meter.start()
    held = [torch.ones(32 * MIB // 4)]
    worker = threading.Thread(target=held.clear)  # the last reference dies on that thread
    worker.start()
    worker.join()
    meter.mark(STEP_START)
    after = torch.ones(16 * MIB // 4)
    meter.mark(FWD_BWD_END)
    meter.stop_tracing()
    assert meter.step_start is not None and meter.step_start < 1 * MIB
    assert 32 * MIB <= meter.peak_bytes() < 40 * MIB
    del after


def test_memory_meter_without_the_c10_counter_warns_and_still_measures(monkeypatch):
    monkeypatch.setattr(memory_module, "_counter_flag", lambda: None)
    meter = MemoryMeter(CPU)
    with pytest.warns(UserWarning, match="process-wide counter was not found"):
        meter.start()
    tensor = torch.ones(16 * MIB // 4)
    assert 16 * MIB <= meter.peak_bytes() < 24 * MIB
    del tensor
