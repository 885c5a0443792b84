"""Strict loading of the run configuration: a JSON/YAML run file plus dotted command-line
overrides, checked key by key against the schema's type hints.

Unknown keys, wrong types and impossible values fail with a ConfigError naming the key. The
data: and model: sections are unions tagged by a key (data.kind, model.name): the tag picks the
variant, whose keys alone are valid there (a key of another kind is an unknown key naming the
kind). Keys that moved to another section are refused with their new name (moved.py).
"""

from __future__ import annotations

import dataclasses
import json
import keyword
import types
import typing
from pathlib import Path
from typing import Any

from zerotrain.train.config.moved import MOVED, find_moved, moved_message
from zerotrain.train.config.schema import RunConfig
from zerotrain.train.errors import ConfigError, did_you_mean


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def field_name(key: str) -> str:
    """The dataclass field of a run-file key: a key that is a Python keyword (checkpoint.async)
    is the field with a trailing underscore (CheckpointConfig.async_)."""
    return key + "_" if keyword.iskeyword(key) else key


def key_name(name: str) -> str:
    """The run-file key of a dataclass field (field_name's inverse)."""
    return name[:-1] if name.endswith("_") and keyword.iskeyword(name[:-1]) else name


def _unwrap_optional(tp):
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def _section(tp):
    """(the dataclass, optional?) when `tp` is a section (`Optional[Section]`: null = off, e.g.
    model.lora), or a tagged union's base class (data:, model:), else (None, False)."""
    base, optional = _unwrap_optional(tp)
    return (base, optional) if dataclasses.is_dataclass(base) or _is_tagged(base) else (None, False)


def _is_tagged(cls) -> bool:
    """A union of sections tagged by one key (DataSection, ModelSection): it has pick() and variants()."""
    return isinstance(cls, type) and hasattr(cls, "pick") and hasattr(cls, "variants")


def _not_a_key(variant, key: str, dotted: str) -> ConfigError:
    """The unknown-key error inside a tagged section: which variant it is, the keys it has, and
    which variants have the key, if any."""
    names = [f.name for f in dataclasses.fields(variant)]
    others = [v.tag_text() for v in variant.variants().values()
              if v is not variant and key in {f.name for f in dataclasses.fields(v)}]
    if len(others) > 1:  # "data.kind text, tokens and sft have it"
        others = [", ".join([others[0]] + [o.rsplit(" ", 1)[1] for o in others[1:-1]]) + " and "
                  + others[-1].rsplit(" ", 1)[1]]
    elsewhere = f"; {others[0]} {'have' if ' and ' in others[0] else 'has'} it" if others else ""
    return ConfigError(f"{dotted} is not a key of {variant.tag_text()} (its keys: {', '.join(names)})"
                       f"{did_you_mean(key, names)}{elsewhere}")


def _type_name(tp) -> str:
    """'an integer', 'a number or null', ... for error messages."""
    tp, opt = _unwrap_optional(tp)
    names = {int: "an integer", float: "a number", bool: "a boolean (true/false)", str: "a string"}
    name = names.get(tp, getattr(tp, "__name__", str(tp)))
    if typing.get_origin(tp) is tuple:
        name = f"a list of {len(typing.get_args(tp))} numbers"
    elif tp is dict or typing.get_origin(tp) is dict:
        name = "a mapping"
    elif typing.get_origin(tp) is list:
        item = typing.get_args(tp)[0]
        name = "a list of mappings" if dataclasses.is_dataclass(item) else "a list of strings"
    return f"{name} or null" if opt else name


class _Refused(Exception):
    """A value its field's type does not take: _coerce turns it into the ConfigError naming the key."""


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise _Refused from None


def _to_bool(value, from_cli: bool) -> bool:
    if isinstance(value, bool):
        return value
    if from_cli and isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
        return value.lower() in ("true", "1", "yes")
    raise _Refused


def _to_int(value, from_cli: bool) -> int:
    if isinstance(value, bool):
        raise _Refused
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer() and not from_cli:
        return int(value)
    if from_cli and isinstance(value, str) and _number(value).is_integer():
        return int(float(value))
    raise _Refused


