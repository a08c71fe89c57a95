"""Driver side: start the ranks of one experiment and bring back rank 0's measurements.

A launcher meets the Launcher protocol (launcher.py) and is registered by `launcher.name`
(registry.py, not re-exported here: it imports every launcher); dispatch.launch picks it."""

from meshrun.driver.launch.launcher import Launcher, Submitter
from meshrun.driver.launch.rank_entry import TRAIN, RankEntry
from meshrun.driver.launch.rank_failure import (
    SIGNAL_UNSEEN,
    RankFailure,
    RunInterrupted,
    interrupted,
)

__all__ = [
    "SIGNAL_UNSEEN",
    "TRAIN",
    "Launcher",
    "RankEntry",
    "RankFailure",
    "RunInterrupted",
    "Submitter",
    "interrupted",
]
