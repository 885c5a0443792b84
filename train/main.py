"""zerotrain's one training program. Same file under every launcher:

    python train/main.py --config run.yaml                      # 1 process
    torchrun --nproc_per_node 2 train/main.py --config run.yaml
    deepspeed --num_gpus 2 train/main.py --ds-config ds_configs/zero3.json
    deepspeed --hostfile hostfile train/main.py ...
    accelerate launch --config_file ds_configs/accelerate/zero2.yaml train/main.py ...

parse config -> build -> fit -> close. `--help` lists every option.
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file imports zerotrain from the installed package (`pip install -e .`
# maps zerotrain.train to this checkout's train/), never by adding the checkout to the import path:
# the user's own `models` or `train` packages stay theirs.
try:
    from zerotrain.train.launch import device_env, library_warnings
except ModuleNotFoundError as e:  # run with a Python that lacks zerotrain
    if e.name not in ("zerotrain", "zerotrain.train"):
        raise
    sys.exit("train/main.py: zerotrain is not installed in this Python (" + sys.executable + "); run "
             "`pip install -e .` in the checkout (or `make install`) and launch again")

device_env.apply()  # before torch is imported: ZEROTRAIN_DEVICE=cpu
library_warnings.quiet()  # before DeepSpeed's first collective: torch's deprecations of the calls it makes

from zerotrain.train.args import parse_train_args  # noqa: E402
from zerotrain.train.errors import collective_failure, user_errors  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    with user_errors():  # a bad flag: one line and exit 2 like any other user error (--debug not yet known)
        args = parse_train_args(sys.argv[1:] if argv is None else argv)
    with user_errors(args.debug):
        from zerotrain.train.training.build import build
        from zerotrain.train.config import load_config
        cfg = load_config(args.config, args.overrides)
        trainer = build(cfg, args.ds_config)
        try:
            trainer.start()
            trainer.finish(trainer.fit())
        except Exception as e:
            if not args.debug:  # debug.collectives: this rank's line now, before close() (a peer may exit first)
                collective_failure(e)
            raise
        finally:
            trainer.close()
        if trainer.stop is not None and trainer.stop.failure is not None:  # e.g. TrainingDiverged: its exit code
            raise trainer.stop.failure(trainer.stop.message)
    return 0


def run_as_script(argv: list[str] | None = None) -> None:
    """Exit without interpreter finalization. At finalization torch's C++ objects (the gloo
    process group behind DDP / DeepSpeed, its worker threads) are torn down in no safe order:
    measured ~1 launch in 6 here ended in SIGABRT ("terminate called without an active
    exception") *after* a complete, successful run, turning exit 0 (or 2, 3) into -6. Every
    file zerotrain writes is closed and synced before main() returns; atexit handlers still run."""
    import traceback
    try:
        code = main(argv)
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - a bug or Ctrl-C outside the loop: show it, exit 1
        traceback.print_exc()
        code = 1
    import atexit
    atexit._run_exitfuncs()  # what a normal exit runs first (wrappers such as bench/rank_peak.py rely on it)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run_as_script()
