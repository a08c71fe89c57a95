"""The profiled steps' traces (rank/profiling.py): where they are, and what each rank's says
of its steps. Time inside the profiled steps (meshrun's `step N` ranges) is split into:

- compute: on CUDA the kernels that are not NCCL's; on CPU the operators the rank's main
  thread runs (torch's cpu_op events on the thread that ran the step), less the time it
  blocks on a collective (c10d's calls; DTensor's `_c10d_functional::wait_tensor`, often
  inside the operator that redistributes);
- communication: collectives in flight, from their start to their completion (gloo's
  `gloo:<op>` ranges, NCCL's kernels); what of it runs during compute is `overlapped`;
- idle: neither (the rank waits for data, the host, or a peer with nothing in flight).

A posted receive is in flight until its data came: a pipeline's bubble is the time its
ranks wait with receives in flight, shown as exposed communication. The timeline keeps the
last profiled step of each rank, on the host's clock, so ranks line up."""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

PROFILE_DIR = "profile"
TIMELINE_FILE = "timeline.png"  # the traced step drawn (driver/sinks/timeline.py)
PHASE = "meshrun:"
STEP_PHASE = f"{PHASE}step "
MICRO_BATCH = re.compile(rf"^{PHASE}(forward|backward)(?: \(weights\))?(?: stage (\d+))? mb (\d+)$")
COMM = re.compile(r"^(gloo|nccl):|^ncclDevKernel|^ncclKernel")
WAIT = re.compile(r"^c10d::|^_c10d_functional::wait_tensor$")  # a CPU rank blocked on a link
TOP_OPS = 8
TIMELINE_INTERVALS = 400  # per kind and rank; closer intervals are merged to stay under it

Interval = tuple[float, float]


def trace_path(run_dir: str, rank: int) -> Path:
    return Path(run_dir) / PROFILE_DIR / f"rank{rank}.trace.json.gz"


def read_trace(path: Path) -> dict[str, Any]:
    with gzip.open(path, "rt") as f:
        return json.load(f)


@dataclass(frozen=True)
class RankProfile:
    """One rank's profiled steps: seconds of each kind, summed over the steps."""

    rank: int
    steps: int
    step_s: float
    compute_s: float
    comm_s: float
    overlapped_s: float  # of comm_s, during compute
    idle_s: float
    top_ops: list[tuple[str, float]]  # by self time, seconds
    timeline: dict[str, list]  # the last step: compute, comm, micro_batches; ms from its start

    @property
    def exposed_comm_s(self) -> float:
        return self.comm_s - self.overlapped_s

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "exposed_comm_s": self.exposed_comm_s}


def summarize(trace: dict[str, Any], rank: int) -> RankProfile | None:
    """None where the trace holds no meshrun step (the rank failed before one)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if e["name"].startswith(STEP_PHASE)]
    if not steps:
        return None
    main = steps[0]["tid"]
    base_us = trace.get("baseTimeNanoseconds", 0) / 1e3
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in steps]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    waits: list[Interval] = []
    ops: list[dict[str, Any]] = []  # the CPU's: the waits their own rows in the top ops
    if kernels:  # CUDA: the device's timeline
        compute_events = [e for e in kernels if not COMM.match(e["name"])]
        comm_events = [e for e in kernels if COMM.match(e["name"])]
        gpu_steps = [e for e in events if e.get("cat") == "gpu_user_annotation"]
        gpu_windows = [
            (e["ts"], e["ts"] + e["dur"]) for e in gpu_steps if e["name"].startswith(STEP_PHASE)
        ]
        windows = gpu_windows or windows
    else:
        ops = [e for e in events if e.get("cat") == "cpu_op" and e["tid"] == main]
        compute_events = [e for e in ops if not WAIT.match(e["name"])]
        waits = _union(_spans([e for e in ops if WAIT.match(e["name"])]))
        comm_events = [e for e in events if COMM.match(e["name"])]
    compute = _clip(_subtract(_union(_spans(compute_events)), waits), windows)
    comm = _clip(_union(_spans(comm_events)), windows)
    busy = _union(compute + comm)
    total = _length(windows)
    last = max(windows)
    return RankProfile(
        rank=rank,
        steps=len(windows),
        step_s=total / 1e6,
        compute_s=_length(compute) / 1e6,
        comm_s=_length(comm) / 1e6,
        overlapped_s=_length(_intersect(compute, comm)) / 1e6,
        idle_s=(total - _length(busy)) / 1e6,
        top_ops=_top_ops(kernels or ops),
        timeline={
            "start_ms": (base_us + last[0]) / 1e3,
            "length_ms": (last[1] - last[0]) / 1e3,
            "compute": _relative(_clip(compute, [last]), last[0]),
            "comm": _relative(_clip(comm, [last]), last[0]),
            "micro_batches": _micro_batches(events, main, last),
        },
    )


def summarize_run(run_dir: str, world_size: int) -> list[RankProfile]:
    """Every rank's that left a trace, in rank order."""
    profiles = []
    for rank in range(world_size):
        path = trace_path(run_dir, rank)
        if path.exists() and (profile := summarize(read_trace(path), rank)) is not None:
            profiles.append(profile)
    return profiles


