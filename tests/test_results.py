"""From measurements to the results record: baseline beside the run, baseline key, speedup with its
spread over the alternating rounds, efficiency flagged above 1 + noise, a busy host flagged."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from meshrun.core.baseline import baseline_config, baseline_key
from meshrun.core.config import RunConfig
from meshrun.core.rank_report import CheckpointSave, RankReport, StageSplit
from meshrun.core.record import RunRecord
from meshrun.core.run_files.metrics import StepRow
from meshrun.driver.measured import Measured, RunMeta, Status
from meshrun.driver.results import assemble
from meshrun.driver.sinks.console import print_summary
from meshrun.rank.metrics.host import other_cpu_share
from tests.helpers import resolved_config

RUN = ("run_dir=/tmp/meshrun-tests/x", "store.path=/tmp/meshrun-tests/x.db", "logger=none")


def assembled(
    cfg: RunConfig,
    steps: list[dict],
    baseline: RunRecord | None = None,
    meta: RunMeta | None = None,
    report: RankReport | None = None,
) -> dict:
    """results.json's content: the record as a dict."""
    return assemble(cfg, Measured(meta or run_meta(), steps, report), baseline).as_dict()


def run_meta(status: Status = "completed", error: str | None = None, **fields) -> RunMeta:
    return RunMeta(
        run_id="run123",
        created_at="2024-01-01T00:00:00+00:00",
        status=status,
        error=error,
        failed_rank=None if status == "completed" else 1,
        duration_s=1.0,
        **fields,
    )


def rank_report(**fields) -> RankReport:
    """Rank 0's report of a run on this host, with `fields` measured."""
    return RankReport(**{"memory_per_rank": [], "fingerprint": {}, **fields})


def steps(times: list[float | None], first_loss: float = 5.0) -> list[StepRow]:
    return [StepRow(step=i, loss=first_loss - 0.1 * i, step_time_s=t) for i, t in enumerate(times)]


@pytest.fixture(scope="module")
def ddp():
    cfg = resolved_config("parallel=ddp", *RUN)
    assert cfg.parallel.dp_replicate == 2 and cfg.launcher.nproc_per_node == 2  # 2 CPU ranks
    assert (cfg.train.global_batch_size, cfg.train.micro_batch_size) == (8, 2)
    return cfg


@pytest.fixture(scope="module")
def single():
    return resolved_config("parallel=single", *RUN)


def test_weak_scaling_baseline_is_one_device_with_the_per_dp_rank_batch(ddp):
    baseline = baseline_config(ddp)
    assert baseline.parallel.name == "single"
    assert (baseline.parallel.dp_replicate, baseline.parallel.dp_shard) == (1, 1)
    assert (baseline.parallel.tp, baseline.parallel.pp) == (1, 1)
    assert baseline.launcher.nproc_per_node == 1
    assert baseline.train.global_batch_size == ddp.train.global_batch_size // 2 == 4
    assert baseline.train.micro_batch_size == ddp.train.micro_batch_size
    assert baseline.launcher.threads_per_rank == ddp.launcher.threads_per_rank
    assert baseline.model == ddp.model
    assert baseline.train.seq_len == ddp.train.seq_len
    assert baseline.train.steps == ddp.train.steps
    assert baseline.run_dir == f"{ddp.run_dir}/baseline"
    assert ddp.parallel.name == "ddp"  # the run's own config is left alone


def test_strong_scaling_baseline_keeps_the_global_batch():
    cfg = resolved_config("parallel=ddp", "metrics.scaling=strong", *RUN)
    baseline = baseline_config(cfg)
    assert baseline.parallel.name == "single"
    assert baseline.launcher.nproc_per_node == 1
    assert baseline.train.global_batch_size == cfg.train.global_batch_size == 8


def test_baseline_key_of_a_single_run_equals_its_baseline(single):
    assert baseline_key(single) == baseline_key(baseline_config(single))


def test_ddp_baseline_has_the_key_of_the_equivalent_single_run(ddp):
    equivalent = resolved_config(
        "parallel=single",
        "train.global_batch_size=4",
        f"launcher.threads_per_rank={ddp.launcher.threads_per_rank}",
        *RUN,
    )
    assert baseline_key(baseline_config(ddp)) == baseline_key(equivalent)
    assert baseline_key(ddp) != baseline_key(baseline_config(ddp))


