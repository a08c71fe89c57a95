"""The runs the MoE tests compare: tiny-moe on the layout tests' batch and steps, a layout's
against one device's (conftest.py's single_moe_steps)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.ranks import assert_steps_match, losses
from tests.test_layouts import COMMON as LAYOUTS_COMMON

COMMON = (*(o for o in LAYOUTS_COMMON if not o.startswith("model=")), "model=tiny-moe")
# the biases moved by the whole batch's loads (a fast rate: routing moves within the steps)
BIAS = ("model.moe.load_balance=bias", "model.moe.bias_update_rate=0.05")


def assert_trains_as_on_one_device(
    experiment: Callable, single_moe_steps: Callable, overrides: tuple[str, ...]
) -> None:
    """Losses and grad norms as one device's (its model.moe overrides alike), and every
    layer's routers seen and counted alike in every step (a pipeline's shape inference
    not counted)."""
    _, measured = experiment(*COMMON, *overrides)
    assert measured.ok, measured.meta.error
    single = single_moe_steps(*(o for o in overrides if o.startswith("model.moe")))
    assert_steps_match(measured.steps, single)
    for mine, ref in zip(measured.steps, single, strict=True):
        keys = {k for k in ("moe_max_load", "moe_dropped", "moe_aux_loss") if k in ref.to_json()}
        assert keys <= mine.to_json().keys()
        for key in keys:
            got, want = getattr(mine, key), getattr(ref, key)
            assert got == pytest.approx(want, rel=1e-5, abs=1e-9), (key, mine, ref)
        assert len(mine.moe_max_load_per_layer) == 4
    got = losses(measured)
    assert got[-1] < got[0]
