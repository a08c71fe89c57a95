"""data=hf: local files tokenized once by the driver into a memory-mapped cache, packed into
windows, a held-out split by document, split over data-parallel ranks exactly like the other
sources, through a real DataLoader. Real datasets, tokenizers and gloo processes throughout."""

from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch
import torch.distributed as dist
from tokenizers import Tokenizer

from meshrun.core.config import DataConfig
from meshrun.core.layout import Layout, dp_rank
from meshrun.core.record import RunRecord
from meshrun.core.run_files.metrics import StepRow
from meshrun.driver.prepare_data import prepare, prepare_data
from meshrun.driver.results import data_wait_share
from meshrun.driver.sinks.console import console, print_summary
from meshrun.rank.mesh import build_mesh, init_distributed
from meshrun.rank.train.data import LocalBatches
from meshrun.rank.train.hf_data import HFWindows, WindowOrder, hf_streams
from tests.helpers import compose_config
from tests.hf_corpus import EOS, write_corpus
from tests.ranks import config_in, losses

SEQ, GLOBAL_BATCH = 32, 8
CPU = torch.device("cpu")


def hf_config(corpus, tmp_path, path=None, *extra: str):
    """The composed config of data=hf on `corpus`, its cache under `tmp_path`."""
    return compose_config(
        *corpus.overrides(
            path, f"data.cache_dir={tmp_path / 'cache'}", f"train.seq_len={SEQ}", *extra
        )
    )


def prepared(corpus, tmp_path, *extra: str) -> tuple[DataConfig, str]:
    """data=hf's config and the cache the driver prepared for it."""
    run = prepare_data(hf_config(corpus, tmp_path, None, *extra))
    return run.data, str(run.resolved.data_cache)


def train_stream(data: tuple[DataConfig, str], seed: int = 0) -> HFWindows:
    return hf_streams(*data, SEQ, seed)[0]


def test_every_format_and_tokenizer_form_load_to_the_same_tokens(hf_corpus, tmp_path):
    caches = {
        name: prepare(hf_config(hf_corpus, tmp_path, path)).cache
        for name, path in [
            ("jsonl", hf_corpus.jsonl),
            ("parquet", hf_corpus.parquet),
            ("text", hf_corpus.text),
            ("disk", hf_corpus.disk),
        ]
    }
    from_dir = hf_config(hf_corpus, tmp_path, None, f"data.tokenizer={hf_corpus.tokenizer_dir}")
    caches["tokenizer directory"] = prepare(from_dir).cache
    assert len({c.path for c in caches.values()}) == len(caches)  # each its own fingerprint
    first = caches["jsonl"]
    assert first.meta["n_docs"] == len(hf_corpus.docs)
    assert first.meta["dtype"] == "uint16"  # 384 tokens fit
    for name, cache in caches.items():
        assert (cache.tokens == first.tokens).all(), name
        assert (cache.offsets == first.offsets).all(), name


def test_text_field_names_the_column(hf_corpus, tmp_path):
    body = tmp_path / "body.jsonl"
    body.write_text("".join(json.dumps({"body": d}) + "\n" for d in hf_corpus.docs))
    renamed = prepare(hf_config(hf_corpus, tmp_path, body, "data.text_field=body")).cache
    assert (renamed.tokens == prepare(hf_config(hf_corpus, tmp_path)).cache.tokens).all()


def test_cache_is_reused_and_rebuilt_when_the_dataset_changes(tmp_path):
    corpus = write_corpus(tmp_path / "own")
    cfg = hf_config(corpus, tmp_path)
    started = time.perf_counter()
    first = prepare(cfg)
    built_s = time.perf_counter() - started
    started = time.perf_counter()
    again = prepare(cfg)
    reused_s = time.perf_counter() - started
    assert first.built and not again.built
    assert again.cache.path == first.cache.path
    print(
        f"prepare: {built_s:.2f} s tokenizing {first.cache.meta['n_tokens']} tokens, "
        f"{reused_s:.3f} s reusing the cache"
    )
    with corpus.jsonl.open("a") as f:
        f.write(json.dumps({"text": "the cat sees a new document."}) + "\n")
    changed = prepare(cfg)
    assert changed.built and changed.cache.path != first.cache.path
    assert changed.cache.meta["n_docs"] == first.cache.meta["n_docs"] + 1
    # complete caches only: every temporary build directory was renamed or removed
    assert sorted(p.name for p in changed.cache.path.parent.iterdir()) == sorted(
        [first.cache.path.name, changed.cache.path.name]
    )


