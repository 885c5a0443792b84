"""The training program's flags: --config, --ds-config, --resume, --debug and dotted overrides
(train/main.py, `zerotrain train`, bench/minimal_loop.py); `--help` lists every option with its
attribute docstring."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
from dataclasses import dataclass, field

from train.config import RunConfig
from train.errors import ConfigError

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
