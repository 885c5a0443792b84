"""Hugging Face Hub ids: `hf:<org>/<name>[@<revision>]` (model.name), and the same ids as
model.init_from and data.tokenizer, resolved through huggingface_hub's cache.

A name is a Hub id when it is not a local path that exists and reads `<org>/<name>` with an
optional `@<revision>` (a branch, a tag or a commit hash; default main). The files are
huggingface_hub's snapshot of that revision in its cache (HF_HUB_CACHE, else HF_HOME/hub, else
~/.cache/huggingface/hub; refs/, snapshots/<commit>/, blobs/): the config, tokenizer and
safetensors weights, and *.py modeling files (run only with model.trust_remote_code). Pickled
weights (*.bin) are never fetched: training never unpickles.

This module only reads the cache (`local_snapshot`, local files only) or fills it (`download`).
Who downloads is train/launch/hub_fetch.py's decision: one process per node, before the model
is resolved, while the node's other processes wait at a barrier, so no file is fetched N times
and none is read half-written. Every failure is one line naming the id, the revision and the
cache, and what to do.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from zerotrain.models.errors import ConfigError

ALLOW = ["*.json", "*.safetensors", "*.model", "*.txt", "*.py", "*.jinja", "*.tiktoken"]
# A dataset repository: its data files and the README whose YAML names its subsets and splits.
DATASET_ALLOW = ["*.parquet", "*.arrow", "*.jsonl", "*.json", "README.md", "*.md"]
# data.path with one of these endings is a file (missing or not), never a dataset id
FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".bin", ".txt", ".md", ".py", ".csv", ".gz", ".zst")
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*(@[A-Za-z0-9][A-Za-z0-9_./-]*)?")


@dataclass(frozen=True)
class HubId:
    repo: str                   # org/name
    revision: Optional[str]     # as given; None = main
    repo_type: str = "model"    # or "dataset" (data.path)

    @property
    def rev(self) -> str:
        return self.revision or "main"

    def __str__(self) -> str:
        return f"{self.repo}@{self.rev}"


def parse(text: Optional[str], repo_type: str = "model") -> Optional[HubId]:
    """The Hub id `text` names, or None for a local path (one that exists always is one). A
    dataset id (data.path) has no file ending (.jsonl, .parquet, ...): those are files."""
    if not text or Path(text).expanduser().exists() or text.startswith((".", "/", "~")):
        return None
    if not _ID.fullmatch(text) or text.count("/") - text.partition("@")[2].count("/") != 1:
        return None
    repo, _, rev = text.partition("@")
    if repo_type == "dataset" and repo.lower().endswith(FILE_SUFFIXES):
        return None
    return HubId(repo, rev or None, repo_type)


def _allow(hub: HubId) -> list[str]:
    return DATASET_ALLOW if hub.repo_type == "dataset" else ALLOW


def cache_dir() -> str:
    from huggingface_hub import constants
    return str(constants.HF_HUB_CACHE)


def _offline() -> bool:
    from huggingface_hub import constants
    return bool(constants.HF_HUB_OFFLINE)


def _shown(hub: HubId) -> str:
    return f"{'hf:' if hub.repo_type == 'model' else ''}{hub.repo}@{hub.rev}"


def _line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:200]


@functools.lru_cache(maxsize=None)
def local_snapshot(hub: HubId, what: str) -> tuple[Path, str]:
    """(the snapshot directory, its commit hash) of `hub` in the cache, reading nothing from the
    network. ConfigError naming the id, revision and cache when it is not there."""
    from huggingface_hub import snapshot_download
    try:
        path = Path(snapshot_download(hub.repo, revision=hub.revision, allow_patterns=_allow(hub),
                                      repo_type=hub.repo_type, local_files_only=True))
    except Exception:  # noqa: BLE001 - huggingface_hub's LocalEntryNotFoundError and kin: not in the cache
        how = ("HF_HUB_OFFLINE is set: unset it on a machine with network to download it" if _offline() else
               "run with network access once (one process per node downloads it)")
        kind = " --repo-type dataset" if hub.repo_type == "dataset" else ""
        raise ConfigError(f"{what} {_shown(hub)}: not a local path, and not in the Hugging Face cache {cache_dir()} "
                          f"(revision {hub.rev}); {how}, or fill the cache with `hf download {hub.repo}{kind} "
                          f"--revision {hub.rev}`") from None
    return path, path.name


def cached(hub: HubId) -> bool:
    try:
        local_snapshot(hub, "")
        return True
    except ConfigError:
        local_snapshot.cache_clear()  # a later download makes it present
        return False


def download(hub: HubId, what: str) -> Path:
    """Fill the cache with `hub`'s files (ALLOW); ConfigError in one line for a missing repo, a
    revision that does not exist, no network or offline mode."""
    from huggingface_hub import errors, snapshot_download
    where = f"{what} {_shown(hub)}"
    try:
        path = Path(snapshot_download(hub.repo, revision=hub.revision, allow_patterns=_allow(hub),
                                      repo_type=hub.repo_type))
    except errors.RevisionNotFoundError:
        raise ConfigError(f"{where}: the revision {hub.rev} does not exist in {hub.repo}; give a branch, tag or "
                          f"commit hash it has") from None
    except errors.RepositoryNotFoundError:
        raise ConfigError(f"{where}: no local path {hub.repo} and no {hub.repo_type} repository {hub.repo} on the Hub "
                          f"(or it is private: log in with `hf auth login` or set HF_TOKEN); check the path or id") from None
    except errors.GatedRepoError:
        raise ConfigError(f"{where}: the repository is gated; accept its terms on the Hub and log in (`hf auth "
                          f"login` or HF_TOKEN)") from None
    except Exception as e:  # noqa: BLE001 - offline, no network, a server error: one line with the cache
        raise ConfigError(f"{where}: cannot download it into the Hugging Face cache {cache_dir()} ({type(e).__name__}: "
                          f"{_line(e)}); check the network (HF_ENDPOINT), or fill the cache with `hf download "
                          f"{hub.repo} --revision {hub.rev}`") from None
    local_snapshot.cache_clear()
    return path


def local_path(text: str, what: str, repo_type: str = "model") -> Path:
    """`text` as a local directory: itself, or the cached snapshot of the Hub id it names."""
    hub = parse(text, repo_type)
    return local_snapshot(hub, what)[0] if hub is not None else Path(text).expanduser()


def commit_of(text: Optional[str], what: str, repo_type: str = "model") -> Optional[dict]:
    """{"id", "revision", "commit"} of a Hub id (None for a local path): what config.json records."""
    hub = parse(text, repo_type)
    if hub is None:
        return None
    return {"id": hub.repo, "revision": hub.rev, "commit": local_snapshot(hub, what)[1]}
