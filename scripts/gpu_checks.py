"""The checks scripts/gpu-check.sh runs on a CUDA machine (`python3 scripts/gpu_checks.py`,
scripts/gpu_check.py's runner), what one GPU proves first (on one GPU the deadline may leave
the last ones SKIPPED). Each is a command and what makes it PASS; a run's
detail line is its figures (tokens/s, MFU, step time against the prediction, memory measured
/ predicted per rank), so the table is the first reading of meshrun on that GPU.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from gpu_check import FAIL, PASS, SKIPPED, Check, Outcome, Verdict, main

PY = sys.executable
MiB = 2**20
# The planner's memory bars (docs/planner.md): measured peak over predicted.
MEMORY_BAR = (0.8, 1.25)
HANG_TIMEOUT_S = 20  # backend.timeout_s of the hang checks


def _meshrun(
    *overrides: str, command: str = "meshrun", under: str = ""
) -> Callable[[Path], list[str]]:
    """A meshrun (or meshrun-verify) run in the check's folder (its sub-folder `under`);
    `overrides` are space-separated Hydra overrides."""
    module = {"meshrun": "meshrun", "verify": "meshrun.tools.verify"}[command]
    quiet = "logger=none train.progress_bar=false" if command == "meshrun" else ""
    words = " ".join((quiet, *overrides)).split()
    return lambda work: [
        PY, "-m", module, f"hydra.run.dir={work / under / 'run'}",
        f"store.path={work / under / 'meshrun.db'}", *words,
    ]  # fmt: skip


def _python(args: str, store: bool = False, words: bool = True) -> Callable[[Path], list[str]]:
    """`python ARGS` (space-separated; `words` False: `-c CODE`, the code whole), with a
    results store in the check's folder."""
    argv = args.split() if words else args.split(" ", 1)
    return lambda work: [
        PY, *argv, *([f"store.path={work / 'meshrun.db'}"] if store else []),
    ]  # fmt: skip


def _results(work: Path) -> dict:
    return json.loads((work / "run" / "results.json").read_text())


def figures(r: dict) -> str:
    """A run's results.json in one line: speed, MFU, the prediction, memory per rank."""
    mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "n/a"
    predicted = r.get("predicted_step_time_s")
    parts = [
        f"{r['tokens_per_s']:,.0f} tok/s",
        f"MFU {mfu}",
        f"step {r['step_time_s']:.3f}s"
        + (f" (pred {predicted:.3f}s)" if predicted else "")
        + (" calibrated" if r.get("predicted_calibrated_at") else ""),
        f"{r.get('precision')}",
    ]
    if r.get("compile_s") is not None:
        parts.append(f"compile {r['compile_s']:.0f}s")
    for rank, (m, p) in enumerate(
        zip(r["memory_per_rank"] or [], r["memory_predicted"] or [], strict=False)
    ):
        reserved = m.get("reserved")
        parts.append(
            f"r{rank} peak {m['peak'] / MiB:,.0f}/{p['peak'] / MiB:,.0f} MiB"
            + (f" reserved {reserved / MiB:,.0f}" if reserved else "")
        )
    return "; ".join(parts)


def memory_ratios(r: dict) -> list[float]:
    return [
        m["peak"] / p["peak"]
        for m, p in zip(r["memory_per_rank"], r["memory_predicted"], strict=True)
    ]


def ran(extra: Callable[[dict], str | None] | None = None) -> Callable[..., Verdict]:
    """PASS where the run ended 0 with its results, and `extra` (a reason to FAIL) finds none."""

    def judge(done: Outcome) -> Verdict:
        if done.rc:
            return Verdict(FAIL, f"exit {done.rc}: {_last_error(done.output)}")
        r = _results(done.work)
        why = extra(r) if extra else None
        return Verdict(FAIL if why else PASS, (f"{why}; " if why else "") + figures(r))

    return judge


def memory_within_bars(r: dict) -> str | None:
    ratios = memory_ratios(r)
    low, high = MEMORY_BAR
    off = [f"rank {i}: {x:.2f}x" for i, x in enumerate(ratios) if not low <= x <= high]
    return f"peak off the prediction ({', '.join(off)}; bars {low}-{high}x)" if off else None


def dataparallel_devices(r: dict) -> str | None:
    """A row per device, the model state on device 0 alone, each peak at or under its
    prediction and within the bars of it."""
    rows = r["memory_per_rank"]
    if len(rows) != 2 or rows[1].get("params", 0):
        return f"{len(rows)} memory row(s), device 1's params {rows[-1].get('params')}"
    return memory_within_bars(r)


