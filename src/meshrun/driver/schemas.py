"""Every config schema, registered once in Hydra's ConfigStore under its own name.

A primary config names its schema first in its defaults list (`- schema: experiment`, or
`- override schema: plan` in a config that includes train.yaml); a launcher preset picks its
own (`- local_schema` in conf/launcher/local.yaml). `hydra_command` registers them before
Hydra composes, so no console script depends on another's import side effects.
"""

from __future__ import annotations

from hydra.core.config_store import ConfigStore

from meshrun.core.config import LAUNCHER_SCHEMAS, MODEL_SCHEMAS, ExperimentConfig
from meshrun.driver.tool_config import (
    CommRunConfig,
    DoctorRunConfig,
    PlanCommandConfig,
    ReportConfig,
    VerifyExperimentConfig,
)

# group "schema" (package _global_): the root schema of a primary config
ROOT_SCHEMAS = {
    "experiment": ExperimentConfig,
    "plan": PlanCommandConfig,
    "verify": VerifyExperimentConfig,
    "comm": CommRunConfig,
    "doctor": DoctorRunConfig,
    "report": ReportConfig,
}
# group "launcher": the schema a conf/launcher/<name>.yaml selects
LAUNCHER_SCHEMA_NAMES = {f"{name}_schema": schema for name, schema in LAUNCHER_SCHEMAS.items()}
# group "schema/model": the schema of a model kind, which a model preset names first
# (`- /schema/model/hf@_here_`); not in group "model", where meshrun-report's `model=` filter
# would read as a preset choice
MODEL_SCHEMA_NAMES = MODEL_SCHEMAS


def register_schemas(store: ConfigStore | None = None) -> ConfigStore:
    """Idempotent: storing a schema converts its dataclass tree to a config again (a quarter
    of a compose's time), so the store is filled once and then left as it is."""
    store = store or ConfigStore.instance()
    if "experiment.yaml" in store.repo.get("schema", {}):
        return store
    for name, node in ROOT_SCHEMAS.items():
        store.store(group="schema", name=name, node=node, package="_global_")
    for name, node in LAUNCHER_SCHEMA_NAMES.items():
        store.store(group="launcher", name=name, node=node)
    for name, node in MODEL_SCHEMA_NAMES.items():
        store.store(group="schema/model", name=name, node=node)
    return store