def _to_float(value, from_cli: bool) -> float:
    if isinstance(value, bool):
        raise _Refused
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):  # YAML 1.1 reads "3e-4" as a string; accept it as a number
        return _number(value)
    raise _Refused


def _to_str(value, from_cli: bool) -> str:
    if isinstance(value, str):
        return value
    raise _Refused


_SCALARS = {bool: _to_bool, int: _to_int, float: _to_float, str: _to_str}


def _coerce(value, tp, key: str, from_cli: bool):
    """Check (file) or convert (CLI string) `value` to type `tp`; ConfigError names `key`."""
    base, optional = _unwrap_optional(tp)
    # On the command line "none"/"null" is null only where null is allowed: a string key keeps
    # the word ("--checkpoint.resume none" is the string checkpoint.resume documents).
    spelled_null = from_cli and isinstance(value, str) and value.lower() in ("null", "none")
    if value is None or (spelled_null and (optional or base is not str)):
        if optional:
            return None
        raise ConfigError(f"{key} must be {_type_name(tp)}, not null")
    try:
        if base in _SCALARS:
            return _SCALARS[base](value, from_cli)
        if base is dict or typing.get_origin(base) is dict:
            return _mapping(value, key, from_cli)
        return _sequence(value, base, key, from_cli)
    except _Refused:
        raise ConfigError(f"{key} must be {_type_name(tp)} (got {value!r})") from None


def _mapping(value, key: str, from_cli: bool) -> dict:
    """A free-form mapping with string keys (model.kwargs: the values are the user's, passed on
    as they are); on the command line a JSON or flow-style YAML mapping, e.g. '{d_model: 64}'."""
    if from_cli and isinstance(value, str):
        import yaml
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            raise _Refused from None
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise _Refused
    try:
        json.dumps(value)  # recorded in config.json and the export's config.json
    except (TypeError, ValueError):
        raise ConfigError(f"{key} must hold plain values (numbers, strings, booleans, lists, mappings); "
                          f"got {value!r}") from None
    return dict(value)


