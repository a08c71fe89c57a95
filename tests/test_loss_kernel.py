"""train.loss_kernel (issue 63): a chunked loss on Liger's fused linear cross-entropy where it
can run (CUDA, liger-kernel installed, a linear head), torch's chunks elsewhere, saying why;
an explicit `liger` that cannot run exits 2 naming the key; the planner takes Liger's chunk
(its formula, liger_kernel/ops/fused_linear_cross_entropy.py); and meshrun's call of the
kernel (a padded vocabulary cut, a bias, ignored targets, a tied head, FSDP2's unsharded
head on two gloo ranks) gives torch's loss and gradients, run by Triton's interpreter on the
CPU where Triton and liger-kernel are
installed (the torch floor's venv: scripts/test-torch-floor.sh sets MESHRUN_REQUIRE_LIGER=1,
so there it fails rather than skips). On CUDA: tests/test_gpu.py, scripts/gpu_checks.py."""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import os
import re
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch import nn

from meshrun.core.choices import LossKernel
from meshrun.core.errors import ConfigError
from meshrun.core.hardware import HostFacts
from meshrun.core.layout import Layout
from meshrun.core.record import RunRecord
from meshrun.driver import box_defaults
from meshrun.driver.resolve import resolve
from meshrun.driver.sinks.console import _loss as summary_loss
from meshrun.models import build_model
from meshrun.models import loss as loss_choice
from meshrun.models.loss import chunk_tokens, liger_chunk_tokens, liger_import_error, loss_kernel
from meshrun.models.vocab import unpad_logits
from meshrun.plan.memory import Dims, loss_memory
from meshrun.rank.mesh import build_mesh
from meshrun.rank.parallel import loss as parallel_loss
from meshrun.rank.parallel.compose import parallelize
from meshrun.rank.parallel.loss import IGNORE_INDEX, apply_chunked_loss, micro_batch_loss
from meshrun.tools.verify import reference_config
from meshrun.validate.loss import check_loss
from tests.helpers import compose_config, resolved_config
from tests.test_custom_model import NAMED

CUDA = "hardware=h100-80g"


MISSING = "liger-kernel is not installed (pip install 'meshrun[liger]')"


@pytest.mark.parametrize(
    ("overrides", "imports", "kernel", "why"),
    [
        ((CUDA,), None, "liger", "CUDA, a linear head, liger-kernel installed"),
        ((CUDA, "model=hf/tiny-llama"), None, "liger", "CUDA, a linear head"),
        ((CUDA,), MISSING, "torch", MISSING),
        ((CUDA,), "liger-kernel does not import: ImportError", "torch", "does not import"),
        (("hardware=cpu",), None, "torch", "Triton for CUDA, and hardware=cpu is cpu"),
        ((CUDA, *NAMED), None, "torch", "model.kind=custom's head is not known to be a plain"),
        ((CUDA, "train.loss_kernel=torch"), None, "torch", None),
    ],
    ids=str,
)
def test_auto_takes_liger_where_it_runs_and_says_why_not(
    overrides, imports, kernel, why, monkeypatch
):
    """`imports`: why Liger's kernel would not import on this (CUDA) host, None where it
    does (models/loss.liger_import_error: this machine has no CUDA torch to import it)."""
    monkeypatch.setattr(loss_choice, "liger_import_error", lambda: imports)
    got, said = loss_kernel(compose_config("model=tiny", *overrides))
    assert got == kernel
    assert (said is None) if why is None else (why in said)


def test_liger_import_error_says_whether_liger_imports_here():
    """Here (CPU torch, no Triton): not installed; in the torch floor's venv it imports."""
    installed = importlib.util.find_spec("liger_kernel") is not None
    assert liger_import_error() == (None if installed else MISSING)


def test_autos_liger_leaves_a_layout_without_chunks_to_its_loss(monkeypatch):
    """On CUDA with liger-kernel installed, auto resolves to liger before the layout's loss
    is known (parallel=auto's search): a TP layout's vocab_parallel loss then runs as it is,
    where an explicit liger is refused; verify's full-loss reference takes torch's."""
    monkeypatch.setattr(loss_choice, "liger_import_error", lambda: None)
    cfg = compose_config("model=tiny", CUDA, "parallel=tp2")
    resolved = box_defaults.with_loss_kernel(cfg, cfg.hardware)
    assert resolved.train.loss_kernel == "liger"
    check_loss(resolved)
    full = reference_config(resolved, "full_loss")
    assert (full.train.loss, full.train.loss_kernel) == ("full", "torch")
    check_loss(full)
    with pytest.raises(ConfigError, match="this layout's is vocab_parallel"):
        check_loss(compose_config("model=tiny", CUDA, "parallel=tp2", "train.loss_kernel=liger"))


