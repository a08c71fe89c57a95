"""Driver side: start the ranks of one experiment and bring back rank 0's measurements."""

from __future__ import annotations


class RankFailure(RuntimeError):
    """A rank died; carries which one and its error so the run can be recorded as failed."""

    def __init__(self, rank: int, error: str) -> None:
        self.rank = rank
        self.error = error
        super().__init__(f"rank {rank} failed: {error}")
