"""Seconds of one collective on a process group, from where its ranks sit (plan/placement.py)
and the hardware profile's links, in the terms of NCCL's own cost model (src/graph/tuning.cc:
a latency per algorithm step, a bus bandwidth) and of nccl-tests (busbw = algbw x 2(n-1)/n
for all-reduce, (n-1)/n for all-gather and reduce-scatter).

    bandwidth   inside a node, the device's link (NVLink, PCIe) at 0.8 of its datasheet rate
                per direction (nccl-tests all_reduce busbw on 8 x A100 SXM: ~230 of NVLink 3's
                300 GB/s); a group spanning nodes is a ring whose node-to-node hops each ride
                a NIC: with r of its ranks on a node (and the node's other groups talking at
                the same time, each rail its own), its bus bandwidth is r x the node's NIC
                bandwidth / devices per node at 0.9 of the line rate, and never more than the
                link inside the node. TP of 8 on DGX A100: NVLink; a DP group of one rank a
                node: one HDR NIC, 25 GB/s.
    latency     ring all-reduce takes 2(n-1) steps, all-gather and reduce-scatter n-1, of
                which those leaving a node cost the network's per-hop latency; across nodes
                NCCL's tree all-reduce takes 2((r-1) + log2(nodes)) steps, and NCCL picks
                the faster.
    p2p         a pipeline send: one hop, over the device's own link or its NIC share.

On CPU (gloo) the profile's link figure is the measured bus bandwidth already. A calibrated
host (`meshrun-plan calibrate`) has each collective's own measured bus bandwidth inside the
node: gloo's reduce-scatter is an all-reduce of the whole buffer with a slice kept (2x a
ring's traffic, pytorch/pytorch#118911) and its all-gather gathers a list then copies, so
on a CPU host they run well under the all-reduce's rate. Where the profile holds each
collective's bus bandwidth at every size it measured (4 KiB to 16 MiB), a collective inside
the node takes its time from that curve at its own size (log-log between the sizes measured,
the smallest one's time below them, the largest one's bandwidth above): gloo's time at a TP
block's few hundred KiB is 1.6-2x what a latency and the 16 MiB bandwidth add up to.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

from meshrun.core.calibration import Calibration
from meshrun.core.config import ExperimentConfig
from meshrun.plan.placement import GroupSpan, devices_per_node

GB = 1e9
NVLINK_EFFICIENCY = 0.8  # nccl-tests all_reduce busbw / datasheet rate per direction
NETWORK_EFFICIENCY = 0.9  # of the NICs' line rate (InfiniBand, RoCE; NCCL's net transport)


@dataclass(frozen=True)
class Fabric:
    """The links of a plan in bytes/s and seconds: per device inside a node, and each
    device's share of its node's NICs (None: no network, the node's link stands in)."""

    intra_bw: float
    intra_latency: float
    nic_bw: float | None
    net_latency: float
    devices_per_node: int
    measured_bw: dict[str, float] = field(default_factory=dict)  # a collective's, in-node
    # a collective's in-node bus bandwidth by size: ((bytes, bytes/s), ...), smallest first
    curves: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, cfg: ExperimentConfig, calibration: Calibration | None = None) -> Fabric:
        """The profile's links; a calibrated host's measured one inside the node."""
        hw = cfg.hardware
        gpu = hw.device_type == "cuda"
        intra = (hw.intra_node.bw_gbs or 1.0) * GB * (NVLINK_EFFICIENCY if gpu else 1.0)
        latency = hw.intra_node.latency_us * 1e-6
        measured: dict[str, float] = {}
        curves: dict[str, tuple[tuple[float, float], ...]] = {}
        if calibration is not None and calibration.link_bw_gbs:
            intra = calibration.link_bw_gbs * GB
            latency = (calibration.link_latency_us or 0.0) * 1e-6
            measured = {op: bw * GB for op, bw in calibration.link_bw_by_op.items()}
            curves = {
                op: tuple((size, bw * GB) for size, bw in curve)
                for op, curve in calibration.link_curves.items()
                if curve
            }
        net = hw.network
        per_node = devices_per_node(cfg)
        nic = (
            net.nics * net.nic_gbps / 8 * GB * NETWORK_EFFICIENCY / per_node
            if net.nic_gbps
            else None
        )
        return cls(intra, latency, nic, net.latency_us * 1e-6, per_node, measured, curves)

    def bus_bw(self, span: GroupSpan, op: str = "all_reduce") -> float:
        """A collective's bus bandwidth on a group: the node's link (`op`'s own where it
        was measured), or the NICs' share where the group leaves the node."""
        intra = self.measured_bw.get(op, self.intra_bw)
        if span.crosses_nodes and self.nic_bw:
            return min(intra, span.ranks_per_node * self.nic_bw)
        return intra

    def _ring_latency(self, span: GroupSpan, steps_per_rank: int) -> float:
        n = span.ranks_per_node * span.nodes
        out = span.nodes if span.crosses_nodes else 0
        return steps_per_rank * ((n - out) * self.intra_latency + out * self.net_latency)

    def _measured(self, span: GroupSpan, op: str, nbytes: float, traffic: float) -> float | None:
        """Seconds of `op` by its measured curve (module docstring), `traffic` the share of
        `nbytes` its bus bandwidth counts; None where there is no curve or the group
        leaves the node."""
        curve = self.curves.get(op)
        if not curve or span.crosses_nodes:
            return None
        if nbytes <= 0:
            return 0.0
        sizes = [size for size, _ in curve]
        if nbytes <= sizes[0]:
            return traffic * sizes[0] / curve[0][1]
        if nbytes >= sizes[-1]:
            return traffic * nbytes / curve[-1][1]
        i = bisect.bisect_right(sizes, nbytes)
        (s0, b0), (s1, b1) = curve[i - 1], curve[i]
        t = math.log(nbytes / s0) / math.log(s1 / s0)
        return traffic * nbytes / math.exp(math.log(b0) + t * math.log(b1 / b0))

    def all_reduce(self, span: GroupSpan, nbytes: float) -> float:
        n = span.ranks_per_node * span.nodes
        if n == 1:
            return 0.0
        measured = self._measured(span, "all_reduce", nbytes, 2 * (n - 1) / n)
        if measured is not None:
            return measured
        latency = self._ring_latency(span, 2) - 2 * self.intra_latency
        if span.crosses_nodes:
            tree = 2 * (
                (span.ranks_per_node - 1) * self.intra_latency
                + math.ceil(math.log2(span.nodes)) * self.net_latency
            )
            latency = min(latency, tree)
        return latency + 2 * (n - 1) / n * nbytes / self.bus_bw(span)

    def all_gather(self, span: GroupSpan, nbytes: float, op: str = "all_gather") -> float:
        """All-gather into a buffer of `nbytes` on each rank (`op`: another collective of
        the same ring traffic, costed at its own measured bandwidth)."""
        n = span.ranks_per_node * span.nodes
        if n == 1:
            return 0.0
        measured = self._measured(span, op, nbytes, (n - 1) / n)
        if measured is not None:
            return measured
        latency = self._ring_latency(span, 1) - self.intra_latency
        return latency + (n - 1) / n * nbytes / self.bus_bw(span, op)

    def reduce_scatter(self, span: GroupSpan, nbytes: float) -> float:
        """Reduce-scatter from a buffer of `nbytes` on each rank."""
        return self.all_gather(span, nbytes, "reduce_scatter")

    def send(self, crosses_nodes: bool, nbytes: float) -> float:
        """One rank's point-to-point transfer, its peer in the next pipeline stage."""
        if crosses_nodes and self.nic_bw:
            return self.net_latency + nbytes / self.nic_bw
        return self.intra_latency + nbytes / self.intra_bw


def overlapped(comm: float, compute: float, chunks: int) -> float:
    """What `chunks` equal collectives on one stream leave exposed beside `chunks` equal
    compute pieces they overlap (each waiting for its piece, or the piece for it): the first
    or last chunk's collective at least, all that exceeds the compute otherwise. DDP's buckets
    after backward, FSDP2's prefetched all-gathers before each block."""
    if chunks < 1 or comm <= 0:
        return max(comm, 0.0)
    return max(comm / chunks, comm - compute * (1 - 1 / chunks))
