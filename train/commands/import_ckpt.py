"""`zerotrain import SOURCE --out CHECKPOINT --config run.yaml --trust-pickle`: a native
DeepSpeed checkpoint (ZeRO-0..3, any world size) -> a zerotrain checkpoint (fp32 master
weights, AdamW moments, step, data position) that `--resume` loads on any number of processes
under DDP or any ZeRO stage. The reading is train/checkpoint/importer.py; this module checks
the result against the run config's model and data and writes it. docs/checkpoints.md,
"Importing DeepSpeed / HF Trainer checkpoints".

The only zerotrain command that unpickles, and only with --trust-pickle (restricted to tensors
and plain containers: train/checkpoint/safe_unpickle.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from zerotrain.train.errors import CheckpointError, ConfigError, user_errors


def _bool(s: str) -> bool:
    if s.lower() in ("true", "1", "yes"):
        return True
    if s.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")


def _parser():
    ap = argparse.ArgumentParser(
        prog="zerotrain import",
        description="Convert a native DeepSpeed checkpoint (global_step*/, any ZeRO stage 0-3, any world size) "
                    "or an HF Trainer checkpoint-N folder into a zerotrain checkpoint that --resume loads on any number of processes and any stage.")
    ap.add_argument("source", help="a DeepSpeed save_checkpoint directory (with `latest`), one global_step* dir, "
                                   "or an HF Trainer checkpoint-N folder (or its output dir: the newest)")
    ap.add_argument("--out", required=True, help="the checkpoint directory to write (then: --resume OUT)")
    ap.add_argument("--config", required=True, help="the run file the imported run continues with (model, data)")
    ap.add_argument("--trust-pickle", action="store_true",
                    help="required: DeepSpeed checkpoints are Python pickles; they are read with a restricted "
                         "unpickler (tensors and plain containers only), but only import files you trust")
    ap.add_argument("--strict", type=_bool, default=True, metavar="true|false",
                    help="false: skip optimizer state that matches no parameter of the model (and give "
                         "parameters without moments fresh ones); weights must always match")
    ap.add_argument("--data-position", choices=("samples", "restart"), default="samples",
                    help="samples (default): continue zerotrain's data order after the source's global_samples "
                         "(exact when the source run read zerotrain's order); restart: epoch 0, sample 0")
    ap.add_argument("--debug", action="store_true", help="show tracebacks")
    return ap


def main(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    with user_errors(a.debug):
        t0 = time.perf_counter()
        src = Path(a.source)
        if not a.trust_pickle:
            raise ConfigError(f"{src} would be unpickled: pass --trust-pickle to import it (only for checkpoints "
                              f"you trust; loading is restricted to tensors and plain containers)")
        out = Path(a.out)
        if out.exists() and not (out / "manifest.json").is_file() and (not out.is_dir() or any(out.iterdir())):
            raise CheckpointError(f"--out {out} exists and is not a zerotrain checkpoint: it would be replaced; "
                                  f"choose a new directory")
        from zerotrain.train.checkpoint.importer import (find_deepspeed_step_dir, find_hf_checkpoint, read_deepspeed,
                                               read_hf_trainer, write_checkpoint)
        # An HF Trainer folder saved under DeepSpeed holds a global_step*/ directory: DeepSpeed's files first.
        step_dir = find_deepspeed_step_dir(src)
        hf_dir = find_hf_checkpoint(src) if step_dir is None else None
        if step_dir is None and hf_dir is None:
            raise CheckpointError(f"{src} is not a DeepSpeed or HF Trainer checkpoint: expected a global_step* "
                                  f"directory with mp_rank_00_model_states.pt (or the directory save_checkpoint "
                                  f"wrote, with `latest`), or a checkpoint-N folder with trainer_state.json")
        print(f"zerotrain: warning: unpickling {step_dir or hf_dir} (--trust-pickle): pickles can run code; only "
              f"tensors and plain containers are allowed through", file=sys.stderr, flush=True)
        run = _RunModel(a.config)
        imp = read_deepspeed(step_dir, run.optimizer_order) if step_dir else read_hf_trainer(hf_dir, run.optimizer_order)
        step_dir = step_dir or hf_dir
        _check(imp, run, a.strict, a.config)
        meta = run.meta(imp, a.data_position, str(step_dir))
        out = write_checkpoint(Path(a.out), imp, meta)
        st = meta["train_state"]
        for note in imp.notes:
            print(f"zerotrain: note: {note}", flush=True)
        print(f"zerotrain: data position: {run.position_note}", flush=True)
        print(f"zerotrain: imported {imp.source} from {step_dir} -> {out}: step {st['step']}, "
              f"{len(imp.weights)} tensors, moments for {len(next(iter(imp.moments.values()), {}))} "
              f"in {time.perf_counter() - t0:.2f} s; resume with --resume {out}", flush=True)
    return 0


class _RunModel:
    """The run config's model (built on the meta device: shapes only) and data (sizes, order)."""

    def __init__(self, config: str):
        import torch

        from zerotrain.models import build_workload
        from zerotrain.models import resolve as resolve_model
        from zerotrain.train.config import load_config
        from zerotrain.train.data import build_data
        self.cfg = cfg = load_config(config)
        spec = resolve_model(cfg.model)
        tokenizer = cfg.data.tokenizer or (spec.name[3:] if spec.family == "hf" else None)
        self.data = build_data(cfg.data, cfg.data.seq_len or spec.context, cfg.train.seed, tokenizer)
        if spec.family == "hf":  # transformers loads its weights itself: built on the CPU
            self.workload = build_workload(spec, self.data)
        else:
            with torch.device("meta"):
                self.workload = build_workload(spec, self.data)
        model = self.workload.model
        self.shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}  # tied: once
        self.trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        from zerotrain.train.checkpoint.files import persistent_buffers
        self.buffers = {n: tuple(b.shape) for n, b in persistent_buffers(model)}
        from zerotrain.train.optim.optimizer import param_groups
        names = {id(p): n for n, p in model.named_parameters()}
        self.groups = [[names[id(p)] for p in g["params"]] for g in param_groups(model, cfg.optim.weight_decay)]
        self.hf_groups = None
        try:  # transformers.Trainer's grouping (decay, then no decay), by its own rule
            from transformers import Trainer
            decay = set(Trainer.get_decay_parameter_names(None, model))
            trained = [n for n, p in model.named_parameters() if p.requires_grad]
            self.hf_groups = [[n for n in trained if n in decay], [n for n in trained if n not in decay]]
        except Exception:  # noqa: BLE001 - transformers missing or changed: that candidate is skipped
            pass
        self.position_note = ""

    def optimizer_order(self, shapes: list, sizes: list[int]):
        """ZeRO-0: the names of the torch optimizer's parameter indices, if the optimizer was built
        like zerotrain's (weight-decay group, then the rest) or as one group in module order; None
        when neither fits the saved shapes."""
        candidates = [self.groups, [[n for g in self.groups for n in g]], [list(self.shapes)]]
        if self.hf_groups:
            candidates += [self.hf_groups, [g for g in self.hf_groups if g]]
        for groups in candidates:
            order = [n for g in groups for n in g]
            if [len(g) for g in groups] == sizes and len(order) == len(shapes) and \
                    all(s is None or tuple(s) == self.shapes[n] for n, s in zip(order, shapes)):
                return order
        return None

    def meta(self, imp, position: str, source: str) -> dict:
        from zerotrain.train.checkpoint import files as ckpt_files
        from zerotrain.train.checkpoint.state import TrainState
        cfg, wl = self.cfg, self.workload
        n = len(self.data.train)
        gb = cfg.train.global_batch_size
        if imp.global_samples and imp.global_steps:
            src_gb = imp.global_samples // imp.global_steps
            if gb is not None and gb != src_gb:
                raise ConfigError(f"train.global_batch_size {gb} in the run file differs from the source run's "
                                  f"global batch {src_gb} (global_samples / global_steps): set it to {src_gb}")
            gb = src_gb
        if gb is None:
            raise ConfigError("the source checkpoint does not record its global batch: set train.global_batch_size "
                              "in the run file (the source run's per-device batch x accumulation x processes)")
        steps_per_epoch = n // gb
        if steps_per_epoch == 0:
            raise ConfigError(f"the training set has {n} samples, fewer than one global batch of {gb}")
        samples = imp.global_samples if imp.global_samples is not None else imp.global_steps * gb
        if position == "samples":
            epoch, rest = divmod(samples, steps_per_epoch * gb)
            offset = rest - rest % gb
            self.position_note = (f"continues zerotrain's order for this data after {samples} samples (epoch {epoch}, "
                                  f"+{offset} samples): the same batches only if the source run read this data in "
                                  f"zerotrain's order (DeepSpeed and the HF Trainer do not record their data loader's position)")
        else:
            epoch, offset = 0, 0
            self.position_note = "the data order restarts (epoch 0, sample 0; --data-position restart)"
        st = TrainState(step=imp.global_steps, epoch=epoch, offset=offset, samples_seen=samples,
                        tokens_seen=samples * self.data.items_per_sample, skipped_steps=imp.skipped_steps)
        return {"format": ckpt_files.FORMAT, "version": ckpt_files.VERSION, "step": st.step,
                "train_state": st.to_dict(),
                "world_size": 1, "holder": f"import ({imp.source})",
                "strategy": {"backend": "import", "zero_stage": None, "precision": "fp32"},
                "imported_from": {"source": source, "format": imp.source},
                "model": {"family": wl.family, "config": wl.model_config, "tied": [list(x) for x in wl.tied]},
                "data": {"global_batch": gb, "num_samples": n, "steps_per_epoch": steps_per_epoch,
                         "seed": cfg.train.seed},
                # The "engine" component's record (train/strategy/ Strategy.state_dict): the source's counters.
                "state": {"engine": {"counters": {"global_steps": imp.global_steps, "global_samples": samples,
                                                  "skipped_steps": imp.skipped_steps}}},
                "config": None}


