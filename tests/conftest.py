"""pytest fixtures shared by the test modules; the helpers they use are tests/helpers.py.

Importing helpers first hides the GPUs from this process (and every launch) before any test
module imports torch.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import REPO, STAGE_ARGS, STAGE_RUNS, cached_run, fp32, make_tokenizer, random_text, write_texts
# The one session-wide two-node rig, registered here: a fixture imported into two test modules is two
# fixtures (one per module), i.e. two rigs at once, whose namespaces collide (zt<pid>n0 exists).
from multinode.fixture import two_nodes  # noqa: F401,E402 (fixture)


# pytest-xdist (`make test XDIST="-n 4 --dist loadgroup"` on a machine with more cores; serial
# by default: on 2 cores 2 workers were no faster, DEVELOPERS.md) then schedules whole
# modules: a module's fixtures launch once, on one worker. Modules that read the same
# session-cached launches (tests/helpers.py cached_run: the ZeRO-2 torchrun reference, the
# stage runs; the two-node rig; the W&B-observed run) share one worker.
SHARED_LAUNCHES = {"test_launchers.py": "zero2-reference", "test_multinode.py": "zero2-reference",
                   "test_elastic.py": "zero2-reference",  # the two-node rig, built once per worker
                   "test_stages.py": "zero2-reference", "test_memory.py": "zero2-reference",
                   "test_observability.py": "observed", "test_wandb.py": "observed"}


def pytest_sessionfinish(session, exitstatus):
    """Remove the DeepSpeed /dev/shm buffers (66 MB each) that launches killed before their
    ranks released them left behind. Safe under pytest-xdist (every worker and the controller
    run it): only buffers that no process has open or mapped and whose master port nobody
    listens on go (train/launch/shm_buffers.py), never one of a launch still running."""
    from train.launch.shm_buffers import sweep_stale
    sweep_stale(min_age_s=0)


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(SHARED_LAUNCHES.get(item.path.name, item.path.name)))


ZERO3_WARNINGS_VISIBLE = {"PYTHONWARNINGS": None, "PYTHONPATH": str(REPO / "tests" / "warnings_probe")}


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def fp32_stage_runs(tmp_path_factory, fp32_configs) -> dict[str, Path]:
    """DDP and ZeRO-0/1/2/3 (+ ZeRO-3 offload, + ZeRO-3 with activation checkpointing) in fp32,
    2 torchrun processes, same seed and data: the stage equivalence tests and the
    measured-memory tests read the same launches. The ZeRO-3 run shows its warnings as a user's
    would (no PYTHONWARNINGS) and emits two of its own at exit (tests/warnings_probe): its stderr
    is what tests/test_stages.py checks for library noise."""
    runs = {name: cached_run(tmp_path_factory, "torchrun", 2, ["--ds-config", fp32_configs[name], *STAGE_ARGS],
                             **({"env": ZERO3_WARNINGS_VISIBLE} if name == "zero3" else {}))
            for name in STAGE_RUNS}
    runs["zero3_ckpt"] = cached_run(tmp_path_factory, "torchrun", 2, ["--ds-config", fp32_configs["zero3"], *STAGE_ARGS,
                                                                      "--model.activation_checkpointing", "true"])
    return runs


@pytest.fixture(scope="session")
def fp32_configs(tmp_path_factory) -> dict[str, str]:
    """fp32 copies of every shipped DeepSpeed JSON, at stable paths for the whole session."""
    d = tmp_path_factory.mktemp("ds_fp32")
    return {p.stem: fp32(d, p.stem) for p in (REPO / "ds_configs").glob("*.json")}


@pytest.fixture
def clean_env(monkeypatch):
    """main() normalises RANK/WORLD_SIZE/... in os.environ; keep the test process clean."""
    saved = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """Text -> a local BPE tokenizer -> token files (train + sibling val) via `zerotrain prepare`."""
    from train.commands.prepare import main as prepare
    d = tmp_path_factory.mktemp("hf")
    docs = {f"doc{i}.txt": random_text(4000, 100 + i) for i in range(4)}
    src = write_texts(d / "src", docs)
    val = write_texts(d / "val", {"v.txt": random_text(2500, 200)})
    tok = make_tokenizer(d / "tok", list(docs.values()), vocab_size=320)
    out = d / "corpus.bin"
    assert prepare([str(src), "--val", str(val), "--out", str(out), "--tokenizer", str(d / "tok")]) == 0
    return {"dir": d, "tok_dir": d / "tok", "vocab": len(tok), "tokens": out}
