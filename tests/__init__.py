"""The test suite. Imported before any test module, conftest included, so before torch.

The suite runs more ranks than the box has cores (two modules' runs at once, and in CI the
lane beside them). An OpenMP thread of a rank computing on two threads (a single-device run
takes every core) spin-waits at each barrier by default (libgomp), burning the CPU that the
other ranks need: two copies of test_layouts + test_checkpoint at once took 243 CPU-s with
the default, 174 with passive waits (82 and 80 alone). libgomp reads the setting as torch
loads it, so every process the suite starts (rank pool, CLI runs and their ranks, SLURM jobs)
inherits it from here; one set outside is kept."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