@pytest.mark.parametrize("change", ["train.seq_len=64", "model=tiny", "train.precision=bf16"])
def test_baseline_key_changes_with_what_changes_throughput(single, change):
    other = resolved_config("parallel=single", change, *RUN)
    assert baseline_key(other) != baseline_key(single)


def test_baseline_key_ignores_run_dir_and_name(single):
    moved = dataclasses.replace(single, run_dir="/elsewhere", name="renamed")
    assert baseline_key(moved) == baseline_key(single)


def test_assemble_computes_throughput_speedup_and_scaling_efficiency(ddp):
    times = [None, None, 0.5, 0.5, 1.0]  # two untimed warmup steps
    tokens_per_step = ddp.train.global_batch_size * ddp.train.seq_len
    tokens_per_s = 3 * tokens_per_step / 2.0
    baseline = RunRecord.from_dict({"run_id": "base1", "tokens_per_s": tokens_per_s / 1.5})
    results = assembled(
        ddp,
        steps(times),
        baseline,
        report=rank_report(memory_per_rank=[{"peak": 100}, {"peak": 300}]),
    )
    assert results["tokens_per_s"] == pytest.approx(tokens_per_s)
    assert results["step_time_s"] == pytest.approx(0.5)
    assert results["samples_per_s"] == pytest.approx(3 * 8 / 2.0)
    assert results["baseline_tokens_per_s"] == pytest.approx(tokens_per_s / 1.5)
    assert results["baseline_run_id"] == "base1"
    assert results["speedup"] == pytest.approx(1.5)
    assert results["devices"] == results["world_size"] == 2
    assert results["scaling_efficiency"] == pytest.approx(0.75)
    assert results["peak_memory_max_bytes"] == 300
    assert results["steps_completed"] == 5
    assert results["losses"] == pytest.approx([5.0, 4.9, 4.8, 4.7, 4.6])
    assert results["grad_accum_steps"] == 2  # 8 / (micro 2 x dp 2)
    assert results["layout_name"] == "ddp2"
    assert results["status"] == "completed"
    assert results["mfu"] is None  # the cpu profile has no peak FLOP/s
    assert results["flops_per_token"] > 0
    assert results["baseline_key"] == baseline_key(ddp)


def test_assemble_of_a_single_run_without_baseline_is_its_own_baseline(single):
    results = assembled(
        single, steps([None, None, 1.0, 1.0]), report=rank_report(memory_per_rank=[{"peak": 10}])
    )
    assert results["speedup"] == pytest.approx(1.0)
    assert results["scaling_efficiency"] == pytest.approx(1.0)
    assert results["baseline_run_id"] == "run123"


def test_assemble_of_a_multi_device_run_without_baseline_has_no_speedup(ddp):
    memory = [{"peak": 10}, {"peak": 10}]
    results = assembled(ddp, steps([None, None, 1.0]), report=rank_report(memory_per_rank=memory))
    assert results["tokens_per_s"] is not None
    assert results["speedup"] is None
    assert results["scaling_efficiency"] is None


def test_assemble_of_a_failed_run_keeps_losses_of_the_finished_steps(ddp):
    baseline = RunRecord.from_dict({"run_id": "base1", "tokens_per_s": 1000.0})
    failed = run_meta("failed", "rank 1 failed at step 3")
    results = assembled(ddp, steps([None, None, 0.5]), baseline, failed)
    assert results["status"] == "failed"
    assert results["error"] == "rank 1 failed at step 3"
    assert results["losses"] == pytest.approx([5.0, 4.9, 4.8])
    assert results["steps_completed"] == 3
    assert results["peak_memory_bytes"] is None
    assert results["peak_memory_max_bytes"] is None
    assert results["tokens_per_s"] == pytest.approx(8 * 128 / 0.5)
    assert results["speedup"] == pytest.approx(8 * 128 / 0.5 / 1000.0)


def test_assemble_of_a_run_that_failed_in_warmup_has_no_timing(ddp):
    baseline = RunRecord.from_dict({"run_id": "base1", "tokens_per_s": 1000.0})
    results = assembled(ddp, steps([None]), baseline, run_meta("failed", "boom"))
    assert results["losses"] == [5.0]
    assert results["tokens_per_s"] is None
    assert results["step_time_s"] is None
    assert results["speedup"] is None
    assert results["scaling_efficiency"] is None
    assert results["mfu"] is None


