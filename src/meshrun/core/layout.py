"""Rank order: the one place that knows which rank sits where; the one name of a layout
(`layout_name`), the overrides that run it again (`layout_overrides`; with the rest of the
command, `rerun_overrides`), its pipeline micro-batch count (`n_microbatches`), which layers
each pipeline stage holds and the bubble its schedule leaves in theory; all from a resolved
config, with no torch.

Ranks are laid out row-major over (pp, dp_replicate, dp_shard, tp): tensor-parallel peers are
adjacent ranks (same node, fastest links), pipeline stages the outermost dimension. This is
also init_device_mesh's order, so `rank_coords` (pure, for the driver and tests) and the
DeviceMesh a worker builds (rank/mesh.py) always agree.
"""

from __future__ import annotations

import dataclasses
import math
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from omegaconf import OmegaConf

from meshrun.core.choices import Schedule
from meshrun.core.config import ExperimentConfig, ParallelConfig
from meshrun.core.paths import CONF_DIR

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
# Schedules that run several stages on each pipeline rank (parallel.stages_per_rank > 1).
MULTI_STAGE_SCHEDULES = (Schedule["interleaved_1f1b"], Schedule["interleaved_zb"])
# parallel.pp_layers: the split chosen by measured cost on the ranks (rank/parallel/balance.py)
PP_AUTO = "auto"


@dataclass(frozen=True)
class Layout:
    """Resolved degrees of each mesh dimension (all >= 1)."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return math.prod(self.degrees().values())

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def uses_fsdp(self) -> bool:
        """Data parallelism through FSDP2: sharded, or replicated beside TP/PP (where DDP
        cannot hold DTensor parameters)."""
        return self.dp_shard > 1 or (self.dp_size > 1 and (self.tp > 1 or self.pp > 1))

    @classmethod
    def of(cls, parallel: ParallelConfig) -> Layout:
        """The layout of a resolved parallel config (no -1 degrees left)."""
        return cls(**{dim: getattr(parallel, dim) for dim in MESH_DIMS})

    def degrees(self) -> dict[str, int]:
        return {dim: getattr(self, dim) for dim in MESH_DIMS}

    def describe(self) -> str:
        """The non-trivial degrees, e.g. 'dp_shard2 x tp2' (for messages about degrees; a
        run's name is `layout_name`)."""
        parts = [f"{dim}{n}" for dim, n in self.degrees().items() if n > 1]
        return " x ".join(parts) or "single"


def rank_coords(layout: Layout, rank: int) -> dict[str, int]:
    """Coordinate of `rank` along each mesh dim (row-major, tp fastest)."""
    coords = {}
    for dim in reversed(MESH_DIMS):
        size = getattr(layout, dim)
        coords[dim] = rank % size
        rank //= size
    return {dim: coords[dim] for dim in MESH_DIMS}


def dp_rank(layout: Layout, rank: int) -> int:
    """Index among data-parallel peers: TP and PP peers share it (and thus their data)."""
    coords = rank_coords(layout, rank)
    return coords["dp_replicate"] * layout.dp_shard + coords["dp_shard"]


def n_microbatches(cfg: ExperimentConfig) -> int:
    """Micro-batches of one step on a data-parallel rank: its share of the global batch over
    `train.micro_batch_size` (the one knob; a pipeline's m, else gradient accumulation)."""
    p = cfg.parallel
    local = cfg.train.global_batch_size // max(1, p.dp_replicate * p.dp_shard)
    return max(1, local // cfg.train.micro_batch_size)


def stage_layer_counts(n_layers: int, n_stages: int, explicit: list[int] | None) -> list[int]:
    """Layers per stage: `explicit` as given, else as even as possible (earlier stages, which
    also hold the embedding, get no more than later ones)."""
    if explicit:
        return list(explicit)
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if stage >= n_stages - extra else 0) for stage in range(n_stages)]


