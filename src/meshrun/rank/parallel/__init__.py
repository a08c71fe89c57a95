"""Turn the model into its parallel form for a layout: one file a dimension (pipeline,
context, tensor, expert, fsdp, ddp, dataparallel; float8, checkpointing, compile beside them),
each an apply_* function; compose.parallelize applies them in torchtitan's order
(docs/architecture.md), parallel_model.ParallelModel is what a rank then trains, and
accumulation.gradient_sync syncs the replicas on a step's last micro-batch."""

from meshrun.rank.parallel.accumulation import gradient_sync
from meshrun.rank.parallel.compose import parallelize
from meshrun.rank.parallel.parallel_model import ParallelModel

__all__ = ["ParallelModel", "gradient_sync", "parallelize"]