def fresh_baseline(times: list[float], batch: int = 4) -> RunRecord:
    """The baseline's record as rank 0 measured it beside the run: batch 4, seq 128."""
    return RunRecord.from_dict(
        {
            "run_id": "baseline1",
            "tokens_per_s": len(times) * batch * 128 / sum(times),
            "step_times": times,
            "global_batch_size": batch,
        }
    )


def test_fresh_baseline_pairs_each_run_step_with_the_baseline_step_after_it(ddp):
    """Round i: the run's i-th timed step (8 samples) against the baseline's (4)."""
    run_times, base_times = [0.5, 0.5, 0.6, 0.5], [0.4, 0.5, 0.4, 0.4]
    fresh = run_meta(baseline_mode="fresh")
    results = assembled(ddp, steps([None, None, *run_times]), fresh_baseline(base_times), fresh)
    ratios = sorted(2 * b / r for r, b in zip(run_times, base_times, strict=True))
    assert results["speedup_rounds"] == 4
    assert results["speedup_p10"] == pytest.approx(np.percentile(ratios, 10))
    assert results["speedup_p90"] == pytest.approx(np.percentile(ratios, 90))
    assert results["speedup"] == pytest.approx(2 * (1.7 / 4) / (2.1 / 4))  # whole-run ratio
    noise = (results["speedup_p90"] - results["speedup_p10"]) / 2 / results["speedup"]
    assert results["speedup_noise"] == pytest.approx(noise)
    assert results["baseline_mode"] == "fresh" and results["flags"] == []


def test_efficiency_above_one_plus_noise_is_flagged_and_not_printed_as_a_result(ddp, capsys):
    """2 ranks running 2.4 times as fast as one, steadily: impossible, so the record says
    why and the summary prints no efficiency (the baseline's steps were disturbed)."""
    base_times = [0.6, 0.6, 0.6, 0.605]
    fresh = run_meta(baseline_mode="fresh")
    results = assembled(
        ddp, steps([None, None, 0.5, 0.5, 0.5, 0.5]), fresh_baseline(base_times), fresh
    )
    assert results["scaling_efficiency"] == pytest.approx(1.2, rel=0.01)
    [flag] = results["flags"]
    assert flag.startswith("scaling efficiency 1.20 is above 1 + its noise")
    print_summary(RunRecord.from_dict(results))
    out = capsys.readouterr().out
    assert "not a result: 1.20 is above 1 + noise" in out
    assert "scaling efficiency   1.2" not in out


def test_efficiency_within_its_noise_of_one_is_a_result(ddp):
    """The same efficiency of 1.05, with rounds spread wider than 5%: within the noise."""
    base_times = [1.05, 0.8, 1.3, 1.05, 0.9, 1.2]
    fresh = run_meta(baseline_mode="fresh")
    results = assembled(ddp, steps([None, None, *[1.0] * 6]), fresh_baseline(base_times), fresh)
    assert results["scaling_efficiency"] > 1.0
    assert results["speedup_noise"] > results["scaling_efficiency"] - 1
    assert results["flags"] == []


def test_without_rounds_the_noise_is_the_step_times_variation(ddp):
    """A stored baseline: no pairs, so the two step-time coefficients of variation."""
    base = RunRecord.from_dict({**fresh_baseline([1.0, 1.0]).as_dict(), "step_time_cv": 0.03})
    stored = run_meta(baseline_mode="stored")
    results = assembled(ddp, steps([None, None, 0.9, 1.1]), base, stored)
    assert results["speedup_rounds"] is None and results["speedup_p10"] is None
    assert results["speedup_noise"] == pytest.approx(np.hypot(0.1, 0.03))


def test_a_host_busy_with_other_work_is_flagged(ddp):
    busy = rank_report(host_other_cpu_share=0.35)
    results = assembled(ddp, steps([None, 1.0]), report=busy)
    assert results["host_other_cpu_share"] == 0.35
    assert results["flags"] == [
        "other processes kept 35% of the host's CPU busy while the run "
        "was timed: its figures are those of a shared host"
    ]
    quiet = assembled(ddp, steps([None, 1.0]), report=rank_report(host_other_cpu_share=0.02))
    assert quiet["flags"] == []