def _spans(events: list[dict[str, Any]]) -> list[Interval]:
    return [(e["ts"], e["ts"] + e["dur"]) for e in events]


def _union(spans: list[Interval]) -> list[Interval]:
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Both lists disjoint and sorted."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """What of `a` lies outside `b` (both disjoint and sorted)."""
    out, j = [], 0
    for begin, end in a:
        while j < len(b) and b[j][1] <= begin:
            j += 1
        at, k = begin, j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > at:
                out.append((at, b[k][0]))
            at = max(at, b[k][1])
            k += 1
        if at < end:
            out.append((at, end))
    return out


def _clip(spans: list[Interval], windows: list[Interval]) -> list[Interval]:
    return _intersect(spans, _union(windows))


def _length(spans: list[Interval]) -> float:
    return sum(b - a for a, b in spans)


def _top_ops(events: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """Self time by name (an operator's time less that of the operators it called)."""
    by_thread: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        by_thread[e["tid"]].append(e)
    own: dict[str, float] = defaultdict(float)
    for thread in by_thread.values():
        stack: list[tuple[float, str]] = []  # (end, name) of the enclosing operators
        for e in sorted(thread, key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1][0] <= e["ts"]:
                stack.pop()
            own[e["name"]] += e["dur"]
            if stack:
                own[stack[-1][1]] -= e["dur"]
            stack.append((e["ts"] + e["dur"], e["name"]))
    ranked = sorted(own.items(), key=lambda item: -item[1])[:TOP_OPS]
    return [(name, round(us / 1e6, 6)) for name, us in ranked]


def _relative(spans: list[Interval], start: float) -> list[list[float]]:
    """ms from the step's start, neighbours merged until few enough to draw."""
    gap = 0.0
    while True:
        merged = _union([(a - gap / 2, b + gap / 2) for a, b in spans])
        if len(merged) <= TIMELINE_INTERVALS:
            break
        gap = max(gap * 2, 1.0)
    return [[round((a - start) / 1e3, 3), round((b - start) / 1e3, 3)] for a, b in merged]


def _micro_batches(events: list[dict[str, Any]], main: Any, step: Interval) -> list[list[Any]]:
    """[start ms, end ms, "F3" or "B3" (stage S: "F3 s1")] of each micro-batch in the step."""
    boxes = []
    for e in events:
        found = MICRO_BATCH.match(e["name"])
        if not found or e["tid"] != main or not step[0] <= e["ts"] < step[1]:
            continue
        kind, stage, index = found.groups()
        label = f"{kind[0].upper()}{index}" + (f" s{stage}" if stage is not None else "")
        start = e["ts"] - step[0]
        boxes.append([round(start / 1e3, 3), round((start + e["dur"]) / 1e3, 3), label])
    return sorted(boxes)
