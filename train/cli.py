"""Command line: `zerotrain <command>` and the training flags shared with train/main.py."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import os
import sys
from dataclasses import dataclass, field

from train.errors import ConfigError, UserError

TRAIN_USAGE = """usage: train/main.py [--config RUN.yaml|json] [--ds-config DS.json] [--resume auto|none|PATH]
                     [--debug] [--<section>.<key> VALUE ...]

Train with the run file's settings, overridden by dotted options, e.g.
  --optim.lr 3e-4 --train.micro_batch_size 16 --model.name gpt2-124m --train.run_dir runs/x
The DeepSpeed JSON (ZeRO stage, offload, precision) comes from --ds-config, the run
file's distributed.ds_config, the accelerate YAML, or ds_configs/zero2.json.
--local_rank (appended by the deepspeed launcher) is accepted and ignored.

Options (default):
"""


@dataclass
class TrainArgs:
    config: str | None = None
    ds_config: str | None = None
    debug: bool = False
    overrides: list[tuple[str, str]] = field(default_factory=list)


def _field_docs(cls) -> dict[str, str]:
    """Attribute docstrings (the string literal after each field) from the source."""
    try:
        tree = ast.parse(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    docs, body = {}, tree.body[0].body
    for a, b in zip(body, body[1:]):
        if isinstance(a, ast.AnnAssign) and isinstance(b, ast.Expr) and isinstance(getattr(b, "value", None), ast.Constant):
            docs[a.target.id] = " ".join(str(b.value.value).split())
    return docs


def options_help() -> str:
    from train.config import RunConfig
    lines = []

    def walk(cls, prefix):
        docs = _field_docs(cls)
        for f in dataclasses.fields(cls):
            tp = cls.__annotations__.get(f.name)
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if dataclasses.is_dataclass(default):
                walk(type(default), f"{prefix}{f.name}.")
                continue
            doc = docs.get(f.name, "")
            lines.append(f"  --{prefix}{f.name} ({default!r})" + (f"\n      {doc}" if doc else ""))
            del tp

    walk(RunConfig, "")
    return "\n".join(lines)


def parse_train_args(argv: list[str]) -> TrainArgs:
    args = TrainArgs()
    i = 0

    def value(flag):
        nonlocal i
        if "=" in argv[i]:
            return argv[i].split("=", 1)[1]
        if i + 1 >= len(argv) or (argv[i + 1].startswith("--") and not _is_number(argv[i + 1])):
            raise ConfigError(f"{flag} needs a value")
        i += 1
        return argv[i]

    while i < len(argv):
        a = argv[i]
        name = a.split("=", 1)[0]
        if name in ("-h", "--help"):
            print(TRAIN_USAGE + options_help())
            sys.exit(0)
        elif name in ("--config", "-c"):
            args.config = value(name)
        elif name == "--ds-config":
            args.ds_config = value(name)
        elif name == "--resume":
            args.overrides.append(("checkpoint.resume", value(name)))
        elif name == "--peak-flops":
            args.overrides.append(("logging.peak_flops", value(name)))
        elif name == "--debug":
            args.debug = True
        elif name in ("--local_rank", "--local-rank"):
            value(name)  # the deepspeed launcher's; LOCAL_RANK is in the environment too
        elif name.startswith("--") and "." in name:
            args.overrides.append((name[2:], value(name)))
        else:
            raise ConfigError(f"unknown argument {a!r}; options are --config, --ds-config, --resume, --debug and "
                              f"dotted keys like --optim.lr 3e-4 (see --help)")
        i += 1
    return args


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


@contextlib.contextmanager
def user_errors(debug: bool = False):
    """A UserError becomes one line on stderr and exit code 2 (traceback only with --debug)."""
    try:
        yield
    except UserError as e:
        if debug:
            raise
        rank = os.environ.get("RANK")
        prefix = f"[rank {rank}] " if rank not in (None, "0") and os.environ.get("WORLD_SIZE", "1") != "1" else ""
        print(f"{prefix}zerotrain: error: {e}", file=sys.stderr, flush=True)
        sys.exit(e.exit_code)
    except Exception as e:
        # A collective failing because another node died: say which node (exit 1, not a usage error).
        lost = sys.modules["train.distributed"].explain_peer_failure(e) if "train.distributed" in sys.modules else None
        if lost is None or debug:
            raise
        print(f"[rank {os.environ.get('RANK', '?')}] zerotrain: error: {lost}", file=sys.stderr, flush=True)
        sys.exit(1)


COMMANDS = {
    "train": ("train.main", "main", "train a model (same as python train/main.py)"),
    "check": ("train.check", "main", "validate run file, DeepSpeed JSON, hostfile and accelerate YAML together"),
    "deepspeed-env": ("train.launch_env", "main", "write .deepspeed_env: the environment remote ranks need"),
    "plot": ("train.plot", "main", "loss / lr / throughput curves of run dirs (metrics.jsonl) to PNG"),
    "prepare": ("train.prepare", "main", "tokenize text files into a token file for data.kind = tokens"),
    "make-shapes": ("train.data.make_shapes", "main", "generate a small labelled shapes/colours ImageFolder set"),
    "export": ("train.export", "main", "checkpoint -> Hugging Face safetensors weights (offline, CPU, any world size)"),
    "plan": ("train.plan_cli", "main", "per-device memory of DDP / ZeRO-1/2/3 / offload for a model and cluster; "
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
        from train.main import run_as_script
        run_as_script(argv[1:])  # exits the process (see its docstring)
    import importlib
    module, func, _ = COMMANDS[argv[0]]
    return getattr(importlib.import_module(module), func)(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
