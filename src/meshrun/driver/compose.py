"""Compose-time checks: every key of a composed config is a field of its schema, and Hydra's
or OmegaConf's own composition errors read like any other config error (key, bad value,
valid choices, the nearest one), never with Hydra's hint to append with `+`.

`check_keys` walks the composed DictConfig: each node keeps the dataclass it was built from,
so a key that is not a field (added with `+`, which OmegaConf.to_object would silently drop)
is an error; open dicts (`backend.env`, `launcher.sbatch_extra`, ...) take any key.
`config_error` turns a composition exception into a ConfigError, or None for any other
exception. `StrictKeys` runs `check_keys` on every job of a multirun before the first starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import typing
from collections.abc import Callable
from enum import Enum
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import ConfigCompositionException, MissingConfigException
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from meshrun.core.config import LAUNCHER_SCHEMAS, MODEL_SCHEMAS, launcher_schema, model_schema
from meshrun.core.errors import ConfigError
from meshrun.core.paths import CONF_DIR
from meshrun.driver.sinks.console import print_error

NOT_A_PRESET = re.compile(r"Could not find '([^']+)'")
OPTIONS = re.compile(r"Available options in '([^']+)':\n((?:\t[^\n]*\n?)*)")
HIDDEN = "_schema"  # launcher/local_schema etc. are the presets' schemas, not presets


def nearest(word: str, options: list[str]) -> str | None:
    close = difflib.get_close_matches(word, options, n=1, cutoff=0.5)
    return close[0] if close else None


def _with_nearest(word: str, options: list[str], what: str, full: list[str] | None = None):
    """'<nearest> (nearest); <what>: a | b | c'."""
    listed = f"{what}: {' | '.join(options)}"
    near = nearest(word, options)
    if near is None:
        return listed
    shown = (full or options)[options.index(near)]
    return f"{shown} (nearest); {listed}"


def unknown_key(full_key: str, schema: type, value: object) -> ConfigError:
    parent, _, key = full_key.rpartition(".")
    names = [f.name for f in dataclasses.fields(schema)]
    where = parent or "the config"
    full = [f"{parent}.{n}" if parent else n for n in names]
    problem = f"not a key of {where}"
    if parent == "launcher":  # a key of the other launcher's schema?
        owners = [
            f"launcher={name}"
            for name, other in LAUNCHER_SCHEMAS.items()
            if other is not schema and key in {f.name for f in dataclasses.fields(other)}
        ]
        here = getattr(schema, "name", None)
        problem = f"not a key of launcher={here}" + (
            f" ({', '.join(owners)} has it)" if owners else ""
        )
    return ConfigError(
        full_key,
        value,
        problem,
        _with_nearest(key, names, f"keys of {where}", full),
    )


def type_model(cfg: DictConfig) -> None:
    """A model preset that names no schema (a kind from a user's module: `kind:
    package.module:attribute`, docs/architecture.md) is typed here by its kind's `schema`, so
    its keys are checked and its values converted as a built-in preset's are at compose
    time; a ConfigError where `model.kind` names nothing importable."""
    valid = f"{' | '.join(MODEL_SCHEMAS)}, or package.module:attribute of a ModelKind"
    _type_by(cfg, "model", "kind", model_schema, ("model kind", valid))


def type_launcher(cfg: DictConfig) -> None:
    """A launcher preset that names no schema (a user's launcher: `name:
    package.module:attribute`), typed by its Launcher's `schema`, as `type_model` types a
    model's."""
    valid = f"{' | '.join(LAUNCHER_SCHEMAS)}, or package.module:attribute of a Launcher"
    _type_by(cfg, "launcher", "name", launcher_schema, ("launcher", valid))


def _type_by(
    cfg: DictConfig,
    group: str,
    key: str,
    schema_of: Callable[[str], type],
    named_what: tuple[str, str],
) -> None:
    """`cfg[group]` typed by the schema its `key` names; `named_what`: what that names, and
    what would be valid."""
    node = cfg.get(group)
    if not isinstance(node, DictConfig) or dataclasses.is_dataclass(OmegaConf.get_type(node)):
        return
    named, (what, valid) = node.get(key), named_what
    try:
        schema = schema_of(str(named))
    except (ImportError, ValueError) as err:
        raise ConfigError(
            f"{group}.{key}",
            named,
            f"names no {what} ({err})",
            f"{valid}, importable from the current directory",
        ) from err
    values = OmegaConf.to_container(node, resolve=False)
    cfg[group] = OmegaConf.structured(schema)
    cfg.merge_with({group: values})


def check_keys(cfg: DictConfig) -> None:
    """Raise ConfigError for the first key that is not a field of its node's schema (a
    schema-less model or launcher typed first: `type_model`, `type_launcher`)."""
    type_model(cfg)
    type_launcher(cfg)
    _walk(cfg, "")


def _walk(node: DictConfig | ListConfig, prefix: str) -> None:
    if node._is_none() or node._is_missing():
        return
    if isinstance(node, ListConfig):
        for index, item in enumerate(node._iter_ex(resolve=False)):
            if isinstance(item, DictConfig | ListConfig):
                _walk(item, f"{prefix}[{index}]")
        return
    schema = OmegaConf.get_type(node)
    if not dataclasses.is_dataclass(schema):
        return  # an open dict (backend.env, launcher.sbatch_extra, ...) takes any key
    names = {f.name for f in dataclasses.fields(schema)}
    for key in node:
        if not prefix and key == "hydra":
            continue
        full_key = f"{prefix}.{key}" if prefix else str(key)
        child = node._get_node(key)
        if key not in names:
            raise unknown_key(full_key, schema, _raw(child))
        if isinstance(child, DictConfig | ListConfig):
            _walk(child, full_key)


def _raw(node: Any) -> object:
    try:
        return OmegaConf.to_container(node, resolve=False)
    except (AttributeError, ValueError):
        return node._value()


def _describe(schema: type | None, key: str) -> str | None:
    """What a field accepts, in words, from its type hint."""
    if schema is None or not dataclasses.is_dataclass(schema):
        return None
    try:
        hint = typing.get_type_hints(schema).get(key)
    except (NameError, TypeError):  # a hint we cannot resolve: no description
        return None
    if hint is None:
        return None
    args = typing.get_args(hint)
    optional = type(None) in args
    if optional:
        hint = next(a for a in args if a is not type(None))
    origin = typing.get_origin(hint) or hint
    words = {
        int: "an integer",
        float: "a number",
        bool: "true | false",
        str: "a string",
        list: "a list",
        dict: "a mapping",
    }.get(origin)
    if isinstance(origin, type) and issubclass(origin, Enum):
        words = " | ".join(str(m.value) for m in origin)
    if words is None:
        return None
    return f"{words}, or null" if optional else words


def _override_value(key: str, overrides: list[str]) -> object:
    """What the command line set `key` to: its value, or for a key only given below it (an
    unknown `trian.steps=3`), those keys and values ({'steps': '3'}); None if neither."""
    below: dict[str, str] = {}
    for override in reversed(overrides):
        name, sep, value = override.lstrip("+~").partition("=")
        if sep and name == key:
            return value
        if sep and name.startswith(f"{key}."):
            below.setdefault(name.removeprefix(f"{key}."), value)
    return below or None


def _group_options(group: str, message: str) -> list[str]:
    found = OPTIONS.search(message)
    if found:
        options = [line.strip() for line in found.group(2).splitlines() if line.strip()]
    else:
        options = sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))
    return [o for o in options if not o.endswith(HIDDEN)]


def config_error(exc: BaseException, overrides: list[str]) -> ConfigError | None:
    """The ConfigError a composition exception means, or None if it is none."""
    if isinstance(exc, ConfigError):
        return exc
    if isinstance(exc, MissingConfigException):
        return _missing_preset(exc, overrides)
    cause = exc.__cause__ if isinstance(exc, ConfigCompositionException) else exc
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        return _omegaconf_error(cause, overrides)
    if isinstance(exc, ConfigCompositionException):
        return _composition_error(str(exc), overrides)
    if type(exc).__name__ == "OverrideParseException":
        return ConfigError(
            "overrides",
            " ".join(overrides),
            str(exc).splitlines()[0],
            "key=value, group=preset, or key=a,b,c to sweep with -m",
        )
    return None


def _composition_error(message: str, overrides: list[str]) -> ConfigError:
    """Hydra's own override errors, e.g. a group this config does not have, or `+` on a key
    that exists; without its advice to append with `+`."""
    first = message.splitlines()[0].rstrip(".")
    quoted = re.search(r"'([^']+)'", first)
    key = quoted.group(1) if quoted else "overrides"
    value = _override_value(key, overrides) if quoted else " ".join(overrides)
    if "No match in the defaults list" in first:
        return ConfigError(
            key,
            value,
            "not a config group of this command",
            "a group of its defaults list (conf/<command>.yaml)",
        )
    if "An item is already at" in first:
        return ConfigError(
            key,
            value,
            "already set by the config (`+` adds a new key)",
            f"{key}=<value> to change it",
        )
    return ConfigError(key, value, first, "see `--help` and conf/ for the keys and presets")


def _missing_preset(exc: MissingConfigException, overrides: list[str]) -> ConfigError | None:
    message = str(exc)
    found = NOT_A_PRESET.search(message)
    if not found or "/" not in found.group(1):
        return ConfigError(
            "config",
            found.group(1) if found else None,
            message.splitlines()[0],
            "a config under conf/",
        )
    group, _, name = found.group(1).rpartition("/")
    options = _group_options(group, message)
    key = group.replace("/", ".")
    return ConfigError(
        key,
        name,
        f"no such preset (conf/{group}/{name}.yaml)",
        _with_nearest(name, options, f"{key} presets") if options else "a file in conf/",
    )


def _omegaconf_error(cause: OmegaConfBaseException, overrides: list[str]) -> ConfigError:
    full_key = str(cause.full_key)
    schema = getattr(cause, "object_type", None)
    value = _override_value(full_key, overrides)
    if value is None:
        value = getattr(cause, "value", None)
    message = str(getattr(cause, "msg", None) or cause).splitlines()[0]
    unknown = message.startswith("Key '") and " not in " in message
    if unknown and dataclasses.is_dataclass(schema):
        return unknown_key(full_key, schema, value)
    key = full_key.rpartition(".")[2]
    valid = _describe(schema, key) or "see the schema in core/config.py"
    enum_values = re.match(r"Invalid value '([^']*)', expected one of \[(.*)\]", message)
    if enum_values:
        options = [o.strip() for o in enum_values.group(2).split(",")]
        return ConfigError(
            full_key, value, "unknown choice", _with_nearest(str(value), options, "choices")
        )
    problem = message.replace("$VALUE", str(value)).rstrip(".")
    if "could not be converted" in problem or "is not Optional" in problem:
        problem = f"wrong type ({problem})"
    return ConfigError(full_key, value, problem, valid)


class StrictKeys(Callback):
    """Hydra callback: before a multirun's first job, compose every job as the sweeper will
    and check its keys, so a bad grid point stops the sweep before anything starts. Hydra
    turns a callback's exceptions into warnings, so a config error exits here (code 2)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        loader = GlobalHydra.instance().config_loader()
        params = config.hydra.sweeper.get("params") or {}
        arguments = [f"{k}={v}" for k, v in params.items()]
        arguments += list(OmegaConf.to_container(config.hydra.overrides.task, resolve=False))
        parsed = OverridesParser.create(config_loader=loader).parse_overrides(arguments)
        for batch in BasicSweeper.split_arguments(parsed, None):
            for job in batch:
                try:
                    check_keys(loader.load_sweep_config(config, list(job)))
                except Exception as exc:
                    error = config_error(exc, list(job))
                    if error is None:
                        return
                    print_error("config error", str(error))
                    raise SystemExit(2) from None
