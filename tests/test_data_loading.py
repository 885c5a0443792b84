"""Data loading off the training loop's critical path: DataLoader workers read sharded corpora
and mixtures exactly as the main process would, nothing open is pickled to them, shard files
are opened lazily and at most MAX_OPEN at a time, the sample order of a large corpus costs no
memory (Feistel permutation) and keeps the sampler's guarantees, and the loader options
follow the hardware. All in-process: no launches."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from helpers import source_tokens, write_shard_dir
from zerotrain.train.config import DataConfig, SourceConfig
from zerotrain.train.data import build_data, mixture, sampler as sampler_mod, shards
from zerotrain.train.data.mixture import MixtureSampler
from zerotrain.train.data.permutation import FeistelPermutation
from zerotrain.train.data.sampler import GlobalBatchSampler
from zerotrain.train.training import hardware

SEQ = 16


@pytest.fixture
def shard_dirs(tmp_path):
    """Two shard directories of 7 shards each; source s's ids lie in [64 s, 64 s + 64)."""
    return [write_shard_dir(tmp_path / f"src{s}", source_tokens(s, 300, SEQ), shard_tokens=700) for s in (0, 1)]


def tokens_cfg(**kw) -> DataConfig:
    return DataConfig(kind="tokens", val_fraction=0.0, **kw)


def batches(dataset, batch_sampler, workers: int, accum: int = 1, context=None) -> list[torch.Tensor]:
    opts = hardware.loader_options(workers, accum, cuda=False, train=True)
    loader = DataLoader(dataset, batch_sampler=batch_sampler, multiprocessing_context=context, **opts)
    return [b["input_ids"] for b in loader]


def test_two_workers_yield_the_batches_of_the_main_process_over_shards(shard_dirs):
    data = build_data(tokens_cfg(path=str(shard_dirs[0])), SEQ, 0)
    s = GlobalBatchSampler(len(data.train), micro=4, world=1, accum=2, seed=3)
    ref = batches(data.train, s, 0)
    got = batches(data.train, s, 2, accum=2)
    assert len(ref) == len(got) == s.steps_per_epoch * 2
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    s.set_position(0, 2 * s.global_batch)  # a resumed epoch: workers start where the sampler says
    assert all(torch.equal(a, b) for a, b in zip(ref[4:], batches(data.train, s, 2)))


