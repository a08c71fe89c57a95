"""The rules of a user's own nn.Module (kind=custom) on its own: that the callable imports
and returns a module, that the names given are its submodules, that its TP plan loads and
names TP styles. What each layout needs of it is validate/custom.py's."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from fnmatch import fnmatch

import torch
from torch import nn

from meshrun.core.choices import TP_STYLES
from meshrun.core.config import CustomModelConfig
from meshrun.core.errors import fail
from meshrun.models.custom import PARTS, CustomLM, build_user_module, user_tp_plan

CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def check_custom(m: CustomModelConfig) -> None:
    if m.pretrained is not None:
        fail(
            "model.pretrained",
            m.pretrained,
            "model=custom builds its weights itself",
            "null; load them in model.target's callable (it runs on each rank's CPU)",
        )
    try:
        with torch.device("meta"):
            module = build_user_module(m)
    except (ImportError, ValueError) as err:
        fail(
            "model.target",
            m.target,
            f"cannot be imported ({err})",
            '"module:callable", importable from the current directory',
        )
    except TypeError as err:
        fail(
            "model.target",
            m.target,
            f"called with model.kwargs={m.kwargs}: {err}",
            "a callable returning an nn.Module, and kwargs it takes",
        )
    names = dict(module.named_modules())
    for key in ("layers", *PARTS.values()):
        path = getattr(m, key)
        if path is not None and path not in names:
            nearest = difflib.get_close_matches(path, [n for n in names if n], n=3)
            fail(
                f"model.{key}",
                path,
                "is not a submodule of the model",
                f"{' | '.join(nearest) or 'a name from named_modules()'} (nearest)",
            )
    if m.layers is not None and not isinstance(names[m.layers], CONTAINERS):
        fail(
            "model.layers",
            m.layers,
            f"is a {type(names[m.layers]).__name__}",
            "the ModuleList, Sequential or ModuleDict of the blocks",
        )
    try:
        CustomLM(module, m)
    except ValueError as err:
        fail(
            "model.vocab_size",
            m.vocab_size,
            str(err),
            "the vocabulary size, or model.embedding naming the module holding the token "
            "nn.Embedding",
        )
    if m.tp_plan is not None:
        _check_plan(m, module)


def _check_plan(m: CustomModelConfig, module: nn.Module) -> None:
    try:
        plan = user_tp_plan(m, module)
    except (ImportError, ValueError, TypeError) as err:
        fail(
            "model.tp_plan",
            m.tp_plan,
            f"cannot be loaded ({err})",
            'a mapping of module-name patterns to TP styles, or "module:callable" returning one',
        )
    if not isinstance(m.tp_plan, (str, Mapping)):
        fail(
            "model.tp_plan",
            m.tp_plan,
            "is neither a mapping nor a callable's path",
            '{pattern: style}, or "module:callable"',
        )
    names = [n for n, _ in module.named_modules() if n]
    for pattern, style in plan.items():
        if (isinstance(style, str) and style not in TP_STYLES) or not _is_style(style):
            fail(
                f"model.tp_plan.{pattern}",
                style,
                "is not a TP style",
                " | ".join(TP_STYLES) + ", or a ParallelStyle from a callable",
            )
        if not any(fnmatch(name, pattern) for name in names):
            nearest = difflib.get_close_matches(pattern, names, n=3)
            fail(
                "model.tp_plan",
                pattern,
                "matches no module of the model",
                f"{' | '.join(nearest) or 'a pattern of named_modules()'} (nearest)",
            )


def _is_style(style: object) -> bool:
    """A style name, or a ParallelStyle: only a plan holding objects imports torch's tensor
    parallelism here, the second every `meshrun` would pay at start otherwise."""
    if isinstance(style, str):
        return True
    from torch.distributed.tensor.parallel import ParallelStyle  # noqa: PLC0415 (see above)

    return isinstance(style, ParallelStyle)
