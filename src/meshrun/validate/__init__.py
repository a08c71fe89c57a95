"""Every rule about a legal experiment, checked in the driver before any process starts: each
raises ConfigError naming the key, the bad value and what would be valid, and returns
nothing. The rules that hold whatever the layout (experiment.py), then, on a config the
resolution filled (driver/resolution.py: no `auto` backend or hardware, no -1 degrees), the
layout's (rules.check_layout) and the rest (rules.check_run). Choosing a layout
(`parallel=auto`) and the memory check are predictions, one layer up (plan/). Shapes of
values (types, unknown keys, unknown presets) are checked at compose time
(driver/compose.py).
"""

from meshrun.validate.experiment import check_experiment, check_logger
from meshrun.validate.hardware import check_backend
from meshrun.validate.rules import check_layout, check_run

__all__ = ["check_backend", "check_experiment", "check_layout", "check_logger", "check_run"]
