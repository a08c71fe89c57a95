"""Which links a process group's traffic crosses, from meshrun's rank order alone (O(1) in the
world size): ranks are laid out row-major over core/layout.MESH_DIMS (pp, dp_replicate,
dp_shard, tp), tp innermost, and ranks fill nodes in order (node = rank // devices per node,
as torchrun and SLURM number them). A group of dim d is `degree(d)` ranks `stride` apart,
stride being the product of the degrees inside d: TP peers are adjacent ranks, pipeline
stages the farthest apart. Which device a rank runs on follows too: rank r on its node's
device r % devices per node, in the profile's (PCI bus) order."""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshrun.core.config import DeviceSpec, ExperimentConfig
from meshrun.core.layout import MESH_DIMS, Layout


@dataclass(frozen=True)
class GroupSpan:
    """One group of a mesh dim: how many of its ranks share a node, and how many nodes it
    touches."""

    ranks_per_node: int
    nodes: int

    @property
    def crosses_nodes(self) -> bool:
        return self.nodes > 1


def group_span(layout: Layout, dim: str, devices_per_node: int) -> GroupSpan:
    """The worst group of `dim` (the one touching most nodes, with fewest ranks on one)."""
    size = getattr(layout, dim)
    stride = math.prod(getattr(layout, d) for d in MESH_DIMS[MESH_DIMS.index(dim) + 1 :])
    return span_of(size, stride, devices_per_node)


def expert_spans(layout: Layout, devices_per_node: int) -> tuple[GroupSpan, GroupSpan]:
    """(an ep group, an expert_shard group) of rank/mesh.py's expert mesh: dp_shard x cp
    split into (expert_shard, ep), ep innermost, so ep peers are tp apart and expert_shard
    peers ep x tp apart."""
    return (
        span_of(layout.ep, layout.tp, devices_per_node),
        span_of(layout.expert_shard_size, layout.ep * layout.tp, devices_per_node),
    )


def span_of(size: int, stride: int, devices_per_node: int) -> GroupSpan:
    """The worst of the groups of `size` ranks `stride` apart."""
    extent = size * stride  # ranks from a group's first member to past its last
    if size == 1 or devices_per_node % extent == 0:
        return GroupSpan(size, 1)
    if stride >= devices_per_node:  # consecutive members a node or more apart
        return GroupSpan(1, size)
    # Node boundaries cut the group into runs of gcd(devices per node, extent) ranks at
    # least: exact when one divides the other (powers of two, as on every GPU node).
    per_node = max(1, math.gcd(devices_per_node, extent) // stride)
    return GroupSpan(per_node, math.ceil(size / per_node))


def devices_per_node(cfg: ExperimentConfig) -> int:
    return cfg.launcher.nproc_per_node or sum(d.count for d in cfg.hardware.devices)


def stage_devices(cfg: ExperimentConfig, layout: Layout, pp_rank: int) -> list[DeviceSpec]:
    """The distinct device kinds a pipeline stage's ranks run on: O(device kinds). A stage
    of a node's worth of ranks or more holds every kind."""
    per_node = devices_per_node(cfg)
    ranks = layout.world_size // layout.pp
    start = pp_rank * ranks % per_node
    spans = [(0, per_node)] if ranks >= per_node else [(start, min(start + ranks, per_node))]
    if start + ranks > per_node and ranks < per_node:
        spans.append((0, start + ranks - per_node))
    kinds, first = [], 0
    for spec in cfg.hardware.devices:
        if any(a < first + spec.count and first < b for a, b in spans):
            kinds.append(spec)
        first += spec.count
    return kinds
