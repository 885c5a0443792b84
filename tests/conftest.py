"""pytest fixtures shared by the test modules; the helpers they use are tests/helpers.py.

Importing helpers first hides the GPUs from this process (and every launch) before any test
module imports torch.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers import REPO, STAGE_ARGS, cached_run, fp32, make_tokenizer, random_text, write_texts
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
    from zerotrain.train.launch.shm_buffers import sweep_stale
    sweep_stale(min_age_s=0)


# The quick tier (`make test`): every in-process test, plus the launches below, the fewest that
# prove each kind of promise once. Every other test that launches processes (marked multiproc,
# multinode or soak) is marked `full`: `make test-all` (what CI runs) adds them. Test id prefix: why.
QUICK_TIER = {
    "test_launchers.py::": "each launcher (torchrun, deepspeed, accelerate, python): true ranks, distinct "
                           "shards of the global batch, identical losses (4 launches)",
    "test_stages.py::test_each_stage_trains_fp32[ddp-": "DDP really wraps 2 processes and trains",
    "test_stages.py::test_each_stage_trains_fp32[zero1-": "ZeRO-1 trains",
    "test_stages.py::test_each_stage_trains_fp32[zero2-": "ZeRO-2 trains",
    "test_stages.py::test_each_stage_trains_fp32[zero3-": "ZeRO-3 trains",
    **{f"test_stages.py::test_stages_agree_in_fp32[{z}]": "DDP vs ZeRO-1/2/3: the same losses (4 launches, shared)"
       for z in ("zero1", "zero2", "zero3")},
    "test_stages.py::test_zero3_runs_partition_every_large_tensor[zero3]": "ZeRO-3 really partitions",
    "test_stages.py::test_zero3_stderr": "no library warning flood (the ZeRO-3 launch)",
    **{f"test_memory.py::{t}": "measured model states per stage vs the planner (the same 4 launches)" for t in (
        "test_measured_model_states_decrease", "test_planner_matches_measured_within_10_percent",
        "test_each_stage_partitions", "test_startup_banner")},
    "test_checkpoint.py::test_zero3_resume_is_bit_identical": "exact resume, partitioned ZeRO-3 checkpoint (2)",
    "test_checkpoint.py::test_zero3_export_equals_checkpoint": "partitioned ZeRO-3 export, live = offline",
    "test_checkpoint.py::test_init_from_exported_weights": "a new run from the export (1 process)",
    "test_fsdp2.py::test_zero3_checkpoint_resumes_under_fsdp2_on_one_process": "FSDP2, the third backend: a "
                                                                               "ZeRO-3 checkpoint resumed under it (2)",
    "test_checkpoint.py::test_one_process_checkpoint_resumes_on_two": "resume onto another world size and stage",
    "test_lora.py::test_lora_round_trip_under_partitioned_zero3": "LoRA under ZeRO-3: save, resume, PEFT (3)",
    "test_multinode.py::test_torchrun_two_nodes_c10d_rendezvous": "one two-node launch (the ssh rig)",
    "test_fit.py::test_ddp_over_the_cap_stops_before_training": "the fit-frontier refusal under a kernel cap (2)",
    "test_reliability.py::test_nan_steps_are_skipped_then_the_run_stops_with_the_last_good_state[ddp]":
        "one fault: NaN steps skipped, then a stop with the last good state",
}
LAUNCH_MARKERS = ("multiproc", "multinode", "soak")


def in_quick_tier(nodeid: str) -> bool:
    test_id = nodeid.split("tests/", 1)[-1]
    return any(test_id.startswith(prefix) for prefix in QUICK_TIER)


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.xdist_group(SHARED_LAUNCHES.get(item.path.name, item.path.name)))
        if any(item.get_closest_marker(m) for m in LAUNCH_MARKERS) and not in_quick_tier(item.nodeid):
            item.add_marker(pytest.mark.full)


ZERO3_WARNINGS_VISIBLE = {"PYTHONWARNINGS": None, "PYTHONPATH": str(REPO / "tests" / "warnings_probe")}


@pytest.fixture
def repo() -> Path:
    return REPO


class _StageRuns(dict):
    """run name -> run dir, launched on first use: the quick tier reads DDP and ZeRO-1/2/3 only."""

    def __init__(self, launch):
        super().__init__()
        self._launch = launch

    def __missing__(self, name: str) -> Path:
        self[name] = self._launch(name)
        return self[name]


@pytest.fixture(scope="session")
def fp32_stage_runs(tmp_path_factory, fp32_configs) -> dict[str, Path]:
    """DDP and ZeRO-0/1/2/3 (+ ZeRO-3 offload, + ZeRO-3 with activation checkpointing) in fp32,
    2 torchrun processes, same seed and data, each launched when a test first reads it: the stage
    equivalence tests and the measured-memory tests read the same launches. The ZeRO-3 run shows
    its warnings as a user's would (no PYTHONWARNINGS) and emits two of its own at exit
    (tests/warnings_probe): its stderr is what tests/test_stages.py checks for library noise."""
    def launch(name: str) -> Path:
        stage = "zero3" if name == "zero3_ckpt" else name
        extra = ["--model.activation_checkpointing", "true"] if name == "zero3_ckpt" else []
        return cached_run(tmp_path_factory, "torchrun", 2, ["--ds-config", fp32_configs[stage], *STAGE_ARGS, *extra],
                          **({"env": ZERO3_WARNINGS_VISIBLE} if name == "zero3" else {}))
    return _StageRuns(launch)


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
    # An in-process DDP run can leave its Reducer and gloo group in a reference cycle; freed later
    # inside a forked DataLoader worker (test_data_loading.py), gloo's destructor waits forever
    # for threads the fork did not copy. Free them here, in the process that owns the threads.
    import gc
    gc.collect()


@pytest.fixture
def fresh_accelerate():
    """Accelerate's process-wide state forgotten before and after an in-process main(), so the
    run starts its own as a launched one does, whatever ran in this pytest process before."""
    from accelerate.state import AcceleratorState
    AcceleratorState._reset_state(reset_partial_state=True)
    _forget_deepspeed_groups()
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    _forget_deepspeed_groups()


def _forget_deepspeed_groups():
    """DeepSpeed caches process groups in module globals (deepspeed.utils.groups: _WORLD_GROUP, ...);
    after an earlier in-process engine's group is destroyed, the next engine in this pytest process
    would broadcast over the stale one ("Group ... is not registered"). A launched run has one."""
    import sys
    groups = sys.modules.get("deepspeed.utils.groups")
    if groups is None:
        return
    import torch.distributed as dist
    for name, value in list(vars(groups).items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(groups, name, None)
        elif isinstance(value, dict) and any(isinstance(v, dist.ProcessGroup) for v in value.values()):
            value.clear()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """Text -> a local BPE tokenizer -> token files (train + sibling val) via `zerotrain prepare`."""
    from zerotrain.train.commands.prepare import main as prepare
    d = tmp_path_factory.mktemp("hf")
    docs = {f"doc{i}.txt": random_text(4000, 100 + i) for i in range(4)}
    src = write_texts(d / "src", docs)
    val = write_texts(d / "val", {"v.txt": random_text(2500, 200)})
    tok = make_tokenizer(d / "tok", list(docs.values()), vocab_size=320)
    out = d / "corpus.bin"
    assert prepare([str(src), "--val", str(val), "--out", str(out), "--tokenizer", str(d / "tok")]) == 0
    return {"dir": d, "tok_dir": d / "tok", "vocab": len(tok), "tokens": out}
