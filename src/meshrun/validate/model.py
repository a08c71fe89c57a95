"""The model's rules: meshrun's own decoder's sizes, and that a `pretrained` Llama
checkpoint is one it can hold, of the preset's sizes; for a Hugging Face model, that
transformers is installed, the architecture exists and can be cut into stages, every config
key is one its config class has, a `pretrained` directory matches the preset, and the
sequence fits its attention and positions; for a user's module, validate/custom.py.

model=hf/auto (`model.architecture=auto`) is decided here too (`read_pretrained`, called by
every command that resolves an experiment before its rules): the architecture and config are
those of `model.pretrained`'s config.json."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import shlex
from pathlib import Path
from typing import Any

from meshrun.core.config import (
    CustomModelConfig,
    ExperimentConfig,
    HFModelConfig,
    LlamaModelConfig,
    ModelConfig,
)
from meshrun.core.errors import fail, positive
from meshrun.core.model_shape import ffn_dim, head_dim, kv_heads
from meshrun.validate.custom import check_custom

# model=hf/auto's architecture (conf/model/hf/auto.yaml): read from model.pretrained.
AUTO = "auto"


def check_model(m: ModelConfig, read_from: str | None = None) -> None:
    """`read_from`: the config.json model=hf/auto was read from, which its checkpoint then
    matches by construction (read_pretrained checked the overrides)."""
    positive("model.context_len", m.context_len, allow_none=True)
    if isinstance(m, HFModelConfig):
        _check_hf(m, read_from)
    elif isinstance(m, CustomModelConfig):
        check_custom(m)
    else:
        _check_llama(m)


def check_sequence(cfg: ExperimentConfig) -> None:
    """What a transformers model's attention and positions hold of train.seq_len: meshrun
    runs full causal attention (no sliding-window mask), and a learned position table has
    rows for so many positions only."""
    m, seq = cfg.model, cfg.train.seq_len
    if not isinstance(m, HFModelConfig):
        return
    from meshrun.models import hf  # noqa: PLC0415 (optional dependency: meshrun[hf])

    c = hf.hf_config(m)
    window = getattr(c, "sliding_window", None) if getattr(c, "use_sliding_window", True) else None
    if window and seq > window:
        fail(
            "train.seq_len",
            seq,
            f"is longer than the model's sliding window "
            f"(model.config.sliding_window={window}), which meshrun's full causal attention "
            "does not apply",
            f"<= {window}, or model.config.sliding_window=null",
        )
    shipped = hf.SHIPPED_PLANS.get(m.architecture)
    if shipped and shipped.positions and seq > c.max_position_embeddings:
        fail(
            "train.seq_len",
            seq,
            f"is longer than the learned position table ({c.max_position_embeddings} positions)",
            f"<= {c.max_position_embeddings}, or a larger table in model.config",
        )


def model_context(m: ModelConfig) -> tuple[int, str] | None:
    """The sequence the model was made for and the key that says so: `model.context_len`
    (meshrun's presets: the pretraining sequence), else a transformers model's
    `max_position_embeddings` (its config as built: the preset's, or config.json's for
    model=hf/auto, over the class's defaults); None where neither is known."""
    if m.context_len:
        return m.context_len, "model.context_len"
    if isinstance(m, HFModelConfig):
        positions = getattr(_transformers(m).hf_config(m), "max_position_embeddings", None)
        if positions:
            return positions, "max_position_embeddings"
    return None


def _check_llama(m: LlamaModelConfig) -> None:
    for key in ("dim", "n_layers", "n_heads", "vocab_size"):
        positive(f"model.{key}", getattr(m, key))
    if m.head_dim is not None:
        positive("model.head_dim", m.head_dim)
    elif m.dim % m.n_heads:
        fail(
            "model.n_heads",
            m.n_heads,
            f"does not divide model.dim ({m.dim})",
            f"a divisor of {m.dim}, or model.head_dim set",
        )
    if head_dim(m) % 2:
        key = "model.head_dim" if m.head_dim is not None else "model.n_heads"
        fail(
            key,
            getattr(m, key.removeprefix("model.")),
            f"head dim {head_dim(m)} is odd; RoPE rotates pairs",
            "an even head dim (dim / n_heads, or model.head_dim)",
        )
    kv = m.n_kv_heads or m.n_heads
    if kv <= 0 or m.n_heads % kv:
        fail(
            "model.n_kv_heads",
            m.n_kv_heads,
            f"must divide model.n_heads ({m.n_heads})",
            f"a divisor of {m.n_heads}, or null for n_heads",
        )
    if m.pretrained is not None:
        _check_llama_pretrained(m)


def _check_llama_pretrained(m: LlamaModelConfig) -> None:
    if importlib.util.find_spec("safetensors") is None:
        fail(
            "model.pretrained",
            m.pretrained,
            "reading a checkpoint needs safetensors, which is not installed",
            "pip install 'meshrun[hf]'",
        )
    from meshrun.models import convert  # noqa: PLC0415 (optional dependency: meshrun[hf])

    saved = _saved_config(m.pretrained, convert.ARCHITECTURE)
    try:
        fields = convert.llama_config_from_hf(saved)
    except ValueError as err:
        fail(
            "model.pretrained",
            m.pretrained,
            str(err),
            "a Llama checkpoint meshrun's LLaMA "
            "can hold, or model=hf/... (transformers' own Llama) to load it",
        )
    preset = {**vars(m), "n_kv_heads": kv_heads(m), "ffn_dim": ffn_dim(m), "head_dim": head_dim(m)}
    for key, value in fields.items():
        if preset[key] != value:
            fail(
                "model.pretrained",
                m.pretrained,
                f"its config.json has "
                f"{convert.CONFIG_FIELDS[key]}={value!r}, the preset model.{key}={preset[key]!r}",
                f"model.{key}={value!r}, or a checkpoint of this preset",
            )


def read_pretrained(m: ModelConfig) -> tuple[ModelConfig, str | None]:
    """model=hf/auto: the architecture (config.json's `architectures[0]`) and the config (its
    fields that differ from that class's defaults: models/hf.saved_fields) read from
    `model.pretrained`, the `model.config` keys given explicitly over them (an override that
    changes a tensor's shape is refused: the checkpoint's weights would not fit), named
    `hf/<directory name>`, with the config.json it was read from; any other model as it is,
    with None. Refused: no `model.pretrained`, no config.json or weights there, an
    architecture meshrun cannot cut (with those it can)."""
    if not isinstance(m, HFModelConfig) or m.architecture != AUTO:
        return m, None
    if m.pretrained is None:
        fail(
            "model.pretrained",
            None,
            f"model={m.name} reads its architecture and config from a save_pretrained "
            "directory, and none is given",
            "model.pretrained=path/to/checkpoint (config.json and *.safetensors), or a "
            "preset: model=hf/<preset>",
        )
    hf = _transformers(m)
    saved = _saved_config(m.pretrained, None)
    architecture = (saved.get("architectures") or [None])[0]
    if not isinstance(architecture, str):
        fail(
            "model.pretrained",
            m.pretrained,
            "its config.json names no architecture (`architectures`)",
            "a directory a transformers model's save_pretrained wrote, or "
            "model.architecture=<class> with a preset: model=hf/<preset>",
        )
    if not hf.can_cut(architecture):
        fail(
            "model.pretrained",
            m.pretrained,
            f"holds {architecture} (config.json's architectures), which meshrun cannot cut "
            "into pipeline stages and shard: it is no transformers causal LM whose "
            "base_model_pp_plan is (embedding, layers, norm), and meshrun ships no plan for it",
            f"a checkpoint of {' | '.join(hf.supported_architectures())}",
        )
    read = hf.saved_fields(architecture, m.pretrained)
    _check_overrides(m, architecture, read)
    model = dataclasses.replace(
        m,
        name=f"hf/{Path(m.pretrained).resolve().name}",
        architecture=architecture,
        config={**read, **m.config},
    )
    return model, str(Path(m.pretrained) / "config.json")


def _check_overrides(m: HFModelConfig, architecture: str, read: dict[str, Any]) -> None:
    """An explicit model.config key wins over config.json's unless it changes the shape of a
    tensor the checkpoint holds (built on meta, only when there are overrides)."""
    from meshrun.models import hf  # noqa: PLC0415 (optional dependency: meshrun[hf])

    changed = {k: v for k, v in m.config.items() if read.get(k, ...) != v}
    if not changed:
        return
    _check_config_keys(m.config, hf.model_class(architecture))
    saved = hf.weight_shapes(architecture, read)
    for key, value in changed.items():
        shapes = hf.weight_shapes(architecture, {**read, key: value})
        name = next((n for n, s in shapes.items() if saved.get(n) != s), None)
        if name is not None:
            fail(
                f"model.config.{key}",
                value,
                f"changes {name} from {list(saved.get(name, ()))} (model.pretrained's "
                f"weights) to {list(shapes[name])}",
                f"{read.get(key, 'its default')!r} (config.json's), or no override",
            )


def describe_read(m: ModelConfig, read_from: str | None) -> str | None:
    """What model=hf/auto read from `read_from`, for the record and the console: the
    architecture, where from, the sizes; None for a model that was not read."""
    if not isinstance(m, HFModelConfig) or read_from is None:
        return None
    from meshrun.models import model_shape  # noqa: PLC0415 (transformers: meshrun[hf])

    s = model_shape(m)
    heads = f"{s.n_heads} heads" + (f" / {s.n_kv_heads} kv" if s.n_kv_heads != s.n_heads else "")
    return (
        f"{m.architecture} read from {read_from} (hidden {s.dim}, {s.n_layers} layers, "
        f"{heads}, ffn {s.ffn_dim}, vocab {s.vocab_size}, {'tied' if s.tied else 'untied'})"
    )


def model_overrides(m: ModelConfig) -> str:
    """The overrides that select the model (as composed, before read_pretrained) again: its
    preset, or hf/auto and the directory."""
    if isinstance(m, HFModelConfig) and m.architecture == AUTO:
        return f"model=hf/{AUTO} model.pretrained={shlex.quote(str(m.pretrained))}"
    return f"model={m.name}"


def _transformers(m: HFModelConfig):
    """models/hf.py, or a ConfigError where transformers is not installed."""
    if importlib.util.find_spec("transformers") is None:
        fail(
            "model.architecture",
            m.architecture,
            f"model={m.name} needs Hugging Face transformers, which is not installed",
            "pip install 'meshrun[hf]'",
        )
    from meshrun.models import hf  # noqa: PLC0415 (optional dependency: meshrun[hf])

    return hf


def _check_config_keys(config: dict[str, Any], cls: type) -> dict[str, Any]:
    """Every key a field of the class's config; its defaults."""
    defaults = cls.config_class().to_dict()
    for key, value in config.items():
        if key not in defaults:
            nearest = difflib.get_close_matches(key, list(defaults), n=1)
            fail(
                f"model.config.{key}",
                value,
                f"not a field of {cls.config_class.__name__}",
                f"model.config.{nearest[0]} (nearest)"
                if nearest
                else "a field of the config class",
            )
    return defaults


def _check_hf(m: HFModelConfig, read_from: str | None) -> None:
    if read_from is None:  # where a command did not read it before its rules
        m, read_from = read_pretrained(m)
    hf = _transformers(m)
    try:
        cls = hf.model_class(m.architecture)
    except ValueError:
        known = [n for n in dir(hf.transformers) if n.endswith("ForCausalLM")]
        nearest = difflib.get_close_matches(m.architecture, known, n=3)
        fail(
            "model.architecture",
            m.architecture,
            "is not a transformers model class",
            f"{' | '.join(nearest) or 'a *ForCausalLM class'} (nearest)",
        )
    defaults = _check_config_keys(m.config, cls)
    try:
        hf.stage_names(m.architecture, hf.hf_config(m))
    except ValueError as err:
        fail(
            "model.architecture",
            m.architecture,
            str(err),
            " | ".join(hf.supported_architectures()),
        )
    if m.pretrained is not None:
        _check_readable(m, cls)
    if m.pretrained is not None and read_from is None:  # what was read needs no check
        _check_pretrained(m, defaults)


def _check_readable(m: HFModelConfig, cls: type) -> None:
    """A checkpoint whose tensors transformers converts on load in a way meshrun cannot read
    a shard at a time (models/hf_files.py) is refused before launch."""
    from meshrun.models.hf_files import unreadable  # noqa: PLC0415 (optional: meshrun[hf])

    why = unreadable(m.architecture, cls.config_class.model_type)
    if why is not None:
        fail(
            "model.pretrained",
            m.pretrained,
            why,
            "no model.pretrained (seeded weights), or a checkpoint of another family",
        )


def _saved_config(pretrained: str, architecture: str | None) -> dict:
    """The config.json of a save_pretrained directory with safetensors (of `architecture`,
    unless None)."""
    root = Path(pretrained)
    if not (root / "config.json").is_file():
        fail(
            "model.pretrained",
            pretrained,
            "no config.json there",
            "a directory written by save_pretrained",
        )
    if not any(root.glob("*.safetensors")):
        fail(
            "model.pretrained",
            pretrained,
            "no .safetensors weights there",
            "save_pretrained(..., safe_serialization=True) output",
        )
    saved = json.loads((root / "config.json").read_text())
    if architecture is not None and architecture not in saved.get("architectures", [architecture]):
        fail(
            "model.pretrained",
            pretrained,
            f"holds {saved['architectures']}, the preset is {architecture}",
            f"a {architecture} checkpoint",
        )
    return saved


def _check_pretrained(m: HFModelConfig, defaults: dict) -> None:
    saved = _saved_config(m.pretrained, m.architecture)
    for key, value in m.config.items():
        if saved.get(key, defaults.get(key)) != value:
            fail(
                "model.pretrained",
                m.pretrained,
                f"its config.json has {key}={saved.get(key)!r}, the preset {value!r}",
                f"model.config.{key}={saved.get(key)!r}, or a checkpoint of this preset",
            )