def test_windows_are_seq_len_plus_one_packed_with_eos_between_documents(hf_corpus, tmp_path):
    data = prepared(hf_corpus, tmp_path)
    train, heldout = hf_streams(*data, SEQ, seed=0)
    cache = train.cache
    eos = cache.meta["separator_id"]
    assert eos == Tokenizer.from_file(str(hf_corpus.tokenizer_json)).token_to_id(EOS)
    offsets = cache.offsets
    assert (cache.tokens[offsets[1:] - 1] == eos).all()  # each document ends with EOS
    assert (cache.tokens == eos).sum() == len(offsets) - 1  # and nowhere else
    assert len(train) == len(train.span) // (SEQ + 1)
    windows = torch.stack([train[w] for w in range(len(train))])
    assert windows.shape == (len(train), SEQ + 1)
    flat = torch.from_numpy(cache.tokens[: len(train) * (SEQ + 1)].astype("int64"))
    assert torch.equal(windows.flatten(), flat)  # non-overlapping, in order, nothing lost
    assert heldout.batch(range(0, 2), SEQ + 1, CPU).shape == (2, SEQ + 1)


def test_heldout_documents_are_not_trained_on(hf_corpus, tmp_path):
    data = prepared(hf_corpus, tmp_path, "data.heldout_fraction=0.1")
    train, heldout = hf_streams(*data, SEQ, seed=0)
    offsets = train.cache.offsets.tolist()
    n_docs = len(offsets) - 1
    assert train.span.stop == heldout.span.start == offsets[n_docs - n_docs // 10]
    assert heldout.span.stop == offsets[-1]
    assert len(heldout) == len(heldout.span) // (SEQ + 1) > 0
    # every training window ends before the first held-out document starts
    last = train.span.start + len(train) * (SEQ + 1)
    assert last <= heldout.span.start


def test_each_epoch_visits_every_window_once_in_a_seeded_order():
    order = WindowOrder(10, seed=3, shuffle=True)
    epoch0, epoch1 = order.windows(range(0, 10)), order.windows(range(10, 20))
    assert sorted(epoch0) == sorted(epoch1) == list(range(10))
    assert epoch0 != epoch1
    assert WindowOrder(10, seed=3, shuffle=True).windows(range(5, 15)) == epoch0[5:] + epoch1[:5]
    assert WindowOrder(10, seed=4, shuffle=True).windows(range(10)) != epoch0
    assert WindowOrder(10, seed=3, shuffle=False).windows(range(8, 12)) == [8, 9, 0, 1]


def hf_rank_tokens(arg) -> dict:
    """One rank: the tokens of each step it trains on, through its DataLoader."""
    layout, data = arg
    init_distributed("gloo", timeout_s=30)
    try:
        build_mesh(layout, "cpu")
        dp = dp_rank(layout, dist.get_rank())
        batches = LocalBatches(train_stream(data), GLOBAL_BATCH, SEQ, dp, layout.dp_size, CPU)
        steps = [batches.for_step(s)[0] for s in range(3)]
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {"dp": dp, "steps": steps})
        return {"ranks": gathered}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "layout",
    [
        pytest.param(Layout(dp_replicate=2, dp_shard=2), marks=pytest.mark.slow),
        Layout(dp_shard=2, tp=2),
    ],
    ids=lambda layout: layout.describe(),
)
def test_dp_ranks_split_hf_windows_and_tp_peers_share_them(rank_pool, hf_corpus, tmp_path, layout):
    data = prepared(hf_corpus, tmp_path)
    ranks = rank_pool.run(hf_rank_tokens, (layout, data), layout.world_size)[0]["ranks"]
    whole = LocalBatches(train_stream(data), GLOBAL_BATCH, SEQ, 0, 1, CPU)
    for step in range(3):
        by_dp: dict[int, torch.Tensor] = {}
        for r in ranks:
            seen = r["steps"][step]
            assert torch.equal(by_dp.setdefault(r["dp"], seen), seen), "TP peers differ"
        assert sorted(by_dp) == list(range(layout.dp_size))
        ordered = torch.cat([by_dp[d] for d in range(layout.dp_size)])
        assert torch.equal(ordered, whole.for_step(step)[0])  # disjoint slices of the batch


