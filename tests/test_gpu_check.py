"""scripts/gpu-check.sh's runner, on this CPU box: the GPUs it counts are those torch sees
(never nvidia-smi's list), checks run to their budgets and one deadline, side by side on
their own devices, and the run ends in one table and its JSON, a line per check."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parents[1] / "scripts"
sys.path.insert(0, str(SCRIPTS))

from gpu_check import (  # noqa: E402 (scripts/ is no package)
    FAIL,
    KILL_GRACE_S,
    MAX_ARTEFACTS,
    PASS,
    PENDING,
    SKIPPED,
    Check,
    Outcome,
    Report,
    Result,
    Runner,
    Verdict,
    child_visible,
    count_gpus,
    table,
)

SMI_8 = "".join(f"GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:08d}-aaaa)\n" for i in range(8))
SMI_MIG = (
    "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77)\n"
    "  MIG 3g.40gb     Device  0: (UUID: MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f)\n"
    "  MIG 3g.40gb     Device  1: (UUID: MIG-cba663e8-9bed-5b25-b243-5985ef7c9beb)\n"
)


def test_the_count_is_torchs_with_nvidia_smi_and_visibility_said():
    assert count_gpus(2, SMI_8, "0,1") == (
        2,
        "nvidia-smi lists 8 GPU(s); CUDA_VISIBLE_DEVICES='0,1'; torch sees 2",
    )
    n, seen = count_gpus(1, SMI_MIG, None)
    assert n == 1 and "2 MIG device(s) (a process opens one)" in seen
    n, seen = count_gpus(0, SMI_8, None)
    assert n == 0 and "a CPU build of torch" in seen


def test_a_check_sees_its_own_entries_of_the_parents_visible_devices():
    assert child_visible(None, [2, 3]) == "2,3"
    assert child_visible("GPU-aa, GPU-bb,GPU-cc", [1, 2]) == "GPU-bb,GPU-cc"
    assert child_visible("MIG-x", [0]) == "MIG-x"


@pytest.mark.slow
def test_gpu_check_with_gpus_torch_cannot_use_skips_each_gpu_check(tmp_path: Path):
    """nvidia-smi lists 8 GPUs, torch (this CPU build) sees none: no check is planned on them."""
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "nvidia-smi").write_text(f"#!/bin/sh\nprintf '{SMI_8}'\n")
    (stub / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "PYTHON": sys.executable}
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(SCRIPTS / "gpu-check.sh"), "--dry-run"],
        env={**env, "OUT": str(out)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "gpu-check.json").read_text())
    assert report["gpus"] == 0
    assert "nvidia-smi lists 8 GPU(s)" in report["host"] and "torch sees 0" in report["host"]
    by_name = {c["name"]: c for c in report["checks"]}
    assert len(by_name) >= 20 and report["finished"]
    from gpu_checks import checks  # noqa: PLC0415

    on_gpus = {c.name for c in checks(0) if c.gpus}
    assert on_gpus and on_gpus < set(by_name)
    gpu_checks = [by_name[name] for name in on_gpus]
    assert all(c["status"] == SKIPPED for c in gpu_checks)
    assert all("none torch can use here" in c["detail"] for c in gpu_checks)
    text = (out / "gpu-check.txt").read_text().splitlines()
    assert all(any(line.startswith(name) for line in text) for name in by_name)


def _sh(script: str):
    return lambda work: ["sh", "-c", script]


def _says(done: Outcome) -> Verdict:
    return Verdict(PASS if done.rc == 0 else FAIL, done.output.strip())


def _run(checks: list[Check], gpus: int, budget_s: float, work: Path) -> dict[str, Result]:
    results: dict[str, Result] = {}

    def add(result: Result) -> None:
        results[result.name] = result

    runner = Runner(gpus, time.monotonic() + budget_s, work, "GPU-x,GPU-y", add)
    runner.run(checks)
    return results


def test_checks_run_side_by_side_on_their_devices_to_their_budgets(tmp_path: Path):
    stamp = "echo $CUDA_VISIBLE_DEVICES $(date +%s.%N)"
    checks = [
        Check("a", _sh(f"{stamp}; sleep 1"), _says, gpus=1, budget_s=10),
        Check("b", _sh(f"{stamp}; sleep 1"), _says, gpus=1, budget_s=10),
        Check("over its budget", _sh("sleep 30"), _says, gpus=1, budget_s=1),
        Check("fails", _sh("echo broken; exit 3"), _says, gpus=1, budget_s=5),
        Check("needs 4", _sh("true"), _says, gpus=4),
        Check("alone", _sh(stamp), _says, gpus=0, budget_s=5, alone=True),
        Check("no time left", _sh("true"), _says, gpus=1, budget_s=60),
    ]
    started = time.monotonic()
    results = _run(checks, 2, 20, tmp_path)
    assert time.monotonic() - started < 15

    a, b = (results[n].detail.split() for n in ("a", "b"))
    assert {a[0], b[0]} == {"GPU-x", "GPU-y"}  # each its own device, of the parent's list
    assert abs(float(a[1]) - float(b[1])) < 0.9  # side by side
    assert results["over its budget"].status == FAIL
    assert "timed out" in results["over its budget"].detail
    assert (results["fails"].status, results["fails"].detail) == (FAIL, "broken")
    assert results["needs 4"].status == SKIPPED
    assert "needs 4 GPU(s), 2 here: NCCL refuses two ranks on one GPU" in results["needs 4"].detail
    assert results["alone"].status == PASS and results["alone"].devices == []
    alone_at = float(results["alone"].detail.split()[-1])
    assert alone_at > max(float(a[1]), float(b[1])) + 0.9  # after the others ended
    assert results["no time left"].status == SKIPPED
    assert "out of time" in results["no time left"].detail

    lines = table(list(results.values()), "host").splitlines()
    assert lines[0] == "host" and len(lines) == len(checks) + 3
    assert lines[-1] == "3 PASS, 2 FAIL, 2 SKIPPED"


def test_a_check_that_ignores_sigterm_is_killed_at_the_deadline_within_the_grace(tmp_path: Path):
    """The box's command limit is hard: a check ignoring SIGTERM (its children too) is cut at
    the run's deadline, its group SIGKILLed after KILL_GRACE_S."""
    hang = "trap '' TERM; while :; do sleep 1; done"
    started = time.monotonic()
    results = _run([Check("hang", _sh(hang), _says, gpus=0, budget_s=3)], 0, 2, tmp_path)
    took = time.monotonic() - started
    assert results["hang"].status == SKIPPED
    assert "cut at the run's deadline" in results["hang"].detail
    assert took < 2 + 2 * KILL_GRACE_S + 2


