"""What the offloads keep in a node's host memory, against what the node has.

parallel.fsdp.offload and parallel.activation_offload move bytes from a GPU to its node's
host memory (plan/memory.py takes them off the device's prediction): a rank's host bytes are
its prediction without the offloads less its prediction with them. A node's are its ranks'
sum, taken as its ranks per node times the most any stage's rank holds (ranks fill nodes in
pipeline order, so a node's ranks are mostly of one stage). They must fit the node's
`host_memory_gib` (the hardware profile's, cited there) less `plan.headroom_gib`, the
operating system's and the data loaders' room; a profile without the figure is not checked.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshrun.core.config import ExperimentConfig
from meshrun.core.layout import Layout
from meshrun.plan import predict
from meshrun.plan.memory import offloads_activations, offloads_state, without_offload

GiB = 2**30


@dataclass(frozen=True)
class HostUse:
    """A node's offloaded bytes, and what its host memory leaves for them (None: unknown)."""

    per_node: int
    capacity: int | None

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.per_node <= self.capacity


def host_use(cfg: ExperimentConfig, on_device: list) -> HostUse | None:
    """`on_device`: the run's per-stage predictions (predict.stage_memory); None where
    nothing is offloaded."""
    if not (offloads_state(cfg) or offloads_activations(cfg)):
        return None
    whole = predict.stage_memory(without_offload(cfg))
    per_rank = max(w.peak - m.peak for w, m in zip(whole, on_device, strict=True))
    per_node = Layout.of(cfg.parallel).world_size // cfg.launcher.nnodes
    gib = cfg.hardware.host_memory_gib
    capacity = None if gib is None else int((gib - cfg.plan.headroom_gib) * GiB)
    return HostUse(per_rank * per_node, capacity)
