"""The run's per-step records: rank 0 appends each log step's to `<run dir>/metrics.jsonl`
as it happens, which the driver reads once the ranks are done (completed or failed)."""

from __future__ import annotations

import json
from pathlib import Path

METRICS_FILE = "metrics.jsonl"


class MetricsLog:
    """Rank 0 appends each log step's records at once, so a crash keeps the steps done."""

    def __init__(self, path: Path | None) -> None:
        self.path = path

    def keep_before(self, step: int) -> None:
        """Drops the steps from `step` on, which a run resumed at `step` trains again."""
        if self.path is None or not self.path.exists():
            return
        kept = [line for line in self.path.read_text().splitlines()
                if line and json.loads(line)["step"] < step]  # fmt: skip
        self.path.write_text("".join(line + "\n" for line in kept))

    def __call__(self, records: list[dict]) -> None:
        if self.path is None:
            return
        with self.path.open("a") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