def test_two_workers_yield_the_batches_of_the_main_process_over_a_mixture_of_shard_dirs(shard_dirs):
    data = build_data(tokens_cfg(sources=[SourceConfig(path=str(d), weight=w) for d, w in zip(shard_dirs, (3, 1))]),
                      SEQ, 0)
    s = MixtureSampler(data.mixture, micro=4, world=1, accum=1, seed=0)
    ref = batches(data.train, s, 0)
    assert {int(b[0, 0]) // 64 for b in ref} == {0, 1}
    s.epoch = 1  # another epoch: other positions of each source's stream
    ref += batches(data.train, s, 0)
    s.epoch = 0
    got = batches(data.train, s, 2)
    s.epoch = 1
    got += batches(data.train, s, 2)
    assert len(ref) == len(got) and all(torch.equal(a, b) for a, b in zip(ref, got))


def test_spawned_workers_unpickle_a_mixture_that_has_been_read(shard_dirs):
    """spawn pickles the dataset into each worker (fork copies it): after the main process has
    read from every shard, the workers must open their own files and redraw their own orders."""
    data = build_data(tokens_cfg(sources=[SourceConfig(path=str(d), weight=1) for d in shard_dirs]), SEQ, 0)
    s = MixtureSampler(data.mixture, micro=8, world=1, accum=1, seed=0)
    ref = batches(data.train, s, 0)
    assert data.train.sources[0].corpus._fds and data.train.plan._perms
    got = batches(data.train, s, 1, context="spawn")  # one worker: each costs an interpreter start
    assert len(ref) == len(got) and all(torch.equal(a, b) for a, b in zip(ref, got))


def test_datasets_pickle_without_open_files_or_cached_orders(shard_dirs):
    data = build_data(tokens_cfg(path=str(shard_dirs[0])), SEQ, 0)
    sample = data.train[len(data.train) - 1]
    assert len(data.train.corpus._fds) == 1  # opened lazily, only the shard read
    blob = pickle.dumps(data.train)
    assert len(blob) < 20_000  # the manifest's names and sizes, no token data
    copy = pickle.loads(blob)
    assert copy.corpus._fds == {} and torch.equal(copy[len(copy) - 1]["input_ids"], sample["input_ids"])
    mix = build_data(tokens_cfg(sources=[SourceConfig(path=str(d), weight=1) for d in shard_dirs]), SEQ, 0)
    first = [mix.train[i]["input_ids"] for i in range(0, len(mix.train), 7)]
    assert mix.train.plan._perms  # cached in this process...
    copy = pickle.loads(pickle.dumps(mix.train))
    assert copy.plan._perms == {} and all(c.corpus._fds == {} for c in (x for x in copy.sources))
    assert all(torch.equal(a, copy[i]["input_ids"]) for a, i in zip(first, range(0, len(mix.train), 7)))


def test_at_most_max_open_shards_are_held_open(shard_dirs, monkeypatch):
    monkeypatch.setattr(shards, "MAX_OPEN", 2)
    data = build_data(tokens_cfg(path=str(shard_dirs[0])), SEQ, 0)
    flat = np.concatenate([np.fromfile(p, dtype=np.uint16) for p in data.train.corpus.paths])
    per_shard = (700 - 1) // SEQ
    for i in range(0, len(data.train), 5):
        shard, w = divmod(i, per_shard)
        lo = shard * 700 + w * SEQ
        assert data.train[i]["input_ids"].tolist() == flat[lo:lo + SEQ].tolist()
        assert len(data.train.corpus._fds) <= 2


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4099])
def test_feistel_permutation_is_a_bijection_and_scalar_lookups_agree(n):
    p = FeistelPermutation(n, [5, 1])
    v = p(np.arange(n))
    assert sorted(v.tolist()) == list(range(n))
    assert [p[k] for k in range(min(n, 200))] == v[:200].tolist()
    assert FeistelPermutation(n, [5, 1])(np.arange(n)).tolist() == v.tolist()  # a pure function of the seed
    if n > 64:
        assert FeistelPermutation(n, [5, 2])(np.arange(n)).tolist() != v.tolist()
        assert v.tolist() != list(range(n))


def test_large_orders_keep_the_samplers_guarantees(monkeypatch):
    monkeypatch.setattr(sampler_mod, "SMALL", 10)  # every order below is a Feistel one
    one = GlobalBatchSampler(203, micro=8, world=1, accum=2, seed=7)
    two = GlobalBatchSampler(203, micro=2, world=4, accum=2, seed=7)
    flat1, flat2 = sum(iter(one), []), sum(iter(two), [])
    assert flat1 == flat2 and len(set(flat1)) == len(flat1) == 192  # world-size independent, no repeats
    assert one.order(0)[:192].tolist() == flat1
    one.set_position(0, 5 * one.global_batch)
    assert sum(iter(one), []) == flat1[5 * 16:]  # resume mid-epoch
    one.set_position(1, 0)
    assert sum(iter(one), []) != flat1  # another epoch, another order