def _sequence(value, tp, key: str, from_cli: bool):
    """A list or tuple field, item by item; on the command line a JSON list or comma-separated items."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin not in (tuple, list):
        raise _Refused  # pragma: no cover - every field type is handled
    if dataclasses.is_dataclass(args[0]):  # a list of sections (data.sources): each built strictly
        return _section_list(value, args[0], key, from_cli)
    if from_cli and isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            value = [v for v in value.split(",") if v]
    if not isinstance(value, (list, tuple)) or (origin is tuple and len(value) != len(args)):
        raise _Refused
    if origin is tuple:
        return tuple(_coerce(v, a, key, from_cli) for v, a in zip(value, args))
    return [_coerce(v, args[0], key, from_cli) for v in value]


def _section_list(value, cls, key: str, from_cli: bool) -> list:
    """A list of sections (data.sources); on the command line a flow-style YAML or JSON list,
    e.g. --data.sources '[{path: a.bin, weight: 0.7}, {path: b.bin, weight: 0.3}]'."""
    if from_cli and isinstance(value, str):
        import yaml
        try:
            value = yaml.safe_load(value)
        except yaml.YAMLError:
            value = None
    if not isinstance(value, (list, tuple)):
        first = dataclasses.fields(cls)[0].name
        raise ConfigError(f"{key} must be a list of mappings, e.g. [{{{first}: ...}}, ...] (got {value!r})")
    # (A command-line value was built when it was set; the run file's is built here.)
    return [v if isinstance(v, cls) else _build(cls, v, f"{key}[{i}].") for i, v in enumerate(value)]


def _build(cls, data: dict, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'the run file'} must be a mapping (got {type(data).__name__})")
    tagged = _is_tagged(cls)
    if tagged:
        cls = cls.pick(data)
    hints = _hints(cls)
    names = [key_name(f.name) for f in dataclasses.fields(cls)]
    kwargs = {}
    for k, v in data.items():
        if k not in names and tagged:
            raise _not_a_key(cls, k, f"{prefix}{k}")
        if k not in names:
            raise ConfigError(f'unknown key "{prefix}{k}"{did_you_mean(k, names)}; '
                              f'valid keys here: {", ".join(names)}')
        tp = hints[field_name(k)]
        section, optional = _section(tp)
        if section is not None:
            kwargs[k] = None if v is None and optional else _build(section, v, f"{prefix}{k}.")
        else:
            kwargs[k] = _coerce(v, tp, prefix + k, from_cli=False)
    kwargs = {field_name(k): v for k, v in kwargs.items()}
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [k for k in required if k not in kwargs]
    if missing:  # only list items (data.sources) have required keys
        raise ConfigError(f"{prefix}{missing[0]} is missing; each entry needs {' and '.join(required)}")
    return cls(**kwargs)


def _set_dotted(raw: dict, dotted: str, text: str):
    """Apply one CLI override to the raw dict, checking the key against the schema."""
    if dotted in MOVED:
        raise ConfigError(moved_message(f"--{dotted}", "on the command line"))
    parts = dotted.split(".")
    cls, node = RunConfig, raw
    for i, part in enumerate(parts):
        if _is_tagged(cls):  # the variant of the tag the run file and the tag overrides set
            cls = cls.pick(node)
            if part not in {f.name for f in dataclasses.fields(cls)}:
                raise _not_a_key(cls, part, f"--{dotted}")
        names = [key_name(f.name) for f in dataclasses.fields(cls)]
        here = ".".join(parts[:i])
        if part not in names:
            raise ConfigError(f'unknown option "--{dotted}"{did_you_mean(part, names)}; '
                              f'valid keys under {here or "the top level"}: {", ".join(names)}')
        tp = _hints(cls)[field_name(part)]
        section, optional = _section(tp)
        if i == len(parts) - 1:
            if section is not None:
                if optional and text.lower() in ("null", "none"):  # an optional section switched off
                    node[part] = None
                    return
                first = section.TAG if _is_tagged(section) else dataclasses.fields(section)[0].name
                raise ConfigError(f'"--{dotted}" is a section; set one of its keys, e.g. --{dotted}.{first}'
                                  + (f" (or --{dotted} null to turn it off)" if optional else ""))
            node[part] = _coerce(text, tp, dotted, from_cli=True)
            return
        if section is None:
            raise ConfigError(f'"--{dotted}": {".".join(parts[:i + 1])} is not a section')
        if node.get(part) is None:  # absent, or switched off (null) in the run file: a key turns it on
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise ConfigError(f"{'.'.join(parts[:i + 1])} in the run file must be a mapping")
        cls = section


def read_mapping(path: str | Path) -> dict:
    """Parse a JSON or YAML file into a dict; syntax errors name the file, line and column."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: file not found")
    text = path.read_text()
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
    else:
        import yaml
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
            raise ConfigError(f"{where}: invalid YAML: {getattr(e, 'problem', None) or e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model, data, optim, ...)")
    return data


def load_config(path: str | None = None, overrides: list[tuple[str, str]] = ()) -> RunConfig:
    """Run file (optional) + dotted overrides -> validated RunConfig. The overrides of a tag
    (data.kind, model.name) apply first, so that the other overrides are checked against the
    variant the run will have: `--data.path x.bin --data.kind tokens` is `--data.kind tokens
    --data.path x.bin` (among tags and among the rest, the later one wins)."""
    raw = read_mapping(path) if path else {}
    old = find_moved(raw)
    if old:
        raise ConfigError(moved_message(old, f"in {path}"))
    tags = [(k, v) for k, v in overrides if _is_tag(k)]
    for key, value in tags + [(k, v) for k, v in overrides if not _is_tag(k)]:
        _set_dotted(raw, key, value)
    try:
        return _build(RunConfig, raw, "")
    except ConfigError as e:
        if path:
            raise ConfigError(f"{path}: {e}") from None
        raise


def _is_tag(dotted: str) -> bool:
    """data.kind, model.name: the key of a tagged section, which picks its variant."""
    section, _, key = dotted.partition(".")
    f = {f.name: f for f in dataclasses.fields(RunConfig)}.get(section)
    base = _section(_hints(RunConfig)[section])[0] if f is not None else None
    return base is not None and _is_tagged(base) and key == base.TAG
