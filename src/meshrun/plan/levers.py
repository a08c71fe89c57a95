"""Issue 63's memory levers, which the search tries where a layout does not fit without them
(plan/search.py): lighter optimizer states, and on a GPU the blocks' activations and FSDP2's
state in host memory."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from meshrun.core.config import ExperimentConfig
from meshrun.core.layout import keeps_whole_replicas

# The memory levers tried where a layout does not fit without them: (key, value) pairs a
# variant sets, cheapest in speed first (plan/host_time.py costs the host's part).
LEVERS: tuple[tuple[tuple[str, str], ...], ...] = (
    (("train.optimizer_states", "bf16"),),
    (("train.optimizer_states", "8bit"),),
    (("parallel.activation_offload", "cpu"),),
    (("parallel.fsdp.offload", "cpu"),),
    (("parallel.fsdp.offload", "cpu"), ("parallel.activation_offload", "cpu")),
    (("train.optimizer_states", "8bit"), ("parallel.activation_offload", "cpu")),
)
# The two that save the most: every other lever's saving is within one of theirs (8-bit states
# are the lightest; FSDP2's offload takes the states off the device whatever their width).
# Where neither fits a layout at its leanest, no lever does (plan/search.best_variant).
STRONGEST = LEVERS[-2:]


def lever_configs(
    cfg: ExperimentConfig, fixed: frozenset[str]
) -> Iterator[tuple[tuple[tuple[str, str], ...], ExperimentConfig]]:
    """(lever, `cfg` with it) for each of LEVERS the user left to the planner: the offloads
    on a GPU only (a CPU's host memory is its device's), FSDP2's where no DDP or
    DataParallel replicates."""
    fsdp = not keeps_whole_replicas(cfg.parallel)
    gpu = cfg.hardware.device_type == "cuda"
    for lever in LEVERS:
        keys = {key for key, _ in lever}
        offloads = {k for k in keys if "offload" in k}
        if keys & fixed or (offloads and not gpu) or ("parallel.fsdp.offload" in keys and not fsdp):
            continue
        changed = cfg
        for key, value in lever:
            changed = with_key(changed, key, value)
        yield lever, changed


def with_key(cfg: ExperimentConfig, key: str, value: str) -> ExperimentConfig:
    """`cfg` with a dotted key (parallel.fsdp.offload) set."""
    head, _, rest = key.partition(".")
    node = getattr(cfg, head)
    if "." in rest:
        inner, _, leaf = rest.partition(".")
        node = dataclasses.replace(
            node, **{inner: dataclasses.replace(getattr(node, inner), **{leaf: value})}
        )
    else:
        node = dataclasses.replace(node, **{rest: value})
    return dataclasses.replace(cfg, **{head: node})
