"""A file written whole or not at all. Ranks write their records while torch elastic may kill
them (a peer failed: SIGTERM, then SIGKILL), and readers follow files as they grow: a file
written in place and cut off is a torn record the driver then fails to read. Written beside
the target and renamed over it, a reader sees the old file or the new one, never part."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """`path` holds `text` (a new inode), or, if the writer dies first, what it held."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    partial.write_text(text)
    os.replace(partial, path)
