"""Your own nn.Module (model=custom), as meshrun's layouts see a decoder.

The module stays as you wrote it: without a pipeline, its own forward runs. What a layout
needs and cannot guess comes from the config, as dotted paths into the module: `layers` the
block list, `embedding`, `norm` and `head` the ends, and `tp_plan`. A pipeline stage keeps
the ends only where it is first or last and its own blocks only (the others become None in
the list, so every name stays the whole model's), and runs its parts in sequence:
embedding -> blocks -> norm -> head, each part whose forward takes the `positions` keyword
given the tokens' positions (a context-parallel rank's, which it cannot count itself).

Values: the callable is called on the meta device (shapes, nothing allocated) and, on each
rank, once more on the CPU under torch.manual_seed(train.seed), which gives the module's own
initialisation and buffers, the same whatever the layout; each rank keeps what it holds.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, MutableMapping

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from meshrun.core.config import CustomModelConfig
from meshrun.core.errors import Refused
from meshrun.core.imports import import_target
from meshrun.core.model_shape import ModelShape
from meshrun.models.shards import fill, named_tensors
from meshrun.models.vocab import pad_vocab, unpad_logits

# our name for a part -> the config key that holds its path in the user's module
PARTS = {"tok_embeddings": "embedding", "norm": "norm", "output": "head"}


def build_user_module(cfg: CustomModelConfig) -> nn.Module:
    """`cfg.target(**cfg.kwargs)`; ImportError/ValueError if it cannot be imported, TypeError
    if it does not return a module."""
    module = import_target(cfg.target)(**cfg.kwargs)
    if not isinstance(module, nn.Module):
        raise TypeError(f"returned a {type(module).__name__}, not a torch.nn.Module")
    return module


def user_tp_plan(cfg: CustomModelConfig, module: nn.Module) -> dict:
    """The plan as given (a mapping), or what a "module:callable" returns for the module."""
    if isinstance(cfg.tp_plan, str):
        return dict(import_target(cfg.tp_plan)(module))
    return dict(cfg.tp_plan or {})


def tied_names(module: nn.Module) -> list[list[str]]:
    """The parameters that are one tensor under several names (a tied head, say)."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


