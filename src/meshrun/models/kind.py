"""What meshrun asks of a model kind (`model.kind`): a family of models with its own config
schema, e.g. meshrun's decoder, transformers causal LMs, a user's nn.Module (models/kinds.py),
or a kind of your own (docs/architecture.md, "A new model kind").

A kind lives in the models layer: it builds and measures its models, and it checks its own
config before any process starts (`check`, raising through core.errors.fail: exit 2), so a
kind nobody in meshrun knows is checked the same way as meshrun's own. The rules that span
the whole experiment (a layout against the model) stay in meshrun.validate and ask the kind
the questions below. A kind that subclasses `ModelKind` inherits the answers of a plain
dense model built from its config; it writes `name`, `schema`, `build`, `shape` and `check`.

The built model presents the parts a layout works on: `tok_embeddings`, `pos_embeddings`
(None unless learned), `layers` by name, `norm`, `output`, with `tp_plan()`,
`prepare_tp(tp)`, `tie_weights()`, `init_weights(seed)` and `to_empty`; where the config
sets `model.pretrained`, `load_pretrained(directory)` (each pipeline part its share),
under context parallelism `use_positions(positions)`, and where TP holds a weight's rows in a
tp-dependent order `row_orders_for(tp)` (models/hf.py; a checkpoint saved under another tp
reads through them). models/llama.py's Transformer is the reference."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

from meshrun.core.config import ModelConfig

if TYPE_CHECKING:
    from pathlib import Path

    import torch
    from torch import nn

    from meshrun.core.config import LlamaModelConfig, MoEConfig
    from meshrun.core.model_shape import ModelShape


@runtime_checkable
class ModelKind(Protocol):
    """One kind of model; `name` is what `model.kind` says (a kind from a user's module is
    named by its import path, "package.module:attribute"), `schema` its config's dataclass."""

    name: str
    schema: type[ModelConfig]

    def build(
        self, cfg: ModelConfig, max_seq_len: int, device: torch.device | str, vocab_multiple: int
    ) -> nn.Module:
        """The model on `device` ("meta": nothing allocated), its vocabulary padded to a
        multiple of `vocab_multiple` (the TP degree: vocab.py)."""
        ...

    def shape(self, cfg: ModelConfig) -> ModelShape:
        """The sizes the layout rules and the analytic planner compute with."""
        ...

    def check(self, cfg: ModelConfig, read_from: str | None) -> None:
        """Refuse a config of this kind that cannot be built (core.errors.fail); `read_from`:
        the file its config was read from (`read_pretrained`), None where nothing was read."""
        ...

    def read_pretrained(self, cfg: ModelConfig) -> tuple[ModelConfig, str | None]:
        """The config completed from `model.pretrained` when the kind reads it from there
        (model=hf/auto), with the file it was read from; else as it is, with None."""
        return cfg, None

    def describe_read(self, cfg: ModelConfig, read_from: str) -> str | None:
        """What `read_pretrained` read, for the record and the console."""
        return None

    def overrides(self, cfg: ModelConfig) -> str:
        """The command-line overrides that select this model again (as composed)."""
        return f"model={cfg.name}"

    def context(self, cfg: ModelConfig) -> tuple[int, str] | None:
        """The sequence the model was made for and the key that says so; None: unknown."""
        return (cfg.context_len, "model.context_len") if cfg.context_len else None

    def check_sequence(self, cfg: ModelConfig, seq_len: int) -> None:
        """Refuse a train.seq_len the model's attention or positions cannot hold."""

    def check_context_parallel(self, cfg: ModelConfig, seq_len: int, cp: int) -> None:
        """Refuse a sequence of `seq_len` split over `cp` > 1 ranks where the model's
        attention is more than CP's causal attention computes."""

    def moe(self, cfg: ModelConfig) -> MoEConfig | None:
        """The settings of meshrun's own MoE blocks (models/moe.py: its routers, its
        balancing, experts TP can split; `experts` 0: dense), None where the kind has none."""
        return None

    def check_expert_split(self, cfg: ModelConfig, etp: int) -> None:
        """Refuse parallel.ep / parallel.etp where the model's experts cannot be split so."""

    def hf_form_refused(self, cfg: ModelConfig) -> tuple[str, str] | None:
        """Why checkpoint.export=hf cannot save this model and what would be valid; None
        where it can (`save_hf`)."""
        return "this model kind has no Hugging Face form", "torch (a consolidated state dict)"

    def save_hf(self, model: nn.Module, cfg: ModelConfig, out: Path) -> None:
        """Write `model` (its whole state, unpadded) as a Hugging Face save_pretrained
        directory `out`."""
        raise ValueError(f"model.kind={cfg.kind} has no Hugging Face form: export it as torch")

    def own_ties(self, cfg: ModelConfig) -> bool:
        """Whether the model's tied parameters are the module's own (refused under a
        pipeline: no tied-gradient sum between its ends), not meshrun's tied head copy."""
        return False

    def finds_head(self, cfg: ModelConfig) -> bool:
        """Whether the built model names its head (`output`), which train.loss=chunked runs
        the loss inside (rank/parallel/loss.py)."""
        return True

    def head_is_linear(self, cfg: ModelConfig) -> bool:
        """Whether the built model's head is a plain nn.Linear, whose weight (and bias)
        Liger's fused linear cross-entropy takes in its place (train.loss_kernel)."""
        return False

    def tp_shards_head(self, cfg: ModelConfig) -> bool:
        """Whether the model's TP plan shards its head over the vocabulary (a `head` entry),
        which train.loss=vocab_parallel computes the loss on."""
        return True

    def decoder(self, cfg: ModelConfig) -> LlamaModelConfig | None:
        """meshrun's decoder config this model is, for what calibration measures on a small
        block of its kind; None: counted as meshrun's LLaMA block."""
        return None
