"""Evaluation on the validation split (every train.eval_every steps, and once more at the end of
a run that completes) and the sample text a GPT run prints at its end."""

from __future__ import annotations

import contextlib
import math
from typing import TYPE_CHECKING, Callable, Optional

import torch

from zerotrain.models.preference import REFERENCE_KEYS

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from zerotrain.models.workload import Workload
    from zerotrain.train.config import RunConfig
    from zerotrain.train.data.bundle import DataBundle
    from zerotrain.train.launch.sequence_parallel import SPRun


def cast_floats(batch: dict, dtype: Optional[torch.dtype]) -> dict:
    """Float inputs in `dtype` where the strategy keeps the parameters themselves in 16 bits
    (Strategy.input_dtype; None: as they are). Not a precomputed DPO reference's log-probs
    (REFERENCE_KEYS): no input of the model but what the loss subtracts in fp32; in bf16 (8
    significant bits) a log-prob of -45.0052 would be -45.0, and the step-1 rewards not 0."""
    if dtype is None:
        return batch
    return {k: v.to(dtype) if v.is_floating_point() and k not in REFERENCE_KEYS else v for k, v in batch.items()}


class Evaluator:
    def __init__(self, *, cfg: RunConfig, acc, model, workload: Workload, data: DataBundle,
                 val_loader: Optional[DataLoader], seq_parallel: Optional[SPRun], cast: Callable[[dict], dict]):
        """`model`: what accelerate prepared; `cast`: the input cast (the batch in the parameters'
        dtype: cast_floats)."""
        self.cfg, self.acc, self.model, self.workload, self.data = cfg, acc, model, workload, data
        self.val_loader, self.seq_parallel, self.cast = val_loader, seq_parallel, cast

    def due(self, step: int, done: bool) -> bool:
        """train.eval_every; the last step evaluates after the loop instead."""
        every = self.cfg.train.eval_every
        return bool(every) and step % every == 0 and not done

    def run(self) -> dict:
        """The val/* metrics (every rank takes part); {} without a validation split. Under
        sequence parallelism every rank evaluates whole rows of its own samples."""
        if self.seq_parallel is None:
            return self._run()
        with self.seq_parallel.detached(self.workload.model):
            return self._run()

    @torch.no_grad()
    def _run(self) -> dict:
        self.workload.sync_norm_stats(self.model)  # also what the end-of-run export then writes
        if self.val_loader is None:
            return {}
        self.model.eval()
        sums, count = {}, 0
        for batch in self.val_loader:
            stats = self.acc.gather_for_metrics(self.workload.eval_stats(self.model, self.cast(batch)))
            # LMs report each sample's labelled tokens: their statistics are token-weighted
            # (a sample of 3 response tokens counts 3, not as much as one of 300).
            weight = stats["tokens"].double() if "tokens" in stats else None
            for k, v in stats.items():
                v = v.double() if weight is None or k == "tokens" else v.double() * weight
                sums[k] = sums.get(k, 0.0) + float(v.sum())
            count += len(next(iter(stats.values())))
        self.model.train()
        per = max(1.0, sums.pop("tokens", 0.0)) if "tokens" in sums else max(1, count)
        out = {f"val/{k}": v / per for k, v in sums.items()}
        out["val/samples"] = count
        if "val/loss" in out and self.workload.task == "lm" and self.workload.preference is None:
            out["val/ppl"] = math.exp(min(50.0, out["val/loss"]))
        return out

    @torch.no_grad()
    def sample_text(self, prompt: bytes = b"def ") -> Optional[str]:
        """train.sample_tokens generated after `prompt` by a byte-level GPT; None otherwise."""
        n = self.cfg.train.sample_tokens
        if n == 0 or self.workload.family != "gpt" or self.data.decode is None or self.data.vocab_size != 256:
            return None
        model = self.workload.model  # the wrapped module (accelerate's unwrap_model imports DeepSpeed)
        model.eval()
        # Every rank runs the same generation (ZeRO-3 gathers parameters collectively).
        g = torch.Generator(device=self.acc.device).manual_seed(self.cfg.train.seed)
        idx = torch.tensor([list(prompt)], dtype=torch.long, device=self.acc.device)
        with self.seq_parallel.detached(model) if self.seq_parallel is not None else contextlib.nullcontext():
            out = model.generate(idx, max_new_tokens=n, temperature=0.8, top_k=50, generator=g)
        model.train()
        return self.data.decode(out[0].tolist())
