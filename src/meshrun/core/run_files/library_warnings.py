"""The library warnings each rank noted: each distinct one once, a line of
`<run dir>/warnings/rank<N>.txt` (rank/library_warnings.py writes them as they come). Rank 0
printed its own; the driver prints those only other ranks raised."""

from __future__ import annotations

from pathlib import Path

WARNINGS_DIR = "warnings"


def warnings_file(run_dir: str, rank: int) -> Path:
    return Path(run_dir) / WARNINGS_DIR / f"rank{rank}.txt"


def other_ranks_warnings(run_dir: str) -> dict[str, list[int]]:
    """The warnings that ranks other than 0 raised and rank 0 did not, with those ranks."""
    ranks: dict[str, list[int]] = {}
    for path in (Path(run_dir) / WARNINGS_DIR).glob("rank*.txt"):
        for text in set(path.read_text().splitlines()):
            ranks.setdefault(text, []).append(int(path.stem.removeprefix("rank")))
    return {text: sorted(r) for text, r in sorted(ranks.items()) if 0 not in r}
