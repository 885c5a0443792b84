"""The training program's flags: --config, --strategy (alias --ds-config), --resume, --debug and dotted overrides
(train/main.py, `zerotrain train`); `--help` lists every option with its
attribute docstring."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing
from dataclasses import dataclass, field

from zerotrain.train.cli_args import ArgumentParser, Value
from zerotrain.train.config import RunConfig
from zerotrain.train.errors import ConfigError

TRAIN_USAGE = """usage: train/main.py [--config RUN.yaml|json] [--strategy FILE.json] [--resume auto|none|PATH]
                     [--debug] [--<section>.<key> VALUE ...]

Train with the run file's settings, overridden by dotted options, e.g.
  --optim.lr 3e-4 --train.micro_batch_size 16 --model.name gpt2-124m --train.run_dir runs/x
data: has the keys of its data.kind, model: those of the family its model.name names (one
group each below); --data.kind and --model.name apply before the other options.
The strategy file (ds_configs/*.json: the backend, DDP, DeepSpeed ZeRO 0-3 with offload or
FSDP2, and the precision) comes from --strategy (--ds-config is the same flag), the run file's
distributed.ds_config, the accelerate YAML, or ds_configs/zero2.json.
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


def _optional_section(tp):
    """The dataclass of an `Optional[Section]` field (a section that is off when null), else None."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if len(args) == 1 and dataclasses.is_dataclass(args[0]) else None


def _tagged(tp):
    """The base class of a union of sections tagged by one key (data:, model:), else None."""
    return tp if isinstance(tp, type) and hasattr(tp, "pick") and hasattr(tp, "variants") else None


def options_help() -> str:
    lines = []

    def walk(cls, prefix):
        docs = _field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            doc = docs.get(f.name, "")
            tagged = _tagged(hints[f.name])
            if tagged is not None:  # one group per variant, each with only its keys
                for variant in tagged.variants().values():
                    lines.append(f"\n {prefix}{f.name} ({variant.tag_text()}): {_class_doc(variant)}")
                    walk(variant, f"{prefix}{f.name}.")
                continue
            if dataclasses.is_dataclass(default):
                walk(type(default), f"{prefix}{f.name}.")
                continue
            section = _optional_section(hints[f.name])
            if section is not None:  # off by default (model.lora): its line, then its keys
                lines.append(f"  --{prefix}{f.name} ({default!r})" + (f"\n      {doc}" if doc else ""))
                walk(section, f"{prefix}{f.name}.")
                continue
            shown = "required" if default is dataclasses.MISSING else repr(default)  # a list entry's own keys
            lines.append(f"  --{prefix}{f.name} ({shown})" + (f"\n      {doc}" if doc else ""))

    walk(RunConfig, "")
    return "\n".join(lines)


def _class_doc(cls) -> str:
    return " ".join((cls.__doc__ or "").split())


# Shorthands for a dotted key. Parsed with the dotted overrides, not as argparse flags, so that
# `--resume auto --checkpoint.resume none` keeps its order (the later one wins): argparse hands
# back the flags it does not know in order, but apart from the ones it does.
SHORTHANDS = {"--resume": "checkpoint.resume", "--peak-flops": "logging.peak_flops"}


def _parser() -> ArgumentParser:
    p = ArgumentParser("train/main.py", lambda: TRAIN_USAGE + options_help())
    p.add_argument("--config", "-c", action=Value)
    p.add_argument("--strategy", "--ds-config", dest="ds_config", action=Value)
    p.add_argument("--debug", action="store_true")
    # The deepspeed launcher's; LOCAL_RANK is in the environment too.
    p.add_argument("--local_rank", "--local-rank", action=Value)
    return p


def parse_train_args(argv: list[str]) -> TrainArgs:
    known, rest = _parser().parse_known_args(argv)
    return TrainArgs(known.config, known.ds_config, known.debug, parse_overrides(rest))


def parse_overrides(rest: list[str]) -> list[tuple[str, str]]:
    """`--section.key VALUE` / `--section.key=VALUE` and the shorthands, in order, as (key, value)
    for train.config.load_config, which judges the keys and values."""
    out, i = [], 0
    while i < len(rest):
        flag, eq, value = rest[i].partition("=")
        key = SHORTHANDS.get(flag) or (flag[2:] if flag.startswith("--") and "." in flag else None)
        if key is None:
            raise ConfigError(f"unknown argument {rest[i]!r}; options are --config, --strategy (--ds-config), --resume, --debug "
                              f"and dotted keys like --optim.lr 3e-4 (see --help)")
        if not eq:
            # The next argument is the value unless it is another flag; a negative number is a value.
            if i + 1 >= len(rest) or (rest[i + 1].startswith("--") and not _is_number(rest[i + 1])):
                raise ConfigError(f"{flag} needs a value")
            i += 1
            value = rest[i]
        out.append((key, value))
        i += 1
    return out


def _is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False
