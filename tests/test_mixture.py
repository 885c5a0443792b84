"""Weighted data mixtures (data.sources): the plan is deterministic, realises the weights, gives
the same global batches for any world size / accumulation, resumes exactly from any step, and
bad mixtures fail with one clear line. The launch test runs the real program: one uninterrupted
2-process run against a 1-process run resumed three times inside the epoch."""

from __future__ import annotations

import zlib
from collections import Counter

import numpy as np
import pytest

from helpers import data_trace, fp32, metrics, run_train, source_tokens, write_token_file
from zerotrain.train.config import DataConfig, SourceConfig, load_config
from zerotrain.train.data import build_data
from zerotrain.train.data.mixture import InterleavedVal, MixturePlan, MixtureSampler, largest_remainder
from zerotrain.train.errors import ConfigError, DataError

SEQ = 16


def make_sources(tmp_path, lengths, seq_len=SEQ, val: dict | None = None) -> list[str]:
    """One token file per source (source s's ids in [64 s, 64 s + 64)); `val`: source -> val sequences."""
    paths = []
    for s, n in enumerate(lengths):
        p = write_token_file(tmp_path / f"src{s}.bin", source_tokens(s, n, seq_len))
        if val and s in val:
            write_token_file(p.with_suffix(".val.bin"), source_tokens(s, val[s], seq_len, seed=1))
        paths.append(str(p))
    return paths


def mixture(paths, weights, seed=0, seq_len=SEQ, **kw):
    cfg = DataConfig(kind="tokens", sources=[SourceConfig(path=p, weight=w) for p, w in zip(paths, weights)],
                     val_fraction=0.0, **kw)
    return build_data(cfg, seq_len, seed)


def source_of(sample: dict) -> int:
    return int(sample["input_ids"][0]) // 64


# ----------------------------------------------------------------------------- the plan

def test_largest_remainder_adds_up_and_follows_the_weights():
    assert largest_remainder([0.5, 0.3, 0.2], 10) == [5, 3, 2]
    assert largest_remainder([1, 1, 1], 10) == [4, 3, 3]          # ties: the earlier source
    assert largest_remainder([2, 1], 7) == [5, 2]                 # 4.67 + 2.33
    assert sum(largest_remainder([0.37, 0.21, 0.42], 12345)) == 12345


def test_plan_is_deterministic_and_cycles_each_source_through_its_own_permutation():
    lengths = [1000, 300, 4000]
    a = MixturePlan(["a", "b", "c"], [0.5, 0.3, 0.2], lengths, seed=3)
    b = MixturePlan(["a", "b", "c"], [0.5, 0.3, 0.2], lengths, seed=3)
    other = MixturePlan(["a", "b", "c"], [0.5, 0.3, 0.2], lengths, seed=4)
    n = a.epoch_samples
    assert n == 5300 and a.counts == [2650, 1590, 1060]
    epoch0 = [a.locate(0, i) for i in range(n)]
    assert epoch0 == [b.locate(0, i) for i in range(n)]
    assert epoch0 != [other.locate(0, i) for i in range(n)]
    by_source = [[i for s, i in epoch0 if s == src] for src in range(3)]
    assert [len(x) for x in by_source] == a.counts
    # Up-sampled b (1590 slots, 300 sequences): whole cycles, each sequence once per cycle.
    up = by_source[1]
    for c in range(5):
        assert sorted(up[c * 300:(c + 1) * 300]) == list(range(300))
    assert Counter(Counter(up).values()) == {5: 210, 6: 90}
    # Down-sampled c (1060 of 4000): no repeat, and the next epoch continues with other sequences.
    down0 = by_source[2]
    down1 = [i for s, i in (a.locate(1, p) for p in range(n)) if s == 2]
    assert len(set(down0)) == 1060 and not set(down0) & set(down1)
    assert down0 != list(range(1060))  # a seeded permutation, not the file's first sequences


