"""The same train/main.py under every launcher: true rank/world on every rank, distinct
data shards, and identical losses (issue 2). Two real processes per launch, gloo on CPU."""

from __future__ import annotations

import json
import zlib

import pytest

from helpers import accelerate_yaml, cached_run, data_trace, rank_infos, small_run_args, train_losses
from zerotrain.train.config import DataConfig
from zerotrain.train.data import build_data
from zerotrain.train.data.sampler import GlobalBatchSampler

pytestmark = pytest.mark.multiproc
STEPS, MICRO, SEED = 4, 4, 1234


def args_for(ds_json):
    return small_run_args(ds_json, STEPS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, fp32_configs):
    z2 = fp32_configs["zero2"]
    acc_yaml = accelerate_yaml(tmp_path_factory.mktemp("acc"), z2, nproc=2)
    return {
        "torchrun": (2, cached_run(tmp_path_factory, "torchrun", 2, args_for(z2))),
        "deepspeed": (2, cached_run(tmp_path_factory, "deepspeed", 2, args_for(z2))),
        "accelerate": (2, cached_run(tmp_path_factory, "accelerate", 2, [a for a in args_for(z2) if a != z2
                                                                             and a != "--ds-config"],
                                     accelerate_config=acc_yaml)),
        # One process with twice the micro-batch = the same global batch as 2 x 4.
        "python": (1, cached_run(tmp_path_factory, "python", 1,
                                 args_for(z2) + ["--train.micro_batch_size", str(2 * MICRO)])),
    }


def expected_global_batches():
    """Fingerprints of the samples each global step must see, from the dataset itself."""
    data = build_data(DataConfig(max_bytes=300000), 64, SEED)
    crcs = [zlib.crc32(data.train[i]["input_ids"].numpy().tobytes()) for i in range(len(data.train))]
    sampler = GlobalBatchSampler(len(data.train), MICRO, 2, 1, SEED)
    order = sampler.order(0)
    g = sampler.global_batch
    return [[crcs[i] for i in order[s * g:(s + 1) * g].tolist()] for s in range(STEPS)]


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed", "accelerate", "python"])
def test_every_rank_knows_its_true_rank_and_world(runs, launcher):
    n, run_dir = runs[launcher]
    infos = rank_infos(run_dir)
    assert [i["rank"] for i in infos] == list(range(n))
    for i in infos:
        assert i["world_size"] == n and i["accelerate_num_processes"] == n and i["process_group_size"] == n
        assert i["accelerate_process_index"] == i["rank"]
        assert i["strategy"] == "ZeRO-2 (fp32)" and "DEEPSPEED" in i["distributed_type"]
    assert infos[0]["launcher"] == {"python": "python", "torchrun": "torchrun", "deepspeed": "deepspeed",
                                    "accelerate": "accelerate"}[launcher]


@pytest.mark.parametrize("launcher", ["torchrun", "deepspeed", "accelerate", "python"])
def test_ranks_read_distinct_shards_of_the_global_batch(runs, launcher):
    n, run_dir = runs[launcher]
    expected = expected_global_batches()
    traces = [data_trace(run_dir, r) for r in range(n)]
    for step in range(STEPS):
        per_rank = [t[step]["crc"] for t in traces]
        assert all(t[step]["step"] == step for t in traces)
        flat = [c for shard in per_rank for c in shard]
        assert len(flat) == len(set(flat)), f"step {step}: a sample was read by two ranks"
        # Rank r gets the r-th contiguous slice of the global batch, whatever the launcher.
        assert flat == expected[step], f"step {step}: ranks did not read the expected global batch"


def test_identical_losses_under_every_launcher(runs):
    ref = train_losses(runs["torchrun"][1])
    assert sorted(ref) == list(range(1, STEPS + 1))
    for launcher in ("deepspeed", "accelerate"):
        assert train_losses(runs[launcher][1]) == pytest.approx(ref, rel=1e-6), launcher
    # One process, same global batch and data: the same mathematics up to reduction order.
    assert train_losses(runs["python"][1]) == pytest.approx(ref, rel=1e-4)


def test_the_deepspeed_launcher_leaves_no_shared_memory_buffer(runs):
    """Under the deepspeed launcher (LOCAL_SIZE set) DeepSpeed's CPU all-reduce creates
    /dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank> (66 MB) per rank and never
    removes it: each rank unlinks its own once every rank has mapped it (train/launch/shm_buffers.py)."""
    from pathlib import Path
    from zerotrain.train.launch import shm_buffers
    released = [Path(i["shm_buffer_released"]) for i in rank_infos(runs["deepspeed"][1])]
    assert [shm_buffers.parse_name(p.name)["rank"] for p in released] == [0, 1]
    assert not [p for p in released if p.exists()]


@pytest.mark.parametrize("name,label", [("ddp", "DDP (fp32)"), ("zero2", "ZeRO-2 (fp32)")])
def test_ranks_under_the_deepspeed_launcher_take_their_share_of_the_cores(tmp_path_factory, fp32_configs, name, label):
    """No OMP_NUM_THREADS (as `make train` and a user's shell; the deepspeed launcher sets none):
    each rank's OpenMP starts at its share of the node's cores, set in the environment before
    torch loads (train/launch/device_env.py), also once Accelerate has started, and the banner
    and config.json say so. On 2 cores torch's default (every core in every rank) ran the plain
    loop's DDP at 0.38 and its ZeRO stages at 0.92-0.96 of 1 thread per rank (issue 41,
    BENCHMARKS.md "Trainer against the best plain loop")."""
    from zerotrain.train.training import hardware
    run_dir = cached_run(tmp_path_factory, "deepspeed", 2, args_for(fp32_configs[name]),
                         env={"OMP_NUM_THREADS": None})
    share = hardware.cores_per_rank(2)
    infos = rank_infos(run_dir)
    assert [i["strategy"] for i in infos] == [label] * 2
    assert [(i["torch_threads"], i["local_world_size"]) for i in infos] == [(share, 2)] * 2
    assert all(i["threads_from"].endswith("core(s) / 2 rank(s) on this node") for i in infos), infos
    hw = json.loads((run_dir / "config.json").read_text())["resolved"]["hardware"]
    assert (hw["cpu_threads"], hw["cpu_threads_from"]) == (share, infos[0]["threads_from"])
    assert f"{share} torch thread(s) per rank" in (run_dir / "launcher.out").read_text()
    assert sorted(train_losses(run_dir)) == list(range(1, STEPS + 1))
