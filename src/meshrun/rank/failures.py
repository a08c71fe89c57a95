"""Which rank failed first. When one rank raises, its peers soon fail too (a closed
connection, a timed-out collective), often within the same second, which is all the
resolution torch elastic's error files have. Each rank therefore notes the exact time of its
own exception in the run dir, and the driver names the earliest."""

from __future__ import annotations

import json
import time
from pathlib import Path

FAILURES_DIR = "failures"


def record_failure(run_dir: str, rank: int, err: BaseException) -> None:
    folder = Path(run_dir) / FAILURES_DIR
    folder.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "time": time.time(), "error": f"{type(err).__name__}: {err}"}
    (folder / f"rank{rank}.json").write_text(json.dumps(record))


def forget_failure(run_dir: str, rank: int) -> None:
    (Path(run_dir) / FAILURES_DIR / f"rank{rank}.json").unlink(missing_ok=True)


def first_failure(run_dir: str) -> tuple[int, str] | None:
    """(rank, error) of the earliest recorded failure, or None if no rank recorded one."""
    records = [json.loads(p.read_text()) for p in (Path(run_dir) / FAILURES_DIR).glob("*.json")]
    if not records:
        return None
    first = min(records, key=lambda r: r["time"])
    return first["rank"], first["error"]