def test_other_processes_share_is_the_hosts_busy_time_beyond_its_ranks():
    """Two ranks on host a over 10 s of 2 cores (20 core-seconds): the host was busy 17 s,
    the ranks used 9 + 4; a rank on another host does not count."""
    ranks = [
        {"host": "a", "wall_s": 10.0, "cpu_s": 9.0, "host_busy_s": 17.0, "host_cpus": 2},
        {"host": "a", "wall_s": 10.0, "cpu_s": 4.0, "host_busy_s": None, "host_cpus": 2},
        {"host": "b", "wall_s": 10.0, "cpu_s": 10.0, "host_busy_s": 3.0, "host_cpus": 2},
    ]
    assert other_cpu_share(ranks) == pytest.approx((17 - 13) / 20)
    ranks[0]["host_busy_s"] = None  # not read (no /proc/stat)
    assert other_cpu_share(ranks) is None


def test_every_figure_of_rank_0s_report_reaches_the_record():
    """A field the ranks report and the record drops would be a figure measured and lost:
    each one, set, is found in results.json (a requeued run's resume step included)."""
    cfg = resolved_config("parallel=pp2", "model=tiny", "parallel.pp_layers=[3,1]", *RUN)
    split = StageSplit(counts=[3, 1], stage_costs_s=[0.02, 0.03], block_s=0.005)
    saves = [CheckpointSave(step=2, blocked_s=0.1, total_s=0.5)]
    report = rank_report(
        memory_per_rank=[{"rank": 0, "peak": 7}, {"rank": 1, "peak": 9}],
        fingerprint={"host": "h"},
        resumed_from_step=2,
        requeues=1,
        slurm_job_id="42",
        host_per_rank=["node1", "node2"],
        pipeline_bubble_per_rank=[0.2, 0.4],
        pp_split=split,
        pretrained_read_bytes_per_rank=[10, 20],
        busy_per_rank=[0.1, 0.2],
        host_other_cpu_share=0.01,
        compile_s=3.5,
        checkpoint_saves=saves,
    )
    results = assembled(cfg, steps([None, 1.0, 1.0]), report=report)
    assert results["peak_memory_bytes"] == [7, 9] and results["peak_memory_max_bytes"] == 9
    assert results["fingerprint"] == {"host": "h"} and results["fingerprint_key"]
    assert (results["requeues"], results["resumed_from_step"]) == (1, 2)
    assert (results["slurm_job_id"], results["host_per_rank"]) == ("42", ["node1", "node2"])
    assert results["bubble_per_rank"] == [0.2, 0.4]
    assert results["bubble_measured"] == pytest.approx(0.3)
    assert (
        results["pp_stage_costs_s"] == [0.02, 0.03] and "chose [3, 1]" in results["pp_split_note"]
    )
    assert results["pretrained_read_bytes_per_rank"] == [10, 20]
    assert results["busy_per_rank"] == [0.1, 0.2] and results["slowest_rank"] == 1
    assert (results["host_other_cpu_share"], results["compile_s"]) == (0.01, 3.5)
    assert results["checkpoint_saves"] == [{"step": 2, "blocked_s": 0.1, "total_s": 0.5}]
    assert results["checkpoint_blocked_s"] == pytest.approx(0.1)


def test_a_cpu_peak_traced_over_step_0_alone_is_flagged(ddp):
    """One untimed step: the CPU trace saw step 0, before AdamW's state existed (small pp2:
    64.7 MiB measured so, 93.2 over a later step)."""
    one = dataclasses.replace(ddp, train=dataclasses.replace(ddp.train, untimed_steps=1))
    [flag] = assembled(one, steps([None, 1.0]), report=rank_report())["flags"]
    assert flag.startswith("peak memory traced over step 0 alone")
    assert assembled(ddp, steps([None, None, 1.0]), report=rank_report())["flags"] == []


def test_a_cuda_run_says_its_slowest_rank_is_not_measured(ddp, capsys):
    """CUDA ranks report no busy time (rank/metrics/busy.py): the summary says so, where a
    CPU run of several ranks names its slowest."""
    results = assembled(ddp, steps([None, None, 1.0]), report=rank_report())
    print_summary(RunRecord.from_dict({**results, "device_type": "cuda"}))
    assert "not measured on CUDA ranks" in capsys.readouterr().out
    print_summary(RunRecord.from_dict(results))
    assert "slowest rank" not in capsys.readouterr().out  # no busy times reported here
