"""Your own model: `model.name = "py:<module>:<factory>"` (docs/workloads.md, Your own model).

The module is imported by its dotted name (from the import path as Python has it: PYTHONPATH, an
installed package; zerotrain adds nothing to it) and the factory is called with
`model.kwargs` as keyword arguments. It must return an nn.Module. It is called:

* for the run, inside the strategy's construction context, exactly where the built-in models are
  built (deepspeed.zero.Init under ZeRO-3: every parameter it creates is partitioned at once);
* on the meta device, to size the model before it exists (the memory planner, the ZeRO-3 "auto"
  bucket sizes). A factory that cannot run there is called once more on the CPU: where it fails
  there too, the failure is the factory's own and the run stops in one line naming model.name and
  its exception (before the model is built); where it builds, its width is read from that module
  (then dropped) and the run trains unchecked by the memory check, with a note.

How it is trained, `model.loss`:

* "lm": forward(input_ids (B, T) int64) returns logits (B, T, V); zerotrain's LM loss
  (models/losses.py: chunked fp32 cross entropy, -100 labels ignored, the trainer's token-count
  normalisation for masked labels);
* "classification": forward(pixel_values (B, ...)) returns logits (B, C); cross entropy;
* "model": forward(**batch) returns the loss: a scalar tensor, or an object or mapping with a
  "loss" entry (a transformers ModelOutput). The batch's keys are the data's (input_ids and
  labels for language-model data, pixel_values and labels for images, x and y for regression).
  The loss is the forward's and not a separate method because the engine (DDP, DeepSpeed) runs
  its gradient synchronisation and ZeRO-3 parameter gathering around forward.

Sparse mixture-of-experts blocks (an nn.ModuleList of experts next to a router, models/moe.py)
are found in the module as in hf: models and made ZeRO-3 leaves, so ranks whose tokens reach
different experts still gather the same parameters.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import math
from typing import Callable, Optional

import torch
import torch.nn as nn

from zerotrain.models.errors import ConfigError
from zerotrain.models.partitioned import builds_empty
from zerotrain.models.spec import ModelSpec
from zerotrain.models.workload import Workload

PREFIX = "py:"
FIX = ("make it importable: put its directory on PYTHONPATH, install its package, or run from the "
       "directory that holds it")


def parse(name: str) -> tuple[str, str]:
    """("my_pkg.my_module", "build_model") from "py:my_pkg.my_module:build_model"."""
    body = name[len(PREFIX):]
    module, sep, fn = body.rpartition(":")
    if not sep or not module or not fn or not all(p.isidentifier() for p in module.split(".")) \
            or not fn.isidentifier():
        raise ConfigError(f'model.name "{name}" is not "py:<module>:<factory>"; write the dotted module name, a '
                          f'colon and the function that builds the model, e.g. "py:my_pkg.my_module:build_model"')
    return module, fn


def factory(name: str) -> Callable[..., nn.Module]:
    """The factory function named by model.name, imported (ConfigError if it cannot be)."""
    module_name, fn = parse(name)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and module_name.startswith(e.name) and module_name[len(e.name):][:1] in ("", "."):
            raise ConfigError(f'model.name "{name}": no module named "{module_name}" on the Python path; '
                              f'{FIX}') from None
        raise ConfigError(f'model.name "{name}": importing {module_name} failed: {e}; install what it '
                          f'imports') from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing: say so in one line
        raise ConfigError(f'model.name "{name}": importing {module_name} failed ({type(e).__name__}: '
                          f'{str(e).splitlines()[0][:200] if str(e) else ""}); fix the module') from None
    f = getattr(module, fn, None)
    if f is None:
        names = [n for n in dir(module) if callable(getattr(module, n)) and not n.startswith("_")]
        from zerotrain.models.errors import did_you_mean
        raise ConfigError(f'model.name "{name}": module {module_name} ({getattr(module, "__file__", "?")}) has no '
                          f'function "{fn}"{did_you_mean(fn, names)}; name the function that builds the model')
    if not callable(f):
        raise ConfigError(f'model.name "{name}": {module_name}.{fn} is a {type(f).__name__}, not a function; '
                          f'name the function that builds the model')
    return f


def check(spec_config) -> None:
    """What resolve checks before any data: the name's form and that the factory imports."""
    factory(spec_config.name)


def call(name: str, kwargs: dict) -> nn.Module:
    """The factory's module (ConfigError when it returns something else or refuses the kwargs)."""
    f = factory(name)
    try:
        inspect.signature(f).bind(**kwargs)
    except TypeError as e:
        raise ConfigError(f'model.kwargs {json.dumps(kwargs)}: the factory of model.name "{name}" does not take them '
                          f"({e}); give the factory's keyword arguments") from None
    except ValueError:  # no signature to check (a builtin, a C extension): the call says
        pass
    model = f(**kwargs)
    if not isinstance(model, nn.Module):
        raise ConfigError(f'model.name "{name}": the factory returned a {type(model).__name__}, not a torch '
                          f'nn.Module; return the model')
    return model


def loss_kind(spec: ModelSpec, data_task: Optional[str]) -> str:
    """model.loss, or the built-in loss the data implies."""
    if spec.config.loss is not None:
        return spec.config.loss
    if data_task == "lm":
        return "lm"
    if data_task == "classify":
        return "classification"
    raise ConfigError(f'model.loss: {spec.name} on {data_task} data needs model.loss "model" (forward(**batch) '
                      f'returns the loss): the built-in losses are "lm" and "classification"')


