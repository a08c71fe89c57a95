"""`meshrun-plan [overrides]` (command.py), or `meshrun-plan calibrate [overrides]`
(calibrate.py): one console script, two commands on the same config."""

from __future__ import annotations

import sys

from meshrun.driver.command import hydra_command
from meshrun.tools.plan import command


def main() -> None:
    if "calibrate" not in sys.argv[1:]:
        command.main()
        return
    sys.argv.remove("calibrate")
    from meshrun.tools.plan import calibrate  # noqa: PLC0415 (multiprocessing: only it pays)

    hydra_command("plan", calibrate.run)()


if __name__ == "__main__":  # `python -m meshrun.tools.plan.main [calibrate]`, as the script
    main()
