"""A rank entry that tells whether its module was imported before its process started: by
a forkserver's preload, which the ranks fork from (tests/test_local_launcher.py)."""

from __future__ import annotations

import os

IMPORTED_IN = os.getpid()


def imported_elsewhere(cfg_dict: dict) -> bool:
    return os.getpid() != IMPORTED_IN