def test_realised_token_shares_of_the_first_steps_match_the_weights(tmp_path):
    """Through the real dataset: the samples' own contents say which source they came from."""
    weights = [0.5, 0.3, 0.2]
    data = mixture(make_sources(tmp_path, [3000, 800, 2200]), weights)
    sampler = MixtureSampler(data.mixture, micro=8, world=2, accum=2, seed=11)  # global batch 32
    steps = 150                                                          # 4800 of 6000 samples
    counts, from_plan = Counter(), np.zeros(3, dtype=np.int64)
    batches = iter(sampler)
    for step in range(steps):
        from_plan += sampler.step_counts(0, step * sampler.global_batch)
        for _ in range(2):  # the step's global micro-batches
            counts.update(source_of(data.train[i]) for i in next(batches))
    total = steps * sampler.global_batch
    shares = [counts[s] / total for s in range(3)]
    assert from_plan.tolist() == [counts[s] for s in range(3)]  # the host-side count is the truth
    assert all(abs(sh - w) < 0.01 for sh, w in zip(shares, weights)), shares
    assert data.items_per_sample == SEQ and "mixture of 3 token files" in data.describe


def _global_batches(dataset, sampler, world: int, accum: int, steps: int) -> list[list[int]]:
    """The global batch of each optimizer step as it reaches the ranks through Accelerate's real
    sharding (split_batches=True): rank r's micro-batches, ranks concatenated, crc32 per sample."""
    from accelerate.data_loader import prepare_data_loader
    from torch.utils.data import DataLoader
    per_rank = []
    for rank in range(world):
        dl = prepare_data_loader(DataLoader(dataset, batch_sampler=sampler), num_processes=world,
                                 process_index=rank, split_batches=True, even_batches=True, rng_types=[])
        per_rank.append([[zlib.crc32(row.numpy().tobytes()) for row in b["input_ids"]] for b in dl])
    out = []
    for step in range(steps):
        out.append([c for m in range(accum) for r in range(world) for c in per_rank[r][step * accum + m]])
    return out


def test_same_global_batches_for_any_world_size_and_accumulation_across_epochs(tmp_path):
    data = mixture(make_sources(tmp_path, [30, 6, 20]), [0.5, 0.3, 0.2])  # 56 per epoch = 14 steps of 4
    layouts = {"world 1, accum 4, micro 1": (1, 4, 1), "world 2, accum 1, micro 2": (2, 1, 2),
               "world 4, accum 1, micro 1": (4, 1, 1)}
    seen = {}
    for name, (world, accum, micro) in layouts.items():
        sampler = MixtureSampler(data.mixture, micro=micro, world=world, accum=accum, seed=5)
        assert sampler.global_batch == 4 and sampler.steps_per_epoch == 14
        steps = []
        for epoch in range(2):
            sampler.set_position(epoch, 0)
            steps += _global_batches(data.train, sampler, world, accum, 14)
        seen[name] = steps
    first, *others = seen.values()
    assert all(o == first for o in others)
    assert first[:14] != first[14:]  # epoch 1 is reshuffled (and draws other sequences)
    # Every sample of epoch 0 is a real sequence of its source; the up-sampled one repeats.
    assert len(set(c for step in first[:14] for c in step)) < 56


def test_resume_from_any_step_boundary_reproduces_the_rest(tmp_path):
    data = mixture(make_sources(tmp_path, [30, 6, 20]), [0.5, 0.3, 0.2])
    sampler = MixtureSampler(data.mixture, micro=2, world=1, accum=2, seed=5)
    g, spe = sampler.global_batch, sampler.steps_per_epoch
    full = {}
    for epoch in (0, 1):
        sampler.set_position(epoch, 0)
        full[epoch] = list(sampler)
    for epoch in (0, 1):
        for step in range(spe):
            resumed = MixtureSampler(data.mixture, micro=2, world=1, accum=2, seed=5)  # a new process
            resumed.set_position(epoch, step * g)
            rest = list(resumed)
            assert rest == full[epoch][step * 2:]
            assert [data.train[i]["input_ids"].tolist() for b in rest[:2] for i in b] == \
                   [data.train[i]["input_ids"].tolist() for b in full[epoch][step * 2:step * 2 + 2] for i in b]