def test_large_mixture_sources_draw_feistel_cycles(monkeypatch, shard_dirs):
    monkeypatch.setattr(mixture, "SMALL", 10)
    monkeypatch.setattr(sampler_mod, "SMALL", 10)
    data = build_data(tokens_cfg(sources=[SourceConfig(path=str(d), weight=w) for d, w in zip(shard_dirs, (3, 1))]),
                      SEQ, 0)
    plan = data.mixture
    assert all(n > 10 for n in plan.lengths)
    seen = {0: [], 1: []}
    for epoch in range(3):
        for pos in range(plan.epoch_samples):
            s, i = plan.locate(epoch, pos)
            seen[s].append(i)
    for s, items in seen.items():  # each source walks whole cycles: every sequence once per cycle
        n = plan.lengths[s]
        for c in range(len(items) // n):
            assert sorted(items[c * n:(c + 1) * n]) == list(range(n))
    s = MixtureSampler(plan, micro=4, world=1, accum=1, seed=0)
    for k, b in enumerate(list(iter(s))[:5]):  # step_counts agrees with the batches' sources
        counts = np.bincount([int(data.train[i]["input_ids"][0]) // 64 for i in b], minlength=2)
        assert counts.tolist() == s.step_counts(0, k * s.global_batch).tolist()


def test_auto_workers_read_sharded_corpora_and_loader_options(shard_dirs, tmp_path):
    from helpers import write_token_file
    single = write_token_file(tmp_path / "one.bin", source_tokens(0, 10, SEQ))
    w = hardware.SHARD_WORKERS
    assert hardware.data_workers(tokens_cfg(path=str(shard_dirs[0])), local_world=2) == w
    assert hardware.data_workers(tokens_cfg(path=str(shard_dirs[0] / "manifest.json")), local_world=2) == w
    mixed = [SourceConfig(path=str(single), weight=1), SourceConfig(path=str(shard_dirs[0]), weight=1)]
    assert hardware.data_workers(tokens_cfg(sources=mixed), local_world=2) == w
    assert hardware.data_workers(tokens_cfg(path=str(single)), local_world=2) == 0  # one small mapped file
    assert hardware.data_workers(DataConfig(), local_world=2) == 0  # the default corpus, in memory
    assert hardware.data_workers(tokens_cfg(path=str(shard_dirs[0]), num_workers=0), local_world=2) == 0
    assert hardware.loader_options(0, 4, cuda=False, train=True) == {"num_workers": 0, "pin_memory": False}
    assert hardware.loader_options(2, 8, cuda=True, train=True) == {
        "num_workers": 2, "pin_memory": True, "prefetch_factor": 4, "persistent_workers": True}
    assert hardware.loader_options(1, 1, cuda=False, train=False) == {
        "num_workers": 1, "pin_memory": False, "prefetch_factor": 2, "persistent_workers": False}


def test_bench_corpora_are_real_shard_sets_that_verify(tmp_path):
    import sys

    from helpers import REPO
    sys.path.insert(0, str(REPO / "bench"))
    import data_scale
    from zerotrain.train.data.shards import Corpus
    d = tmp_path / "c"
    meta = data_scale.generate(d, 2_000_000, shard_tokens=300_000)
    assert len(meta["shards"]) == 4 and meta["num_tokens"] == 1_000_000 and meta["max_token"] <= 255
    assert Corpus(d).verify() == 2_000_000  # real sha256 of every byte written
    mtime = (d / "manifest.json").stat().st_mtime_ns
    assert data_scale.generate(d, 2_000_000, shard_tokens=300_000) == meta  # reused, not rewritten
    assert (d / "manifest.json").stat().st_mtime_ns == mtime
    data_scale.evict(d)
    bundle = build_data(tokens_cfg(path=str(d)), 128, 0)
    assert bundle.vocab_size == 256 and len(bundle.train) == 3 * ((300_000 - 1) // 128) + (100_000 - 1) // 128


def test_an_up_sampled_source_draws_each_cycle_once_per_epoch(monkeypatch):
    from zerotrain.train.data.mixture import MixturePlan
    draws = []
    real = np.random.default_rng
    monkeypatch.setattr(np.random, "default_rng", lambda seed: draws.append(tuple(seed)) or real(seed))
    plan = MixturePlan(["small", "big"], [1, 1], [10, 100], seed=0)  # small: 55 samples an epoch, 5.5 cycles
    order = np.random.permutation(plan.epoch_samples)  # the sampler visits positions in random order
    for epoch in range(2):
        for pos in order:
            plan.locate(epoch, int(pos))
    small = [d for d in draws if d[1] == 0]
    assert len(small) == len(set(small)) == 11  # 110 stream items = cycles 0..10, none redrawn
    monkeypatch.setattr(mixture, "SMALL", 50)  # 10 sequences x 7 cycles no longer "fit": Feistel
    lazy = MixturePlan(["small", "big"], [1, 1], [10, 100], seed=0)
    assert isinstance(lazy._perm(0, 0), FeistelPermutation)
