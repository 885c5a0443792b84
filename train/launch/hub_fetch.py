"""The Hub ids a run names (model.name hf:<org>/<name>[@rev], model.init_from, data.tokenizer,
and a dataset id as data.path; models/hub.py), fetched into huggingface_hub's cache before anything reads them: on each node
one process (local rank 0) downloads what is missing while every other process waits at a
barrier, so a file is fetched once per node (once in all where nodes share the cache:
huggingface_hub locks each file) and nobody reads a file being written. Then every process
checks the snapshot from the cache alone. With HF_HUB_OFFLINE=1 nothing is downloaded: what is
not cached is one line naming the id, the revision and the cache. Called at the start of
load_data (train/training/assembly.py), before the model is resolved; the barrier runs on the
process group Accelerate adopts later (train/launch/distributed.py init_process_group), so a
download must finish within the collectives' timeout (distributed.timeout_minutes)."""

from __future__ import annotations

import os

import zerotrain.models.hub as hub
from zerotrain.models.errors import ConfigError


DATASET_KINDS = ("text", "sft", "preference")  # whose data.path may be a Hub dataset id (train/data/records.py)


def hub_ids(cfg) -> list[tuple[hub.HubId, str]]:
    """[(id, the key that names it)] of the run, in a fixed order (every rank the same)."""
    named = []
    if cfg.model.family == "hf":
        named.append((cfg.model.name[3:], "model.name"))
    named.append((getattr(cfg.model, "init_from", None), "model.init_from"))
    named.append((cfg.data.tokenizer, "data.tokenizer"))
    ids = [(h, what) for text, what in named if (h := hub.parse(text)) is not None]
    if cfg.data.kind in DATASET_KINDS and (h := hub.parse(getattr(cfg.data, "path", None), "dataset")) is not None:
        ids.append((h, "data.path"))
    return ids


def fetch(cfg, timeout_s: int, say=print) -> list[dict]:
    """Download the run's Hub ids (one process per node), wait for them, check them on every
    rank. Returns [{"key", "id", "revision", "commit"}] for config.json."""
    ids = hub_ids(cfg)
    if not ids:
        return []
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    error = None
    if local_rank == 0 and not hub._offline():
        for h, what in ids:
            try:
                say(f"zerotrain: {what} {hub._shown(h)}: fetching into the Hugging Face cache {hub.cache_dir()} (one process "
                    f"per node; the others wait)")
                hub.download(h, what)
            except ConfigError as e:
                error = e
                break
    if world > 1:
        import torch.distributed as dist

        from zerotrain.train.launch import distributed as dist_
        dist_.init_process_group(timeout_s)
        dist.barrier()
    if error is not None:
        raise error
    out = []
    for h, what in ids:
        path, commit = hub.local_snapshot(h, what)  # every rank, from the cache only
        out.append({"key": what, "id": h.repo, "revision": h.rev, "commit": commit, "type": h.repo_type})
        if rank == 0:
            say(f"zerotrain: {what} {hub._shown(h)} = commit {commit} ({path})")
    return out