def test_validation_interleaves_the_sources_in_proportion(tmp_path):
    data = mixture(make_sources(tmp_path, [40, 40, 40], val={0: 30, 1: 20, 2: 10}), [0.5, 0.3, 0.2])
    assert len(data.val) == 60
    first = Counter(source_of(data.val[i]) for i in range(20))
    assert first == {0: 10, 1: 6, 2: 4}  # a prefix (train.eval_batches) is the mixture
    assert Counter(source_of(data.val[i]) for i in range(60)) == {0: 30, 1: 20, 2: 10}
    assert len(InterleavedVal([None, None], [1, 1])) == 0


# ----------------------------------------------------------------------------- bad mixtures

@pytest.mark.parametrize("overrides,needle", [
    ([("data.sources", "[{path: a.bin, weight: 1, wieght: 2}]")],
     'unknown key "data.sources[0].wieght" (did you mean "weight"?)'),
    ([("data.sources", "[{path: a.bin}]")], "data.sources[0].weight is missing"),
    ([("data.sources", "[{path: a.bin, weight: 0}]")], "weight of a.bin must be a number > 0"),
    ([("data.sources", "[{path: a.bin, weight: -1}]")], "weight of a.bin must be a number > 0"),
    ([("data.sources", "[{path: a.bin, weight: 1}]"), ("data.path", "b.bin")],
     "data.sources and data.path are both set"),
    ([("data.sources", "a.bin")], "data.sources must be a list of mappings"),
    ([("data.sources", "[{path: x/a.bin, weight: 1}, {path: y/a.bin, weight: 1}]")], 'both named "a"'),
    ([("data.sources", "[{path: a.bin, weight: 1, name: 'a b'}]")], "may only use letters"),
])
def test_bad_mixture_configs_name_the_key(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, [("data.kind", "tokens"), *overrides])
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_sources_need_data_kind_tokens_and_a_run_file_can_list_them(tmp_path):
    with pytest.raises(ConfigError, match="^--data.sources is not a key of data.kind text .*; data.kind tokens has it$"):
        load_config(None, [("data.sources", "[{path: a.bin, weight: 1}]")])
    run = tmp_path / "run.yaml"
    run.write_text("data:\n  kind: tokens\n  sources:\n    - {path: web.bin, weight: 3}\n"
                   "    - path: code.bin\n      weight: 1\n      name: code\n")
    cfg = load_config(str(run))
    assert [(s.name, s.weight) for s in cfg.data.sources] == [("web", 3.0), ("code", 1.0)]
    run.write_text("data:\n  kind: tokens\n  sources:\n    - {path: web.bin, weight: 3, wait: 1}\n")
    with pytest.raises(ConfigError, match='run.yaml: unknown key "data.sources\\[0\\].wait"'):
        load_config(str(run))


def test_sources_must_share_a_tokenizer_and_exist(tmp_path):
    a = write_token_file(tmp_path / "a.bin", source_tokens(0, 10, SEQ))
    b = write_token_file(tmp_path / "b.bin", source_tokens(1, 10, SEQ), tokenizer="/tok/gpt2", vocab_size=50257)
    with pytest.raises(DataError) as e:
        mixture([str(a), str(b)], [1, 1])
    assert f"data.sources {a} and {b} were tokenized differently" in str(e.value)
    with pytest.raises(DataError, match="does not exist"):
        mixture([str(a), str(tmp_path / "missing.bin")], [1, 1])
    with pytest.raises(DataError, match="data.sources b.bin: weight 1 gives it no sample in an epoch of 20"):
        MixturePlan(["a", "b"], [1000, 1], [10, 10], seed=0, paths=["a.bin", "b.bin"])


# ----------------------------------------------------------------------------- the real program

def _steps(run_dir, world: int, accum: int) -> dict[int, list[int]]:
    """Global batch (crc32 per sample) of each optimizer step from the per-rank data traces: a
    step's rows are its micro-batches in order (debug.trace_data logs them before the step ends)."""
    out: dict[int, list[int]] = {}
    rows = [data_trace(run_dir, r) for r in range(world)]
    for r0 in range(0, len(rows[0]), accum):
        step = rows[0][r0]["step"]
        assert all(rows[r][r0 + m]["step"] == step for r in range(world) for m in range(accum))
        out[step] = [c for m in range(accum) for r in range(world) for c in rows[r][r0 + m]["crc"]]
    return out