_TASK = {"lm": "lm", "classification": "classify"}


def _check_data(spec: ModelSpec, kind: str, data) -> None:
    want = _TASK.get(kind)
    if want is not None and data.task != want:
        raise ConfigError(f'model.loss "{kind}" needs {"language-model" if want == "lm" else "image"} data but '
                          f'data.kind gives a {data.task} task; choose the matching model.loss or data.kind')
    packed = data.extra.get("packed")
    if packed and kind != "model":
        raise ConfigError(f"{packed}: {spec.name} is called as forward(input_ids) and cannot keep packed records "
                          f'apart; set {packed} false, or use model.loss "model" (forward(**batch) gets '
                          f"position_ids and doc_ids)")


def _tied(model: nn.Module) -> list[tuple[str, str]]:
    """[(alias, source)]: parameters registered under two names (tied weights), stored once in exports."""
    seen, tied = {}, []
    for n, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.append((n, seen[id(p)]))
        else:
            seen[id(p)] = n
    return tied


def _numel(p) -> int:
    return int(getattr(p, "ds_numel", p.numel()))


def width(model: nn.Module) -> Optional[int]:
    """The side of the largest weight (sqrt of its elements): the model width's role for the
    ZeRO-3 bucket and persistence sizes, as for the vision and linear models."""
    sizes = [_numel(p) for p in model.parameters()]
    return max(1, math.isqrt(max(sizes))) if sizes else None


class MetaUnavailable(Exception):
    """The factory builds its module, but not on the meta device: the planner cannot size it (the
    run trains unchecked, with this as the note); its width is known from a CPU build."""

    def __init__(self, message: str, width: Optional[int]):
        super().__init__(message)
        self.width = width


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else ""


def factory_error(name: str, kwargs: dict, e: BaseException) -> ConfigError:
    """The factory's own exception as the run's one line."""
    return ConfigError(f'model.name "{name}": the factory raised {type(e).__name__}: {_first_line(e)} '
                       f'(model.kwargs {json.dumps(kwargs)}); fix the factory or model.kwargs')


_META: dict = {}


def meta(spec: ModelSpec) -> nn.Module:
    """The factory's module with its parameters on the meta device (no memory), built once per
    process for this name and kwargs: the planner and the ZeRO-3 sizes read it. A factory that
    fails there is called on the CPU (`_on_cpu`): ConfigError with its exception where it fails
    again, else MetaUnavailable (remembered, with the width)."""
    key = (spec.name, json.dumps(spec.config.kwargs, sort_keys=True))
    if key not in _META:
        try:
            with torch.random.fork_rng(devices=[]), torch.device("meta"):
                _META[key] = call(spec.name, spec.config.kwargs)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - the meta device, or the factory itself: the CPU build tells
            _META[key] = _on_cpu(spec, e)
    if isinstance(_META[key], MetaUnavailable):
        raise _META[key]
    return _META[key]


def _on_cpu(spec: ModelSpec, meta_error: Exception) -> MetaUnavailable:
    """The factory once on the CPU after it failed on the meta device: its own exception
    (ConfigError) if it fails again, else what the note says, with the width of the module it
    built (dropped at once: the run builds its own in the strategy's context)."""
    try:
        with torch.random.fork_rng(devices=[]), torch.device("cpu"), torch.no_grad():
            model = call(spec.name, spec.config.kwargs)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's factory: its error in one line
        raise factory_error(spec.name, spec.config.kwargs, e) from None
    w = width(model)
    del model
    return MetaUnavailable(f'the factory of model.name "{spec.name}" cannot build on the meta device '
                           f"({type(meta_error).__name__}: {_first_line(meta_error)}); it was built once on the "
                           f"CPU for its width, and trains unchecked", w)


def model_config(spec: ModelSpec, kind: str) -> dict:
    """Saved with checkpoints and exports (config.json): enough to build the module again."""
    module, fn = parse(spec.name)
    return {"family": "py", "factory": f"{module}:{fn}", "kwargs": dict(spec.config.kwargs), "loss": kind}


def build_user(spec: ModelSpec, data, init_context=contextlib.nullcontext) -> Workload:
    from zerotrain.models.moe import detect
    kind = loss_kind(spec, data.task)
    _check_data(spec, kind, data)
    try:
        with init_context():
            model = call(spec.name, spec.config.kwargs)
    except Exception as e:  # a constructor that needs values (e.g. .item()) cannot run on the meta device
        if not builds_empty(init_context):
            raise
        print(f"zerotrain: {spec.name} cannot be constructed on the meta device ({type(e).__name__}: "
              f"{str(e).splitlines()[0][:120] if str(e) else ''}); built whole on this rank instead", flush=True)
        model = call(spec.name, spec.config.kwargs)
    n = sum(_numel(p) for p in model.parameters())
    info = detect(model, None)
    if info is not None:  # FLOPs follow the parameters a token uses (its top-k experts)
        n -= info.active_params_delta
    return Workload(model=model, task=data.task if kind == "model" else _TASK[kind], family="py",
                    model_config=model_config(spec, kind), hidden_size=width(model), flops_per_item=6.0 * n,
                    tied=_tied(model), model_loss=kind == "model", sparse=info)