def test_the_resolved_run_says_which_kernel_auto_chose():
    run = resolve(compose_config("model=tiny", "parallel=single"), HostFacts.detect()).config
    assert run.train.loss_kernel == "torch"
    assert "Triton for CUDA" in run.resolved.loss_kernel_auto


def test_liger_chunks_are_its_own_formula():
    """Liger's own example (its forward's comment): 16,384 tokens of width 4,096 into 32,000
    logits, 8 chunks of 2,048; a power of two of tokens, never more than there are."""
    assert liger_chunk_tokens(16384, 32000, 4096) == 2048
    assert liger_chunk_tokens(3000, 65536, 2048) == 128  # 3000 / 32 = 93.75 -> 94 -> 128
    assert liger_chunk_tokens(5, 100, 64) == 4  # 2 chunks: 3 tokens -> 4
    assert liger_chunk_tokens(1, 100, 64) == 1


def test_the_plan_counts_liger_chunk_at_the_matmul_width_not_three_fp32_copies():
    """llama-1b bf16, 8,192 tokens: torch's chunk is 130 tokens of three fp32 copies of the
    logits; Liger's 256 (8,192 / 63 chunks, to a power of two) of bf16 logits, their
    gradient written in place."""
    cfg = compose_config("model=llama-1b", CUDA, "parallel=single")
    layout = Layout.of(cfg.parallel)
    d = Dims.of_layout(cfg.model, layout)

    def transient(kernel: str) -> float:
        train = dataclasses.replace(cfg.train, loss_kernel=LossKernel[kernel])
        memory = loss_memory(dataclasses.replace(cfg, train=train), layout, d, 8192, 2)
        return memory.transient - d.vocab * d.h * 4  # one more V x h gradient (fp32) beside

    assert transient("torch") == chunk_tokens(d.vocab) * 3 * d.vocab * 4
    assert liger_chunk_tokens(8192, d.vocab, d.h) == 256
    assert transient("liger") == 256 * d.vocab * 2