@pytest.mark.multiproc
def test_two_processes_equal_one_process_resumed_three_times(tmp_path):
    """A: torchrun 2 processes, micro 2, accum 1, 8 steps uninterrupted. B: python 1 process,
    micro 1, accum 4, stopped and resumed (--resume auto) after steps 2, 4 and 6. Same global
    batches step by step, and the same per-source token counts, which are the trace's own.
    The first source is a shard directory (`zerotrain prepare --out DIR`, 4 shards): sharded
    sets train end to end too."""
    from zerotrain.train.commands.prepare import main as prepare
    seq, lengths, weights = 32, [24, 6, 16], [0.5, 0.3, 0.2]  # 45 sequences (shard tails): 11 steps of 4, 8 used
    paths = make_sources(tmp_path, lengths, seq_len=seq)
    raw = tmp_path / "src0.raw"  # source 0's ids (< 64) as bytes, for byte-level prepare
    raw.write_bytes(np.fromfile(paths[0], dtype=np.uint16).astype(np.uint8).tobytes())
    assert prepare([str(raw), "--out", str(tmp_path / "src0"), "--shard-tokens", "200", "--workers", "1"]) == 0
    paths[0] = str(tmp_path / "src0")
    assert len(list((tmp_path / "src0").glob("shard_*.bin"))) == 4
    sources = "[" + ", ".join(f"{{path: '{p}', weight: {w}}}" for p, w in zip(paths, weights)) + "]"
    common = ["--ds-config", fp32(tmp_path, "ddp"), "--model.name", "gpt-tiny", "--data.kind", "tokens",
              "--data.sources", sources, "--data.seq_len", str(seq), "--train.eval_every", "0",
              "--train.eval_batches", "1", "--debug.trace_data", "true", "--logging.progress", "false",
              "--train.sample_tokens", "0", "--logging.every_steps", "1", "--optim.warmup_steps", "2",
              "--checkpoint.export", "false"]
    a, b = tmp_path / "a", tmp_path / "b"
    run_train("torchrun", 2, [*common, "--train.micro_batch_size", "2", "--train.max_steps", "8",
                              "--checkpoint.save_at_end", "false", "--train.run_dir", str(a)])
    for stop in (2, 4, 6, 8):
        proc = run_train("python", 1, [*common, "--train.micro_batch_size", "1", "--train.grad_accum_steps", "4",
                                       "--train.max_steps", str(stop), "--checkpoint.save_at_end", "true",
                                       "--resume", "auto", "--train.run_dir", str(b)])
        if stop > 2:
            assert f"step {stop - 2}, epoch 0" in proc.stdout  # resumed inside the first epoch
    steps_a, steps_b = _steps(a, world=2, accum=1), _steps(b, world=1, accum=4)
    assert sorted(steps_a) == list(range(8)) and steps_a == steps_b
    # The logged counts are what was trained on: each sample's source from its content.
    data = build_data(DataConfig(kind="tokens", sources=[SourceConfig(path=p, weight=w)
                                                         for p, w in zip(paths, weights)]), seq, 0)
    crc_source = {}
    for s, src in enumerate(data.train.sources):
        crc_source.update({zlib.crc32(src[i]["input_ids"].numpy().tobytes()): s for i in range(len(src))})
    truth = Counter(crc_source[c] for step in steps_a.values() for c in step)
    last_a = [r for r in metrics(a) if "loss" in r][-1]
    last_b = [r for r in metrics(b) if "loss" in r][-1]
    names = data.mixture.names
    counts_a = {n: last_a[f"data/tokens/{n}"] for n in names}
    assert counts_a == {n: last_b[f"data/tokens/{n}"] for n in names}
    assert counts_a == {n: truth[s] * seq for s, n in enumerate(names)}
    assert sum(counts_a.values()) == last_b["tokens_seen"] == 8 * 4 * seq
