"""zerotrain's one training program. Same file under every launcher:

    python train/main.py --config run.yaml                      # 1 process
    torchrun --nproc_per_node 2 train/main.py --config run.yaml
    deepspeed --num_gpus 2 train/main.py --ds-config ds_configs/zero3.json
    deepspeed --hostfile hostfile train/main.py ...
    accelerate launch --config_file ds_configs/accelerate/zero2.yaml train/main.py ...

parse config -> build -> fit -> close. `--help` lists every option.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script: Python put train/ first on sys.path; import from the repo root instead.
    sys.path[0] = str(Path(__file__).resolve().parent.parent)

from train.cli import parse_train_args, user_errors  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = parse_train_args(sys.argv[1:] if argv is None else argv)
    with user_errors(args.debug):
        from train.build import build
        from train.config import load_config
        cfg = load_config(args.config, args.overrides)
        trainer = build(cfg, args.ds_config)
        try:
            trainer.start()
            trainer.finish(trainer.fit())
        finally:
            trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
