"""Every command line that README.md and docs/*.md show composes, so that an example which no
longer does (a renamed key or preset, a value of the wrong type) fails here, named by its
file:line, instead of failing the user who copies it.

Composing is what the console script does before it runs anything: Hydra's command-line
parser reads the flags and overrides, Hydra composes conf/<config>.yaml with them (every job
of a multirun, expanded as Hydra's basic sweeper expands it), and the job's config is checked
key by key (driver/compose.check_keys) and typed into the command's schema, interpolations
resolved as Hydra's run_job would. Nothing is launched and nothing is written; paths a
command names need not exist.

What is read: fenced code blocks (```bash, ```sh, ```shell, ```console or bare ```), one
command a line, with or without a `$ ` prompt; trailing `\\` continues a line, `#` starts a
comment, `VAR=value` prefixes and `torchrun ... -m <module>` lead to the command they run.
An HTML comment on the line before a block says what else its commands are:
    <!-- docs-commands: config-error -->   each is refused with a config error, starting with
                                           the `meshrun: config error ...` line shown after it
    <!-- docs-commands: skip (why) -->      not checked; keep these rare, and say why
"""

from __future__ import annotations

import dataclasses
import functools
import re
import shlex
from importlib.metadata import distribution
from pathlib import Path

import pytest
from hydra import initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra._internal.utils import get_args_parser
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

# Imported for what `meshrun` registers at import: the schemas and the `sweeps` group.
import meshrun.driver.cli  # noqa: F401
from meshrun.core.errors import ConfigError
from meshrun.core.paths import CONF_DIR, REPO_ROOT
from meshrun.driver.compose import check_keys, config_error
from meshrun.entrypoints import COMMANDS

# Every page; a diagram whose lines start with a command's name is fenced as `text`.
DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
# What each console script composes: the arguments of its hydra_command(...) call.
CONFIGS = {
    "meshrun": ("train", CONF_DIR),
    "meshrun-plan": ("plan", CONF_DIR),
    "meshrun-verify": ("verify", CONF_DIR),
    "meshrun-comm": ("comm", CONF_DIR),
    "meshrun-doctor": ("doctor", CONF_DIR),
    "meshrun-report": ("report", CONF_DIR / "report"),
}
COLLECT = "meshrun-collect"  # argparse, no Hydra: run or sweep directories
FENCE = re.compile(r"\s*```\s*(\w*)")
CHECKED_FENCES = {"", "bash", "sh", "shell", "console"}
MARKER = re.compile(r"\s*<!--\s*docs-commands:\s*(config-error|skip)\b.*-->")
ENV_PREFIX = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
ERROR_SHOWN = "meshrun: config error "


def _script_modules() -> dict[str, str]:
    """Console script by the module `python -m` (torchrun -m) runs it as."""
    packages = {"meshrun": "meshrun", "meshrun.tools.comm": "meshrun-comm"}  # their __main__
    return {**packages, **{module: name for name, module in COMMANDS.items()}}


MODULES = _script_modules()


@dataclasses.dataclass(frozen=True)
class DocCommand:
    where: str  # file:line, the line the command starts on
    line: str  # as written, continuations joined
    script: str  # the console script it runs
    args: tuple[str, ...]  # its arguments, as the shell passes them
    refused: bool = False  # under `docs-commands: config-error`
    shown_error: str | None = None  # the `meshrun: config error ...` line shown after it


def parse_command(text: str) -> tuple[str, tuple[str, ...]] | None:
    """(script, arguments) of a shell line that runs a meshrun console script, else None."""
    words = text.removeprefix("$ ").split()
    while words and ENV_PREFIX.match(words[0]):
        words = words[1:]
    if not words or not (words[0] == "torchrun" or words[0] in CONFIGS or words[0] == COLLECT):
        return None  # prose in a diagram is no shell: only a command's line is split as one
    words = shlex.split(" ".join(words), comments=True)
    if words[0] == "meshrun-plan" and "calibrate" in words:  # a command on the same config
        words.remove("calibrate")
    if words[0] != "torchrun":
        return words[0], tuple(words[1:])
    at = words.index("-m") + 1 if "-m" in words[:-1] else 0
    if not at or words[at] not in MODULES:
        return None  # torchrun of something else
    return MODULES[words[at]], tuple(words[at + 1 :])