class Blocks(MutableMapping):
    """The user's block container (ModuleList, Sequential or ModuleDict) as a mapping from
    its names; a deleted block becomes None in place, so the others keep their names."""

    def __init__(self, container: nn.Module) -> None:
        self.container = container

    def __getitem__(self, key: str) -> nn.Module:
        module = self.container._modules[key]
        if module is None:
            raise KeyError(key)
        return module

    def __setitem__(self, key: str, module: nn.Module | None) -> None:
        setattr(self.container, key, module)

    def __delitem__(self, key: str) -> None:
        self[key] = None

    def __iter__(self) -> Iterator[str]:
        return (k for k, m in self.container._modules.items() if m is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    @property
    def complete(self) -> bool:
        return None not in self.container._modules.values()


class CustomLM(nn.Module):
    def __init__(self, module: nn.Module, cfg: CustomModelConfig) -> None:
        super().__init__()
        self.module = module
        self.cfg = cfg
        self.paths = {ours: getattr(cfg, key) for ours, key in PARTS.items()}
        self.pos_embeddings = None  # positions, if any, are the user's embedding's or blocks'
        self.seq_shards = 1
        self.positions: torch.Tensor | None = None  # a CP rank's tokens' (use_positions)
        self.ties = tied_names(module)
        self.tied = bool(self.ties)
        self.vocab_size = cfg.vocab_size or token_lookup(module, cfg.embedding)[1].num_embeddings
        # the parts whose own forward takes model.positions: a stage passes them theirs
        self.positioned = {key for key, part in self.parts() if _takes(part, cfg.positions)}

    def __getattr__(self, name: str):
        paths = self.__dict__.get("paths")
        if paths is not None and name in PARTS:
            return _find(self.module, paths[name])
        if paths is not None and name == "layers":
            return Blocks(self.module.get_submodule(self.cfg.layers)) if self.cfg.layers else {}
        return super().__getattr__(name)

    def __setattr__(self, name: str, value) -> None:
        paths = self.__dict__.get("paths")
        if paths is not None and name in PARTS and paths[name] is not None:
            owner, _, attr = paths[name].rpartition(".")
            setattr(self.module.get_submodule(owner), attr, value)
        elif paths is not None and name in PARTS and value is not None:
            raise AttributeError(f"model.{PARTS[name]} is not set: the module has no {name}")
        else:
            super().__setattr__(name, value)

    def tie_weights(self) -> None:
        for first, *rest in self.ties:
            for name in rest:
                owner, _, attr = name.rpartition(".")
                setattr(self.module.get_submodule(owner), attr, self.module.get_parameter(first))

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> CustomLM:
        """Materialise (from meta) keeping tied parameters tied (to_empty gives each its own)."""
        super().to_empty(device=device, recurse=recurse)
        self.tie_weights()
        return self

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The module's own forward; a pipeline stage runs its parts in sequence (taking and
        returning hidden states where it lacks the embedding or the head)."""
        if self.whole():
            return unpad_logits(self.module(tokens, **self._positions(tokens)), self.vocab_size)
        h = self.staged(tokens)
        return h if self.output is None else unpad_logits(h, self.vocab_size)

    def parts(self) -> Iterator[tuple[str, nn.Module | None]]:
        """(key, part) in a stage's order: embedding, blocks, norm, head; None where absent."""
        yield "tok_embeddings", self.tok_embeddings
        for name, block in self.layers.items():
            yield f"layers.{name}", block
        yield "norm", self.norm
        yield "output", self.output

    def staged(self, tokens: torch.Tensor) -> torch.Tensor:
        """The parts this holds in sequence, each that takes model.positions given them (a
        context-parallel rank's, under a pipeline too)."""
        positions = self._positions(tokens)
        h = tokens
        for key, part in self.parts():
            if part is not None:
                h = part(h, **(positions if key in self.positioned else {}))
        return h

    def use_positions(self, positions: torch.Tensor) -> None:
        """The global positions of the tokens this rank sees (a context-parallel rank's
        shard of each sequence), passed to the module by `model.positions`."""
        self.positions = positions

    def _positions(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """The module's positions keyword, if it has one: this rank's tokens' positions."""
        if self.cfg.positions is None:
            return {}
        if self.positions is None:
            return {self.cfg.positions: torch.arange(tokens.shape[1], device=tokens.device)[None]}
        if self.positions.device != tokens.device:  # once: no host copy a step
            self.positions = self.positions.to(tokens.device)
        return {self.cfg.positions: self.positions[None]}

    def tp_plan(self) -> dict:
        """The user's plan, its patterns relative to their module."""
        return {f"module.{k}": v for k, v in user_tp_plan(self.cfg, self.module).items()}

    def prepare_tp(self, tp: int) -> None:
        """Nothing to regroup: the plan is the user's."""

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """The module's own initialisation: built whole on the CPU from `seed`, this part's
        parameters and buffers copied from it (vocabulary padding zero)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            with torch.device("cpu"):
                reference = build_user_module(self.cfg)
        tensors = [*reference.parameters(), *reference.buffers()]
        if not self.whole() and not any(is_fake(t) for t in tensors):  # the planner traces
            check_staged_forward(reference, self.cfg)
        values = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
        for name, tensor in named_tensors(self.module, buffers=True):
            fill(tensor, values[name])

    def whole(self) -> bool:
        """Whether this is the whole module, not a pipeline stage's cut of it."""
        blocks = self.layers
        ends = all(self.paths[p] is None or getattr(self, p) is not None for p in PARTS)
        return ends and (not isinstance(blocks, Blocks) or blocks.complete)


# The probe a pipeline's parts are checked on against the module's own forward: a few tokens,
# in float32 on the CPU, where the two agree to rounding (1e-5 relative) when they are one.
PROBE_TOKENS = 8
PROBE_RTOL = 1e-4


class StagedForwardDiffers(Refused):
    """A module whose forward a pipeline's stages would not reproduce."""


def check_staged_forward(module: nn.Module, cfg: CustomModelConfig) -> None:
    """A pipeline stage runs the named parts in sequence (embedding -> blocks -> norm ->
    head), so the module's own forward must be exactly that: anything it does between them
    (a residual add, a scale) a pipeline would silently leave out and train another model.
    Compared on a probe batch with the module built whole (eval mode: no dropout)."""
    model = CustomLM(module, cfg)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.vocab_size, (1, PROBE_TOKENS), generator=generator)
    if cfg.positions is not None:  # not 0..n-1 (a CP rank's are not): each part must take them
        model.use_positions(torch.arange(PROBE_TOKENS).flip(0))
    training = module.training
    module.eval()
    own = module(tokens, **model._positions(tokens))
    try:
        h = model.staged(tokens)
    except Exception as err:  # a part that needs what the forward hands it besides h
        differ = f"the parts raise {type(err).__name__}: {err}"
    else:
        if h.shape == own.shape and torch.allclose(h, own, rtol=PROBE_RTOL, atol=PROBE_RTOL):
            return
        differ = (
            f"the two differ by up to {(h - own).abs().max().item():.2e}"
            if h.shape == own.shape
            else f"the two differ in shape ({tuple(h.shape)} vs {tuple(own.shape)})"
        )
    finally:
        module.train(training)
    named = " -> ".join(
        f"{key}={getattr(cfg, key)}"
        for key in ("embedding", "layers", "norm", "head")
        if getattr(cfg, key)
    )
    raise StagedForwardDiffers(
        f"model=custom under a pipeline: the module's forward is not its named parts in "
        f"sequence ({named}); on a probe batch {differ}, so the stages would "
        "train another model",
        "put what the forward does between the parts (a residual add, a scale, positions) "
        "inside the blocks or the embedding (a part whose forward takes the model.positions "
        "keyword is given them), or train without a pipeline (parallel.pp=1)",
    )


