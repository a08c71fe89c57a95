"""What a launcher raises when a rank failed, or when Ctrl-C or SIGTERM stopped the ranks:
the one shape of a failure every launcher gives the driver."""

from __future__ import annotations

from meshrun.core.run_files.failures import first_failure

# A rank gone before its peers failed that recorded nothing (no exception, no watchdog exit)
# died by a signal torch elastic did not report (it reports one rank's exit only).
SIGNAL_UNSEEN = "a signal: gone before its peers failed, nothing recorded"


class RankFailure(RuntimeError):
    """A rank died; carries which one, its error and traceback (where it raised), or the
    signal that killed it (where it did not), so the run can be recorded as failed."""

    def __init__(
        self, rank: int, error: str, traceback: str | None = None, signal: str | None = None
    ) -> None:
        self.rank, self.error, self.traceback, self.signal = rank, error, traceback, signal
        if signal:
            super().__init__(f"rank {rank} was killed ({signal})" + (f", {error}" if error else ""))
        else:
            super().__init__(f"rank {rank} failed: {error}")

    def __reduce__(self) -> tuple:
        """Pickled by its fields (its message alone would not rebuild it), so that it can
        cross a process boundary."""
        return type(self), (self.rank, self.error, self.traceback, self.signal)


class RunInterrupted(RankFailure):
    """Ctrl-C or SIGTERM reached the driver, which stopped the ranks (a run that checkpoints
    has its ranks save first: theirs is the Stopped record instead)."""


def interrupted(signal_name: str, run_dir: str) -> RankFailure:
    """What a launcher raises once Ctrl-C or SIGTERM reached it and its ranks are stopped:
    the Stopped record of a run that saved first (it says how to resume), else that nothing
    was saved."""
    recorded = first_failure(run_dir)
    if recorded is not None:
        return RankFailure(*recorded)
    return RunInterrupted(
        0, f"interrupted by {signal_name}; without checkpoint.every_steps nothing was saved"
    )
