"""Megatron-style tensor parallelism with torch.distributed.tensor.parallel, from a plan.

A TP plan maps module-name patterns (`*` matches one name, as in transformers'
`base_model_tp_plan`) to a style: `colwise` (output features sharded: q/k/v, gate and up),
`rowwise` (input features sharded, output all-reduced: attention output, down), `embedding`
(sharded over the vocabulary), `head` (vocabulary-sharded logits, gathered; left sharded, a
DTensor, for train.loss=vocab_parallel: parallel/loss.py), and for
sequence parallelism `sequence_parallel` (a norm computed on its sequence shard) and
`gather_input` (a sub-block whose column-wise matrices share its input: all-gathered over
the sequence first under SP, and their input gradients reduced once). Written once, a plan
serves both modes: without SP `sequence_parallel` is a no-op and the residual stream is
replicated; with SP it is sharded over the sequence, each all-reduce becoming a
reduce-scatter + all-gather. A value may also be a ParallelStyle, used as it is.

A float8 linear (train.float8, parallel/float8.py) whose recipe has float8 TP styles
(tensorwise) takes them for its `colwise` or `rowwise` entry, and a sub-block whose
column-wise matrices are all such shares its input cast to float8: SP's all-gathers move
float8, as torchtitan's float8 TP (Float8ColwiseParallel, Float8RowwiseParallel,
PrepareFloat8ModuleInput).
"""

from __future__ import annotations

from collections.abc import Callable
from fnmatch import fnmatch

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from meshrun.core.choices import TP_STYLES
from meshrun.core.imports import import_callable

TpPlan = Callable[[nn.Module, DeviceMesh, bool], None]


class ShareInput(ParallelStyle):
    """A sub-block's input (first positional, or `hidden_states=`) handed to its column-wise
    matrices as one replicated DTensor, all-gathered over the sequence first under SP
    (Megatron's g; torchtitan's PrepareModuleInput before attention and the MLP). Each
    matrix then takes it as it is, and backward sums their partial input gradients before
    one collective reduces the sum: an all-reduce, under SP a reduce-scatter. Without it
    each column-wise matrix wraps the tensor itself and reduces its own gradient: q, k, v,
    gate and up, five all-reduces a block where two do."""

    def __init__(
        self,
        sequence_parallel: bool,
        shared: bool,
        cast: Callable[[DTensor], DTensor] | None = None,
    ) -> None:
        super().__init__()
        self.stream = Shard(1) if sequence_parallel else Replicate()
        self.shared = shared  # else handed on as a plain tensor (a block that routes it)
        self.cast = cast  # to float8 before the all-gather: its float8 matrices' input

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not self.shared and self.stream == Replicate():
            return module  # nothing to gather, nothing to share

        def share(x: torch.Tensor) -> torch.Tensor:
            # a SequenceParallel norm hands on a DTensor, the residual stream a local tensor
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, device_mesh, [self.stream], run_check=False)
            if self.cast is not None:
                x = self.cast(x)
            x = x.redistribute(device_mesh, [Replicate()])
            return x if self.shared else x.to_local()

        def hook(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (share(args[0]), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": share(kwargs["hidden_states"])}

        module.register_forward_pre_hook(hook, with_kwargs=True)
        if not self.shared:  # under SP: its whole-sequence output back to this rank's shard
            module.register_forward_hook(lambda _, __, out: sequence_shard(out, device_mesh))
        return module


def sequence_shard(x: torch.Tensor, tp_mesh: DeviceMesh) -> torch.Tensor:
    """This rank's sequence shard of `x`, which every TP rank computed alike from the whole
    sequence (an MoE layer under SP): forward its slice, backward the slices' gradients
    all-gathered, so each rank's replicated computation gets the whole gradient (DTensor's
    Replicate -> Shard and back), and the input's all-gather hands each its slice back."""
    whole = DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False)
    return whole.redistribute(tp_mesh, [Shard(1)]).to_local()


def parallel_styles(
    plan: dict[str, str | ParallelStyle], sequence_parallel: bool, vocab_parallel: bool = False
) -> dict[str, ParallelStyle]:
    """The torch styles of a plan in one mode (see the module docstring); `gather_input`
    is decided per module (sub_blocks); `vocab_parallel`: the head's logits left sharded."""
    residual = Shard(1) if sequence_parallel else Replicate()
    styles: dict[str, ParallelStyle] = {}
    for pattern, style in plan.items():
        if isinstance(style, ParallelStyle):
            styles[pattern] = style
        elif style == "colwise":
            styles[pattern] = ColwiseParallel()
        elif style == "rowwise":
            styles[pattern] = RowwiseParallel(output_layouts=residual)
        elif style == "embedding":
            styles[pattern] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
        elif style == "head" and vocab_parallel:
            styles[pattern] = ColwiseParallel(
                input_layouts=residual, output_layouts=Shard(-1), use_local_output=False
            )
        elif style == "head":
            styles[pattern] = ColwiseParallel(input_layouts=residual, output_layouts=Replicate())
        elif style == "sequence_parallel":
            if sequence_parallel:
                styles[pattern] = SequenceParallel()
        elif style == "gather_input":
            continue  # per module: apply_tp's sub_blocks
        else:
            raise ValueError(f"{pattern}: unknown TP style {style!r} (one of {TP_STYLES})")
    return styles


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    sequence_parallel: bool,
    block_overrides: dict[str, str | ParallelStyle] | None = None,
    vocab_parallel: bool = False,
) -> None:
    """Shard `model` in place over `tp_mesh` by its own plan (`model.tp_plan()`); a pipeline
    stage lacks some of the modules it names, which are skipped. `vocab_parallel`: the
    head's logits left sharded over the vocabulary (train.loss=vocab_parallel).

    `block_overrides` replaces entries of each block's plan (keys like "attention.wo"): a
    user's plan that differs in a few layers calls this instead of restating the rest."""
    model.prepare_tp(tp_mesh.size())  # e.g. a fused q|k|v regrouped per rank
    plan = {**model.tp_plan(), **{f"layers.*.{k}": v for k, v in (block_overrides or {}).items()}}
    names = [name for name, _ in model.named_modules()]
    held = {k: v for k, v in plan.items() if any(fnmatch(name, k) for name in names)}
    styles = parallel_styles(held, sequence_parallel, vocab_parallel)
    for pattern, named in float8_styles(model, held, styles).items():
        del styles[pattern]
        styles |= named
    for pattern in [k for k, v in held.items() if v == "gather_input"]:
        styles |= sub_blocks(model, pattern, plan, sequence_parallel)
    parallelize_module(model, tp_mesh, styles)
    # The embedding and the head are both sharded over the vocabulary (dim 0 of each weight):
    # a tied pair, distributed as two tensors, is one again.
    model.tie_weights()
    model.seq_shards = tp_mesh.size() if sequence_parallel else 1


