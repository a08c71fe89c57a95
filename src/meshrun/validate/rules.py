"""The rules of a config whose layout is filled (driver/resolution.py fills it): those a
memory prediction needs to hold (`check_layout`), then the rest (`check_run`)."""

from __future__ import annotations

from meshrun.core.config import ExperimentConfig
from meshrun.core.hardware import HostFacts
from meshrun.validate.checkpoint import check_checkpoint
from meshrun.validate.context import check_context_parallel
from meshrun.validate.custom import check_custom_layout, check_staged
from meshrun.validate.data import check_text_heldout
from meshrun.validate.experts import check_expert_layout
from meshrun.validate.fault_tolerance import check_fault_tolerance
from meshrun.validate.float8 import check_float8
from meshrun.validate.guard import check_guard
from meshrun.validate.inspection import check_inspection
from meshrun.validate.launcher import check_debug
from meshrun.validate.layout import check_batch, check_pipeline, check_tensor_parallel
from meshrun.validate.loss import check_loss
from meshrun.validate.offload import check_offload
from meshrun.validate.optimizer import check_optimizer_states


def check_layout(resolved: ExperimentConfig, facts: HostFacts) -> None:
    """The layout's rules and the pipeline's: enough to predict memory."""
    check_tensor_parallel(resolved)
    check_context_parallel(resolved)
    check_expert_layout(resolved)
    check_custom_layout(resolved)
    check_pipeline(resolved)
    check_float8(resolved, facts)
    check_offload(resolved)
    check_optimizer_states(resolved)
    check_loss(resolved)


def check_run(resolved: ExperimentConfig) -> None:
    """The rest of the rules, on a config `check_layout` passed."""
    check_batch(resolved)
    check_text_heldout(resolved)
    world = resolved.launcher.nproc_per_node * resolved.launcher.nnodes
    check_debug(resolved.debug, world, resolved.train.steps)
    check_inspection(resolved, world)
    check_guard(resolved)
    check_fault_tolerance(resolved)
    check_staged(resolved)
    check_checkpoint(resolved)
