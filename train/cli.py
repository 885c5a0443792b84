"""`zerotrain <command>`: one entry point that dispatches to each command's module.

The training flags (shared by train/main.py and `zerotrain train`) are train/args.py; the
handling of user errors every command shares is train/errors.py.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "train": ("zerotrain.train.main", "main", "train a model (same as python train/main.py)"),
    "check": ("zerotrain.train.commands.check", "main", "validate run file, DeepSpeed JSON, hostfile and accelerate YAML together"),
    "deepspeed-env": ("zerotrain.train.commands.deepspeed_env", "main", "write .deepspeed_env: the environment remote ranks need"),
    "plot": ("zerotrain.train.commands.plot", "main", "loss / lr / throughput curves of run dirs (metrics.jsonl) to PNG"),
    "prepare": ("zerotrain.train.commands.prepare", "main", "tokenize text files (data.kind tokens) or, with --sft, JSONL records (data.kind sft) once"),
    "make-shapes": ("zerotrain.train.data.make_shapes", "main", "generate a small labelled shapes/colours ImageFolder set"),
    "export": ("zerotrain.train.commands.export", "main", "checkpoint -> Hugging Face safetensors weights (offline, CPU, any world size)"),
    "import": ("zerotrain.train.commands.import_ckpt", "main", "native DeepSpeed (ZeRO-0..3, any world size) or HF Trainer "
                                                 "checkpoint -> a zerotrain checkpoint (--trust-pickle)"),
    "verify": ("zerotrain.train.commands.verify", "main", "run a run file K steps in 1 fp32 process and under its strategy and "
                                       "world; compare loss, grad norm, parameter checksum per step"),
    "plan": ("zerotrain.train.commands.plan", "main", "per-device memory of DDP / ZeRO-1/2/3 / offload for a model and cluster; "
                                   "recommends the fastest that fits"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        width = max(map(len, COMMANDS))
        print("usage: zerotrain <command> [args]\n\ncommands:")
        for name, (_, _, doc) in COMMANDS.items():
            print(f"  {name:<{width}}  {doc}")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nzerotrain: error: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    if argv[0] == "train":
        from zerotrain.train.main import run_as_script
        run_as_script(argv[1:])  # exits the process (see its docstring)
    module, func, _ = COMMANDS[argv[0]]
    return getattr(importlib.import_module(module), func)(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