def float8_styles(
    model: nn.Module, held: dict[str, str | ParallelStyle], styles: dict[str, ParallelStyle]
) -> dict[str, dict[str, ParallelStyle]]:
    """The `colwise` and `rowwise` entries that name float8 linears with styles of their own
    (parallel/float8.py's Float8Linear.tp_style), each entry's modules by name: the float8
    ones with theirs, the others with the entry's torch style (`styles`). They replace the
    entry: parallelize_module would apply both a pattern's style and a name's."""
    found: dict[str, dict[str, ParallelStyle]] = {}
    for pattern, style in held.items():
        if style not in ("colwise", "rowwise"):
            continue
        names = {n: m for n, m in model.named_modules() if fnmatch(n, pattern)}
        float8 = {n: _float8_style(m, style, styles[pattern]) for n, m in names.items()}
        if any(float8.values()):
            found[pattern] = {n: float8[n] or styles[pattern] for n in names}
    return found


def _float8_style(
    module: nn.Module, style: str, torch_style: ParallelStyle
) -> ParallelStyle | None:
    """A float8 linear's own TP style for `style`, with the torch style's layouts."""
    tp_style = getattr(module, "tp_style", None)
    if tp_style is None:
        return None
    layouts = {"output_layouts": torch_style.output_layouts[0]} if style == "rowwise" else {}
    return tp_style(style, **layouts)


def sub_blocks(
    model: nn.Module, pattern: str, plan: dict[str, str | ParallelStyle], sequence_parallel: bool
) -> dict[str, ParallelStyle]:
    """The modules a `gather_input` entry names, by their own names: one whose column-wise
    matrices are its own children (attention, a dense MLP) shares its input with them, cast
    to float8 first where all of them are float8 linears with float8 TP styles; one that
    routes its input first (an MoE layer, whose router is no TP matrix) gets it gathered
    under SP and whole as a plain tensor, and hands back its own sequence shard of the output
    (`sequence_shard`)."""
    colwise = [k for k, v in plan.items() if v == "colwise"]
    styles = {}
    for name, module in model.named_modules():
        if not fnmatch(name, pattern):
            continue
        matrices = [
            child
            for child_name, child in module.named_children()
            if any(fnmatch(f"{name}.{child_name}", c) for c in colwise)
        ]
        float8 = all(getattr(m, "tensorwise", False) for m in matrices)
        cast = matrices[0].cast_input if matrices and float8 else None
        styles[name] = ShareInput(sequence_parallel, shared=bool(matrices), cast=cast)
    return styles


def resolve_tp_plan(path: str | None) -> TpPlan:
    """The model's own plan, or a user's "package.module:function" with apply_tp's signature."""
    return apply_tp if path is None else import_callable(path)