def commands_in(path: Path, name: str) -> list[DocCommand]:
    """The commands in the checked code blocks of `path` (`name` in their file:line)."""
    lines = path.read_text().splitlines()
    found: list[DocCommand] = []
    marker, fence, number = None, None, 0
    while number < len(lines):
        start, text = number, lines[number]
        number += 1
        opening = FENCE.match(text)
        if fence is None:
            if opening:
                checked = opening.group(1) in CHECKED_FENCES and marker != "skip"
                fence = "checked" if checked else "other"
            elif (marked := MARKER.match(text)) or text.strip():
                marker = marked.group(1) if marked else None
            continue
        if opening:
            fence, marker = None, None
            continue
        if fence != "checked":
            continue
        while text.endswith("\\") and number < len(lines):
            text = text[:-1] + " " + lines[number].strip()
            number += 1
        try:
            parsed = parse_command(text.strip())
        except ValueError as exc:  # shlex: a quote left open
            raise ValueError(f"{name}:{start + 1}: {exc}: {text}") from exc
        if parsed is None:
            if found and found[-1].refused and text.startswith(ERROR_SHOWN):
                found[-1] = dataclasses.replace(found[-1], shown_error=text)
            continue
        refused = marker == "config-error"
        line = text.strip().removeprefix("$ ")
        found.append(DocCommand(f"{name}:{start + 1}", line, *parsed, refused=refused))
    return found


EXAMPLES = [c for path in DOCS for c in commands_in(path, path.relative_to(REPO_ROOT).as_posix())]


def _hydra_args(args: tuple[str, ...]) -> tuple[tuple[str, ...], bool]:
    """(overrides, multirun) as Hydra's own command-line parser reads them."""
    parsed = get_args_parser().parse_args(list(args))
    return tuple(parsed.overrides), bool(parsed.multirun)


def _typed(cfg: DictConfig, dir_key: str, subdir_key: str | None) -> None:
    """What Hydra's run_job and then the console script do with a job's config before the
    job runs: the output dir resolved into hydra.runtime, the `hydra` node dropped (run_job
    drops it from a copy; `cfg` is not used again), then meshrun's key check and the typed
    schema object (every interpolation resolved, `${hydra:...}` through HydraConfig)."""
    saved = HydraConfig.instance().cfg
    try:
        HydraConfig.instance().set_config(cfg)
        output_dir = Path(str(OmegaConf.select(cfg, dir_key)))
        if subdir_key is not None:
            output_dir /= str(OmegaConf.select(cfg, subdir_key))
        with read_write(cfg.hydra.runtime), open_dict(cfg.hydra.runtime):
            cfg.hydra.runtime.output_dir = str(output_dir.absolute())
        HydraConfig.instance().set_config(cfg)  # keeps a copy of the hydra node
        with read_write(cfg), open_dict(cfg):
            del cfg["hydra"]
        check_keys(cfg)
        OmegaConf.to_object(cfg)
    finally:
        HydraConfig.instance().cfg = saved


def _sweep_jobs(master: DictConfig) -> list[list[str]]:
    """A multirun's jobs as Hydra's basic sweeper expands them: hydra.sweeper.params (a
    ready sweep's grid) first, then the command line's overrides, which replace a key's."""
    params = master.hydra.sweeper.get("params") or {}
    arguments = [f"{key}={value}" for key, value in params.items()]
    arguments += OmegaConf.to_container(master.hydra.overrides.task, resolve=False)
    loader = GlobalHydra.instance().config_loader()
    parsed = OverridesParser.create(config_loader=loader).parse_overrides(arguments)
    (jobs,) = BasicSweeper.split_arguments(parsed, None)
    return jobs


@functools.cache
def compose_jobs(script: str, overrides: tuple[str, ...], multirun: bool) -> int:
    """Compose every job of `script overrides` (raising what the script would refuse);
    the number of jobs. Cached: the same command in README and in a page composes once."""
    config_name, config_dir = CONFIGS[script]
    mode = RunMode.MULTIRUN if multirun else RunMode.RUN
    with initialize_config_dir(config_dir=str(config_dir), version_base="1.3", job_name=script):
        hydra = GlobalHydra.instance().hydra
        assert hydra is not None
        master = hydra.compose_config(
            config_name, list(overrides), run_mode=mode, with_log_configuration=False
        )
        if not multirun:
            _typed(master, "hydra.run.dir", None)
            return 1
        jobs = _sweep_jobs(master)
        for num, job in enumerate(jobs):
            try:
                cfg = hydra.config_loader.load_sweep_config(master, job)
                with open_dict(cfg):
                    cfg.hydra.job.id, cfg.hydra.job.num = num, num
                _typed(cfg, "hydra.sweep.dir", "hydra.sweep.subdir")
            except Exception as exc:  # named by the job's values, as meshrun names them
                error = config_error(exc, job)
                if error is None:
                    raise
                raise error from exc
        return len(jobs)


