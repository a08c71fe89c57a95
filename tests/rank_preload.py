"""Imported once by the rank pool's fork server (tests/ranks.py): the workers forked from it
start with torch, the rank's code and the pool's own module (the target each worker unpickles)
already imported, one thread each."""

import os

os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: F401

import meshrun.rank.worker  # noqa: F401
import tests.ranks  # noqa: F401