def _takes(part: nn.Module | None, keyword: str | None) -> bool:
    """Whether the part's forward takes `keyword` by name (read before any wrapper: an
    activation checkpoint's takes **kwargs and passes them on)."""
    if part is None or keyword is None:
        return False
    return keyword in inspect.signature(part.forward).parameters


def token_lookup(module: nn.Module, embedding: str | None) -> tuple[str, nn.Embedding]:
    """The token lookup (its path and module), which says the vocabulary and the width: the
    first nn.Embedding of the named embedding; unnamed, the module's one nn.Embedding.
    ValueError where there is none, or several to choose from."""
    root = module.get_submodule(embedding) if embedding else module
    lookups = [(n, m) for n, m in root.named_modules() if isinstance(m, nn.Embedding)]
    if embedding:
        if not lookups:
            raise ValueError(f"model.embedding ({embedding}) holds no nn.Embedding")
        name, lookup = lookups[0]
        return ".".join(p for p in (embedding, name) if p), lookup
    if len(lookups) != 1:
        held = ", ".join(n for n, _ in lookups) or "none"
        raise ValueError(
            f"model.vocab_size is null and the module holds {len(lookups)} nn.Embedding "
            f"({held}): which is the token embedding cannot be told"
        )
    return lookups[0]


def _find(module: nn.Module, path: str | None) -> nn.Module | None:
    """The submodule at `path`, or None where the path is unset or a pipeline cut it away."""
    for attr in path.split(".") if path else ():
        module = getattr(module, attr)
        if module is None:
            return None
    return module if path else None


def custom_shape(cfg: CustomModelConfig) -> ModelShape:
    """What the layout rules can know without a formula: blocks, vocabulary, ties; the
    widths only the embedding tells (the planner's formulas need more)."""
    model = build_custom(cfg, "meta")
    return ModelShape(
        dim=token_lookup(model.module, cfg.embedding)[1].embedding_dim if cfg.embedding else None,
        n_layers=len(model.layers),
        n_heads=None,
        n_kv_heads=None,
        vocab_size=model.vocab_size,
        ffn_dim=None,
        tied=model.tied,
    )


def build_custom(cfg: CustomModelConfig, device: torch.device | str, vocab_multiple: int = 1):
    """Built on `device` (meta: nothing allocated); `vocab_multiple`: the TP degree the
    vocabulary is padded for, where the embedding and head are named (vocab.py)."""
    with torch.device(device):
        model = CustomLM(build_user_module(cfg), cfg)
    if paddable(model):
        pad_vocab(model, model.vocab_size, vocab_multiple)
    return model


def paddable(model: CustomLM) -> bool:
    """Whether meshrun can pad the vocabulary: the ends are named and of torch's own kinds."""
    return isinstance(model.tok_embeddings, nn.Embedding) and isinstance(model.output, nn.Linear)
