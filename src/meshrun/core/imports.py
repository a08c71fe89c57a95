"""Import what a config names as "package.module:attribute" (e.g. parallel.tp_plan).

A user's own module is found in the current directory as well as on sys.path, in the driver
and in every rank process alike: `meshrun` started as a console script, and the ranks torch
elastic spawns, do not have the working directory on sys.path by themselves.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any


def import_target(path: str) -> Any:
    """The attribute `path` names; ImportError if the module cannot be imported, ValueError
    if it is not "module:attribute" or the module has no such attribute."""
    module, sep, name = path.partition(":")
    if not (module and sep and name):
        raise ValueError(f"{path!r} is not 'package.module:attribute'")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)  # after installed packages: a local file never shadows them
    target = getattr(importlib.import_module(module), name, None)
    if target is None:
        raise ValueError(f"module {module!r} has no attribute {name!r}")
    return target


def import_callable(path: str) -> Callable[..., Any]:
    """`import_target`, and ValueError if what it names cannot be called."""
    target = import_target(path)
    if not callable(target):
        raise ValueError(f"{path} is not a callable")
    return target