def test_the_report_is_on_disk_after_each_result_with_at_most_eight_files(tmp_path: Path):
    """gpu-check.txt and .json rewritten after every result (what never ran PENDING), the
    output tails in one log, and no more than five artefacts: 8 files, 2 folders down."""
    out, work = tmp_path / "out", tmp_path / "work"
    names = ["first", "second"]
    report = Report(out, "host", 1, names, work)
    report.add(Result("first", PASS, "fine", 1.0))
    on_disk = json.loads((out / "gpu-check.json").read_text())
    assert [c["status"] for c in on_disk["checks"]] == [PASS, PENDING]
    assert not on_disk["finished"]
    assert "second  PENDING" in (out / "gpu-check.txt").read_text()
    folder = work / "first"
    folder.mkdir(parents=True)
    for i in range(8):
        (folder / f"trace{i}.json").write_text("x" * 1000)
    (folder / "output.log").write_text("line\n" * 100)
    check = Check("first", _sh("true"), _says, keep=("trace*.json",))
    report.keep(check, folder)
    report.write(finished=True)
    files = [p.relative_to(out) for p in out.rglob("*") if p.is_file()]
    assert len(files) == 3 + MAX_ARTEFACTS <= 8
    assert all(len(f.parts) <= 3 for f in files)
    assert json.loads((out / "gpu-check.json").read_text())["finished"]
    assert "===== first (PASS) =====" in (out / "gpu-check-logs.txt").read_text()


