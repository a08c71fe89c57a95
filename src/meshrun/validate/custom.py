"""A user's own nn.Module (model=custom) under a layout: what each layout needs of it and it
does not say (a TP plan for tp > 1, the parts a pipeline runs in sequence, the blocks
checkpointing wraps); the module's own rules (its target, names, plan) are its kind's,
models/custom_rules.py.
The module is built on the meta device for this: nothing is allocated; only a pipeline's
probe of its forward builds it on the CPU, where it is small."""

from __future__ import annotations

import inspect
from fnmatch import fnmatch

import torch
from torch import Tensor, nn

from meshrun.core.config import ExperimentConfig, ModelConfig
from meshrun.core.errors import fail
from meshrun.models.custom import (
    CustomLM,
    StagedForwardDiffers,
    build_custom,
    build_user_module,
    check_staged_forward,
    paddable,
    token_lookup,
)
from meshrun.models.kinds import CustomKind
from meshrun.validate.context import check_alltoall_heads

SEE_DOCS = "see docs/models.md, Any nn.Module"
SP_STYLES = ("sequence_parallel", "gather_input")  # what takes a sequence-sharded stream
# The largest module the driver builds on its CPU to probe a pipeline's parts (fp32: 400 MB,
# a second's init); a larger one only each rank probes, as it initialises
# (models/custom.CustomLM.init_weights), and refuses after launch.
DRIVER_PROBE_PARAMS = 100_000_000


def user_module(m: ModelConfig) -> bool:
    """Whether `m` is model=custom's: the module meshrun did not write, whose parts the
    config names (these rules build it with the rank layer's probes, below the kinds)."""
    return m.kind == CustomKind.name


def check_custom_layout(cfg: ExperimentConfig) -> None:
    """What the resolved layout needs of the module (a user's module only)."""
    m, p = cfg.model, cfg.parallel
    if not user_module(m):
        return
    model = build_custom(m, "meta", vocab_multiple=p.tp)
    if p.tp > 1:
        if m.tp_plan is None:
            fail(
                "parallel.tp",
                p.tp,
                "needs a TP plan and model=custom has none",
                f"set model.tp_plan ({SEE_DOCS}), or tp=1",
            )
        _check_divisible(model, p.tp)
        if p.sequence_parallel and not any(
            not isinstance(style, str) or style in SP_STYLES for style in model.tp_plan().values()
        ):
            fail(
                "parallel.sequence_parallel",
                True,
                "shards the residual stream over the sequence, and model.tp_plan has no "
                f"{' or '.join(SP_STYLES)} entry to take it so: the module's blocks would get "
                "part of each sequence where they expect it whole",
                "false, or a plan whose norms are sequence_parallel and whose attention and "
                "MLP are gather_input before their colwise matrices",
            )
    if p.pp > 1:
        missing = [f"model.{k}" for k in ("layers", "embedding", "head") if getattr(m, k) is None]
        if missing:
            fail(
                "parallel.pp",
                p.pp,
                "a pipeline stage runs embedding -> layers -> norm -> head "
                f"in sequence, and {', '.join(missing)} is not set",
                f"set {', '.join(missing)} ({SEE_DOCS}), or pp=1",
            )
    if p.activation_checkpointing != "none" and m.layers is None:
        fail(
            "parallel.activation_checkpointing",
            p.activation_checkpointing,
            "wraps each block of model.layers, which is not set",
            "set model.layers to the module's block list, or none",
        )
    if p.cp > 1:
        _check_context_parallel(cfg, model)
    if cfg.train.compile and m.layers is None:
        fail(
            "train.compile",
            True,
            "compiles each block of model.layers, which is not set",
            "set model.layers to the module's block list, or train.compile=false",
        )


def check_staged(cfg: ExperimentConfig) -> None:
    """A pipeline's stages run the named parts in sequence: the probe the ranks run
    (check_staged_forward), run here on a CPU build from the run's seed where the module is
    small enough, so that a module they would train otherwise is refused before launch.
    Once for the run (rules.check_run), not for each layout the planner weighs."""
    if cfg.parallel.pp == 1 or not user_module(cfg.model):
        return
    with torch.device("meta"):
        params = sum(p.numel() for p in build_user_module(cfg.model).parameters())
    if params > DRIVER_PROBE_PARAMS:
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.train.seed)
        with torch.device("cpu"):
            module = build_user_module(cfg.model)
        try:
            check_staged_forward(module, cfg.model)
        except StagedForwardDiffers as err:
            fail("parallel.pp", cfg.parallel.pp, err.problem, err.fix)


