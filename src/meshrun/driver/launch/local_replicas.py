"""launcher=local's torchft replica groups (driver/launch/replicas.py): each group's ranks
started on this host by torch elastic's start_processes, on a store hosted here as torch
elastic's agent hosts one; each group's ranks take their own of the host's devices."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
from torch.distributed.elastic.multiprocessing.api import PContext
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from meshrun.core.config import ExperimentConfig
from meshrun.core.layout import Layout
from meshrun.core.replica_place import AGENT_STORE, ReplicaPlace
from meshrun.core.run_files.failures import recorded_failures
from meshrun.driver.launch import RankEntry
from meshrun.driver.launch.launcher import KILLED, GroupEnd
from meshrun.driver.launch.start_method import rank_start_method

LOCAL_HOST = "127.0.0.1"


@dataclass
class _LocalGroup:
    run_dir: str
    first: int  # the group's first rank in the run
    process: PContext
    store: dist.TCPStore  # the group's rendezvous, which the ranks and torchft's Manager join

    def ended(self) -> GroupEnd | None:
        result = self.process.wait(timeout=0)
        if result is None:
            return None
        if not result.is_failed():
            return GroupEnd(value=result.return_values[0])
        failures = {self.first + r: f for r, f in result.failures.items()}
        return GroupEnd(failure=self._cause(failures))

    def _cause(self, ended: dict[int, ProcessFailure]) -> tuple[int, str]:
        """A rank killed by a signal without a record of its own (its peers' errors are its
        consequence), else the first rank's recorded error. Only the group's own ranks and
        records count (launch/local.root_cause reads the whole run's: here another group's
        dead rank is no cause)."""
        recorded = recorded_failures(self.run_dir)
        killed = [r for r, f in sorted(ended.items()) if f.exitcode < 0 and r not in recorded]
        rank = killed[0] if killed else min(ended)
        if killed:
            return rank, f"{KILLED}{ended[rank].signal_name()})"
        if rank in recorded:
            return rank, recorded[rank]["error"]
        return rank, f"exit code {ended[rank].exitcode}"

    def stop(self) -> None:
        self.process.close()


class LocalReplicaGroups:
    lighthouse_host = LOCAL_HOST

    def __init__(self, cfg: ExperimentConfig, entry: RankEntry) -> None:
        self.cfg, self.entry = cfg, entry
        self.size = Layout.of(cfg.parallel).world_size // cfg.parallel.dp_replicate
        self.method = rank_start_method(cfg.launcher.start_method, entry)
        self.poll_interval_s = cfg.launcher.monitor_interval_s

    def start(self, place: ReplicaPlace, env: dict[str, str]) -> _LocalGroup:
        """The group's ranks, a world of their own: its own store, which the ranks and
        torchft's Manager join (torch elastic's agent store)."""
        size = self.size
        store = dist.TCPStore(LOCAL_HOST, 0, is_master=True, wait_for_workers=False)
        shared = {
            **env,
            "WORLD_SIZE": str(size),
            "LOCAL_WORLD_SIZE": str(size),
            "MASTER_ADDR": LOCAL_HOST,
            "MASTER_PORT": str(store.port),
            AGENT_STORE: str(True),
        }
        ranks = range(size)
        process = start_processes(
            name=f"meshrun-replica{place.id}",
            entrypoint=self.entry,
            args=dict.fromkeys(ranks, (asdict(self.cfg),)),
            envs={
                r: {**shared, "RANK": str(r), "LOCAL_RANK": str(place.id * size + r)} for r in ranks
            },
            logs_specs=DefaultLogsSpecs(),
            start_method=self.method,
        )
        return _LocalGroup(self.cfg.run_dir, place.id * size, process, store)