def test_loader_workers_yield_the_batches_of_the_rank_itself(hf_corpus, tmp_path):
    data = prepared(hf_corpus, tmp_path)
    with_workers = (dataclasses.replace(data[0], num_workers=2, prefetch_factor=3), data[1])
    here = LocalBatches(train_stream(data), GLOBAL_BATCH, SEQ, 1, 2, CPU)
    workers = LocalBatches(train_stream(with_workers), GLOBAL_BATCH, SEQ, 1, 2, CPU)
    stream = train_stream(data)
    for step in range(5):
        mine, theirs = here.for_step(step), workers.for_step(step)
        assert torch.equal(mine[0], theirs[0]) and torch.equal(mine[1], theirs[1])
        samples = range(step * GLOBAL_BATCH + 4, step * GLOBAL_BATCH + 8)  # dp rank 1 of 2
        assert torch.equal(mine[0], stream.batch(samples, SEQ + 1, CPU)[:, :-1])
    assert len(here.drain_waits()) == 5 and here.waits == []


def test_start_step_continues_where_a_run_from_zero_is(hf_corpus, tmp_path):
    data = prepared(hf_corpus, tmp_path)
    # past the first epoch: the permutation of epoch 1 is drawn on the way
    steps = len(train_stream(data)) // GLOBAL_BATCH + 3
    from_zero = LocalBatches(train_stream(data), GLOBAL_BATCH, SEQ, 0, 1, CPU)
    all_steps = [from_zero.for_step(s)[0] for s in range(steps)]
    resumed = LocalBatches(train_stream(data), GLOBAL_BATCH, SEQ, 0, 1, CPU, start_step=4)
    for step in range(4, steps):
        assert torch.equal(resumed.for_step(step)[0], all_steps[step]), step
    with pytest.raises(AssertionError, match="the loader is at"):
        resumed.for_step(steps + 1)


def test_ddp_on_hf_data_learns_with_the_losses_of_one_device(experiment, hf_corpus, tmp_path):
    common = (
        *hf_corpus.overrides(),
        f"data.cache_dir={tmp_path}",
        f"train.seq_len={SEQ}",
        "train.steps=12",
        "train.lr=3e-3",
        "train.seed=1",
        "metrics.baseline=off",
    )
    single_cfg, single = experiment("parallel=single", *common)
    cfg, ddp = experiment("parallel=ddp", *common)
    assert single.ok and ddp.ok, (single.meta.error, ddp.meta.error)
    assert cfg.resolved.data_cache == single_cfg.resolved.data_cache  # tokenized once, shared
    got, want = losses(ddp), losses(single)
    for step, (loss, ref) in enumerate(zip(got, want, strict=True)):
        assert abs(loss - ref) <= 1e-4 * abs(ref), f"step {step}: {loss} vs {ref}"
    assert got[-1] < 0.7 * got[0]  # a tiny grammar is quickly learnt
    assert all(step.data_wait_s >= 0 for step in ddp.steps)


def test_data_wait_share_is_recorded_and_a_stall_shown():
    steps = [
        StepRow(0, 1.0, step_time_s=None, data_wait_s=5.0),  # untimed: not counted
        StepRow(1, 1.0, step_time_s=1.0, data_wait_s=0.25),
        StepRow(2, 1.0, step_time_s=3.0, data_wait_s=0.75),
    ]
    assert data_wait_share(steps) == pytest.approx(0.25)
    before = StepRow.from_json({"step": 0, "loss": 1.0, "step_time_s": 1.0})
    assert data_wait_share([before]) is None  # a record from before the field
    with console.capture() as captured:
        print_summary(RunRecord.from_dict({"status": "completed", "data_wait_share": 0.25}))
        print_summary(RunRecord.from_dict({"status": "completed", "data_wait_share": 0.01}))
    shown = captured.get()
    assert shown.count("data stall") == 1 and "25% of step time waiting" in shown


def test_a_resolved_run_carries_its_cache_to_the_ranks(hf_corpus, tmp_path):
    cfg = config_in(tmp_path, *hf_corpus.overrides(), f"train.seq_len={SEQ}")
    assert cfg.resolved.data_cache is not None
    assert cfg.resolved.data_cache.startswith(str(tmp_path / "data-cache"))  # beside the store
