"""What the training loop's own bookkeeping costs per step, against the step itself.

Runs train/main.py in this process (1 process, the default model under ZeRO-2 fp32) under
cProfile, with logging, evaluation and checkpoints pushed past the run's end so that every step
but the last is a plain one, and prints, per function of the loop (the step, the agreement, each
component's on_step / before_step, the data position's advance), its calls and time per call.
cProfile slows Python calls, so the figures are upper bounds and only their ratio means much.

    python bench/loop_cost.py                 # 60 steps
    python bench/loop_cost.py --steps 100

Nothing of zerotrain is imported here: it works on any checkout (run it from its root).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import runpy
import sys
import tempfile

# The progress bar's switch moved from train. to logging. in zerotrain 0.2; this script runs any checkout.
QUIET_BAR = ["--logging.progress" if os.path.exists("train/config/moved.py") else "--train.progress", "false"]

LOOP = ("fit", "train_step", "_agree", "agree", "on_step", "before_step", "advance")  # _agree: before LoopControl


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--ds-config", default="ds_configs/zero2_fp32.json")
    a = p.parse_args(argv)
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": os.environ.get("MASTER_PORT", "29733")})
    sys.argv = ["train/main.py", "--config", "examples/default.yaml", "--ds-config", a.ds_config,
                "--train.run_dir", tempfile.mkdtemp(prefix="loop-cost-"), "--train.max_steps", str(a.steps),
                "--logging.every_steps", str(10 * a.steps), "--train.eval_every", "0",
                "--checkpoint.every_steps", "0", "--checkpoint.save_at_end", "false", "--checkpoint.export", "false",
                *QUIET_BAR, "--logging.wandb.mode", "disabled"]
    sys.path.insert(0, os.getcwd())
    run = runpy.run_path("train/main.py", run_name="loop_cost")["main"]
    prof = cProfile.Profile()
    prof.enable()
    code = run()
    prof.disable()
    rows = []
    for (path, line, fn), (_, calls, _, cum, _) in pstats.Stats(prof).stats.items():
        if fn in LOOP and f"{os.sep}train{os.sep}" in path:
            rows.append((cum / calls, calls, f"{path.split(os.sep + 'train' + os.sep)[-1]}:{line} {fn}"))
    print(f"\nper call, under cProfile ({a.steps} steps; the last one logs and evaluates):")
    for per, calls, where in sorted(rows, reverse=True):
        print(f"  {where:48s} {calls:5d} calls  {per * 1e6:12.1f} us")
    sys.stdout.flush()
    os._exit(code)  # as train/main.py exits: no interpreter finalization of torch's process group


if __name__ == "__main__":
    sys.exit(main())
