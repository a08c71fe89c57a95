"""The one name of a layout (`layout_name`), the overrides that run it again
(`layout_overrides`; with the rest of the command, `rerun_overrides`) and the parallel presets
they refer to (conf/parallel), from a resolved config."""

from __future__ import annotations

import dataclasses
import re
import shlex
from collections.abc import Sequence
from functools import cache

from omegaconf import OmegaConf

from meshrun.core.batch import n_microbatches
from meshrun.core.config import ExperimentConfig, ParallelConfig
from meshrun.core.layout import Layout, config_degrees
from meshrun.core.paths import CONF_DIR
from meshrun.core.stages import PP_AUTO


def layout_name(cfg: ExperimentConfig) -> str:
    """The one readable name of a resolved config's layout, e.g. `ddp4(bucket-view)`,
    `hsdp2x2`, `fsdp-replicate2 x tp2`, `fsdp2 x cp2(ring)`, `fsdp4 x ep2`, `fsdp8(offload)`,
    `fsdp1(offload)` (one device's state in host memory),
    `pp2(1f1b, m=4) x tp2, ckpt=full, activation offload`; `single` for one device. Shown
    by the console, store, report, planner and W&B alike."""
    p = cfg.parallel
    if p.data_parallel == "dataparallel":
        parts = [f"dataparallel{p.dataparallel_devices}"]
    else:
        parts = [_pipeline_part(cfg)] if p.pp > 1 else []
        parts += _data_parts(p)
        if p.cp > 1:
            parts.append(f"cp{p.cp}({p.cp_method})")
        if p.ep > 1:
            parts.append(f"ep{p.ep}")
        if p.tp > 1:
            extras = (
                (["sp"] if p.sequence_parallel else [])
                + (["etp"] if p.etp > 1 else [])
                + ([f"plan={p.tp_plan}"] if p.tp_plan else [])
            )
            parts.append(f"tp{p.tp}" + (f"({', '.join(extras)})" if extras else ""))
    name = " x ".join(parts) or "single"
    if p.activation_checkpointing != "none":
        name += f", ckpt={p.activation_checkpointing}"
        if p.checkpoint_every > 1:
            name += f"/{p.checkpoint_every}"
    if p.activation_offload == "cpu":
        name += ", activation offload"
    return name


def _pipeline_part(cfg: ExperimentConfig) -> str:
    p = cfg.parallel
    inner = [p.schedule]
    if p.stages_per_rank > 1:
        inner.append(f"{p.stages_per_rank} stages/rank")
    inner.append(f"m={n_microbatches(cfg)}")
    if p.pp_layers == PP_AUTO:
        inner.append("layers=auto")
    elif p.pp_layers:
        inner.append(f"layers=[{','.join(map(str, p.pp_layers))}]")
    return f"pp{p.pp}({', '.join(inner)})"


def _data_parts(p: ParallelConfig) -> list[str]:
    offload = "(offload)" if p.fsdp.offload == "cpu" else ""
    if p.dp_replicate > 1 and p.dp_shard > 1:
        return [f"hsdp{p.dp_replicate}x{p.dp_shard}{offload}"]
    if p.dp_shard > 1:
        return [f"fsdp{p.dp_shard}{offload}"]
    if p.dp_replicate > 1 and Layout.of(p).uses_fsdp:
        return [f"fsdp-replicate{p.dp_replicate}{offload}"]
    if p.dp_replicate > 1:
        return [f"ddp{p.dp_replicate}" + ("(bucket-view)" if p.ddp.gradient_as_bucket_view else "")]
    return [f"fsdp1{offload}"] if offload else []  # FSDP2 over one rank, for its offload


@cache
def _preset(name: str) -> ParallelConfig | None:
    """conf/parallel/<name>.yaml on the schema, or None where there is no such preset."""
    path = CONF_DIR / "parallel" / f"{name}.yaml"
    if not re.fullmatch(r"[\w.-]+", name) or not path.is_file():
        return None
    merged = OmegaConf.merge(OmegaConf.structured(ParallelConfig), OmegaConf.load(path))
    return OmegaConf.to_object(merged)


def preset_names() -> list[str]:
    """The parallel presets (conf/parallel/*.yaml)."""
    return sorted(p.stem for p in (CONF_DIR / "parallel").glob("*.yaml"))


def is_preset_layout(preset: str, degrees: dict[str, int]) -> bool:
    """Whether a run of `preset` with these mesh degrees is the preset as shipped: every
    degree the preset fixes unchanged (a -1 degree, filled from the ranks, may be any)."""
    shipped = _preset(preset)
    if shipped is None:
        return False
    fixed = config_degrees(shipped)
    return all(n == -1 or degrees.get(dim, 1) == n for dim, n in fixed.items())


def _flat(value, prefix: str) -> dict:
    if dataclasses.is_dataclass(value):
        out = {}
        for f in dataclasses.fields(value):
            out.update(_flat(getattr(value, f.name), f"{prefix}.{f.name}"))
        return out
    return {prefix: value}


def _literal(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list | tuple):
        return f"[{','.join(map(_literal, value))}]"
    return str(value)


def layout_overrides(cfg: ExperimentConfig) -> str:
    """The command-line overrides that run this layout again: its preset (`single` where it
    has none, e.g. a planner's pick) and each parallel key that differs from the preset,
    then the micro-batch size (which sets the micro-batch count)."""
    p = cfg.parallel
    preset = _preset(p.name) if p.name != "auto" else None
    base = preset or ParallelConfig(name="single")
    parts = [f"parallel={base.name}"]
    if preset is None and p.name != "auto" and re.fullmatch(r"[\w.-]+", p.name):
        parts.append(f"parallel.name={p.name}")
    given, default = _flat(p, "parallel"), _flat(base, "parallel")
    parts += [
        f"{key}={_literal(value)}"
        for key, value in given.items()
        if key != "parallel.name" and value != default[key]
    ]
    parts.append(f"train.micro_batch_size={cfg.train.micro_batch_size}")
    return " ".join(parts)


def _replaced_by_layout(override: str) -> bool:
    """The layout's keys, Hydra's own, and plan.trials' (the layout they chose is given)."""
    key = override.lstrip("+~").split("=", 1)[0]
    layout = ("parallel", "train.micro_batch_size", "plan.trials", "plan.trials_only")
    return key in layout or key.startswith(("parallel.", "hydra.", "plan.trial_"))


def rerun_overrides(given: Sequence[str], cfg: ExperimentConfig) -> str:
    """The command-line overrides that run this experiment again: the ones it was given
    (model, data, batch, ...), less those the layout's replace with what was resolved (a
    planner's pick, `pp_layers=auto`'s split) and Hydra's own, then the layout's."""
    kept = [shlex.quote(o) for o in given if not _replaced_by_layout(o)]
    return " ".join([*kept, layout_overrides(cfg)])
