"""A save_pretrained directory's tensors under the names of the transformers model built from
its config, each a source that reads only the box a rank asks for (shards.py).

transformers 5 holds some tensors in another form than its checkpoints store them and
converts on load: `conversion_mapping.get_model_conversion_mapping(model)` lists the
transforms, `core_model_loading.convert_and_load_state_dict_in_model` applies them (each
checkpoint key, in `dot_natural_key` order, through `rename_source_key`; a converter's keys
collected per source pattern, then its operations run over them). Renamings change a name
only (Mixtral's `block_sparse_moe.` is `mlp.`). Every MoE family's routed experts are stored
one expert at a time and held fused, 3-D: `mlp.experts.{i}.gate_proj.weight` and
`.up_proj.weight` (Mixtral's `block_sparse_moe.experts.{i}.w1.weight` and `.w3.weight`) are
`mlp.experts.gate_up_proj` [E, 2f, h], `MergeModulelist(dim=0)` stacking the experts then
`Concatenate(dim=1)` joining gate and up in that order (the experts' forward takes
`.chunk(2, dim=-1)` as gate, up); `experts.{i}.down_proj.weight` (`w2`) is
`experts.down_proj` [E, h, f], stacked. Here those operations compose lazy sources
(`Stacked`, `Concatenated`) over the saved tensors, so that an expert-parallel rank reads its
experts alone and an FSDP rank its dim-0 shard; a conversion of another kind is refused
(`unreadable`) before launch.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection

from transformers import PreTrainedModel
from transformers.conversion_mapping import (
    get_checkpoint_conversion_mapping,
    get_model_conversion_mapping,
)
from transformers.core_model_loading import (
    Concatenate,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
    WeightTransform,
    dot_natural_key,
    rename_source_key,
)

from meshrun.models.checkpoint_files import SavedTensors
from meshrun.models.shards import Concatenated, Source, Stacked


def conversions(hf: PreTrainedModel) -> list[WeightTransform]:
    """What from_pretrained applies to a checkpoint of `hf`'s class (legacy renamings too)."""
    return get_model_conversion_mapping(hf)


def unreadable(architecture: str, model_type: str) -> str | None:
    """Why meshrun cannot read the class's checkpoints (a conversion whose operations it has
    no lazy form of), or None. The class's own mapping, else its model_type's, as
    transformers looks them up (conversion_mapping.extract_weight_conversions_for_model)."""
    mapping = get_checkpoint_conversion_mapping(architecture)
    if mapping is None:
        mapping = get_checkpoint_conversion_mapping(model_type) or []
    for transform in mapping:
        if isinstance(transform, WeightConverter) and not _readable(transform):
            ops = ", ".join(type(op).__name__ for op in transform.operations)
            return (
                f"its checkpoints store {transform.target_patterns} as "
                f"{transform.source_patterns}, converted by {ops} on load, which meshrun "
                "cannot read a shard at a time"
            )
    return None


def _readable(converter: WeightConverter) -> bool:
    return all(
        isinstance(op, Concatenate) or (isinstance(op, MergeModulelist) and op.dim == 0)
        for op in converter.operations
    )


def saved_sources(
    saved: SavedTensors,
    transforms: list[WeightTransform],
    wanted: Collection[str],
    base_model_prefix: str,
) -> dict[str, Source]:
    """The `wanted` tensors (the model's names) among the directory's, as transformers names
    and converts each checkpoint key on load; a fused tensor's parts in transformers' order."""
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    converter_of = {pattern: c for c in converters for pattern in c.source_patterns}
    present = dict.fromkeys(wanted, True)  # rename_source_key's meta_state_dict
    sources: dict[str, Source] = {}
    parts: dict[str, dict[str, list[Source]]] = defaultdict(lambda: defaultdict(list))
    fused: dict[str, WeightConverter] = {}
    for key in sorted(saved.files, key=dot_natural_key):
        name, pattern = rename_source_key(key, renamings, converters, base_model_prefix, present)
        if name not in present and key in present:  # as transformers: a key it should not rename
            name, pattern = key, None
        if name not in present:
            continue
        if pattern is None:
            sources[name] = saved[key]
        else:
            parts[name][pattern].append(saved[key])
            fused[name] = converter_of[pattern]
    for name, by_pattern in parts.items():
        sources[name] = _converted(fused[name], by_pattern)
    return sources


def _converted(converter: WeightConverter, parts: dict[str, list[Source]]) -> Source:
    """The converter's operations (unreadable refused the others) over lazy sources:
    MergeModulelist stacks each pattern's list, Concatenate joins the patterns in the
    converter's order."""
    values: dict[str, Source | list[Source]] = dict(parts)
    for op in converter.operations:
        if isinstance(op, MergeModulelist):
            values = {pattern: Stacked(list(value)) for pattern, value in values.items()}
        elif isinstance(op, Concatenate):
            ordered = [_one(values[p]) for p in converter.source_patterns if p in values]
            values = {"": Concatenated(ordered, op.dim)}
        else:
            raise ValueError(f"{converter}: {type(op).__name__} has no lazy form here")
    [value] = values.values()
    return _one(value)


def _one(value: Source | list[Source]) -> Source:
    if isinstance(value, list):
        [value] = value
    return value