def _rename_ties(imp, run: _RunModel):
    """The source may keep a tied pair under the other name (lm_head.weight for tok_emb.weight)."""
    for alias, source in run.workload.tied:
        if alias in imp.weights and source not in imp.weights:
            imp.weights[source] = imp.weights.pop(alias)
            for d in imp.moments.values():
                if alias in d:
                    d[source] = d.pop(alias)
            if alias in imp.steps:
                imp.steps[source] = imp.steps.pop(alias)
        imp.tied.pop(alias, None)


def _vocab_only(differ: dict, mismatches: int, run: _RunModel) -> int | None:
    """The checkpoint's vocabulary when every mismatch is a GPT tensor that differs from the model
    only in its vocabulary dimension (the embedding, an untied head), by the same size; else None."""
    vocab = run.workload.model_config.get("vocab_size") if run.workload.family == "gpt" else None
    if vocab is None or not differ or len(differ) != mismatches:
        return None
    sizes = set()
    for model_shape, ckpt_shape in differ.values():
        dims = [i for i, (a, b) in enumerate(zip(model_shape, ckpt_shape)) if a != b]
        if len(model_shape) != len(ckpt_shape) or len(dims) != 1 or model_shape[dims[0]] != vocab:
            return None
        sizes.add(ckpt_shape[dims[0]])
    return sizes.pop() if len(sizes) == 1 else None