def test_the_runner_imports_nothing_of_the_checks():
    """scripts/gpu_checks.py calls gpu_check.main; the runner never imports the checks back."""
    tree = ast.parse((SCRIPTS / "gpu_check.py").read_text())
    imported = {
        n.module if isinstance(n, ast.ImportFrom) else a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.Import | ast.ImportFrom)
        for a in n.names
    }
    assert not {"gpu_checks", "gpu_rehearsal", "gpu_wheels"} & imported


@pytest.mark.parametrize("gpus", [1, 8])
def test_what_one_gpu_proves_runs_first_and_each_budget_fits_the_run(gpus: int):
    from gpu_checks import checks  # noqa: PLC0415

    listed = checks(gpus)
    assert listed[0].gpus == 0 and "imports" in listed[0].name  # before any GPU is used
    assert listed[1].name.startswith("make run") and listed[1].gpus == gpus
    assert len({c.name for c in listed}) == len(listed)
    assert all(c.budget_s <= 540 for c in listed)
    if gpus == 1:  # what runs on one GPU comes first; the CPU cores' and the last look after
        runs = [c.gpus <= 1 for c in listed]
        assert runs == [*sorted(runs[:-2], reverse=True), True, True]


def test_gains_say_compile_and_float8_against_bf16_and_fail_on_the_loss(tmp_path: Path):
    """The llama-1b check's judge: compile's gain over eager, float8's over compiled bf16
    (measured and predicted), every float8 step's loss within meshrun-verify's bound."""
    from gpu_checks import _gains  # noqa: PLC0415

    from meshrun.driver.tool_config import FLOAT8_LOSS_BOUND  # noqa: PLC0415

    def results(name: str, losses: list[float], tokens: float, predicted: float) -> None:
        run = tmp_path / name / "run"
        run.mkdir(parents=True, exist_ok=True)
        r = {"losses": losses, "tokens_per_s": tokens, "predicted_tokens_per_s": predicted}
        r |= {"mfu": 0.5, "mfu_fp8_peak": 0.25, "step_time_s": 1.0, "precision": "bf16"}
        r |= {"memory_per_rank": [{"peak": 100}], "memory_predicted": [{"peak": 100}]}
        (run / "results.json").write_text(json.dumps(r))

    results("eager", [10.0, 9.0], 800.0, 900.0)
    results("compiled", [10.0, 9.0], 1000.0, 1000.0)
    results("float8", [10.0, 9.0 * (1 + FLOAT8_LOSS_BOUND / 2)], 1200.0, 1250.0)
    verdict = _gains(Outcome(0, "", tmp_path, 1.0))
    assert verdict.status == PASS, verdict.detail
    assert "float8 1.20x bf16 (predicted 1.25x)" in verdict.detail
    assert "compile 1.25x eager" in verdict.detail and "fp8 peak 25.0%" in verdict.detail
    results("float8", [10.0, 9.0 * (1 + 2 * FLOAT8_LOSS_BOUND)], 1200.0, 1250.0)
    verdict = _gains(Outcome(0, "", tmp_path, 1.0))
    assert verdict.status == FAIL and "float8 losses 3.1% from bf16's" in verdict.detail
    (tmp_path / "float8" / "run" / "results.json").unlink()
    verdict = _gains(Outcome(1, "Traceback\nRuntimeError: boom", tmp_path, 1.0))
    assert verdict.status == FAIL and "compile 1.25x eager" in verdict.detail


