"""The rules of a Hugging Face transformers model (kind=hf): that transformers is installed,
the architecture exists and can be cut into stages, every config key is one its config class
has, a `pretrained` directory matches the preset, the sequence fits its attention and
positions, its experts can be split as asked (a kind's own rules live with the kind:
models/kind.py).

model=hf/auto (`model.architecture=auto`) is decided here too (`read_pretrained`, called by
every command that resolves an experiment before its rules): the architecture and config are
those of `model.pretrained`'s config.json."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import json
import shlex
from pathlib import Path
from typing import Any

from meshrun.core.config import HFModelConfig
from meshrun.core.errors import fail
from meshrun.core.model_shape import ModelShape
from meshrun.models import hf_experts
from meshrun.models.keys import from_key, model_key

# model=hf/auto's architecture (conf/model/hf/auto.yaml): read from model.pretrained.
AUTO = "auto"


def read_pretrained(m: HFModelConfig) -> tuple[HFModelConfig, str | None]:
    """model=hf/auto: the architecture (config.json's `architectures[0]`) and the config (its
    fields that differ from that class's defaults: models/hf.saved_fields) read from
    `model.pretrained`, the `model.config` keys given explicitly over them (an override that
    changes a tensor's shape is refused: the checkpoint's weights would not fit), named
    `hf/<directory name>`, with the config.json it was read from; any other model as it is,
    with None. Refused: no `model.pretrained`, no config.json or weights there, an
    architecture meshrun cannot cut (with those it can)."""
    if m.architecture != AUTO:
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
    hf = hf_module(m)
    saved = saved_config(m.pretrained, None)
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


def hf_module(m: HFModelConfig):
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


def check_hf(m: HFModelConfig, read_from: str | None) -> None:
    if read_from is None:  # where a command did not read it before its rules
        m, read_from = read_pretrained(m)
    hf = hf_module(m)
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


def saved_config(pretrained: str, architecture: str | None) -> dict:
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
    saved = saved_config(m.pretrained, m.architecture)
    for key, value in m.config.items():
        if saved.get(key, defaults.get(key)) != value:
            fail(
                "model.pretrained",
                m.pretrained,
                f"its config.json has {key}={saved.get(key)!r}, the preset {value!r}",
                f"model.config.{key}={saved.get(key)!r}, or a checkpoint of this preset",
            )


NO_EXPERTS = "meshrun finds no experts of transformers' form"


def check_hf_experts(m: HFModelConfig, etp: int) -> None:
    """transformers' experts are split over ep whatever they compute (models/hf_experts.py:
    plain SwiGLU by meshrun's compute, the rest by their own forward over the experts a rank
    holds); over the TP ranks (etp) only plain SwiGLU experts, whose hidden width meshrun
    splits itself (`unsplittable` names what another computes, on the model built on meta)."""
    why = _experts_refusal(*model_key(m))
    if why is not None and why.startswith(NO_EXPERTS):
        fail("parallel.ep", "> 1", f"{m.architecture}: {why}", "parallel.ep=1, parallel.etp=1")
    if why is not None and etp > 1:
        fail(
            "parallel.etp",
            etp,
            f"{m.architecture}'s experts cannot be split over the TP ranks: {why}; meshrun "
            "splits the hidden width of plain SwiGLU experts only (ep splits them whole)",
            "parallel.etp=1",
        )


@functools.lru_cache(maxsize=16)
def _experts_refusal(schema: type[HFModelConfig], cfg_json: str) -> str | None:
    """hf_experts.unsplittable of the model's first experts, built on meta once per model
    (the planner validates every ep candidate)."""
    from meshrun.models.hf import build_hf  # noqa: PLC0415 (optional: meshrun[hf])

    model = build_hf(from_key(schema, cfg_json), "meta")
    experts = next((e for e in model.modules() if hf_experts.is_hf_experts(e)), None)
    if experts is None:
        return f"{NO_EXPERTS} (3-D gate_up_proj and down_proj)"
    return hf_experts.unsplittable(experts)


def check_hf_context_parallel(m: HFModelConfig, seq: int, cp: int) -> None:
    """A sliding window is a mask (models/hf_attention.sliding_window_mask), which CP's
    attentions, causal over the whole sequence, do not take."""
    from meshrun.models import hf  # noqa: PLC0415 (optional dependency: meshrun[hf])
    from meshrun.models.hf_attention import sliding_windows  # noqa: PLC0415 (the same)

    windows = sliding_windows(hf.hf_config(m))
    if windows and seq > (window := min(windows.values())):
        fail(
            "parallel.cp",
            cp,
            f"context parallelism computes causal attention without a mask, and the model's "
            f"sliding window (model.config.sliding_window={window}) is one over "
            f"train.seq_len={seq}",
            f"cp=1, train.seq_len <= {window}, or model.config.sliding_window=null",
        )


def check_hf_sequence(m: HFModelConfig, seq: int) -> None:
    """What a learned position table holds of train.seq_len: rows for so many positions."""
    from meshrun.models import hf  # noqa: PLC0415 (optional dependency: meshrun[hf])

    c = hf.hf_config(m)
    shipped = hf.SHIPPED_PLANS.get(m.architecture)
    if shipped and shipped.positions and seq > c.max_position_embeddings:
        fail(
            "train.seq_len",
            seq,
            f"is longer than the learned position table ({c.max_position_embeddings} positions)",
            f"<= {c.max_position_embeddings}, or a larger table in model.config",
        )


def describe_hf_read(m: HFModelConfig, read_from: str, s: ModelShape) -> str:
    """What model=hf/auto read from `read_from`, for the record and the console: the
    architecture, where from, the sizes (`s`)."""
    heads = f"{s.n_heads} heads" + (f" / {s.n_kv_heads} kv" if s.n_kv_heads != s.n_heads else "")
    return (
        f"{m.architecture} read from {read_from} (hidden {s.dim}, {s.n_layers} layers, "
        f"{heads}, ffn {s.ffn_dim}, vocab {s.vocab_size}, {'tied' if s.tied else 'untied'})"
    )


def hf_positions(m: HFModelConfig) -> int | None:
    """A transformers model's `max_position_embeddings` (its config as built: the preset's,
    or config.json's for model=hf/auto, over the class's defaults); None where it has none."""
    return getattr(hf_module(m).hf_config(m), "max_position_embeddings", None) or None


def hf_overrides(m: HFModelConfig) -> str:
    """The overrides that select the model (as composed, before read_pretrained) again: its
    preset, or hf/auto and the directory."""
    if m.architecture == AUTO:
        return f"model=hf/{AUTO} model.pretrained={shlex.quote(str(m.pretrained))}"
    return f"model={m.name}"
