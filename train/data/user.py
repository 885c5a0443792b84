"""Your own dataset: `data.kind: py` with `data.factory: "module:function"` (docs/workloads.md,
Your own dataset).

The module is imported by its dotted name (the import path as Python has it; zerotrain adds
nothing to it) and the function is called with data.kwargs. It returns

  * a map-style Dataset: __len__ and __getitem__(i) -> a dict of tensors (torch's
    `torch.utils.data.Dataset`, a Hugging Face `datasets.Dataset` with a torch format, any
    object with both methods; not an IterableDataset: the sampler needs indices), or
  * a mapping {"train": Dataset, "val": Dataset or None, "collate_fn": callable or None}:
    the validation split, and the function that turns a list of samples into a batch (a dict;
    torch's default_collate otherwise).

The samples go through the global-batch sampler of every data kind (train/data/sampler.py): the
same global batches for any world size and accumulation, and exact resume. A batch is given to
the model as the data's: a py: model with model.loss "model" gets forward(**batch). Samples
whose keys are input_ids and labels are language-model data (model.loss lm works; the tokens per
sample are input_ids' length), pixel_values and labels are images (classification); other keys
need model.loss "model".

Checked at start-up, before the model is built, each in one line naming data.factory (exit 2): a
module that does not import, a missing function, kwargs the function does not take, a function
that raises, a return value that is no map-style Dataset (or mapping of them), an empty training
set, and a first sample (collated as a batch of one) that is not a dict of tensors.
"""

from __future__ import annotations

import importlib
import inspect
import json
from typing import Callable, Optional

from zerotrain.train.config import PyData
from zerotrain.train.data.bundle import DataBundle
from zerotrain.train.errors import DataError

FIX = "make it importable: put its directory on PYTHONPATH, install its package, or run from the directory that holds it"
RETURNS = ('a map-style Dataset (__len__ and __getitem__), or {"train": Dataset, "val": Dataset or None, '
           '"collate_fn": callable or None}')


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


def factory(name: str) -> Callable:
    """The function data.factory names, imported (DataError if it cannot be)."""
    module_name, _, fn = name.rpartition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and module_name.startswith(e.name) and module_name[len(e.name):][:1] in ("", "."):
            raise DataError(f'data.factory "{name}": no module named "{module_name}" on the Python path; {FIX}') from None
        raise DataError(f'data.factory "{name}": importing {module_name} failed ({_first_line(e)}); install what it '
                        f'imports') from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing
        raise DataError(f'data.factory "{name}": importing {module_name} failed ({_first_line(e)}); fix the '
                        f'module') from None
    f = getattr(module, fn, None)
    if not callable(f):
        what = "has no function" if f is None else f"has a {type(f).__name__}, not a function,"
        raise DataError(f'data.factory "{name}": module {module_name} ({getattr(module, "__file__", "?")}) {what} '
                        f'"{fn}"; name the function that returns the Dataset')
    return f


def _map_style(value, name: str, what: str):
    from torch.utils.data import IterableDataset
    if value is None:
        return None
    if isinstance(value, IterableDataset) or not (hasattr(value, "__len__") and hasattr(value, "__getitem__")):
        t = type(value).__name__
        kind = "an IterableDataset" if isinstance(value, IterableDataset) else f"{'an' if t[0] in 'aeiouAEIOU' else 'a'} {t}"
        raise DataError(f'data.factory "{name}" returned {kind} as {what}, not a map-style Dataset; return '
                        f'{RETURNS} (the sampler needs indices for the same order on any world size and resume)')
    return value


def call(cfg: PyData):
    """(train, val or None, collate_fn or None) from the factory."""
    name = cfg.factory
    f = factory(name)
    try:
        inspect.signature(f).bind(**cfg.kwargs)
    except TypeError as e:
        raise DataError(f'data.kwargs {json.dumps(cfg.kwargs)}: the function of data.factory "{name}" does not take '
                        f"them ({e}); give its keyword arguments") from None
    except ValueError:  # no signature to check: the call says
        pass
    try:
        out = f(**cfg.kwargs)
    except Exception as e:  # noqa: BLE001 - the user's factory failed: one line naming it
        raise DataError(f'data.factory "{name}" raised {_first_line(e)}; fix the factory (run it alone to see the '
                        f'traceback, or add --debug)') from None
    if isinstance(out, dict):
        unknown = set(out) - {"train", "val", "collate_fn"}
        if "train" not in out or unknown:
            raise DataError(f'data.factory "{name}" returned a mapping with the keys {", ".join(map(str, out))}; '
                            f'return {RETURNS}')
        collate = out.get("collate_fn")
        if collate is not None and not callable(collate):
            raise DataError(f'data.factory "{name}": its "collate_fn" is a {type(collate).__name__}, not a function')
        return _map_style(out["train"], name, "train"), _map_style(out.get("val"), name, "val"), collate
    return _map_style(out, name, "the dataset"), None, None


def _first_batch(ds, collate, name: str, what: str) -> dict:
    import torch
    from torch.utils.data import default_collate
    try:
        batch = (collate or default_collate)([ds[0]])
    except Exception as e:  # noqa: BLE001
        raise DataError(f'data.factory "{name}": its {what} sample 0 cannot be read and collated ({_first_line(e)}); '
                        f"fix __getitem__ or the collate_fn") from None
    if not isinstance(batch, dict) or not batch or not all(isinstance(v, torch.Tensor) for v in batch.values()):
        got = type(batch).__name__ if not isinstance(batch, dict) else \
            ", ".join(f"{k}: {type(v).__name__}" for k, v in batch.items()) or "an empty dict"
        raise DataError(f'data.factory "{name}": a batch of its {what} samples is {got}, not a dict of tensors; '
                        f"return dict samples (or a collate_fn that makes a dict of tensors), as forward(**batch) "
                        f"takes them")
    return batch


def build_user_data(cfg: PyData) -> DataBundle:
    name = cfg.factory
    train, val, collate = call(cfg)
    if len(train) == 0:
        raise DataError(f'data.factory "{name}" returned an empty training set; it needs samples')
    batch = _first_batch(train, collate, name, "training")
    if val is not None and len(val) > 0:
        _first_batch(val, collate, name, "validation")
    keys = set(batch)
    if {"input_ids", "labels"} <= keys:
        task, per_sample, seq_len = "lm", int(batch["input_ids"].shape[-1]), int(batch["input_ids"].shape[-1])
    elif {"pixel_values", "labels"} <= keys:
        task, per_sample, seq_len = "classify", 1, None
    else:
        task, per_sample, seq_len = "custom", 1, None
    val_text = f"val: {len(val)} samples" if val is not None and len(val) else "no validation"
    return DataBundle(train=train, val=val if val is not None and len(val) else None, task=task,
                      items_per_sample=per_sample, seq_len=seq_len,
                      describe=f"py dataset {name} ({type(train).__name__}, {len(train)} samples, batch keys "
                               f"{', '.join(sorted(keys))}{', collate_fn ' + getattr(collate, '__name__', '?') if collate else ''}; "
                               f"{val_text})",
                      extra={"collate": collate, "factory": name})