def refusal(example: DocCommand) -> ConfigError | None:
    """The config error the example's command stops with, or None if all its jobs compose."""
    overrides, multirun = _hydra_args(example.args)
    try:
        compose_jobs(example.script, overrides, multirun)
    except Exception as exc:
        error = config_error(exc, list(overrides))
        if error is None:
            raise
        return error
    return None


CHECKED = [e for e in EXAMPLES if not e.refused]
REFUSED = [e for e in EXAMPLES if e.refused]


@pytest.mark.parametrize("example", CHECKED, ids=[e.where for e in CHECKED])
def test_each_documented_command_composes(example: DocCommand) -> None:
    if example.script == COLLECT:
        assert example.args and not any(a.startswith("-") for a in example.args), (
            f"{example.where}: `{example.line}`: meshrun-collect takes run or sweep dirs"
        )
        return
    error = refusal(example)
    if error is not None:
        pytest.fail(f"{example.where}: `{example.line}`\n  config error {error}", pytrace=False)


@pytest.mark.parametrize("example", REFUSED, ids=[e.where for e in REFUSED])
def test_each_documented_config_error_is_the_one_meshrun_prints(example: DocCommand) -> None:
    error = refusal(example)
    if error is None:
        pytest.fail(
            f"{example.where}: `{example.line}` is shown refused, but composes", pytrace=False
        )
    shown = (example.shown_error or "").removesuffix("...").rstrip()
    printed = f"{ERROR_SHOWN}{error}"
    if not shown or not printed.startswith(shown):
        pytest.fail(
            f"{example.where}: `{example.line}` shows\n  {shown or '(no error line)'}\n"
            f"but meshrun prints\n  {printed}",
            pytrace=False,
        )


def test_every_console_script_is_checked() -> None:
    scripts = {e.name for e in distribution("meshrun").entry_points if e.group == "console_scripts"}
    assert scripts == {*CONFIGS, COLLECT}


def test_the_parser_reads_prompts_continuations_comments_markers_and_torchrun(
    tmp_path: Path,
) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\n"
        "make run   # not meshrun\n"
        "# meshrun model=commented-out\n"
        "meshrun model=tiny \\\n"
        "    parallel=fsdp   # a comment\n"
        "NCCL_DEBUG=INFO meshrun-comm backend=gloo\n"
        "torchrun --standalone --nproc-per-node 2 -m meshrun parallel=ddp\n"
        "torchrun --nproc-per-node 8 -m meshrun.tools.comm.main backend=nccl\n"
        "torchrun --nproc-per-node 8 -m other.module x=1\n"
        "```\n"
        "<!-- docs-commands: config-error -->\n"
        "```console\n"
        "$ meshrun parallel=tp2pp2\n"
        "meshrun: config error parallel='tp2pp2': no such preset ...\n"
        "```\n"
        "<!-- docs-commands: skip (needs a cluster) -->\n"
        "```\n"
        "meshrun launcher=slurm\n"
        "```\n"
        "```python\n"
        "meshrun = 1\n"
        "```\n"
    )
    found = [
        (c.where.rpartition(":")[2], c.script, c.args, c.refused, c.shown_error)
        for c in commands_in(page, "page.md")
    ]
    assert found == [
        ("4", "meshrun", ("model=tiny", "parallel=fsdp"), False, None),
        ("6", "meshrun-comm", ("backend=gloo",), False, None),
        ("7", "meshrun", ("parallel=ddp",), False, None),
        ("8", "meshrun-comm", ("backend=nccl",), False, None),
        (
            "13",
            "meshrun",
            ("parallel=tp2pp2",),
            True,
            "meshrun: config error parallel='tp2pp2': no such preset ...",
        ),
    ]