def _check_context_parallel(cfg: ExperimentConfig, model: CustomLM) -> None:
    """CP shares the attention each block computes with SDPA, its ranks holding two chunks of
    each sequence: the module must take their positions and attend through SDPA, which a
    probe on meta shows. Under a pipeline each part whose forward takes the positions keyword
    is given them, and check_staged's probe (positions not 0..n-1) shows the parts then
    compute what the forward does."""
    m, cp = cfg.model, cfg.parallel.cp
    if m.layers is None:
        fail(
            "parallel.cp",
            cp,
            "shares the attention inside each block of model.layers, which is not set",
            "set model.layers to the module's block list, or cp=1",
        )
    if m.positions is None:
        fail(
            "parallel.cp",
            cp,
            "gives each rank two chunks of every sequence, whose positions a model=custom "
            "module cannot count itself, and model.positions (the keyword its forward takes "
            "them by) is not set",
            f"model.positions=<a keyword of the forward> ({SEE_DOCS}), or cp=1",
        )
    forward = inspect.signature(model.module.forward)
    if m.positions not in forward.parameters and not any(
        p.kind is p.VAR_KEYWORD for p in forward.parameters.values()
    ):
        fail(
            "model.positions",
            m.positions,
            f"is not a keyword of {type(model.module).__name__}.forward{forward}",
            "the name of the argument the forward takes token positions by",
        )
    # only here: rank.parallel imports FSDP and DTensor, a second every `meshrun` would pay
    from meshrun.rank.parallel.context import ContextAttention, share_attention  # noqa: PLC0415

    probe = _AttentionProbe()
    mode = ContextAttention(probe, group=None)
    share_attention(model, mode)
    seq = 2 * cp
    model.use_positions(torch.arange(seq, device="meta"))
    try:
        model(torch.zeros(1, seq, dtype=torch.long, device="meta"))
    except Exception as err:
        fail(
            "parallel.cp",
            cp,
            f"model=custom's forward, probed on the meta device for the attention CP shares, "
            f"raised {type(err).__name__}: {err}",
            "a module whose blocks attend with causal F.scaled_dot_product_attention, or cp=1",
        )
    if mode.calls == 0:
        fail(
            "parallel.cp",
            cp,
            "shares the attention blocks compute with torch.nn.functional."
            "scaled_dot_product_attention, and model=custom's blocks call none (probed on "
            "the meta device): attention computed otherwise would see each rank's own "
            "tokens only",
            "causal F.scaled_dot_product_attention in the blocks, or cp=1",
        )
    if cfg.parallel.cp_method == "alltoall":
        for heads in probe.heads:
            check_alltoall_heads(heads, cfg.parallel.tp, cp)


class _AttentionProbe:
    """The probe's attention: SDPA on meta (K/V heads may be fewer), the heads of each call
    noted (Ulysses splits them over cp)."""

    def __init__(self) -> None:
        self.heads: list[dict[str, int | None]] = []

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, group: None, scale: float | None) -> Tensor:
        heads = {"the blocks' query heads": q.shape[-3], "their key/value heads": k.shape[-3]}
        if heads not in self.heads:
            self.heads.append(heads)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[-3] != q.shape[-3]
        )


def _check_divisible(model: CustomLM, tp: int) -> None:
    """Each matrix the plan shards splits evenly; the vocabulary is padded where meshrun can
    (model.embedding an nn.Embedding and model.head an nn.Linear)."""
    plan = model.tp_plan()
    for name, module in model.named_modules():
        style = next((s for k, s in plan.items() if fnmatch(name, k)), None)
        if style in ("colwise", "head") and isinstance(module, nn.Linear):
            size, what = module.out_features, "output features"
        elif style == "rowwise" and isinstance(module, nn.Linear):
            size, what = module.in_features, "input features"
        elif style == "embedding" and isinstance(module, nn.Embedding):
            size, what = module.num_embeddings, "rows"
        else:
            continue
        if size % tp:
            pad = (
                ""
                if paddable(model)
                else (
                    "; name model.embedding (an nn.Embedding) and model.head (an nn.Linear) "
                    "and meshrun pads the vocabulary"
                )
            )
            fail(
                "parallel.tp",
                tp,
                f"{name.removeprefix('module.')} ({style}) has {size} "
                f"{what}, which tp does not divide{pad}",
                "a tp that divides it",
            )


def vocabulary_note(cfg: ExperimentConfig) -> str | None:
    """What meshrun took for the vocabulary of a user's module that names none: its one
    nn.Embedding (several, or none, were refused by check_custom)."""
    m = cfg.model
    if not user_module(m) or m.vocab_size is not None or m.embedding:
        return None
    with torch.device("meta"):
        path, lookup = token_lookup(build_user_module(m), None)
    return (
        f"model=custom: the vocabulary is {lookup.num_embeddings}, that of the module's one "
        f"nn.Embedding ({path}); model.vocab_size or model.embedding would say so"
    )
