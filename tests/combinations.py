"""Every layout dimension with every feature, as a user asks for the pair, and what meshrun's
rules say of it: the table of combinations in docs/layouts.md is `table()`, written there by
`python -m tests.combinations` and compared with it by tests/test_combinations.py, so that it
cannot drift from the rules; the pairs the rules let run are run there by meshrun-verify.

The dimensions and the features come from the config's own choices (core/choices.py: each
pipeline schedule, CP method, checkpointing mode, loss, optimizer states' form), so a new one
gets its row or column. The rules are asked on a fixed CPU host (`HOST`), not this one: the
table is the rules', whatever machine writes it.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from meshrun.core.choices import Checkpointing, CpMethod, LossMethod, OptimizerStates, Schedule
from meshrun.core.config import ExperimentConfig
from meshrun.core.errors import ConfigError
from meshrun.core.hardware import HostFacts
from meshrun.core.layout import Layout
from meshrun.core.paths import REPO_ROOT
from meshrun.driver.compose import check_keys
from meshrun.driver.resolution import resolved_config
from tests.helpers import composed
from tests.test_custom_model import NAMED

HOST = HostFacts(cpu_count=16, memory_gib=64.0)
DOC = REPO_ROOT / "docs" / "layouts.md"
BEGIN, END = "<!-- combinations: begin -->", "<!-- combinations: end -->"
# What every pair trains: meshrun-verify's few steps of a small model on short sequences.
BASE = (
    "model=tiny",
    "parallel=single",
    "train.seq_len=64",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
)
MOE = "model=tiny-moe"
CUSTOM = (*NAMED, "model.positions=positions")


@dataclass(frozen=True)
class Axis:
    """A dimension (a row) or a feature (a column): its name and the overrides that ask for
    it; `experts`, a dimension that splits the experts (the pair's model is then an MoE)."""

    name: str
    overrides: tuple[str, ...]
    experts: bool = False


DIMENSIONS = (
    Axis("dp_replicate", ("parallel.dp_replicate=2",)),
    Axis("dp_shard", ("parallel.dp_shard=2",)),
    Axis("tp", ("parallel.tp=2",)),
    Axis("tp + SP", ("parallel.tp=2", "parallel.sequence_parallel=true")),
    *(
        Axis(
            f"pp {s.value}",
            (
                "parallel.pp=2",
                f"parallel.schedule={s.value}",
                *(("parallel.stages_per_rank=2",) if s.value.startswith("interleaved") else ()),
            ),
        )
        for s in Schedule
    ),
    *(Axis(f"cp {m.value}", ("parallel.cp=2", f"parallel.cp_method={m.value}")) for m in CpMethod),
    Axis("ep", ("parallel.dp_shard=2", "parallel.ep=2"), experts=True),
    Axis(
        "ep + etp",
        ("parallel.dp_shard=2", "parallel.tp=2", "parallel.ep=2", "parallel.etp=2"),
        experts=True,
    ),
)
FEATURES = (
    Axis("compile", ("train.compile=true",)),
    Axis("float8", ("train.float8.enabled=true",)),
    Axis("MoE", (MOE,)),
    *(
        Axis(f"checkpointing {c.value}", (f"parallel.activation_checkpointing={c.value}",))
        for c in Checkpointing
        if c.value != "none"
    ),
    Axis("gradient accumulation", ("train.micro_batch_size=1",)),
    Axis("torchft replicas", ("parallel.fault_tolerance=torchft",)),
    Axis("HF model", ("model=hf/tiny-llama",)),
    Axis("custom module", CUSTOM),
    *(Axis(f"loss {m.value}", (f"train.loss={m.value}",)) for m in LossMethod if m.value != "auto"),
    Axis("FSDP offload", ("parallel.fsdp.offload=cpu",)),
    Axis("activation offload", ("parallel.activation_offload=cpu",)),
    *(
        Axis(f"optimizer states {s.value}", (f"train.optimizer_states={s.value}",))
        for s in OptimizerStates
        if s.value != "fp32"
    ),
)
# An experts dimension takes the feature's model in its MoE form.
MOE_FORM = {"model=hf/tiny-llama": "model=hf/tiny-mixtral"}


def asked(dim: Axis, feature: Axis) -> tuple[str, ...]:
    """The pair's overrides, but the ranks its layout needs (`configured` adds them)."""
    said = [*BASE, *dim.overrides, *(MOE_FORM.get(o, o) for o in feature.overrides)]
    if dim.experts and not any(o.startswith("model=") and o != "model=tiny" for o in said):
        said.append(MOE)
    if "parallel.fault_tolerance=torchft" in said and "parallel.dp_replicate=2" not in said:
        said.append("parallel.dp_replicate=2")  # torchft's replicas are dp_replicate's
    return tuple(said)


def configured(dim: Axis, feature: Axis) -> tuple[ExperimentConfig, tuple[str, ...]]:
    """The pair's config and its overrides, with the ranks its layout needs. Hydra composes
    each choice of presets once (~0.1 s a compose, 221 pairs); the pair's own keys are merged
    into a copy, the schema checking them as Hydra's merge does (meshrun-verify composes the
    pair whole, test_combinations.py)."""
    said = asked(dim, feature)
    presets = tuple(o for o in said if "." not in o.split("=", 1)[0])
    keys = [o for o in said if o not in presets]
    cfg = OmegaConf.merge(_presets(presets), OmegaConf.from_dotlist(keys))
    check_keys(cfg)
    typed: ExperimentConfig = OmegaConf.to_object(cfg)
    ranks = Layout.of(typed.parallel).world_size
    launcher = dataclasses.replace(typed.launcher, nproc_per_node=ranks)
    return dataclasses.replace(typed, launcher=launcher), (
        *said,
        f"launcher.nproc_per_node={ranks}",
    )


@functools.cache
def _presets(presets: tuple[str, ...]) -> DictConfig:
    return composed(*presets)


def verdict(dim: Axis, feature: Axis) -> ConfigError | None:
    """The rules' refusal of the pair, or None: it runs. (A pair that does not compose is
    this module's mistake, raised.)"""
    cfg, _ = configured(dim, feature)
    try:
        resolved_config(cfg, HOST)
    except ConfigError as err:
        return err
    return None


def reason(err: ConfigError) -> str:
    """A refusal as the table lists it: the key the rule names and its problem, one line."""
    return re.sub(r"\s+", " ", f"`{err.key}`: {err.problem}").strip()


def table() -> str:
    """The grid (a dimension a row, a feature a column: ✓ runs, [n] refused) and the
    refusals' reasons, numbered."""
    reasons: list[str] = []
    rows = []
    for dim in DIMENSIONS:
        cells = []
        for feature in FEATURES:
            err = verdict(dim, feature)
            if err is None:
                cells.append("✓")
                continue
            said = reason(err)
            if said not in reasons:
                reasons.append(said)
            cells.append(f"[{reasons.index(said) + 1}]")
        rows.append(f"| {dim.name} | {' | '.join(cells)} |")
    header = f"| | {' | '.join(f.name for f in FEATURES)} |"
    rule = "|---" * (len(FEATURES) + 1) + "|"
    notes = [f"{n}. {r}" for n, r in enumerate(reasons, 1)]
    return "\n".join([header, rule, *rows, "", *notes])


def in_doc(text: str) -> str:
    """The table as docs/layouts.md holds it, between its markers."""
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def written(doc: str, generated: str) -> str:
    """`doc` with the table between its markers replaced by `generated`."""
    before, rest = doc.split(BEGIN, 1)
    return f"{before}{BEGIN}\n{generated}\n{END}{rest.split(END, 1)[1]}"


if __name__ == "__main__":
    path = Path(sys.argv[1]) if len(sys.argv) > 1 else DOC
    path.write_text(written(path.read_text(), table()))
