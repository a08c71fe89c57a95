"""Shared fixtures."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable
from multiprocessing import resource_tracker
from pathlib import Path

import pytest

from meshrun.driver import cli
from meshrun.driver.experiment import measure
from meshrun.tools import verify
from tests.cli import CliRun, run_console, run_meshrun
from tests.hf_corpus import Corpus, write_corpus
from tests.launch_host import LaunchHost
from tests.moe_runs import COMMON as MOE_COMMON
from tests.ranks import RankPool, config_in

# `make test` runs two test modules at a time (xdist --dist loadscope: a module's tests, and
# its module fixtures, stay on one worker). The longest go first, so that the last to finish
# is a short one.
LONGEST_FIRST = (
    "test_doctor",
    "test_checkpoint",
    "test_layouts",
    "test_sweep_grid",
    "test_end_to_end",
    "test_plan_accuracy",
    "test_hf_models",
    "test_verify",
    "test_comm",
    "test_sweeps",
    "test_report_layouts",
    "test_failures",
    "test_docs_commands",
    "test_fp16",
    "test_eval",
    "test_torchrun",
    "test_watchdog",
    "test_config_errors",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        return LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)


@pytest.fixture(scope="session")
def debian_packages() -> None:
    """.ci/run installs Chromium, g++ and Python's headers while the suite already runs:
    MESHRUN_PACKAGES_STARTING names the file the install writes its exit status to when it
    ends. Tests that need those packages wait for it here; elsewhere it is not set."""
    done = os.environ.get("MESHRUN_PACKAGES_STARTING")
    if not done:
        return
    deadline = time.monotonic() + 900
    while not os.path.exists(done):
        assert time.monotonic() < deadline, "the Debian packages' install did not end in 900 s"
        time.sleep(1)
    status = Path(done).read_text().strip()
    assert status == "0", f"the Debian packages' install failed (exit status {status})"


@pytest.fixture
def chromium(debian_packages) -> str:
    """Debian's chromium (tests/chromium.py renders pages in it), or the test is skipped."""
    path = shutil.which("chromium")
    if path is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    return path


@pytest.fixture
def meshrun(tmp_path: Path) -> Callable[..., CliRun]:
    """Call with Hydra overrides; each call gets its own run dir, all calls of one test share
    a results store (so baselines are reused as in real use)."""
    counter = iter(range(1000))

    def run(*overrides: str, **kwargs) -> CliRun:
        return run_meshrun(
            tmp_path / f"run{next(counter)}", tmp_path / "meshrun.db", *overrides, **kwargs
        )

    return run


@pytest.fixture
def meshrun_here(tmp_path: Path, monkeypatch, rank_pool: RankPool) -> Callable[..., CliRun]:
    """`meshrun` as the `meshrun` fixture calls it, but in this process (tmp_path its working
    directory) with the ranks on the session's pool: the whole driver (Hydra, resolve, the
    baseline, the records) without an interpreter start and a rank spawn per run."""
    monkeypatch.setattr(cli, "launch", rank_pool.launch)
    monkeypatch.chdir(tmp_path)
    counter = iter(range(1000))

    def run(*overrides: str, multirun: bool = False, store_path: Path | None = None) -> CliRun:
        store = store_path or tmp_path / "meshrun.db"
        return run_console(
            cli.main, tmp_path / f"run{next(counter)}", store, *overrides, multirun=multirun
        )

    return run


def processes_with(token: str) -> set[int]:
    """Live processes whose environment carries `token` (a run's ranks inherit it)."""
    found = set()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if token.encode() in environ.read_bytes():
                found.add(int(environ.parent.name))
        except OSError:  # exited meanwhile, or not ours to read
            continue
    return found


@pytest.fixture
def marked_env(rank_pool):
    """An env marker for one run; afterwards no process may still carry it. Started first,
    multiprocessing's resource tracker and forkserver (this process's helpers, alive until it
    exits; the rank pool starts the forkserver) do not inherit the marker when the test sets
    it in this process's env for an in-process launch."""
    resource_tracker.ensure_running()
    rank_pool.start()
    token = f"run-{uuid.uuid4().hex}"
    yield {"MESHRUN_TEST_MARK": token}
    assert processes_with(token) == set(), "rank processes outlived meshrun"


@pytest.fixture(scope="session")
def launch_host():
    """meshrun's real launcher in a process of its own, its ranks forked from its forkserver
    (tests/launch_host.py); started before the test's own fixtures change this process."""
    host = LaunchHost()
    host.start()
    yield host
    host.close()


@pytest.fixture(scope="session")
def rank_pool():
    """Eight real worker processes for the session (dp2 x tp2 x pp2 is the widest layout)."""
    pool = RankPool(8)
    yield pool
    pool.close()


@pytest.fixture
def on_pool(monkeypatch, rank_pool):
    """meshrun-verify's runs on the session's rank pool."""
    monkeypatch.setattr(verify, "launch", rank_pool.launch)


@pytest.fixture(scope="module")
def single_moe_steps(tmp_path_factory, rank_pool):
    """One device's steps of tiny-moe with the given model.moe overrides (each run once a
    module)."""
    runs: dict[tuple[str, ...], list[dict]] = {}

    def steps(*extra: str) -> list[dict]:
        if extra not in runs:
            tmp = tmp_path_factory.mktemp("single")
            cfg = config_in(tmp, "parallel=single", *MOE_COMMON, *extra)
            measured = measure(cfg, "run", rank_pool.launch)
            assert measured.ok, measured.meta.error
            runs[extra] = measured.steps
        return runs[extra]

    return steps


@pytest.fixture
def experiment(tmp_path: Path, rank_pool: RankPool):
    """Call with Hydra overrides: the run measured on the pool (driver.experiment.measure,
    no CLI); each call gets its own run dir under tmp_path."""
    counter = iter(range(1000))

    def run(*overrides: str, role: str = "run"):
        cfg = config_in(tmp_path / f"exp{next(counter)}", *overrides)
        return cfg, measure(cfg, role, rank_pool.launch)

    return run


@pytest.fixture(scope="session")
def hf_corpus(tmp_path_factory) -> Corpus:
    """data=hf's test corpus in every format, and its tokenizer (tests/hf_corpus.py); tests
    that change a file write their own."""
    return write_corpus(tmp_path_factory.mktemp("hf-corpus"))