class _Head(nn.Module):
    """A model part of a head with a bias over a vocabulary padded by 5 rows."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.output = nn.Linear(hidden, vocab + 5, bias=True)
        self.vocab_size = vocab

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return unpad_logits(self.output(hidden), self.vocab_size)


def liger_against_torch() -> None:
    """Liger's kernel against torch's chunks: meshrun's tied decoder over a padded
    vocabulary, a head with a bias (its input's gradient too), a third of the targets
    ignored; and a head whose input takes no gradient (a frozen trunk, whose head's
    gradients Liger would not take: torch's chunks run it). Each says whether Liger ran."""
    calls = []
    liger = parallel_loss.liger_cross_entropy
    parallel_loss.liger_cross_entropy = lambda *a: calls.append(1) or liger(*a)
    torch.manual_seed(0)
    tied = compose_config("model=tiny", "model.tie_embeddings=true").model
    tiny = build_model(tied, 16, "cpu", vocab_multiple=3)
    tiny.init_weights(0)
    hidden = torch.randn(3, 16, 32)
    cases = {
        "tiny tied, padded": (tiny, torch.randint(tiny.vocab_size, (3, 16))),
        "a biased head": (_Head(32, 100), hidden.requires_grad_()),
        "a frozen trunk": (_Head(32, 100), hidden.detach()),
    }
    for name, (part, inputs) in cases.items():
        calls.clear()
        torch_part, liger_part = copy.deepcopy(part), copy.deepcopy(part)
        apply_chunked_loss(torch_part, "torch")
        apply_chunked_loss(liger_part, "liger")
        targets = torch.randint(part.vocab_size, (3, 16))
        targets[:, ::3] = IGNORE_INDEX
        leaves = [inputs.detach().clone().requires_grad_(inputs.requires_grad) for _ in "ab"]
        want = micro_batch_loss(torch_part, leaves[0], targets, "chunked")
        got = micro_batch_loss(liger_part, leaves[1], targets, "chunked")
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
        (2.0 * want).backward()  # a scaled loss: Liger scales its kept gradients in backward
        (2.0 * got).backward()
        pairs = [*zip(torch_part.named_parameters(), liger_part.parameters(), strict=True)]
        if inputs.requires_grad and inputs.is_floating_point():
            pairs.append((("input", leaves[0]), leaves[1]))
        for (param, a), b in pairs:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=param)
        print(f"{name}: loss {got.item():.6f} and gradients as torch's, Liger ran: {bool(calls)}")


def _fsdp_rank(rank: int, port: int) -> None:
    """One of two gloo ranks: meshrun's decoder (tied, so the head is the root's) under
    parallel=fsdp as parallelize() builds it, each kernel's loss and gathered gradients."""
    os.environ |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    dist.init_process_group("gloo", rank=rank, world_size=2)
    cfg = resolved_config("model=tiny", "model.tie_embeddings=true", "parallel=fsdp")
    layout = Layout.of(cfg.parallel)
    mesh = build_mesh(layout, "cpu")
    tokens = torch.randint(256, (2, 16), generator=torch.Generator().manual_seed(rank))
    targets = torch.randint(256, (2, 16), generator=torch.Generator().manual_seed(9 + rank))
    got, calls = {}, []
    liger = parallel_loss.liger_cross_entropy
    parallel_loss.liger_cross_entropy = lambda *a: calls.append(1) or liger(*a)
    for kernel in ("torch", "liger"):
        meta = build_model(cfg.model, 16, "meta")
        part = parallelize(
            meta, mesh, layout, cfg.parallel, torch.device("cpu"), seed=0,
            param_dtype=torch.float32, loss="chunked", loss_kernel=kernel,
        ).parts[0]  # fmt: skip
        loss = micro_batch_loss(part, tokens, targets, "chunked")
        loss.backward()
        got[kernel] = [loss.detach(), *(p.grad.full_tensor() for p in part.parameters())]
    assert calls == [1], calls  # Liger's, once, for the liger model's micro-batch alone
    for want, value in zip(got["torch"], got["liger"], strict=True):
        torch.testing.assert_close(value, want, rtol=1e-4, atol=1e-6)
    if rank == 0:
        print(f"fsdp2: loss {got['liger'][0].item():.6f} and gradients as torch's")
    dist.destroy_process_group()


def liger_under_fsdp_against_torch() -> None:
    """Two ranks of parallel=fsdp, Liger's kernel inside FSDP2's unsharded head."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # forked: the interpreter's import of torch, meshrun and Liger (seconds) done once, here,
    # before this process computes anything (no OpenMP pool to inherit)
    torch.multiprocessing.start_processes(_fsdp_rank, (port,), nprocs=2, start_method="fork")


def _liger_runs_here() -> str | None:
    missing = [m for m in ("triton", "liger_kernel") if importlib.util.find_spec(m) is None]
    return f"{' and '.join(missing)} not installed" if missing else None


def test_liger_kernel_gives_torchs_loss_and_gradients_under_tritons_interpreter():
    why_not = _liger_runs_here()
    if why_not is not None:
        if os.environ.get("MESHRUN_REQUIRE_LIGER") == "1":
            pytest.fail(f"MESHRUN_REQUIRE_LIGER=1 but {why_not}")
        pytest.skip(f"{why_not} (the torch floor's venv runs this)")
    code = (
        "from tests.test_loss_kernel import liger_against_torch, liger_under_fsdp_against_torch\n"
        "liger_under_fsdp_against_torch()\nliger_against_torch()"
    )
    env = os.environ | {"TRITON_INTERPRET": "1"}  # read when Triton's kernels are defined
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fsdp2: loss" in done.stdout, done.stdout
    ran = re.findall(r"^(.*): loss .* as torch's, Liger ran: (\w+)$", done.stdout, re.MULTILINE)
    assert dict(ran) == {
        "tiny tied, padded": "True",
        "a biased head": "True",
        "a frozen trunk": "False",
    }, done.stdout


def test_an_unknown_head_under_liger_is_refused_at_the_rank_not_run():
    part = _Head(8, 10)
    part.output = nn.Sequential(nn.Linear(8, 10))
    with pytest.raises(TypeError, match=r"plain nn\.Linear head, and this model's is a Sequential"):
        apply_chunked_loss(part, "liger")


@pytest.mark.parametrize(
    ("kernel", "device", "said"),
    [
        ("liger", "cuda", "chunked on Liger's fused kernel (auto: chunks)"),
        ("torch", "cuda", "chunked on torch's chunks, not Liger's: not installed (auto: chunks)"),
        ("torch", "cpu", "chunked (auto: chunks)"),  # the only kernel there: nothing to say
    ],
)
def test_the_summary_says_the_kernel_where_liger_could_have_run(kernel, device, said):
    record = RunRecord.from_dict(
        {
            "loss": "chunked",
            "loss_auto": "chunks",
            "loss_kernel": kernel,
            "loss_kernel_auto": "not installed" if kernel == "torch" else None,
            "device_type": device,
        }
    )
    assert summary_loss(record) == said
