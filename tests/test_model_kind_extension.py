"""A model kind of one's own, from this module alone (no edit in src/): its config schema,
its builder and its rules (`ToyKind`, a models.kind.ModelKind), named by its import path in
`model.kind`. `meshrun` composes a preset of it, checks it (a bad value refused with exit 2
before any rank starts), trains it under DDP on real gloo ranks, which import the kind from
the same path to rebuild the config, and records the run; and no code in src/ dispatches on a
model config's class outside the registry, so such a kind is asked what meshrun's are."""

from __future__ import annotations

import ast
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from meshrun.core import config as schemas
from meshrun.core.config import ModelConfig
from meshrun.core.errors import ConfigError, positive
from meshrun.core.model_shape import ModelShape
from meshrun.core.paths import REPO_ROOT
from meshrun.models import ModelKind, build_model, model_kind, model_shape

KIND = f"{__name__}:ToyKind"


@dataclass
class ToyModelConfig(ModelConfig):
    """kind=ToyKind: an embedding, `n_layers` residual MLP blocks `dim` wide, a head."""

    kind: str = KIND
    vocab_size: int = 64
    dim: int = 16
    n_layers: int = 2


class ToyBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.tanh(self.up(h)))


class ToyLM(nn.Module):
    """The parts a layout works on (models/kind.py), no tensor parallelism of its own."""

    def __init__(self, cfg: ToyModelConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos_embeddings = None
        self.layers = nn.ModuleDict({str(i): ToyBlock(cfg.dim) for i in range(cfg.n_layers)})
        self.norm = nn.LayerNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.vocab_size = cfg.vocab_size

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h)
        return self.output(self.norm(h))

    def tp_plan(self) -> dict[str, str]:
        return {}

    def prepare_tp(self, tp: int) -> None:
        """Nothing to regroup."""

    def tie_weights(self) -> None:
        """Nothing tied."""

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for name, param in self.named_parameters():
            values = torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[-1])
            param.copy_(torch.ones(param.shape) if name == "norm.weight" else values)


class ToyKind(ModelKind):
    name = KIND
    schema = ToyModelConfig

    def build(self, cfg: ToyModelConfig, max_seq_len: int, device, vocab_multiple: int):
        with torch.device(device):
            return ToyLM(cfg)

    def shape(self, cfg: ToyModelConfig) -> ModelShape:
        return ModelShape(
            dim=cfg.dim,
            n_layers=cfg.n_layers,
            n_heads=None,
            n_kv_heads=None,
            vocab_size=cfg.vocab_size,
            ffn_dim=None,
            tied=False,
        )

    def check(self, cfg: ToyModelConfig, read_from: str | None) -> None:
        for key in ("vocab_size", "dim", "n_layers"):
            positive(f"model.{key}", getattr(cfg, key))


def toy_preset(tmp_path: Path, **values: int) -> str:
    """A conf/model/toy.yaml of the user's own, which names no schema (its kind types it);
    the override that adds its directory to Hydra's search path."""
    conf = tmp_path / "conf" / "model"
    conf.mkdir(parents=True)
    keys = "".join(f"{key}: {value}\n" for key, value in values.items())
    (conf / "toy.yaml").write_text(f"kind: {KIND}\nname: toy\n{keys}")
    return f"hydra.searchpath=[file://{tmp_path / 'conf'}]"


RUN = (
    "model=toy",
    "parallel=ddp",
    "launcher.nproc_per_node=2",
    "train.steps=4",
    "train.untimed_steps=1",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.seq_len=16",
    "metrics.baseline=off",
)
# the ranks import the kind from this module, as a user's from their working directory
ON_PATH = {"PYTHONPATH": str(REPO_ROOT)}


def test_the_registry_gives_the_users_kind_by_its_import_path():
    cfg = ToyModelConfig(name="toy")
    assert isinstance(model_kind(cfg), ToyKind)
    assert model_shape(cfg).n_layers == 2
    logits = build_model(cfg, 16, "cpu")(torch.zeros(1, 16, dtype=torch.long))
    assert logits.shape == (1, 16, 64)
    rebuilt = schemas.from_dict({**_plain_run_dict(), "model": {"kind": KIND, "name": "toy"}})
    assert rebuilt.model == cfg  # as a rank rebuilds it from the driver's plain dict


def _helpers():
    """tests/helpers.py (Hydra, the driver), imported by the tests: the ranks import this
    module for its kind only, as they would a user's."""
    from tests import helpers  # noqa: PLC0415 (see the docstring)

    return helpers


def _plain_run_dict() -> dict:
    return dataclasses.asdict(_helpers().compose_config("parallel=ddp"))


@pytest.mark.slow
def test_meshrun_trains_the_users_kind_under_ddp_and_records_it(meshrun, tmp_path):
    run = meshrun(toy_preset(tmp_path, dim=24), *RUN, env=ON_PATH)
    assert run.returncode == 0, run.output
    (row,) = run.stored()
    assert (row["model"], row["world_size"], row["steps_completed"]) == ("toy", 2, 4)
    assert len(row["losses"]) == 4
    assert all(math.isfinite(loss) for loss in row["losses"])


@pytest.mark.slow
def test_a_bad_value_of_the_users_kind_is_refused_before_launch(meshrun, tmp_path):
    search = toy_preset(tmp_path)
    refused = meshrun(search, *RUN, "model.dim=0", env=ON_PATH)
    assert refused.returncode == 2, refused.output
    assert "model.dim" in refused.output
    assert not list(refused.run_dir.glob("rank*"))  # no rank started
    typed = meshrun(search, *RUN, "model.dim=wide", env=ON_PATH)
    assert typed.returncode == 2, typed.output
    assert "model.dim" in typed.output
    unknown = meshrun(search, *RUN, "+model.depth=3", env=ON_PATH)
    assert unknown.returncode == 2, unknown.output
    assert "model.depth" in unknown.output


MODEL_CONFIGS = {
    name
    for name, value in vars(schemas).items()
    if isinstance(value, type) and issubclass(value, ModelConfig)
}
REGISTRY = Path("src/meshrun/models/registry.py")


def model_config_checks(source: str) -> list[int]:
    """The lines of `source` that ask isinstance of a model config class."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "isinstance"
            and len(node.args) == 2
        ):
            continue
        classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
        names = {c.id if isinstance(c, ast.Name) else getattr(c, "attr", None) for c in classes}
        if names & MODEL_CONFIGS:
            lines.append(node.lineno)
    return lines


def test_no_code_dispatches_on_a_model_configs_class_outside_the_registry():
    src = REPO_ROOT / "src"
    found = {
        f"{path.relative_to(REPO_ROOT)}:{line}"
        for path in src.rglob("*.py")
        if path.relative_to(REPO_ROOT) != REGISTRY
        for line in model_config_checks(path.read_text())
    }
    assert not found, "ask the kind (models/registry.model_kind), not the class: " + ", ".join(
        sorted(found)
    )


@pytest.mark.parametrize(
    ("kind", "problem"),
    [
        ("no_such_module:Kind", "nor an importable ModelKind"),
        ("hf", "is the kind of HFModelConfig"),
    ],
)
def test_a_model_kind_that_is_none_or_not_the_presets_is_refused(kind, problem):
    with pytest.raises(ConfigError, match=problem) as refused:
        _helpers().resolved_config("model=small", f"model.kind={kind}")
    assert refused.value.key == "model.kind"
