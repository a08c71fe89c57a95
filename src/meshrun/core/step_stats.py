"""A run's step times summarized for its record: median, spread and throughput; the
percentile the record's other spreads (the speedup's over the alternating rounds) use too."""

from __future__ import annotations

import statistics


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize_steps(step_times: list[float], tokens_per_step: int, samples_per_step: int) -> dict:
    """Median and spread (p10, p90, coefficient of variation) of the step times; throughput
    over their sum."""
    total = sum(step_times)
    mean = total / len(step_times)
    return {
        "step_time_s": statistics.median(step_times),
        "step_time_p10_s": percentile(step_times, 10),
        "step_time_p90_s": percentile(step_times, 90),
        "step_time_cv": statistics.pstdev(step_times) / mean if mean else None,
        "tokens_per_s": tokens_per_step * len(step_times) / total,
        "samples_per_s": samples_per_step * len(step_times) / total,
    }


def slowest(values: list[float]) -> tuple[int, float]:
    """The index of the largest value and the median of the others (with two, the other):
    the slow rank against the ranks it keeps waiting."""
    index = max(range(len(values)), key=values.__getitem__)
    others = values[:index] + values[index + 1 :]
    return index, statistics.median(others) if others else values[index]
