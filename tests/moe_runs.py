"""The runs the MoE tests compare: tiny-moe on the layout tests' batch and steps."""

from __future__ import annotations

from tests.test_layouts import COMMON as LAYOUTS_COMMON

COMMON = (*(o for o in LAYOUTS_COMMON if not o.startswith("model=")), "model=tiny-moe")
# the biases moved by the whole batch's loads (a fast rate: routing moves within the steps)
BIAS = ("model.moe.load_balance=bias", "model.moe.bias_update_rate=0.05")
