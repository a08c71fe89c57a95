"""The settings an experiment leaves to the box it runs on, resolved once (where its -1
degree is filled, or before parallel=auto's search): the global batch (null: derived from
the data-parallel size, so the default experiment runs on any number of ranks) and the
precision (auto: bf16 on GPUs that have it), and what computes a chunked loss (auto:
Liger's kernel where it runs). The resolved config carries why (`Resolved.batch_derived`,
`Resolved.precision_auto`, `Resolved.loss_kernel_auto`) for the summary to say."""

from __future__ import annotations

import dataclasses

from meshrun.core.batch import derived_global_batch
from meshrun.core.choices import LossKernel, Precision
from meshrun.core.config import ExperimentConfig, HardwareConfig, with_resolved
from meshrun.core.hardware import HostFacts
from meshrun.core.precision import auto_precision
from meshrun.models.loss import loss_kernel


def with_batch(cfg: ExperimentConfig, dp: int) -> ExperimentConfig:
    """A null global batch derived for `dp` data-parallel ranks; a given one as it is (the
    batch rules check it)."""
    t = cfg.train
    if t.global_batch_size is not None:
        return cfg
    derived = derived_global_batch(t.micro_batch_size, dp)
    train = dataclasses.replace(t, global_batch_size=derived)
    return with_resolved(dataclasses.replace(cfg, train=train), batch_derived=True)


def with_precision(
    cfg: ExperimentConfig, hardware: HardwareConfig, facts: HostFacts
) -> ExperimentConfig:
    """train.precision=auto decided for `hardware` (resolved) on the box `facts` describe:
    its devices' compute capabilities where known, else the profile's datasheet."""
    if cfg.train.precision != "auto":
        return cfg
    capabilities = [device.capability for device in facts.cuda_devices]
    precision, why = auto_precision(hardware, capabilities)
    train = dataclasses.replace(cfg.train, precision=Precision[precision])
    return with_resolved(dataclasses.replace(cfg, train=train), precision_auto=why)


def with_loss_kernel(cfg: ExperimentConfig, hardware: HardwareConfig) -> ExperimentConfig:
    """train.loss_kernel=auto decided for `hardware` (resolved), with what this Python has
    installed (the ranks run in the same environment)."""
    if cfg.train.loss_kernel != "auto":
        return cfg
    kernel, why = loss_kernel(dataclasses.replace(cfg, hardware=hardware))
    train = dataclasses.replace(cfg.train, loss_kernel=LossKernel[kernel])
    return with_resolved(dataclasses.replace(cfg, train=train), loss_kernel_auto=why)