def test_this_box_reads_each_part_by_its_exit_status():
    from gpu_checks import _this_box  # noqa: PLC0415

    good = [
        ("profile h100-80g ['NVIDIA H100 80GB HBM3']", 0),
        ("device_type: cuda\nbackend: nccl\n...\nprediction:\n  memory: 1", 0),
        ("single -> cuda:0", 0),
        ("meshrun: config error launcher.start_method='fork': ...", 2),
    ]
    output = "".join(f"{text}\n=== exit {rc}\n" for text, rc in good)
    verdict = _this_box(Outcome(0, output, Path("."), 1.0))
    assert verdict.status == PASS and verdict.detail.startswith("profile h100-80g")
    output = output.replace("=== exit 2", "=== exit 0")
    verdict = _this_box(Outcome(0, output, Path("."), 1.0))
    assert verdict.status == FAIL and "fork not refused (exit 0)" in verdict.detail


def test_without_the_core_needs_the_run_stops_at_once_saying_why(tmp_path: Path):
    """The carried set's core needs do not install: exit 3 before any check starts, the
    table on disk naming the install's failure and the check never run."""
    from gpu_check import main  # noqa: PLC0415

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "core.txt").write_text("meshrun-no-such-package\n")
    (wheels / "constraints.txt").write_text("")
    never = Check("never", _sh("touch started"), _says, gpus=0)
    out, work = tmp_path / "out", tmp_path / "work"
    argv = ["--wheels", str(wheels), "--out", str(out), "--work", str(work)]
    assert main(lambda gpus, left: [never], argv) == 3
    text = (out / "gpu-check.txt").read_text()
    assert "install: meshrun's needs, offline  FAIL" in text
    assert "the core needs (hydra-core, omegaconf, submitit) do not import" in text
    assert "never" in text and "PENDING" in text and not (work / "never").exists()
    assert "meshrun-no-such-package" in (out / "gpu-check-logs.txt").read_text()


def test_only_matches_a_name_in_any_case_and_one_that_matches_none_exits_2_before_the_install(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    """`--only liger` picks "Liger's fused cross-entropy"; `--only ligre` exits 2 listing the
    checks, before the carried set's install (here one that would fail, exit 3) starts."""
    from gpu_check import main  # noqa: PLC0415

    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "core.txt").write_text("meshrun-no-such-package\n")
    (wheels / "constraints.txt").write_text("")
    liger = Check("Liger's fused cross-entropy", _sh("touch started"), _says, gpus=0)
    other = Check("make run", _sh("touch started"), _says, gpus=0)
    out = tmp_path / "out"
    argv = ["--wheels", str(wheels), "--out", str(out), "--work", str(tmp_path / "work")]
    assert main(lambda gpus, left: [liger, other], [*argv, "--dry-run", "--only", "LIGER"]) == 0
    table_text = (out / "gpu-check.txt").read_text()
    assert "Liger's fused cross-entropy" in table_text and "make run" not in table_text
    (out / "gpu-check.txt").unlink()
    assert main(lambda gpus, left: [liger, other], [*argv, "--only", "ligre"]) == 2
    said = capsys.readouterr().out
    assert "--only ligre names no check" in said and "make run" in said
    assert not (out / "gpu-check.txt").exists()  # nothing installed, nothing run


def test_a_collective_gloo_lacks_on_cuda_is_skipped_saying_which():
    """The one-GPU checks of layouts over gloo: meshrun-verify's PASS, or SKIPPED where gloo
    has no CUDA implementation of a collective (not a FAIL of meshrun's)."""
    from gpu_checks import passed_or_gloo_lacks  # noqa: PLC0415

    lacks = "RuntimeError: ProcessGroupGloo::allgather: unsupported device type cuda"
    verdict = passed_or_gloo_lacks(Outcome(1, f"Traceback\n{lacks}\n", Path("."), 1.0))
    assert verdict.status == SKIPPED and "allgather: unsupported device type" in verdict.detail
    verdict = passed_or_gloo_lacks(Outcome(1, "Traceback\nValueError: boom\n", Path("."), 1.0))
    assert verdict.status == FAIL
    verdict = passed_or_gloo_lacks(Outcome(0, "meshrun-verify: PASS (fsdp2)\n", Path("."), 1.0))
    assert verdict.status == PASS
