"""The embedded default corpus (this Python's standard-library sources) is the same bytes in
the same order for every process and run: the lazy walk that stops at data.max_bytes lists
exactly what a full sorted scan would."""

from __future__ import annotations

import sysconfig
from itertools import islice
from pathlib import Path

from zerotrain.train.data.text import default_corpus_files, read_bytes


def test_lazy_walk_equals_the_sorted_scan_and_stops_early():
    root = Path(sysconfig.get_paths()["stdlib"])
    scan = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    assert len(scan) > 100 and list(default_corpus_files()) == scan
    assert list(islice(default_corpus_files(), 5)) == scan[:5]


def test_default_corpus_is_the_first_files_joined_and_cut_at_max_bytes():
    tokens, what = read_bytes(None, 300_000)
    want = b""
    for f in sorted(p for p in Path(sysconfig.get_paths()["stdlib"]).rglob("*.py") if "site-packages" not in p.parts):
        want += (b"\n" if want else b"") + f.read_bytes()
        if len(want) >= 300_000:
            break
    assert tokens.tobytes() == want[:300_000] and "standard library" in what
