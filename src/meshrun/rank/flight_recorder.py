"""Every rank's last collectives, on disk when a run fails (core/run_files/flight_records.py
reads them): torch's flight recorder keeps a ring of the collectives a rank issued, gloo's
and NCCL's; this module turns it on before the process group exists, and dumps it with
every thread's Python stack. A failing rank asks its peers for theirs and waits for them a
moment; each peer's watchdog thread (rank/watchdog.py) answers, whatever its main thread is
stuck in."""

from __future__ import annotations

import faulthandler
import json
import time
from collections.abc import Mapping

from torch._C._distributed_c10d import _dump_fr_trace_json

from meshrun.core.atomic_write import write_atomic
from meshrun.core.config import BackendConfig
from meshrun.core.run_files.flight_records import (
    REQUEST_FILE,
    TRANSFERS_KEY,
    dump_path,
    dumps_dir,
    stack_path,
)
from meshrun.rank.parallel import transfers

ENTRIES = 2000  # torchtitan's default ring (comm.trace_buf_size is 20,000 for NCCL)
PEER_WAIT_S = 3.0  # a watchdog thread polls each second


# NCCL's: its error handling (torch's default, 3, SkipCleanUp: a timed-out collective ends
# the process), and its flight recorder dumped by its heartbeat monitor when a collective
# times out or fails (ProcessGroupNCCL.hpp: TORCH_NCCL_DUMP_ON_TIMEOUT needs
# TORCH_NCCL_ENABLE_MONITORING and a ring; the ring's size under both names, the
# TORCH_NCCL_ one the older)
NCCL_ENV = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_NCCL_ENABLE_MONITORING": "1",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": str(ENTRIES),
}
# Where NCCL's dump goes, `<prefix><rank>`: torch reads the first of these that is set, an
# older torch only the second (torch/csrc/distributed/c10d/FlightRecorder.cpp,
# DebugInfoWriter::getWriter); one the environment or backend.env sets is left alone
DUMP_FILE_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
NCCL_DUMP_PREFIX = "nccl_rank"


def rank_env(backend: BackendConfig, run_dir: str, environ: Mapping[str, str]) -> dict[str, str]:
    """What a rank adds to `environ` before its process group exists: torch's flight
    recorder on for every backend; for the resolved backend nccl (backend=auto's choice
    too), NCCL's dump on a timeout, into the run's dumps folder. backend.env goes over
    these, and a variable `environ` already sets (the user's own export) is kept."""
    wanted = {"TORCH_FR_BUFFER_SIZE": str(ENTRIES)}
    if backend.name == "nccl":
        wanted |= NCCL_ENV
        if not any(name in environ or name in backend.env for name in DUMP_FILE_VARS):
            prefix = str(dumps_dir(run_dir) / NCCL_DUMP_PREFIX)
            wanted |= dict.fromkeys(DUMP_FILE_VARS, prefix)
    wanted |= backend.env
    return {name: value for name, value in wanted.items() if name not in environ}


def enable(backend: str, run_dir: str) -> None:
    """Before init_process_group (rank_env already applied): meshrun's record of a
    pipeline's transfers starts empty; on NCCL, the folder its watchdog dumps into exists
    (torch writes it with a plain open, which a missing folder fails)."""
    transfers.forget()
    if backend == "nccl":
        dumps_dir(run_dir).mkdir(parents=True, exist_ok=True)


def dump(run_dir: str, rank: int) -> None:
    """This rank's recorded collectives and its threads' stacks; the JSON written whole
    (a reader never sees half of it)."""
    folder = dumps_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    with stack_path(run_dir, rank).open("w") as f:
        faulthandler.dump_traceback(f, all_threads=True)
    try:
        trace = json.loads(_dump_fr_trace_json(True, False))
    except RuntimeError as err:  # no process group, or a backend without a recorder
        trace = {"entries": [], "error": str(err)}
    trace[TRANSFERS_KEY] = transfers.recorded()  # a pipeline's, which gloo does not record
    write_atomic(dump_path(run_dir, rank), json.dumps(trace))


def requested(run_dir: str) -> bool:
    return (dumps_dir(run_dir) / REQUEST_FILE).exists()


def dump_all(run_dir: str, rank: int, world_size: int) -> None:
    """A failing rank's: its own dump, then the peers' asked for and awaited (at most
    PEER_WAIT_S: a dead peer leaves none)."""
    folder = dumps_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / REQUEST_FILE).touch()
    dump(run_dir, rank)
    deadline = time.monotonic() + PEER_WAIT_S
    while time.monotonic() < deadline:
        if all(dump_path(run_dir, r).exists() for r in range(world_size)):
            return
        time.sleep(0.1)
