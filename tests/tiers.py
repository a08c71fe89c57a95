"""The suite's two tiers. CI (`make test`, .ci/run: under 12 minutes on two cores) runs the
fast tier: every behaviour proven once, on the cheapest case that exercises it. Of a matrix of
cases (layouts x models x features), CI keeps the cases no other fast case stands for; the
rest are marked slow and `make test-all` runs them: run it after a change to rank/, models/,
plan/ or the checkpoints."""

from __future__ import annotations

from collections.abc import Collection, Iterable

import pytest


def tiered(cases: Iterable, fast: Collection) -> list:
    """`cases` as pytest params, those not in `fast` marked slow."""
    return [pytest.param(case, marks=() if case in fast else pytest.mark.slow) for case in cases]
