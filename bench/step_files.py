"""Which of zerotrain's own files one training step runs: the measure of how many files a
maintainer reads to follow a step (docs/architecture.md, issue 36).

It runs train/main.py in this process (the plain-python launcher: 1 process), with a profiler
that records every function call whose code lives under train/ or models/, from the entry into
the trainer's step at optimizer step K to the entry at step K+1: the step itself, then
everything the loop does after it (agreeing, logging, evaluating, saving, the components).
Pick K to be a logging, evaluation and checkpoint step to see the longest path (the default:
all three cadences are set to K).

    python bench/step_files.py                          # the default run, step 10 logs, evaluates, saves
    python bench/step_files.py --step 7 --plain         # a step with no log, eval or save
    python bench/step_files.py --ds-config ds_configs/zero3_fp32.json

It prints the files in the order first reached, and their count; with --json, instead, one last
line {"step", "plain", "ds_config", "count", "files"} (what tests/test_step_files.py reads). It
exits 1 if the run never reached step K's entry. Nothing of zerotrain is imported here: it works
on any checkout (run it from that checkout's root).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path

# The progress bar's switch moved from train. to logging. in zerotrain 0.2; this script runs any checkout.
QUIET_BAR = ["--logging.progress" if Path("train/config/moved.py").exists() else "--train.progress", "false"]


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="examples/default.yaml")
    p.add_argument("--ds-config", default="ds_configs/zero2_fp32.json")
    p.add_argument("--step", type=int, default=10, help="the optimizer step followed (1-based)")
    p.add_argument("--plain", action="store_true", help="no log, eval or save at that step")
    p.add_argument("--entry", default="train_step", help="the function whose entries mark the steps")
    p.add_argument("--run-dir", help="the run's directory, kept (default: a temporary one, removed at the end)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line, last")
    return p.parse_args(argv)


def main(argv=None) -> int:
    a = parse(argv)
    repo = Path.cwd().resolve()
    roots = tuple(str(repo / d) + os.sep for d in ("train", "models"))
    every = 1000 if a.plain else a.step
    run_dir = a.run_dir or tempfile.mkdtemp(prefix="step-files-")
    sys.argv = ["train/main.py", "--config", a.config, "--ds-config", a.ds_config, "--train.run_dir", run_dir,
                "--train.max_steps", str(a.step + 2), "--logging.every_steps", str(every),
                "--train.eval_every", str(every), "--checkpoint.every_steps", str(every),
                "--checkpoint.export", "false", *QUIET_BAR, "--logging.wandb.mode", "disabled"]
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": os.environ.get("MASTER_PORT", "29611")})
    seen: dict[str, None] = {}
    entries = [0]

    def profile(frame, event, arg):
        if event != "call":
            return
        path = frame.f_code.co_filename
        if not path.startswith(roots):
            return
        if frame.f_code.co_name == a.entry and path.endswith(os.sep + "trainer.py"):
            entries[0] += 1
        if entries[0] == a.step:
            seen.setdefault(str(Path(path).relative_to(repo)), None)

    sys.path.insert(0, str(repo))
    import runpy
    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        code = runpy.run_path(str(repo / "train" / "main.py"), run_name="step_files")["main"]()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    if not a.run_dir:
        shutil.rmtree(run_dir, ignore_errors=True)
    files = list(seen)
    if not files:
        print(f"step_files: the run never entered {a.entry}() of trainer.py for step {a.step} "
              f"(train.max_steps {a.step + 2}); pass --entry if the step's function was renamed", file=sys.stderr)
        code = code or 1
    elif a.json:
        print(json.dumps({"step": a.step, "plain": a.plain, "ds_config": a.ds_config, "count": len(files),
                          "files": files}))
    else:
        kind = "a step with no log, eval or save" if a.plain else "a step that logs, evaluates and saves"
        print(f"\n{len(files)} files of train/ and models/ run in step {a.step} ({kind}, {a.ds_config}):")
        for f in files:
            print(f"  {f}")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as train/main.py exits: no interpreter finalization of torch's process group


if __name__ == "__main__":
    sys.exit(main())