def default_experiment(gpus: int) -> Callable[[dict], str | None]:
    """The README's default on every GPU: bf16 chosen by auto on sm80+, the batch derived
    (8 rounded up to a multiple of micro x dp), and on one GPU its own baseline."""

    def why(r: dict) -> str | None:
        batch = -(-8 // (2 * gpus)) * 2 * gpus
        wrong = []
        if r.get("precision") != "bf16" or not r.get("precision_auto"):
            wrong.append(f"precision {r.get('precision')} ({r.get('precision_auto')})")
        if r.get("global_batch_size") != batch:
            wrong.append(f"batch {r.get('global_batch_size')}, not {batch}")
        if gpus == 1 and r.get("baseline_mode") != "own":
            wrong.append(f"baseline {r.get('baseline_mode')} on one GPU")
        return "; ".join(wrong) or None

    return why


def exits_zero_with(pattern: str) -> Callable[..., Verdict]:
    """PASS where the command ended 0 and its output has `pattern` (its line is the detail)."""

    def judge(done: Outcome) -> Verdict:
        found = re.search(pattern, done.output)
        if done.rc or not found:
            return Verdict(FAIL, f"exit {done.rc}: {_last_error(done.output)}")
        output = done.output
        line = output[output.rfind("\n", 0, found.start()) + 1 :].split("\n", 1)[0]
        return Verdict(PASS, line.strip()[:200])

    return judge


def refused_with(key: str) -> Callable[[Outcome], Verdict]:
    """PASS where a config error (exit 2) names `key`."""

    def judge(done: Outcome) -> Verdict:
        found = re.search(rf"config error .*{re.escape(key)}.*", done.output)
        if done.rc != 2 or not found:
            return Verdict(FAIL, f"exit {done.rc}: {_last_error(done.output)}")
        return Verdict(PASS, found.group(0)[:200])

    return judge


def _last_error(output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    for line in reversed(lines):
        if re.search(r"error|Error|FAIL|failed|Traceback", line):
            return line[:200]
    return lines[-1][:200] if lines else "no output"


def checks(gpus: int) -> list[Check]:
    """Every check, in the order they start: what one GPU proves first, in about 7 minutes
    (the default experiment, a llama-1b step's MFU and memory, compile's and float8's gain,
    a trace and a memory snapshot, calibration, CP's fused kernels and the experts' grouped
    GEMM), then what needs more GPUs. `gpus`: how many this box has."""
    return [*one_gpu(max(gpus, 1)), *more_gpus(gpus)]


def one_gpu(all_gpus: int) -> list[Check]:
    llama = "model=llama-1b train.precision=bf16 train.seq_len=2048"
    short = "train.steps=6 train.untimed_steps=2 metrics.baseline=off"
    tiny_moe = (
        "model=tiny-moe train.precision=bf16 train.seq_len=1024 train.steps=20 "
        "train.untimed_steps=4 metrics.baseline=off"
    )
    return [
        Check(
            "every meshrun module imports (the carried wheels against the image's packages)",
            _python(f"-c {IMPORT_ALL}", words=False),
            exits_zero_with(r"imported \d+ modules"),
            gpus=0,
            budget_s=90,
        ),
        Check(
            f"make run: the default experiment on all {all_gpus} GPU(s)",
            _meshrun(""),  # the README's first command, W&B aside
            ran(default_experiment(all_gpus)),
            gpus=all_gpus,
            budget_s=120,
        ),
        Check(
            "a tiny run on the CPU (Hydra, the launcher, a rank, the record; no GPU)",
            _meshrun("model=tiny hardware=cpu backend=gloo parallel=single", short),
            ran(),
            gpus=0,
            budget_s=180,  # 86 s in the rehearsal beside the test suite on 2 cores
        ),
        Check(
            "meshrun-plan llama-1b on h100-80g (the planner offline, no GPU)",
            _python(
                "-m meshrun.tools.plan.main model=llama-1b hardware=h100-80g world_size=1",
                store=True,
            ),
            exits_zero_with(r"fsdp|single|ddp"),
            gpus=0,
            budget_s=90,
        ),
        Check(
            "llama-1b bf16 on one GPU: eager, compiled, float8 compiled (MFU, gains, memory)",
            _eager_compiled_float8(
                "parallel=single train.micro_batch_size=4 train.global_batch_size=8 "
                "train.steps=20 train.untimed_steps=5 metrics.baseline=off",
                llama,
            ),
            _gains,
            budget_s=330,
            alone=True,
        ),
        Check(
            "inside a step: llama-1b profiled steps 4-5, allocator snapshots",
            _meshrun(
                "parallel=single train.micro_batch_size=2 train.steps=8 train.untimed_steps=2 "
                "debug.profile_steps=[4,5] debug.memory_snapshot=true metrics.baseline=off",
                llama,
            ),
            ran(lambda r: None if r.get("profile") else "no profile in results.json"),
            budget_s=120,
            alone=True,
            keep=("run/profile/rank0.trace.json.gz", "run/memory_snapshot/rank0.peak.pickle"),
        ),
        Check(
            "memory: llama-1b bf16 ckpt=full, predicted vs measured",
            _meshrun(
                "parallel=single train.micro_batch_size=2 parallel.activation_checkpointing=full",
                llama,
                short,
            ),
            ran(memory_within_bars),
            budget_s=90,
        ),
        Check(
            "CP's fused CUDA attention kernels, the experts' grouped GEMM and Liger's fused "
            "cross-entropy, in one process",
            _python(
                "-m pytest -q -p no:cacheprovider tests/test_gpu.py -k "
                "kernel_on_cuda_equals_sdpa or kernel_rules or gqa_reaches or grouped_gemm "
                "or liger"
            ),
            exits_zero_with(r"\d+ passed"),
            budget_s=120,
        ),
        Check(
            "meshrun-plan calibrate (matmul, attention, memory, host costs; NCCL with 2+)",
            _python(
                "-m meshrun.tools.plan.main calibrate model=llama-1b hardware=auto "
                "train.precision=bf16 train.seq_len=2048 train.micro_batch_size=4",
                store=True,
            ),
            _calibrated,
            gpus=all_gpus,
            budget_s=180,
            alone=True,
        ),
        Check(
            "this box: its profile, its RunPlan, a SLURM task's cuda:0, fork refused",
            _all_of(
                _python(
                    "-c from meshrun.core.hardware import HostFacts, detect_profile; "
                    "f = HostFacts.detect(); print('profile', detect_profile(f).name, "
                    "[d.name for d in f.cuda_devices])",
                    words=False,
                ),
                _python("-m meshrun.tools.plan.main model=tiny show=resolved", store=True),
                _python(
                    "-c import torch; from meshrun.rank.mesh import select_device; "
                    "d = select_device('cuda', 3); torch.ones(1, device=d); print('single ->', d)",
                    words=False,
                ),
                _meshrun("launcher.start_method=fork parallel=single train.steps=2"),
            ),
            _this_box,
            budget_s=120,
        ),
        Check(
            "memory: small fp32 and gpt2-124m bf16 seq 1024, predicted vs measured",
            _all_of(
                _meshrun("parallel=single model=small train.precision=fp32", short, under="small"),
                _meshrun(
                    "parallel=single model=gpt2-124m train.precision=bf16 train.seq_len=1024 "
                    "train.micro_batch_size=4",
                    short,
                    under="gpt2",
                ),
            ),
            _both_within_bars("small", "gpt2"),
            budget_s=120,
        ),
        Check(
            "memory levers on one GPU: llama-1b bf16, the loss full against auto's chunked, "
            "then 8-bit states with the activations in pinned host memory, then FSDP2's state "
            "on the host over a shard of one",
            _all_of(
                *[
                    _meshrun(
                        "parallel=single train.micro_batch_size=2",
                        llama,
                        short,
                        extra,
                        under=name,
                    )
                    for name, extra in LEVER_RUNS
                ]
            ),
            _levers_against_full,
            budget_s=230,
        ),
        *(shared_gpu() if all_gpus == 1 else []),
        Check(
            "fp32 on CUDA with train.tf32 on and off: the rate planned is the rate run",
            _tf32_on_and_off(
                "parallel=single model=llama-1b train.precision=fp32 train.seq_len=1024 "
                "train.micro_batch_size=4 train.global_batch_size=4 train.steps=8 "
                "train.untimed_steps=3 metrics.baseline=off"
            ),
            _tf32_as_planned,
            budget_s=150,
            alone=True,
        ),
        Check(
            "moe: tiny-moe bf16 single, grouped GEMM against the loop",
            _grouped_and_loop("parallel=single", tiny_moe),
            _grouped_against_loop,
            budget_s=120,
        ),
        Check(
            "a transformers Qwen3-MoE save_pretrained directory trains on one GPU, bf16",
            _from_saved_qwen3_moe("parallel=single train.steps=3 metrics.baseline=off"),
            ran(lambda r: None if r["status"] == "completed" else r["status"]),
            budget_s=90,
        ),
        Check(
            "resume on CUDA: RNG states read as tensors only, the losses go on as before",
            _resumed("model=tiny parallel=single train.steps=4 metrics.baseline=off"),
            _resumed_alike,
            budget_s=120,
        ),
        Check(
            "checkpoint.every_steps=auto on CUDA: saves at the interval it printed",
            _meshrun(
                "model=small parallel=single train.steps=60 checkpoint.every_steps=auto "
                "plan.mtbf_hours=0.05 metrics.baseline=off"
            ),
            _saved_as_printed,
            budget_s=120,
        ),
        Check(
            "installer: the image's CUDA torch kept, seeing every GPU nvidia-smi lists",
            lambda work: ["env", "MESHRUN_INSTALL_DRY_RUN=1", "scripts/install-torch.sh", PY],
            exits_zero_with(r"sees the \d+ GPU\(s\) nvidia-smi lists"),
            gpus=all_gpus,
            budget_s=60,
        ),
        Check(
            "throughput: hf/llama-3.2-1b bf16 (a transformers model's MFU)",
            _meshrun(
                "parallel=single model=hf/llama-3.2-1b train.precision=bf16 train.seq_len=2048 "
                "train.micro_batch_size=4 train.global_batch_size=8 train.steps=20 "
                "train.untimed_steps=5 metrics.baseline=off"
            ),
            ran(),
            budget_s=120,
            alone=True,
        ),
        Check(
            "verify: auto's chunked loss on Liger's kernel against the full loss, one GPU",
            _meshrun(
                "model=tiny parallel=single train.precision=fp32 verify.reference=full_loss",
                command="verify",
            ),
            _verified_on_liger,
            budget_s=90,
        ),
        Check(
            "gpu-marked tests",
            _python(
                "-m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py "
                "tests/test_gpu_dataparallel.py tests/test_comm.py"
            ),
            exits_zero_with(r"\d+ passed"),
            gpus=min(all_gpus, 2),
            budget_s=240,
        ),
    ]


def shared_gpu() -> list[Check]:
    """Multi-rank layouts on a box of one GPU: NCCL refuses two ranks on one device, gloo
    takes them (meshrun lets its ranks share GPUs), so every collective, the small control
    ones too, runs on CUDA tensors where the layout puts them. A collective gloo has no CUDA
    kernel for is SKIPPED, saying which (torch's backend table: docs/distributed.rst)."""
    tiny = "model=tiny train.precision=fp32 backend=gloo launcher.nproc_per_node=2"
    layouts = ("ddp", "fsdp", "tp2", "fsdp parallel.fsdp.offload=cpu")  # the last: pinned
    return [
        Check(
            f"verify: {layout} over gloo, 2 ranks sharing the GPU, against one GPU",
            _meshrun(f"parallel={layout}", tiny, command="verify"),
            passed_or_gloo_lacks,
            budget_s=120,
        )
        for layout in layouts
    ]


# issue 63's levers on a GPU: the whole fp32 logits, auto's chunked loss, and 8-bit AdamW
# (torchao's CUDA kernels) with the blocks' saved tensors in pinned host memory
LEVER_RUNS = (
    ("full", "train.loss=full"),
    ("auto", ""),
    ("levers", "train.optimizer_states=8bit parallel.activation_offload=cpu"),
    ("offload", "parallel.fsdp.offload=cpu"),  # FSDP2 over one rank: the state on the host
)


def _levers_against_full(done: Outcome) -> Verdict:
    """Every run ended 0 with its peak within the planner's bars, auto's loss peaks under the
    full loss's, and FSDP2's offload on one GPU under auto's."""
    if any(rc for rc, _ in parts(done.output)):
        return Verdict(FAIL, f"a run failed: {_last_error(done.output)}")
    runs = {name: _results(done.work / name) for name, _ in LEVER_RUNS}
    wrong = [f"{n}: {why}" for n, r in runs.items() if (why := memory_within_bars(r))]
    peaks = {n: max(m["peak"] for m in r["memory_per_rank"]) for n, r in runs.items()}
    for lean, than in (("auto", "full"), ("offload", "auto")):
        if peaks[lean] >= peaks[than]:
            wrong.append(
                f"{lean} peaks at {peaks[lean] / MiB:,.0f} MiB, {than} at {peaks[than] / MiB:,.0f}"
            )
    said = " | ".join(f"{n}: {figures(r)}" for n, r in runs.items())
    return Verdict(FAIL if wrong else PASS, "; ".join([*wrong, said]))


def _verified_on_liger(done: Outcome) -> Verdict:
    """meshrun-verify's PASS, with the chunked loss on Liger's kernel (carried in the wheel
    set: train.loss_kernel=auto takes it on CUDA)."""
    if done.rc != 0:
        return Verdict(FAIL, _last_error(done.output))
    report = json.loads((done.work / "run" / "verify.json").read_text())
    if report.get("loss_kernel") != "liger":
        return Verdict(FAIL, f"the chunked loss ran on {report.get('loss_kernel')}, not Liger's")
    said = [line for line in done.output.splitlines() if "largest deviation" in line]
    return Verdict(PASS, said[-1].strip()[:200] if said else "PASS")


def passed_or_gloo_lacks(done: Outcome) -> Verdict:
    """meshrun-verify's PASS; SKIPPED where gloo has no CUDA implementation of a collective
    the layout needs."""
    lacks = re.search(
        r".*(?i:gloo).*(?i:not supported|unsupported|does not support).*", done.output
    )
    if done.rc and lacks:
        return Verdict(SKIPPED, f"gloo on CUDA tensors: {lacks.group(0).strip()[:160]}")
    return exits_zero_with(r"PASS")(done)


def more_gpus(gpus: int) -> list[Check]:
    """The checks of two GPUs and more (SKIPPED on one, saying why), then those of the box's
    CPU cores, then a look through every check's output."""
    llama = "model=llama-1b train.precision=bf16 train.seq_len=2048"
    moe = (
        "model=mixtral-8x7b model.n_layers=2 model.dim=1024 model.n_heads=8 model.n_kv_heads=8 "
        "model.ffn_dim=3584 train.precision=bf16 train.seq_len=1024 train.micro_batch_size=2 "
        "train.global_batch_size=8 train.steps=8 train.untimed_steps=2 metrics.baseline=off"
    )
    nccl2 = "backend=nccl launcher.nproc_per_node=2"
    cp16k = (
        f"model=small model.n_kv_heads=2 parallel=cp2 {nccl2} train.seq_len=16384 "
        "train.micro_batch_size=1 train.global_batch_size=2"
    )
    tiny_moe = (
        "model=tiny-moe train.precision=bf16 train.seq_len=1024 train.steps=20 "
        "train.untimed_steps=4 metrics.baseline=off"
    )
    hang = (
        "metrics.baseline=off model=tiny backend=nccl train.steps=6 debug.fail_rank=1 "
        f"debug.fail_step=2 debug.fail_mode=hang backend.timeout_s={HANG_TIMEOUT_S}"
    )
    return [
        Check(
            "float8 vs bf16: llama-1b fsdp on NCCL, compiled, tokens/s and loss",
            _eager_compiled_float8(
                "parallel=fsdp train.micro_batch_size=4 train.global_batch_size=8 "
                "train.steps=20 train.untimed_steps=5 metrics.baseline=off",
                llama,
                nccl2,
                eager=False,
            ),
            _gains,
            gpus=2,
            budget_s=300,
            alone=True,
        ),
        *[
            Check(
                f"{layout} on NCCL, 2 GPUs: llama-1b bf16",
                _meshrun(
                    f"parallel={layout} train.micro_batch_size=2 train.global_batch_size=8 "
                    "train.steps=10 train.untimed_steps=3 metrics.baseline=off",
                    llama,
                    nccl2,
                ),
                ran(memory_within_bars),
                gpus=2,
                budget_s=120,
            )
            for layout in ("fsdp", "tp2")
        ],
        Check(
            "dataparallel over 2 GPUs: llama-1b bf16, memory per device",
            _meshrun(
                "parallel=dataparallel parallel.dataparallel_devices=2 train.micro_batch_size=4 "
                "train.global_batch_size=8 train.steps=10 train.untimed_steps=3 "
                "metrics.baseline=off",
                llama,
            ),
            ran(dataparallel_devices),
            gpus=2,
            budget_s=120,
        ),
        Check("ep2 on NCCL: mixtral-shaped", _meshrun("parallel=ep2", moe, nccl2), ran(), gpus=2),
        Check(
            "tp2 x etp on NCCL: mixtral-shaped",
            _meshrun("parallel=tp2 parallel.etp=2", moe, nccl2),
            ran(),
            gpus=2,
        ),
        *[
            Check(
                f"verify: {what} on NCCL against one GPU",
                _meshrun(overrides, nccl2, command="verify"),
                exits_zero_with(r"PASS"),
                gpus=2,
            )
            for what, overrides in (
                (
                    "fsdp fp32 under TF32 (verify's 2^-11 bar)",
                    "model=tiny parallel=fsdp train.precision=fp32",
                ),
                (
                    "fsdp with FSDP2's CPU offload (pinned host memory)",
                    "model=tiny parallel=fsdp parallel.fsdp.offload=cpu",
                ),
                (
                    "tp2's vocabulary-parallel loss (loss_parallel)",
                    "model=tiny parallel=tp2 parallel.sequence_parallel=true",
                ),
                ("tiny-moe ep2", "model=tiny-moe parallel=ep2"),
                (
                    "a tied embedding across 2 pipeline stages",
                    "model=tiny model.tie_embeddings=true parallel=pp2",
                ),
            )
        ],
        Check(
            "a hang on NCCL: flight recorder names the collective",
            _meshrun("parallel=ddp launcher.nproc_per_node=2", hang),
            _hang_named,
            gpus=2,
            budget_s=150,
        ),
        Check(
            "moe: tiny-moe bf16 ep2 on NCCL, grouped GEMM against the loop",
            _grouped_and_loop("parallel=ep2", tiny_moe, nccl2),
            _grouped_against_loop,
            gpus=2,
            budget_s=150,
        ),
        Check(
            "verify: a transformers Qwen3-MoE directory under ep2 on NCCL, bf16",
            _from_saved_qwen3_moe(f"parallel=ep2 {nccl2} train.steps=3", command="verify"),
            exits_zero_with(r"PASS"),
            gpus=2,
        ),
        Check(
            "torchft on NCCL: a spike at step 25 rolls both replica groups back alike",
            _meshrun(
                "parallel=ddp model=tiny parallel.fault_tolerance=torchft train.steps=40 "
                "train.guard.spike=true checkpoint.every_steps=10 debug.corrupt_step=[25] "
                "debug.corrupt_mode=spike metrics.baseline=off",
                nccl2,
            ),
            ran(_rolled_back_alike),
            gpus=2,
            budget_s=150,
        ),
        Check(
            "a hang in tp2 x pp2's TP group on NCCL ends at backend.timeout_s",
            _meshrun("parallel=tp2_pp2 launcher.nproc_per_node=4", hang),
            _hang_named,
            gpus=4,
            budget_s=150,
        ),
        Check(
            "torchft on NCCL: replica 1 killed at step 10, rejoins",
            _meshrun(
                "parallel=ddp model=tiny parallel.fault_tolerance=torchft train.steps=60 "
                "train.untimed_steps=2 debug.fail_rank=1 debug.fail_step=10 debug.fail_mode=kill "
                "debug.slow_step_s=0.05 parallel.replica_restart_delay_s=2 metrics.baseline=off",
                nccl2,
            ),
            ran(lambda r: None if r.get("replica_failure_count") else "no replica failure"),
            gpus=2,
            budget_s=180,
        ),
        *[
            Check(
                f"cp2 {method} at 16k tokens on NCCL, fp32: fused chunk pairs against one GPU",
                _meshrun(
                    f"{cp16k} parallel.cp_method={method} train.precision=fp32 train.tf32=false",
                    command="verify",
                ),
                exits_zero_with(r"PASS"),
                gpus=2,
                budget_s=150,
            )
            for method in ("ring", "allgather")
        ],
        *[
            Check(
                f"cp2 {method} at 16k tokens on NCCL, bf16: memory against the plan",
                _meshrun(
                    f"{cp16k} parallel.cp_method={method} train.precision=bf16 train.steps=6 "
                    "train.untimed_steps=2 metrics.baseline=off"
                ),
                ran(memory_within_bars),
                gpus=2,
                budget_s=120,
            )
            for method in ("ring", "allgather")
        ],
        Check(
            "cp2 x dp_replicate2 (replicas beside CP) at 16k, bf16: memory against the plan",
            _meshrun(
                f"{cp16k} parallel.dp_replicate=2 launcher.nproc_per_node=4 "
                "train.global_batch_size=4 train.precision=bf16 train.steps=6 "
                "train.untimed_steps=2 metrics.baseline=off"
            ),
            ran(memory_within_bars),
            gpus=4,
            budget_s=150,
        ),
        Check(
            "context parallelism: cp2 per method against one GPU (4k, 16k), bf16",
            _python("benchmarks/context_parallel.py 4096 16384 --cap-mib 2048 --precision bf16"),
            exits_zero_with(r"cp2"),
            gpus=2,
            budget_s=300,
        ),
        Check(
            "meshrun-comm over NCCL (all-reduce bus bandwidth)",
            _python("-m meshrun.tools.comm.main backend=nccl", store=True),
            exits_zero_with(r"(?i)busbw|bus bandwidth"),
            gpus=max(gpus, 2),
            budget_s=120,
        ),
        Check(
            "meshrun-doctor",
            _python("-m meshrun.tools.doctor.main"),
            exits_zero_with(r"(?i)doctor|devices"),
            gpus=max(gpus, 2),
            budget_s=180,
        ),
        Check(
            "pipeline bubble on the box's CPU cores",
            _python("-m pytest -q -p no:cacheprovider -s -m slow -k bubble tests/test_pipeline.py"),
            exits_zero_with(r"\d+ passed"),
            gpus=0,
            budget_s=180,
            alone=True,
            rehearse=False,
        ),
        Check(
            "no NCCL barrier on a guessed device (in every check's output)",
            lambda work: ["grep", "-rl", "barrier(): using the device", str(work.parent)],
            lambda done: Verdict(
                PASS if done.rc == 1 else FAIL,
                "none" if done.rc == 1 else f"in {done.output.strip() or 'grep failed'}",
            ),
            gpus=0,
            budget_s=30,
            alone=True,
            rehearse=False,
        ),
    ]


def _hang_named(done: Outcome) -> Verdict:
    """A hang ends the run (non-zero) with the collective named, within the timeout and the
    teardown's minute and a half (NCCL's watchdog waits 4 x 15 s after a timeout, whatever
    the dump: not torch's 10-minute default of a sub-group), and NCCL's own flight recorder
    dumped each rank's entries (meshrun's rank<N>.json are there whether or not it did)."""
    named = re.search(r"collective hang.*", done.output)
    if done.rc == 0 or not named:
        why = _last_error(done.output)
        return Verdict(FAIL, f"exit {done.rc}, no 'collective hang' message: {why}")
    folder = done.work / "run" / "flight_recorder"
    dumps = {p.name: pickle.loads(p.read_bytes()) for p in sorted(folder.glob("nccl_rank*"))}
    entries = {name: len(dump.get("entries", [])) for name, dump in dumps.items()}
    why = []
    if done.seconds > HANG_TIMEOUT_S + 90:
        why.append("late")
    if "nccl_rank0" not in dumps or not all(entries.values()):
        why.append("no NCCL flight-recorder dump with entries")
    return Verdict(
        FAIL if why else PASS,
        "; ".join(
            [
                *why,
                f"ended after {done.seconds:.0f} s (timeout {HANG_TIMEOUT_S})",
                f"NCCL dumps {entries}",
                named.group(0)[:120],
            ]
        ),
    )


def _rolled_back_alike(r: dict) -> str | None:
    """One rollback, step 25 to the checkpoint of 20, and no step retried: the replica
    groups agreed (a vote lost in torchft's NCCL group fails the commit: steps retried)."""
    rollbacks = [(b["step"], b["restored_step"]) for b in r.get("rollbacks") or []]
    retried = r.get("retried_steps") or []
    if rollbacks == [(25, 20)] and not retried:
        return None
    return f"rollbacks {rollbacks}, retried steps {retried}"


QWEN3_MOE = (
    "import torch, transformers as t, sys; torch.manual_seed(0); "
    "c = t.Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=128, "
    "moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, "
    "num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2); "
    "t.Qwen3MoeForCausalLM(c).save_pretrained(sys.argv[1])"
)


def _from_saved_qwen3_moe(overrides: str, command: str = "meshrun") -> Callable[[Path], list[str]]:
    """A tiny Qwen3-MoE written by transformers' save_pretrained (experts per expert on
    disk), then trained from its directory with `overrides`."""

    def argv(work: Path) -> list[str]:
        saved = work / "qwen3-moe"
        run = _meshrun(
            f"model=hf/auto model.pretrained={saved} train.precision=bf16",
            overrides,
            command=command,
        )(work)
        return [
            "bash",
            "-c",
            f"{shlex.join([PY, '-c', QWEN3_MOE, str(saved)])} && {shlex.join(run)}",
        ]

    return argv


def _calibrated(done: Outcome) -> Verdict:
    """Calibrated, with the checkpoint rates the run plan uses (staging against the 32 GB/s
    it assumes on a GPU, docs/planner.md)."""
    verdict = exits_zero_with(r"calibrated: ")(done)
    if verdict.status == FAIL:
        return verdict
    cal = json.loads((done.work / "calibration.json").read_text())
    staging, storage = cal.get("staging_gbs"), cal.get("storage_gbs")
    ok = staging is not None and 1 <= staging <= 64 and (storage or 0) > 0
    return Verdict(
        PASS if ok else FAIL,
        f"staging {staging} GB/s (plan assumes 32), storage {storage} GB/s; {verdict.detail}",
    )


def _saved_as_printed(done: Outcome) -> Verdict:
    """The N printed is the record's, and the saves are its multiples from step 5, and 60."""
    if done.rc:
        return Verdict(FAIL, f"exit {done.rc}: {_last_error(done.output)}")
    r = _results(done.work)
    printed = re.search(r"checkpoint\.every_steps=auto: every (\d+) step", done.output)
    every = r.get("checkpoint_every_steps")
    saved = [s["step"] for s in r.get("checkpoint_saves") or []]
    want = [k for k in range(every or 1, 60, every or 1) if k >= 5] + [60] if every else None
    ok = printed is not None and int(printed.group(1)) == every and saved == want
    return Verdict(
        PASS if ok else FAIL,
        f"every {every} (printed {printed and printed.group(1)}), saved {saved}; blocked "
        f"{r.get('checkpoint_blocked_s')} s a save, predicted "
        f"{r.get('predicted_checkpoint_blocked_s')}",
    )


def _resumed(overrides: str) -> Callable[[Path], list[str]]:
    """A run saving at step 2 (work/first), then one resumed from that checkpoint
    (work/resumed)."""

    def argv(work: Path) -> list[str]:
        first = _meshrun(overrides, "checkpoint.every_steps=2")(work / "first")
        step2 = work / "first" / "run" / "checkpoints" / "step-00000002"
        resumed = _meshrun(overrides, f"checkpoint.resume={step2}")(work / "resumed")
        return ["bash", "-c", f"{shlex.join(first)} && {shlex.join(resumed)}"]

    return argv


def _resumed_alike(done: Outcome) -> Verdict:
    if done.rc:
        return Verdict(FAIL, f"exit {done.rc}: {_last_error(done.output)}")
    first, resumed = (_results(done.work / name)["losses"] for name in ("first", "resumed"))
    same = resumed == first[2:]
    return Verdict(PASS if same else FAIL, f"losses {first} then, resumed at 2, {resumed}")


def _tf32_on_and_off(overrides: str) -> Callable[[Path], list[str]]:
    def argv(work: Path) -> list[str]:
        runs = [
            shlex.join(_meshrun(overrides, f"train.tf32={on}")(work / f"tf32_{on}"))
            for on in ("true", "false")
        ]
        return ["bash", "-c", " && ".join(runs)]

    return argv


def _tf32_as_planned(done: Outcome) -> Verdict:
    """Each run's matmul precision the one asked for, its step within the planner's 2x of the
    prediction, full fp32 at least twice TF32's step, no MFU over 1."""
    if done.rc:
        return Verdict(FAIL, f"exit {done.rc}: {_last_error(done.output)}")
    on, off = (_results(done.work / f"tf32_{v}") for v in ("true", "false"))
    wrong = [f"matmuls {r.get('matmul_precision')}" for r, want in ((on, "tf32"), (off, "fp32"))
             if r.get("matmul_precision") != want]  # fmt: skip
    for name, r in (("tf32", on), ("fp32", off)):
        ratio = r["step_time_s"] / r["predicted_step_time_s"]
        if not 0.5 <= ratio <= 2 or (r.get("mfu") or 0) >= 1:
            wrong.append(f"{name}: step {ratio:.2f}x predicted, MFU {r.get('mfu')}")
    slower = off["step_time_s"] / on["step_time_s"]
    if slower < 2:
        wrong.append(f"fp32 only {slower:.2f}x TF32's step")
    detail = f"TF32 {figures(on)} | fp32 {figures(off)}"
    return Verdict(FAIL if wrong else PASS, "; ".join([*wrong, detail]))


def _grouped_and_loop(*overrides: str) -> Callable[[Path], list[str]]:
    """The same run twice: the MoE experts as one grouped GEMM (work/grouped), then as a loop
    (work/loop, model.moe.grouped_mm=false)."""

    def argv(work: Path) -> list[str]:
        runs = [
            shlex.join(_meshrun(*overrides, f"model.moe.grouped_mm={on}")(work / name))
            for name, on in (("grouped", "true"), ("loop", "false"))
        ]
        return ["bash", "-c", " && ".join(runs)]

    return argv


def _grouped_against_loop(done: Outcome) -> Verdict:
    """Every step's loss within 2% of the loop's, and the grouped GEMM no slower than 0.95x."""
    if done.rc:
        return Verdict(FAIL, f"exit {done.rc}: {_last_error(done.output)}")
    grouped, loop = (_results(done.work / name) for name in ("grouped", "loop"))
    pairs = zip(grouped["losses"], loop["losses"], strict=True)
    apart = max(abs(g - w) / abs(w) for g, w in pairs)
    speed = grouped["tokens_per_s"] / loop["tokens_per_s"]
    why = [f"losses {apart:.1%} apart"] if apart > 0.02 else []
    why += [f"grouped {speed:.2f}x the loop's tokens/s"] if speed < 0.95 else []
    detail = (
        f"losses within {apart:.2%}; {grouped['tokens_per_s']:,.0f} tok/s grouped, "
        f"{loop['tokens_per_s']:,.0f} loop ({speed:.2f}x)"
    )
    return Verdict(FAIL if why else PASS, "; ".join([*why, detail]))


def import_everything(src: Path) -> int:
    """Every module of meshrun, and every module meshrun's source imports anywhere (inside
    functions too: torchao, torchft, transformers, wandb are imported where used), imported
    here: the carried wheels proven against this interpreter's packages before a check
    needs them. Prints the failures and a count; the exit status is theirs."""
    import ast  # noqa: PLC0415 (the checks' module stays light for the runner)
    import importlib  # noqa: PLC0415
    import pkgutil  # noqa: PLC0415

    import meshrun  # noqa: PLC0415

    modules = pkgutil.walk_packages(meshrun.__path__, "meshrun.")
    names = {m.name for m in modules if not m.name.endswith(".__main__")}  # those run
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
    failed = []
    for name in sorted(names):
        try:
            importlib.import_module(name)
        except Exception as err:  # every failure is listed, not only the first
            failed.append(f"{name}: {type(err).__name__}: {err}")
    print("\n".join(failed))
    print(f"imported {len(names) - len(failed)} modules of {len(names)}")
    return 1 if failed else 0


IMPORT_ALL = (
    "import sys; sys.path.insert(0, 'scripts'); from pathlib import Path; "
    "from gpu_checks import import_everything; "
    "sys.exit(import_everything(Path('src/meshrun')))"
)


def _all_of(*commands: Callable[[Path], list[str]]) -> Callable[[Path], list[str]]:
    """Several commands one after the other whatever each ends with, each part of the output
    closed by its exit status (`parts` reads them back)."""

    def argv(work: Path) -> list[str]:
        script = "; ".join(f'{shlex.join(c(work))}; echo "=== exit $?"' for c in commands)
        return ["bash", "-c", script]

    return argv


def parts(output: str) -> list[tuple[int, str]]:
    """_all_of's output: (exit status, output) of each command."""
    found = re.split(r"^=== exit (\d+)$", output, flags=re.MULTILINE)
    return [(int(rc), text) for text, rc in zip(found[0::2], found[1::2], strict=False)]


def _this_box(done: Outcome) -> Verdict:
    """hardware=auto names a profile, the RunPlan is CUDA's, a task seeing one GPU takes
    cuda:0 whatever its local rank, and fork is refused (exit 2)."""
    wanted = [
        (0, r"profile (?!unknown)\S+.*", "no profile"),
        (0, r"device_type: cuda\nbackend: nccl(.|\n)*prediction:\n  memory:", "not cuda/nccl"),
        (0, r"single -> cuda:0", "not cuda:0"),
        (2, r"config error .*launcher\.start_method", "fork not refused"),
    ]
    got = parts(done.output)
    wrong = [
        f"{why} (exit {got[i][0] if i < len(got) else 'none'})"
        for i, (rc, pattern, why) in enumerate(wanted)
        if i >= len(got) or got[i][0] != rc or not re.search(pattern, got[i][1])
    ]
    profile = re.search(wanted[0][1], got[0][1]) if got else None
    detail = profile.group(0)[:120] if profile else "no profile line"
    return Verdict(FAIL if wrong else PASS, "; ".join([*wrong, detail]))


def _both_within_bars(*names: str) -> Callable[[Outcome], Verdict]:
    """Each run under its own sub-folder ended 0, its peak within the planner's bars."""

    def judge(done: Outcome) -> Verdict:
        if done.rc or any(rc for rc, _ in parts(done.output)):
            return Verdict(FAIL, f"a run failed: {_last_error(done.output)}")
        found = {name: _results(done.work / name) for name in names}
        wrong = [f"{n}: {why}" for n, r in found.items() if (why := memory_within_bars(r))]
        detail = " | ".join(f"{n}: {figures(r)}" for n, r in found.items())
        return Verdict(FAIL if wrong else PASS, "; ".join([*wrong, detail]))

    return judge


def _eager_compiled_float8(*overrides: str, eager: bool = True) -> Callable[[Path], list[str]]:
    """The same bf16 run eager (work/eager, unless `eager` is False), compiled
    (work/compiled) and compiled with float8 (work/float8), one after the other."""
    runs = [("compiled", "train.compile=true"),
            ("float8", "train.compile=true train.float8.enabled=true")]  # fmt: skip
    if eager:
        runs.insert(0, ("eager", "train.compile=false"))

    def argv(work: Path) -> list[str]:
        made = [shlex.join(_meshrun(*overrides, extra, under=name)(work)) for name, extra in runs]
        return ["bash", "-c", " && ".join(made)]

    return argv


def _gains(done: Outcome) -> Verdict:
    """The figures of each run there (eager's memory within the bars), compile's gain over
    eager, float8's over compiled bf16, and every float8 step's loss within meshrun-verify's
    high-precision bound of bf16's (FLOAT8_LOSS_BOUND)."""
    # here, not at the top: the runner lists its checks where meshrun's needs are missing
    from meshrun.driver.tool_config import FLOAT8_LOSS_BOUND  # noqa: PLC0415

    runs = {
        name: _results(done.work / name)
        for name in ("eager", "compiled", "float8")
        if (done.work / name / "run" / "results.json").exists()
    }
    wrong = [f"exit {done.rc}: {_last_error(done.output)}"] if done.rc else []
    said = [f"{name}: {figures(r)}" for name, r in runs.items()]
    if "eager" in runs and (why := memory_within_bars(runs["eager"])):
        wrong.append(f"eager: {why}")
    if {"eager", "compiled"} <= set(runs):
        gain = runs["compiled"]["tokens_per_s"] / runs["eager"]["tokens_per_s"]
        said.insert(0, f"compile {gain:.2f}x eager")
    if {"compiled", "float8"} <= set(runs):
        bf16, float8 = runs["compiled"], runs["float8"]
        apart = max(
            abs(f - b) / abs(b) for f, b in zip(float8["losses"], bf16["losses"], strict=True)
        )
        predicted = [float8.get("predicted_tokens_per_s"), bf16.get("predicted_tokens_per_s")]
        said.insert(
            0,
            f"float8 {float8['tokens_per_s'] / bf16['tokens_per_s']:.2f}x bf16"
            + (f" (predicted {predicted[0] / predicted[1]:.2f}x)" if all(predicted) else "")
            + f", losses within {apart:.2%}, MFU of the fp8 peak "
            + (f"{float8['mfu_fp8_peak']:.1%}" if float8.get("mfu_fp8_peak") else "n/a"),
        )
        if apart > FLOAT8_LOSS_BOUND:
            wrong.append(f"float8 losses {apart:.1%} from bf16's (bound {FLOAT8_LOSS_BOUND:.1%})")
    return Verdict(FAIL if wrong else PASS, "; ".join([*wrong, *said]))


def planted(seconds_left: float) -> list[Check]:
    """The rehearsal's own checks (scripts/gpu_rehearsal.py judges what they leave): one that
    fails, one that waits until the table on disk holds the checks before it and keeps an
    artefact, and one that ignores SIGTERM and would run past the deadline (its budget over
    what is left, so it starts and is cut there)."""
    names = [c.name for c in checks(0) if c.gpus == 0 and c.rehearse]
    wait = (
        "import json, os, sys, time; names = json.loads(sys.argv[1]); "
        "path = os.path.join(os.environ['OUT'], 'gpu-check.json'); end = time.time() + 240\n"
        "while time.time() < end:\n"
        "    rows = {c['name']: c['status'] for c in json.load(open(path))['checks']}\n"
        "    if all(rows.get(n) not in (None, 'PENDING') for n in names): break\n"
        "    time.sleep(1)\n"
        "open('artefact.txt', 'w').write('kept'); print('on disk:', rows)"
    )
    return [
        Check(
            "planted: a hang that ignores SIGTERM, past the deadline",
            lambda work: ["bash", "-c", "trap '' TERM; while :; do sleep 1; done"],
            lambda done: Verdict(FAIL, "it ended by itself"),
            gpus=0,
            budget_s=1.5 * seconds_left,
        ),
        Check(
            "planted: a check that fails",
            lambda work: ["sh", "-c", "echo planted failure; exit 3"],
            exits_zero_with("never"),
            gpus=0,
            budget_s=30,
        ),
        Check(
            "planted: the table on disk holds the checks that ended",
            lambda work: [
                "bash",
                "-c",
                f"cd {shlex.quote(str(work))} && "
                + shlex.join([PY, "-c", wait, json.dumps(names)]),
            ],
            exits_zero_with(r"on disk: .*PASS"),
            gpus=0,
            budget_s=250,
            keep=("artefact.txt",),
        ),
    ]


def rehearsal(gpus: int, seconds_left: float) -> list[Check]:
    """What the rehearsal runs: the planted checks, then every check it may (those of GPUs
    are SKIPPED on its CPU box, saying so)."""
    return [*planted(seconds_left), *[c for c in checks(gpus) if c.rehearse]]


if __name__ == "__main__":
    rehearsing = os.environ.get("GPU_CHECK_REHEARSAL") == "1"
    sys.exit(main(rehearsal if rehearsing else lambda gpus, left: checks(gpus)))
