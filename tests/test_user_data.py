"""Your own dataset: data.kind py with data.factory "module:function" (issue 48, item 4 of "What
to build"; docs/workloads.md "Your own dataset").

What is promised: the factory's map-style Dataset (with its validation set and collate_fn) goes
through the same global-batch sampler as every data kind, so a run resumed from a checkpoint onto
another world size trains on exactly the samples of the uninterrupted run, step by step, and
reaches its losses; a py: model's own loss consumes the batches; a factory that does not import,
raises or returns something that is no map-style Dataset stops the run in one line naming
data.factory, exit 2, before the model is built.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from helpers import REPO, data_trace, fp32, metrics, run_main, run_train
from zerotrain.train.config import DataConfig, load_config
from zerotrain.train.data import build_data
from zerotrain.train.errors import ConfigError

USER_ENV = {"PYTHONPATH": str(REPO / "tests")}
MODEL = ["--model.name", "py:user_models.own_loss:regressor", "--model.loss", "model", "--model.kwargs",
         "{features: 4}"]
DATA = ["--data.kind", "py", "--data.factory", "user_models.own_data:build", "--data.kwargs", "{n: 256}"]
RUN = [*MODEL, *DATA, "--train.max_steps", "6", "--train.eval_every", "3", "--train.eval_batches", "2",
       "--logging.every_steps", "1", "--logging.progress", "false", "--train.sample_tokens", "0",
       "--optim.lr", "1e-2", "--optim.warmup_steps", "0", "--checkpoint.export", "false",
       "--checkpoint.save_at_end", "false", "--debug.trace_data", "true"]


@pytest.fixture(autouse=True)
def importable(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "tests"))


def test_the_factorys_splits_and_collate_fn_make_the_bundle():
    data = build_data(DataConfig(kind="py", factory="user_models.own_data:build", kwargs={"n": 32}), None, 0)
    assert (len(data.train), len(data.val)) == (32, 64)
    assert data.extra["collate"].__name__ == "rename"
    assert data.task == "custom"
    assert "py dataset user_models.own_data:build (Points, 32 samples, batch keys x, y, collate_fn rename" \
        in data.describe
    bare = build_data(DataConfig(kind="py", factory="user_models.own_data:plain"), None, 0)
    assert bare.val is None and bare.extra["collate"] is None and len(bare.train) == 64


@pytest.mark.parametrize("factory,kwargs,says", [
    ("user_models.own_data:raises", None, 'data.factory "user_models.own_data:raises" raised FileNotFoundError: '
                                          "/data/my_images: no such directory; fix the factory"),
    ("user_models.own_data:a_number", None, "returned an int as the dataset, not a map-style Dataset"),
    ("user_models.own_data:iterable", None, "returned an IterableDataset as the dataset, not a map-style Dataset"),
    ("user_models.own_data:strings", None, "a batch of its training samples is list, not a dict of tensors"),
    ("user_models.missing:build", None, 'no module named "user_models.missing" on the Python path'),
    ("user_models.own_data:bulid", None, 'has no function "bulid"'),
    ("user_models.own_data:build", {"size": 3}, 'data.kwargs {"size": 3}: the function of data.factory'),
], ids=["raises", "not-a-dataset", "iterable", "not-dict-samples", "missing-module", "missing-function", "kwargs"])
def test_a_bad_factory_stops_in_one_line_with_exit_2_before_the_model(capsys, tmp_path, factory, kwargs, says):
    argv = [*MODEL, "--data.kind", "py", "--data.factory", factory, "--train.max_steps", "1",
            "--logging.progress", "false", "--train.run_dir", str(tmp_path / "run")]
    code, err = run_main(capsys, argv + (["--data.kwargs", json.dumps(kwargs)] if kwargs else []))
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1, err
    assert says in lines[0], lines[0]


@pytest.mark.parametrize("pairs,says", [
    ([("data.kind", "py")], "data.kind py needs data.factory"),
    ([("data.kind", "py"), ("data.factory", "user_models.own_data")], 'is not "module:function"'),
    ([("data.kind", "py"), ("data.factory", "m:f"), ("data.path", "x")], "data.path is not a key of data.kind py"),
])
def test_the_section_is_checked_when_loaded(pairs, says):
    with pytest.raises(ConfigError, match=says):
        load_config(None, pairs)


def _rows_per_step(run_dir, ranks: int) -> dict[int, Counter]:
    """Each optimizer step's samples (crc32 of each row of the batch's first tensor), all ranks."""
    out: dict[int, Counter] = {}
    for r in range(ranks):
        for row in data_trace(run_dir, r):
            out.setdefault(row["step"], Counter()).update(row["crc"])
    return out


@pytest.mark.multiproc
def test_a_py_model_on_a_py_dataset_resumes_bit_identically_onto_another_world_size(tmp_path):
    """2 processes x micro 4 (DDP, fp32) train 6 steps and save at step 3; 1 process x micro 4 x
    accumulation 2 (the same global batch) resumes from that save: steps 4-6 see exactly the
    samples of the uninterrupted run and give bit-identical losses. Exact, not within a
    tolerance: each micro-batch's gradient is computed alike, and 2 ranks' mean (g1 + g2) / 2
    equals accumulation's g1 / 2 + g2 / 2 bit for bit (halving is exact in binary floating point)."""
    ddp = fp32(tmp_path, "ddp")
    ref = tmp_path / "ref"
    run_train("torchrun", 2, [*RUN, "--ds-config", ddp, "--train.micro_batch_size", "4", "--checkpoint.every_steps",
                              "3", "--train.run_dir", str(ref)], env=USER_ENV)
    resumed = tmp_path / "resumed"
    run_train("python", 1, [*RUN, "--ds-config", ddp, "--train.micro_batch_size", "4", "--train.grad_accum_steps",
                            "2", "--train.run_dir", str(resumed), "--resume", str(ref / "checkpoints" / "step_00000003")],
              env=USER_ENV)
    want, got = _rows_per_step(ref, 2), _rows_per_step(resumed, 1)
    assert sorted(got) == [3, 4, 5] and all(sum(c.values()) == 8 for c in want.values())
    for step in got:
        assert got[step] == want[step], step
    assert want[0] != want[1]  # the trace tells batches apart
    ref_loss = {r["step"]: r["loss"] for r in metrics(ref) if "loss" in r}
    res_loss = {r["step"]: r["loss"] for r in metrics(resumed) if "loss" in r}
    assert sorted(res_loss) == [4, 5, 6]
    assert res_loss == {s: ref_loss[s] for s in res_loss}, (res_loss, ref_loss)
    assert ref_loss[6] < ref_loss[1]  # it learns
    assert any("val/loss" in r for r in metrics(resumed))