def _check(imp, run: _RunModel, strict: bool, config: str):
    """Names and shapes against the run's model: one line per mismatch. Weights must match
    exactly; optimizer state that fits no parameter is an error unless --strict false."""
    _rename_ties(imp, run)
    for n in [n for n in imp.weights if n in run.buffers]:  # HF weight files hold persistent buffers too
        imp.buffers[n] = imp.weights.pop(n)
    lines, differ = [], {}
    for n, shape in run.shapes.items():
        if n not in imp.weights:
            lines.append(f"  {n}: in model {list(shape)}, not in the checkpoint")
        elif tuple(imp.weights[n].shape) != shape:
            lines.append(f"  {n}: model {list(shape)} vs checkpoint {list(imp.weights[n].shape)}")
            differ[n] = (shape, tuple(imp.weights[n].shape))
    for n, t in imp.weights.items():
        if n not in run.shapes:
            lines.append(f"  {n}: in the checkpoint {list(t.shape)}, not in the model")
    for n, t in imp.buffers.items():
        if n not in run.buffers:
            lines.append(f"  buffer {n}: in the checkpoint {list(t.shape)}, not in the model")
    if lines:
        vocab = _vocab_only(differ, len(lines), run)
        fix = (f"the checkpoint was trained with a vocabulary of {vocab}, this model has "
               f"{run.workload.model_config['vocab_size']}"
               + (" (model.vocab_size is unset: the data's)"
                  if run.cfg.model.family == "gpt" and run.cfg.model.vocab_size is None else "")
               + f": set model.vocab_size: {vocab} in {config}") if vocab else \
            "import with the run file of the model that was trained"
        raise CheckpointError(f"the checkpoint's weights do not fit the model of {config} "
                              f"({len(lines)} mismatches):\n" + "\n".join(lines) + "\n" + fix)
    problems = []
    for n in list(imp.steps):
        if n not in run.trainable:
            problems.append(f"  optimizer state for {n}: not a trainable parameter of the model")
            imp.steps.pop(n)
    for n in run.trainable:
        if n not in imp.steps:
            problems.append(f"  {n}: no optimizer state in the checkpoint (fresh AdamW moments)")
    if problems and strict:
        raise CheckpointError(f"the checkpoint's optimizer state does not fit the model of {config} "
                              f"({len(problems)} mismatches):\n" + "\n".join(problems) +
                              "\npass --strict false to skip it (weights are still all imported)")
    for p in problems:
        print(f"zerotrain: --strict false: {p.strip()}", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
