"""Rank order: the one place that knows which rank sits where, from a resolved config, with
no torch.

Ranks are laid out row-major over (pp, dp_replicate, dp_shard, cp, tp): tensor-parallel peers
are adjacent ranks (same node, fastest links), then a sequence's context-parallel group
(Megatron's tp-cp-dp-pp order), pipeline stages the outermost dimension. This is also
init_device_mesh's order, so `rank_coords` (pure, for the driver and tests) and the
DeviceMesh a worker builds (rank/mesh.py) always agree.

`DIMENSIONS` is the one table of mesh dimensions: their order, each one's key, the settings
a preset fixes with it and what a step communicates over it; the mesh, the degree rules
(validate/layout.py), the watchdog and the planner's preset keys read it. What a new degree
still touches beyond it: docs/architecture.md's checklist.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from meshrun.core.config import ParallelConfig


@dataclass(frozen=True)
class Dimension:
    """A mesh dimension: `name` is its key (`parallel.<name>`, the DeviceMesh dim's name),
    `settings` the parallel keys a preset fixes with its degree (conf/parallel), and
    `collectives` what a step's forward/backward communicates over it (the watchdog's words
    for a collective that hangs)."""

    name: str
    collectives: str
    settings: tuple[str, ...] = ()


# Row-major order, outermost first.
DIMENSIONS = (
    Dimension("pp", "pipeline send/recv", ("schedule", "stages_per_rank")),
    Dimension("dp_replicate", "gradient all_reduce"),
    Dimension("dp_shard", "FSDP all_gather/reduce_scatter"),
    Dimension("cp", "context-parallel attention, FSDP over its ranks", ("cp_method",)),
    Dimension("tp", "tensor-parallel collectives"),
)
MESH_DIMS = tuple(dim.name for dim in DIMENSIONS)


@dataclass(frozen=True)
class Layout:
    """Resolved degrees of each mesh dimension (all >= 1)."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # not a mesh dim: drawn from dp_shard x cp (rank/mesh.py's expert mesh)
    etp: int = 1  # the experts' TP: 1 or tp
    fsdp_offload: bool = False  # parallel.fsdp.offload=cpu: FSDP2 holds the state, one rank or more

    @property
    def world_size(self) -> int:
        return math.prod(self.degrees().values())

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def uses_fsdp(self) -> bool:
        """Data parallelism through FSDP2: sharded (over dp_shard x cp: CP ranks hold the same
        parameters), or replicated beside TP/PP (where DDP cannot hold DTensor parameters);
        and wherever its CPUOffloadPolicy keeps the state in host memory, on one rank too
        (ZeRO-Offload's single-GPU case: a shard of 1)."""
        return self._fsdp_data_parallel or self.fsdp_offload

    @property
    def uses_ddp(self) -> bool:
        """Replicas that DDP keeps in step: data parallelism FSDP2 does not take."""
        return self.dp_size > 1 and not self._fsdp_data_parallel

    @property
    def _fsdp_data_parallel(self) -> bool:
        return self.shard_size > 1 or (self.dp_size > 1 and (self.tp > 1 or self.pp > 1))

    @property
    def has_mesh(self) -> bool:
        """Whether a rank builds process groups and a DeviceMesh: more than one rank, or FSDP2
        on one (its 1-rank mesh)."""
        return self.world_size > 1 or self.uses_fsdp

    @property
    def shard_size(self) -> int:
        """The ranks FSDP2 shards parameters over: data-parallel shards and their CP peers
        (torchtitan's dp_shard_cp), whose gradients it averages."""
        return self.dp_shard * self.cp

    @property
    def splits_experts(self) -> bool:
        """Whether the experts are laid out on their own mesh (rank/mesh.py): split over ep
        ranks, or over the TP ranks."""
        return self.ep > 1 or self.etp > 1

    @property
    def expert_shard_size(self) -> int:
        """The ranks FSDP2 shards each rank's experts over: what ep leaves of dp_shard x cp."""
        return self.shard_size // self.ep

    @classmethod
    def of(cls, parallel: ParallelConfig) -> Layout:
        """The layout of a resolved parallel config (no -1 degrees left)."""
        offload = parallel.fsdp.offload == "cpu"
        return cls(
            **config_degrees(parallel), ep=parallel.ep, etp=parallel.etp, fsdp_offload=offload
        )

    def degrees(self) -> dict[str, int]:
        return {dim: getattr(self, dim) for dim in MESH_DIMS}

    def describe(self) -> str:
        """The non-trivial degrees, e.g. 'dp_shard2 x tp2' (for messages about degrees; a
        run's name is `layout_name`)."""
        parts = [f"{dim}{n}" for dim, n in self.degrees().items() if n > 1]
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.etp > 1:
            parts.append(f"etp{self.etp}")
        return " x ".join(parts) or "single"


def keeps_whole_replicas(parallel: ParallelConfig) -> bool:
    """DDP or DataParallel: each replica whole on its device, which FSDP2's offload cannot take
    off it (validate/offload.py refuses it, plan/levers.py does not try it)."""
    return parallel.data_parallel == "dataparallel" or Layout.of(parallel).uses_ddp


def config_degrees(parallel: ParallelConfig) -> dict[str, int]:
    """Each mesh dimension's degree as the config gives it (-1: the rest, until resolved)."""
    return {dim: getattr(parallel, dim) for dim in MESH_DIMS}


def rank_coords(layout: Layout, rank: int) -> dict[str, int]:
    """Coordinate of `rank` along each mesh dim (row-major, tp fastest)."""
    coords = {}
    for dim in reversed(MESH_DIMS):
        size = getattr(layout, dim)
        coords[dim] = rank % size
        rank //= size
    return {dim: coords[dim] for dim in MESH_DIMS}


def dp_rank(layout: Layout, rank: int) -> int:
    """Index among data-parallel peers: TP, CP and PP peers share it (and thus their data;
    CP peers each take their part of its sequences)."""
    coords = rank_coords(layout, rank)
    return coords["dp_replicate"] * layout.dp_shard + coords["dp_shard"]


def cp_rank(layout: Layout, rank: int) -> int:
    """Index in its context-parallel group: which part of each sequence the rank holds."""
    return rank_coords(layout, rank)["cp"]


def dataparallel_devices(p: ParallelConfig, n_gpus: int) -> int:
    """torch.nn.DataParallel's devices: the given number, or (-1) every visible one."""
    return n_gpus if p.dataparallel_devices == -1 else p.dataparallel_devices
