"""The collectives each rank issued last, as torch's flight recorder kept them (gloo's and
NCCL's alike since torch 2.7), dumped by every rank when a run fails (rank/flight_recorder.py):
`<run dir>/flight_recorder/rank<N>.json`, with `rank<N>.stack.txt` (every thread's Python
stack: where a rank that is in no collective is instead). A collective is named by its
process group and its sequence number there, which every member counts alike: the rank that
issued #12 while a peer's last is #11 waits for a peer that never came.

Only a failing rank asks for the dumps (`REQUEST_FILE`); each rank's watchdog thread answers
within a second, whatever its main thread is stuck in. A dump also holds meshrun's own record
of a pipeline stage's sends and receives (`TRANSFERS_KEY`, rank/parallel/transfers.py), which
gloo's recorder does not keep: a pipeline hang is a receive posted and never done."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DUMPS_DIR = "flight_recorder"
REQUEST_FILE = "dump-requested"
TRANSFERS_KEY = "meshrun_transfers"


def dumps_dir(run_dir: str) -> Path:
    return Path(run_dir) / DUMPS_DIR


def dump_path(run_dir: str, rank: int) -> Path:
    return dumps_dir(run_dir) / f"rank{rank}.json"


def stack_path(run_dir: str, rank: int) -> Path:
    return dumps_dir(run_dir) / f"rank{rank}.stack.txt"


@dataclass(frozen=True)
class Collective:
    """One flight-recorder entry: which collective, in which group, of what."""

    group: str  # the process group's description (DeviceMesh's mesh_<dim>), else its name
    seq: int  # its sequence number in the group (point-to-point ops counted apart)
    op: str  # "gloo:all_reduce", "nccl:_allgather_base", ...
    sizes: list
    dtypes: list
    p2p: bool
    created_ns: int

    @classmethod
    def of(cls, entry: dict) -> Collective:
        name, desc = entry["process_group"]
        p2p = bool(entry.get("is_p2p"))
        return cls(
            desc or name,
            int(entry["p2p_seq_id"] if p2p else entry["collective_seq_id"]),
            entry["profiling_name"],
            entry.get("input_sizes", []),
            entry.get("input_dtypes", []),
            p2p,
            int(entry.get("time_created_ns", 0)),
        )

    def __str__(self) -> str:
        kind = "p2p " if self.p2p else ""
        of = " ".join([str(self.sizes), *sorted(set(self.dtypes))])
        return f"{self.op} {kind}#{self.seq} of {self.group} (input {of})"


def read_dumps(run_dir: str) -> dict[int, list[Collective]]:
    """rank -> its recorded collectives, oldest first (ranks that left no dump: absent)."""
    dumps = {}
    for path in dumps_dir(run_dir).glob("rank*.json"):
        entries = json.loads(path.read_text()).get("entries", [])
        collectives = [Collective.of(e) for e in entries]
        dumps[int(path.stem.removeprefix("rank"))] = sorted(collectives, key=lambda c: c.created_ns)
    return dumps


def describe(run_dir: str, failed_rank: int, world_size: int) -> str | None:
    """The failed rank's last collective and where each peer of its group stood: in it too,
    never issued it (and its last there), or no dump at all; None without the failed rank's."""
    dumps = read_dumps(run_dir)
    if not dumps.get(failed_rank):
        return None
    last = dumps[failed_rank][-1]
    parts = [f"rank {failed_rank}'s last collective: {last}"]
    behind = False
    for rank in range(world_size):
        if rank == failed_rank:
            continue
        if rank not in dumps:
            parts.append(f"rank {rank} left no dump (gone)")
            continue
        mine = [c for c in dumps[rank] if (c.group, c.p2p) == (last.group, last.p2p)]
        if not mine:
            continue  # not in that group
        newest = max(c.seq for c in mine)
        if newest < last.seq:
            theirs = max(mine, key=lambda c: c.seq)
            parts.append(f"rank {rank} never issued it (its last there: {theirs.op} #{newest})")
            behind = True
        elif newest == last.seq:
            parts.append(f"rank {rank} issued it too")
        else:
            parts.append(f"rank {rank} went past it (to #{newest})")
    where = f"(dumps in {dumps_dir(run_dir)})"
    waits = transfers_waited(run_dir)
    said = f"; meshrun's record of the pipeline's transfers: {waits}" if waits else ""
    if not behind and len(dumps) == world_size:
        return (
            f"every rank's last recorded collective is {last}, which all of them issued: the "
            f"wait is in an operation the recorder does not keep (gloo records no "
            f"point-to-point sends or receives){said} {where}"
        )
    return "; ".join(parts) + f"{said} {where}"


def transfers_waited(run_dir: str) -> str | None:
    """Each dumped rank's oldest receive posted and never done (the one it waited on), or,
    where none is pending, the last transfer it posted (a send completes once the peer
    receives it: gloo's send waits for that); None where no rank noted any (no pipeline)."""
    said = []
    for path in sorted(dumps_dir(run_dir).glob("rank*.json")):
        rank = int(path.stem.removeprefix("rank"))
        noted = json.loads(path.read_text()).get(TRANSFERS_KEY, [])
        if not noted:
            continue
        pending = [t for t in noted if t["op"] == "recv" and t["done_s"] is None]
        if pending:
            said.append(f"rank {rank} waits on the {_transfer(min(pending, key=_posted))}")
        else:
            said.append(
                f"rank {rank} has no receive pending (its last posted: {_transfer(noted[-1])})"
            )
    return ", ".join(said) or None


def _posted(transfer: dict) -> float:
    return transfer["posted_s"]


def _transfer(t: dict) -> str:
    way = "from" if t["op"] == "recv" else "to"
    size = f"{t['shape']} {t['dtype']}, {t['bytes']:,} bytes"
    op = "receive" if t["op"] == "recv" else "send"
    return f"{op} of micro-batch {t['microbatch']}'s {t['what']} {way} rank {t['peer']} ({size})"
