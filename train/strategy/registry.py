"""The backends, one entry each: every backend module of this package registers itself at import
(`register(Backend(...))` at its end: ddp.py, zero.py), and everything that lists or picks a
backend asks here instead of naming one:

  - `train.strategy.for_setup` makes the Strategy of the block a run's strategy JSON holds
    (`for_json`);
  - the planner's options (`planner_options`: train/plan/estimate.py OPTIONS, the candidates of
    --ds-config auto and memory_check's advice, zerotrain check) and `zerotrain verify --matrix`
    (its rows: one per option file) are the registered options, fastest first;
  - the planner's cost of an option (train/strategy/cost.py `terms`) is its backend's `cost`.

This module imports nothing of the project: the config layer (ds_config.py) reads it too, and
the entries exist whenever any module of the package does (train/strategy/__init__.py imports
every backend module).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional


@dataclass(frozen=True)
class PlannerOption:
    """One option the planner prices: a shipped strategy file (ds_configs/NAME) and its label.
    `order` sorts every backend's options fastest first: the communication DDP has, then more
    communication, then PCIe traffic (offload)."""

    order: int
    label: str
    file: str
    #: a candidate of --ds-config auto and of the plan's recommendation (and so of memory_check's
    #: advice); False: priced when a run names the file, and a `zerotrain verify --matrix` row
    auto: bool = True

    @property
    def name(self) -> str:
        """The file's name without ".json": a `zerotrain verify --matrix` row's strategy."""
        return self.file.removesuffix(".json")


class Settings:
    """The base of each backend's settings record: a frozen dataclass in the backend's module
    (DDPSettings in ddp.py, ZeroSettings in zero.py, FSDP2Settings in fsdp2.py) holding what that
    backend alone reads from a strategy file. Its parsers make it (the entry's `setup` for a run,
    `option` and `default_option` for the planner); the records every backend shares carry it
    (ds_config.py DSSetup.settings, option.py Option.settings), so only the backend's own module
    (its Strategy, its cost, its `describe`) reads its fields. What is asked of every backend's
    settings is here, with the answer of a backend that has nothing to say."""

    @property
    def zero_stage(self) -> Optional[int]:
        """The ZeRO stage, what a plan's JSON reports as "stage" (option.py Option.stage); None: a
        backend without stages."""
        return None


@dataclass(frozen=True)
class Backend:
    """What zerotrain knows of one backend.

    name       what a checkpoint and config.json record ("ddp", "deepspeed"), DSSetup.backend
    block      the key of the strategy JSON block it owns ("ddp", "zero_optimization"); a JSON
               without any registered block belongs to the entry with `default` True
    strategy   the Strategy subclass (base.py) a run uses
    setup      (path, json, precision, hidden_size, sizes_later) -> DSSetup: parses its block
               (ds_config.py load_ds_setup, after the keys every file shares) into its
               `Settings` record, which the DSSetup carries
    option     (label, path, precision, json, width) -> Option: the file reduced to what the
               planner prices (option.py Option.from_json), its Settings record read the same way
    default_option (label, file, precision) -> Option: a shipped file's option without the file
    describe   (DSSetup) -> the phrase banners and errors name the resolved file by, e.g. "DDP (fp32)"
    options    the shipped files the planner offers (PlannerOption)
    cost       (cost._Rank, batch, rank) -> (terms, caveats): the bytes a rank holds (cost.py)
    startup    bytes a CPU rank grows by while its Accelerator starts (cost.py startup)
    splits_sequences  can a run use sequence parallelism (the refusal a plan and the verify
               matrix apply before a run would: Strategy.check_sequence_parallel)
    """

    name: str
    block: str
    strategy: type
    setup: Callable
    option: Callable
    default_option: Callable
    describe: Callable
    options: tuple = ()
    cost: Optional[Callable] = None
    startup: int = 0
    splits_sequences: bool = True
    default: bool = False


_BACKENDS: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Adds a backend; its name and its block are its own."""
    for other in _BACKENDS.values():
        if other.name != backend.name and (other.block == backend.block or (other.default and backend.default)):
            raise ValueError(f"backend {backend.name!r} claims what {other.name!r} registered")
    _BACKENDS[backend.name] = backend
    return backend


def backends() -> list[Backend]:
    return list(_BACKENDS.values())


def get(name: str) -> Backend:
    """The backend a DSSetup, an Option or a checkpoint names."""
    return _BACKENDS[name]


def for_json(ds: dict, path=None) -> Backend:
    """The backend whose block the strategy JSON `ds` (read from `path`) holds: the default one
    when none. A file with the blocks of two backends is refused (errors.ConfigError) where the
    pair of blocks DDP's parser names itself (DDP's and DeepSpeed's: "ddp" and "zero_optimization")."""
    owners = [b for b in _BACKENDS.values() if b.block in ds]
    if len(owners) > 1 and {owners[0].name, owners[1].name} != {"ddp", "deepspeed"}:
        from zerotrain.train.errors import ConfigError
        raise ConfigError(f'{path or "the strategy file"}: "{owners[0].block}" ({owners[0].name}) and '
                          f'"{owners[1].block}" ({owners[1].name}) in one file: a file selects one backend; '
                          f"remove one of the blocks")
    if owners:
        return owners[0]
    return next(b for b in _BACKENDS.values() if b.default)


def planner_options(every: bool = False) -> list[PlannerOption]:
    """The registered backends' options, fastest first: the candidates of --ds-config auto and of
    the plan's recommendation, or with `every` all of them (the rows of `zerotrain verify --matrix`)."""
    return sorted((o for b in _BACKENDS.values() for o in b.options if every or o.auto), key=lambda o: o.order)


def for_option_file(fname: str) -> Backend:
    """The backend that ships the option file `fname` (e.g. "zero2_offload.json")."""
    return next(b for b in _BACKENDS.values() if any(o.file == fname for o in b.options))
