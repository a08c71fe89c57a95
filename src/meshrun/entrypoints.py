"""The console scripts' entry points: each imports its command only when it is called.

multiprocessing starts every rank (spawn and forkserver alike) by importing the driver's main
module again, as `__mp_main__`, and a console script's main module is a file that imports
the module its entry point names. Were that the command's own module, every rank of
`meshrun`, `meshrun-verify` or `meshrun-comm` would import the whole driver (Hydra,
matplotlib, the planner): 0.62 CPU-s a rank (benchmarks/rank_start.py), for nothing a rank
uses.
"""

from __future__ import annotations

import importlib

# Each console script's command: the module whose `main` it runs (`python -m` runs it too).
COMMANDS = {
    "meshrun": "meshrun.driver.cli",
    "meshrun-verify": "meshrun.tools.verify",
    "meshrun-plan": "meshrun.tools.plan.main",
    "meshrun-report": "meshrun.tools.report.main",
    "meshrun-comm": "meshrun.tools.comm.main",
    "meshrun-doctor": "meshrun.tools.doctor.main",
    "meshrun-collect": "meshrun.driver.collect",
}


def _command(script: str) -> None:
    importlib.import_module(COMMANDS[script]).main()


def meshrun() -> None:
    _command("meshrun")


def meshrun_verify() -> None:
    _command("meshrun-verify")


def meshrun_plan() -> None:
    _command("meshrun-plan")


def meshrun_report() -> None:
    _command("meshrun-report")


def meshrun_comm() -> None:
    _command("meshrun-comm")


def meshrun_doctor() -> None:
    _command("meshrun-doctor")


def meshrun_collect() -> None:
    _command("meshrun-collect")
