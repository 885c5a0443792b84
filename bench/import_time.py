"""Where a rank's start-up time goes: one 1-process run of the tiny GPT (2 steps, ZeRO-2 fp32)
under `python -X importtime`, its wall time, and the imports that cost most, grouped by the
package that triggered them. Every launch in the test suite pays this per rank.

    .venv/bin/python bench/import_time.py            # prints a table; ~15 s
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ARGS = ["--model.name", "gpt-tiny", "--data.seq_len", "64", "--data.max_bytes", "300000",
        "--train.micro_batch_size", "4", "--logging.progress", "false", "--train.sample_tokens", "0",
        "--train.eval_batches", "1", "--train.max_steps", "2", "--train.eval_every", "0",
        "--checkpoint.export", "false", "--checkpoint.save_at_end", "false",
        "--ds-config", str(REPO / "ds_configs" / "zero2_fp32.json")]
LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \| (\s*)(\S+)")


def corpus_listing() -> str:
    """The default corpus (train/data/text.py): listing all of it vs the lazy walk's first files."""
    import sysconfig
    from itertools import islice
    sys.path.insert(0, str(REPO))
    from zerotrain.train.data.text import default_corpus_files
    root = Path(sysconfig.get_paths()["stdlib"])
    t0 = time.perf_counter()
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    t1 = time.perf_counter()
    first = list(islice(default_corpus_files(), 40))
    t2 = time.perf_counter()
    assert first == files[:40]
    return (f"default corpus: sorted rglob of {len(files)} files {t1 - t0:.3f} s; "
            f"lazy walk to the first 40 {t2 - t1:.4f} s")


def main() -> int:
    env = dict(os.environ, ZEROTRAIN_DEVICE="cpu", CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu",
               WANDB_MODE="disabled", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    with tempfile.TemporaryDirectory() as run_dir:
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-X", "importtime", str(REPO / "train" / "main.py"), *ARGS,
                            "--train.run_dir", run_dir], cwd=REPO, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t0
    if p.returncode != 0:
        print(p.stderr[-3000:], file=sys.stderr)
        return 1
    # Top-level entries (no indent) are imports made from outside any other import: at start-up
    # or deferred into a function. Their cumulative times add up to the whole import cost.
    # Children are listed before their parent: remember the direct ones to name the biggest.
    top, children = [], []
    for _, cum, indent, name in LINE.findall(p.stderr):
        if not indent:
            biggest = max(children, default=(0, ""))[1]
            top.append((int(cum), name, biggest))
            children = []
        elif len(indent) == 2:
            children.append((int(cum), name))
    total = sum(us for us, _, _ in top)
    print(f"1 process, 2 steps of gpt-tiny (ZeRO-2 fp32): wall {wall:.1f} s, imports {total / 1e6:.1f} s")
    print(f"{'seconds':>8}  top-level import (cumulative)  <- its biggest direct import")
    for us, name, biggest in sorted(top, reverse=True)[:12]:
        print(f"{us / 1e6:8.2f}  {name}" + (f"  <- {biggest}" if biggest else ""))
    print(corpus_listing())
    return 0


if __name__ == "__main__":
    sys.exit(main())
