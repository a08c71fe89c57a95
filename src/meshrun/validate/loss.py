"""train.loss names a loss the layout can run, and an explicit train.loss_kernel a kernel
that can compute it (models/loss.py says which and why not)."""

from __future__ import annotations

from meshrun.core.config import ExperimentConfig, resolved_of
from meshrun.core.errors import fail
from meshrun.models.loss import (
    chunked_refused,
    liger_refused,
    loss_method,
    vocab_parallel_refused,
)

REFUSALS = {"chunked": chunked_refused, "vocab_parallel": vocab_parallel_refused}


def check_loss(cfg: ExperimentConfig) -> None:
    refused = REFUSALS.get(str(cfg.train.loss))
    why = refused(cfg) if refused is not None else None
    if why is not None:
        fail(
            "train.loss",
            str(cfg.train.loss),
            why,
            "auto (it picks what the layout can run) or full",
        )
    if cfg.train.loss_kernel != "liger" or resolved_of(cfg).loss_kernel_auto is not None:
        return  # auto's liger (resolved before parallel=auto's search) leaves other losses be
    method = loss_method(cfg)[0]
    why = (
        f"Liger's kernel computes a chunked loss, and this layout's is {method}"
        if method != "chunked"
        else liger_refused(cfg)
    )
    if why is not None:
        fail("train.loss_kernel", "liger", why, "auto (Liger's where it runs) or torch")