def balanced_layer_counts(
    n_layers: int, block: list[float], first: float, last: float
) -> list[int]:
    """The split of `n_layers` over len(block) stages, each at least one layer, whose slowest
    stage is the fastest: stage s costs counts[s] * block[s], plus `first` on stage 0 (the
    embedding) and `last` on the last stage (norm, head, loss). Of equally slow splits, the
    one with fewer layers on earlier stages (as the even split). O(stages x layers^2)."""
    n_stages = len(block)
    # best[k]: (slowest stage, counts) of the stages so far holding k layers
    best: dict[int, tuple[float, tuple[int, ...]]] = {0: (0.0, ())}
    for stage in range(n_stages):
        extra = (first if stage == 0 else 0.0) + (last if stage == n_stages - 1 else 0.0)
        left = n_stages - stage - 1  # stages after this one, a layer each at least
        nxt: dict[int, tuple[float, tuple[int, ...]]] = {}
        for held, (slowest, counts) in best.items():
            for c in range(1, n_layers - held - left + 1):
                option = (max(slowest, c * block[stage] + extra), (*counts, c))
                if held + c not in nxt or option < nxt[held + c]:
                    nxt[held + c] = option
        best = nxt
    return list(best[n_layers][1])


def stage_costs(counts: list[int], block: list[float], first: float, last: float) -> list[float]:
    """Each stage's cost under `balanced_layer_counts`'s model."""
    n = len(counts)
    return [
        c * b + (first if s == 0 else 0.0) + (last if s == n - 1 else 0.0)
        for s, (c, b) in enumerate(zip(counts, block, strict=True))
    ]


def with_layers(cfg: ExperimentConfig, counts: list[int]) -> ExperimentConfig:
    """`cfg` with an explicit split: what `parallel.pp_layers=auto` chose, to run it again."""
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp_layers=counts))


def local_stage_ids(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    return [pp_rank + i * pp for i in range(stages_per_rank)]


def theoretical_bubble(pp: int, n_microbatches: int, stages_per_rank: int) -> float:
    """Idle fraction of a step: (p-1)/(m+p-1), or (p-1)/(v*m+p-1) interleaved (v stages a rank)."""
    return (pp - 1) / (stages_per_rank * n_microbatches + pp - 1)


def layout_name(cfg: ExperimentConfig) -> str:
    """The one readable name of a resolved config's layout, e.g. `ddp4(bucket-view)`,
    `hsdp2x2`, `fsdp-replicate2 x tp2`, `pp2(1f1b, m=4) x tp2, ckpt=full`; `single` for one
    device. Shown by the console, store, report, planner and W&B alike."""
    p = cfg.parallel
    if p.data_parallel == "dataparallel":
        parts = [f"dataparallel{p.dataparallel_devices}"]
    else:
        layout = Layout.of(p)
        parts = []
        if p.pp > 1:
            inner = [p.schedule]
            if p.stages_per_rank > 1:
                inner.append(f"{p.stages_per_rank} stages/rank")
            inner.append(f"m={n_microbatches(cfg)}")
            if p.pp_layers == PP_AUTO:
                inner.append("layers=auto")
            elif p.pp_layers:
                inner.append(f"layers=[{','.join(map(str, p.pp_layers))}]")
            parts.append(f"pp{p.pp}({', '.join(inner)})")
        if p.dp_replicate > 1 and p.dp_shard > 1:
            parts.append(f"hsdp{p.dp_replicate}x{p.dp_shard}")
        elif p.dp_shard > 1:
            parts.append(f"fsdp{p.dp_shard}")
        elif p.dp_replicate > 1 and layout.uses_fsdp:
            parts.append(f"fsdp-replicate{p.dp_replicate}")
        elif p.dp_replicate > 1:
            view = "(bucket-view)" if p.ddp.gradient_as_bucket_view else ""
            parts.append(f"ddp{p.dp_replicate}{view}")
        if p.tp > 1:
            extras = (["sp"] if p.sequence_parallel else []) + (
                [f"plan={p.tp_plan}"] if p.tp_plan else []
            )
            parts.append(f"tp{p.tp}" + (f"({', '.join(extras)})" if extras else ""))
    name = " x ".join(parts) or "single"
    if p.activation_checkpointing != "none":
        name += f", ckpt={p.activation_checkpointing}"
    return name


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
    fixed = {dim: getattr(shipped, dim) for dim in MESH_DIMS}
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
    key = override.lstrip("+~").split("=", 1)[0]
    return key in ("parallel", "train.micro_batch_size") or key.startswith(("parallel.", "hydra."))


def rerun_overrides(given: Sequence[str], cfg: ExperimentConfig) -> str:
    """The command-line overrides that run this experiment again: the ones it was given
    (model, data, batch, ...), less those the layout's replace with what was resolved (a
    planner's pick, `pp_layers=auto`'s split) and Hydra's own, then the layout's."""
    kept = [shlex.quote(o) for o in given if not _replaced_by_layout(o)]
    return " ".join([*kept, layout_overrides(cfg)])
