"""What the offloads cost a step on a GPU (plan/speed.py adds it; a CPU moves nothing).

- parallel.fsdp.offload: each FSDP2 unit's sharded parameters (fp32) copied to the device for
  every all-gather (forward, and backward again where it reshards after forward; once a step
  under a pipeline, which keeps the stage gathered) and its sharded gradients (fp32) back
  after every reduce-scatter, at the device's `host_link_gbs`. FSDP2 issues them on its
  all-gather and reduce-scatter streams, ahead of the compute as its collectives: only what
  the step's compute does not cover is exposed. The optimizer steps on the host instead of
  the device: AdamW's 28 bytes a held parameter at HOST_ADAMW_GBS.
- parallel.activation_offload: each micro-batch's offloaded activations (plan/memory.py's,
  the difference the hooks make to a micro-batch's) copied out in forward and back in
  backward. torch's `save_on_cpu` and meshrun's hooks copy on the compute stream: all of it
  is exposed.
"""

from __future__ import annotations

from meshrun.core.config import DeviceSpec, ExperimentConfig
from meshrun.core.layout import Layout
from meshrun.plan.compute import ADAMW_BYTES
from meshrun.plan.memory import (
    activation_bytes,
    offloads_activations,
    offloads_state,
    without_offload,
)
from meshrun.plan.shapes import StageShare

# AdamW on the host, bytes a second a rank: meshrun's fused CPU AdamW stepped model=small's
# 7.5M parameters in 6.5 ms on one thread here (benchmarks/optimizer_step.py: 32 GB/s);
# a server's ~200 GB/s of DRAM a socket shared by its ranks leaves each about this.
HOST_ADAMW_GBS = 25.0


def host_parts(
    cfg: ExperimentConfig,
    layout: Layout,
    share: StageShare,
    micro: int,
    m: int,
    rank_elements: int,
    compute_s: float,
    spec: DeviceSpec,
) -> dict[str, float]:
    """Seconds a step: `host_copies` (exposed), and `optimizer` where it runs on the host;
    none where the profile gives no `host_link_gbs` for the device."""
    if spec.host_link_gbs is None or not (offloads_state(cfg) or offloads_activations(cfg)):
        return {}
    link = spec.host_link_gbs * 1e9
    parts: dict[str, float] = {}
    copies = 0.0
    if offloads_state(cfg):
        sharded = rank_elements / layout.shard_size
        unsharded_steps = 1 if layout.pp > 1 else m
        gathers = 2 if cfg.parallel.fsdp.reshard_after_forward and layout.pp == 1 else 1
        moved = unsharded_steps * (gathers + 1) * sharded * 4
        copies += max(0.0, moved / link - compute_s)
        parts["optimizer"] = sharded * ADAMW_BYTES / (HOST_ADAMW_GBS * 1e9)
    if offloads_activations(cfg):
        kept = activation_bytes(without_offload(cfg), layout, share, 0, 1, micro)
        offloaded = kept - activation_bytes(cfg, layout, share, 0, 1, micro)
        copies += m * 2 * offloaded / link
    parts["host_copies"] = copies
    return parts
