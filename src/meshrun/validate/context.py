"""Rules of context parallelism (parallel.cp > 1): a sequence the causal load balance can
cut, heads Ulysses can split, options CP combines with (what it needs of a user's module:
validate/custom.py)."""

from __future__ import annotations

from meshrun.core.config import ExperimentConfig
from meshrun.core.errors import fail
from meshrun.core.model_shape import ModelShape
from meshrun.models import model_kind, model_shape


def check_context_parallel(cfg: ExperimentConfig) -> None:
    p, t = cfg.parallel, cfg.train
    if p.cp == 1:
        return
    if t.seq_len % (2 * p.cp):
        fail(
            "train.seq_len",
            t.seq_len,
            f"not divisible by 2 x cp = {2 * p.cp}: context parallelism cuts each sequence into "
            "2 x cp chunks, rank r holding chunks r and 2cp-1-r (causal load balance)",
            f"a multiple of {2 * p.cp}, e.g. {t.seq_len + (-t.seq_len) % (2 * p.cp)}",
        )
    if p.sequence_parallel and (t.seq_len // p.cp) % p.tp:
        fail(
            "train.seq_len",
            t.seq_len,
            f"a CP rank's {t.seq_len // p.cp} tokens are not divisible by tp ({p.tp}), which "
            "sequence parallelism splits them over",
            f"a multiple of {2 * p.cp * p.tp}",
        )
    if p.cp_method == "alltoall":
        _check_heads(cfg)
    model_kind(cfg.model).check_context_parallel(cfg.model, t.seq_len, p.cp)


def unsplit_heads(shape: ModelShape, tp: int, cp: int) -> tuple[str, int] | None:
    """The first of a model's heads (and K/V heads) that Ulysses cannot split: it gives each
    CP rank heads/cp of the heads its TP rank holds. None where both split, or where the
    shape does not say them (a user's module: its CP probe counts them, validate/custom.py)."""
    return _unsplit(_heads(shape), tp, cp)


def _heads(shape: ModelShape) -> dict[str, int | None]:
    return {"model.n_heads": shape.n_heads, "model.n_kv_heads": shape.n_kv_heads}


def _unsplit(heads: dict[str, int | None], tp: int, cp: int) -> tuple[str, int] | None:
    return next(((k, n) for k, n in heads.items() if n is not None and (n // tp) % cp), None)


def check_alltoall_heads(heads: dict[str, int | None], tp: int, cp: int) -> None:
    """Each of `heads` (what holds them -> how many) splits over cp after tp."""
    unsplit = _unsplit(heads, tp, cp)
    if unsplit:
        name, n = unsplit
        fail(
            "parallel.cp_method",
            "alltoall",
            f"splits attention heads over cp: {name} ({n}) / tp ({tp}) = {n // tp} is not "
            f"divisible by cp ({cp})",
            "parallel.cp_method=ring or allgather, or a cp that divides the heads",
        )


def _check_heads(cfg: ExperimentConfig) -> None:
    check_alltoall_heads(_heads(model_shape(cfg.model)), cfg.parallel.tp, cfg.parallel.cp)
