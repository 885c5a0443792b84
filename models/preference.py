"""Preference tuning objectives (train.objective dpo on data.kind preference): DPO, IPO, SimPO.

For a pair (x, y_w chosen, y_l rejected), with log pi(y|x) the summed log-probability of the
response tokens under the policy and log ref(y|x) under the reference:

    sigmoid (DPO, Rafailov et al. 2023, eq. 7):
        h = beta ((log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l)))
        loss = -log sigmoid(h)
    ipo (Azar et al. 2023, eq. 17, sampled form, as TRL's DPOTrainer computes it):
        h = (log pi(y_w) - log ref(y_w)) / |y_w| - (log pi(y_l) - log ref(y_l)) / |y_l|
        loss = (h - 1 / (2 beta))^2                            (beta is the paper's tau)
        (train.dpo.ipo_sum true: the log-ratios summed, not divided by |y|; rewards likewise)
    simpo (Meng et al. 2024, eq. 6; no reference):
        loss = -log sigmoid(beta / |y_w| log pi(y_w) - beta / |y_l| log pi(y_l) - gamma)

|y| is the number of response tokens (labels) of the sequence after truncation. A micro-batch's
loss is the mean over its pairs; every micro-batch holds train.micro_batch_size pairs, so the
engines' mean over micro-batches and ranks is the mean over the global batch's pairs.

Metrics (TRL's names): rewards/chosen = beta (log pi(y_w) - log ref(y_w)) (simpo: beta / |y_w|
log pi(y_w)), rewards/rejected likewise, rewards/margins = chosen - rejected, rewards/accuracies
= the share of pairs with margin > 0, logps/chosen and logps/rejected = log pi summed over the
response; means over the pairs of the logging interval.

The chosen and rejected sequences of a micro-batch go through one forward, concatenated along
the batch (2B rows). The reference log-probabilities come from one no-grad forward of the same
rows: under model.lora the model itself with every adapter switched off (peft's layers'
`_disable_adapters`), else a frozen copy of the initial model; both in eval mode (no dropout).
With train.dpo.reference precomputed there is no reference forward: the batch carries each
pair's reference log-probabilities (`zerotrain prepare --reference`, train/data/reference.py),
as reference_chosen_logps / reference_rejected_logps, (B,) each.
Log-probabilities are models/losses.py's token_logps: fp32 mathematics, no fp32 (N, V) copy.

Packed pairs (data.packing; the batch carries chosen_length / rejected_length): the micro-batch's
2B sequences are packed best-fit-decreasing (as train/data/packing.py packs sft records) into R <= 2B rows of T
tokens, each sequence a document of its row (positions restart at 0, attention stays inside it:
the document mask, models/gpt.py), and each sequence's log-probability is the sum of its
segment's token log-probs. The micro-batch is still B pairs, so the loss is packing's off; the
policy and the reference forward (live) take the same packed rows.
"""

from __future__ import annotations

import bisect
import contextlib
from typing import Optional

import torch
import torch.nn.functional as F

from zerotrain.models.losses import IGNORE_INDEX, token_logps

LOSSES = ("sigmoid", "ipo", "simpo")
#: the batch keys of precomputed reference log-probs (train.dpo.reference precomputed): no input of
#: the model but what the loss subtracts, read in fp32 (never cast to the 16-bit input dtype)
REFERENCE_KEYS = ("reference_chosen_logps", "reference_rejected_logps")
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
           "logps/rejected")


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed log-probability of the labelled tokens per row, fp32 (R,), number of labels (R,))
    of (R, T, V) logits and (R, T) labels."""
    per_tok = token_logps(logits.reshape(-1, logits.size(-1)), labels.reshape(-1)).view(labels.shape)
    return per_tok.sum(1), (labels != IGNORE_INDEX).sum(1)


def pair_losses(kind: str, beta: float, gamma: float, pc: torch.Tensor, pr: torch.Tensor,
                rc: Optional[torch.Tensor], rr: Optional[torch.Tensor], nc: torch.Tensor,
                nr: torch.Tensor, ipo_sum: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair loss, chosen reward, rejected reward), fp32 (B,) each (module docstring). IPO
    divides each log-ratio by its completion length unless `ipo_sum`."""
    if kind == "simpo":
        rew_c, rew_r = beta * pc / nc.clamp(min=1), beta * pr / nr.clamp(min=1)
        return -F.logsigmoid(rew_c - rew_r - gamma), rew_c.detach(), rew_r.detach()
    if kind == "ipo" and not ipo_sum:  # TRL's loss_type "ipo": per-token mean log-probs
        pc, rc = pc / nc.clamp(min=1), rc / nc.clamp(min=1)
        pr, rr = pr / nr.clamp(min=1), rr / nr.clamp(min=1)
    h = (pc - rc) - (pr - rr)
    loss = -F.logsigmoid(beta * h) if kind == "sigmoid" else (h - 1.0 / (2.0 * beta)) ** 2
    return loss, (beta * (pc - rc)).detach(), (beta * (pr - rr)).detach()


def _best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Rows of indices into `lengths` (each <= capacity), summing to <= capacity: longest first,
    each into the open row with the least room that holds it (ties by index: deterministic).
    train/data/packing.py packs sft records the same way (models/ imports nothing from train/)."""
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = bisect.bisect_left(room, (lengths[i], -1))
        if k == len(room):
            rows.append([i])
            left, r = capacity - lengths[i], len(rows) - 1
        else:
            left, r = room.pop(k)
            rows[r].append(i)
            left -= lengths[i]
        bisect.insort(room, (left, r))
    return rows


def pack_sequences(ids: torch.Tensor, labels: torch.Tensor, lengths: torch.Tensor) -> dict:
    """The (S, T) sequences `ids`/`labels` with `lengths` (S,) input tokens each, packed into rows
    of T: {"input_ids", "labels", "position_ids", "doc_ids"} (R, T) and "segment" (R, T): the
    sequence each token belongs to (S for a row's padding tail). The plan is best-fit-decreasing
    on the host (one read of `lengths`, S numbers); the gathers run where the tensors are."""
    S, T = labels.shape
    lens = [int(n) for n in lengths.tolist()]
    rows = _best_fit_decreasing(lens, T)
    src = torch.full((len(rows), T), -1, dtype=torch.int64)        # flat index into (S, T), -1: padding
    pos = torch.zeros(len(rows), T, dtype=torch.int64)
    doc = torch.zeros(len(rows), T, dtype=torch.int64)
    seg = torch.full((len(rows), T), S, dtype=torch.int64)
    for r, members in enumerate(rows):
        at = 0
        for d, s in enumerate(members):
            n = lens[s]
            src[r, at:at + n] = s * T + torch.arange(n)
            pos[r, at:at + n] = torch.arange(n)
            doc[r, at:at + n] = d
            seg[r, at:at + n] = s
            at += n
        pos[r, at:] = torch.arange(T - at)  # the tail: a document of its own, labels ignored
        doc[r, at:] = len(members)
    dev = ids.device
    src, pad = src.to(dev), src.to(dev) < 0
    flat = src.clamp(min=0)
    return {"input_ids": torch.where(pad, torch.zeros_like(flat), ids.reshape(-1)[flat]),
            "labels": torch.where(pad, torch.full_like(flat, IGNORE_INDEX), labels.reshape(-1)[flat]),
            "position_ids": pos.to(dev), "doc_ids": doc.to(dev), "segment": seg.to(dev)}


def segment_logps(logits: torch.Tensor, packed: dict, n_seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """sequence_logps of packed rows: (summed log-prob of each sequence's labels, fp32 (S,),
    number of labels (S,)), summed over its segment of the rows."""
    labels, seg = packed["labels"], packed["segment"].reshape(-1)
    per_tok = token_logps(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
    sums = per_tok.new_zeros(n_seq + 1).index_add(0, seg, per_tok)
    counts = torch.zeros(n_seq + 1, dtype=torch.int64, device=seg.device).index_add(
        0, seg, (labels.reshape(-1) != IGNORE_INDEX).long())
    return sums[:n_seq], counts[:n_seq]


class Preference:
    """The objective of a run with train.objective dpo: the loss of a micro-batch of pairs, its
    validation statistics, and the interval's metrics (summed on the device, read at log lines)."""

    def __init__(self, loss: str, beta: float, gamma: float, reference: Optional[torch.nn.Module] = None,
                 lora: bool = False, precomputed: bool = False, ipo_sum: bool = False):
        assert loss in LOSSES
        self.kind, self.beta, self.gamma, self.ipo_sum = loss, float(beta), float(gamma), bool(ipo_sum)
        self.reference, self.lora = reference, lora  # a frozen copy (full fine-tuning) or None
        self.precomputed = precomputed               # the reference log-probs come with the batch
        self.sums: Optional[torch.Tensor] = None     # METRICS sums + the pair count, on the device
        self.packed_positions = 0                    # positions of the last packed rows the policy ran on

    @property
    def needs_reference(self) -> bool:
        return self.kind != "simpo"

    @staticmethod
    def rows(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels) of the micro-batch's 2B rows: the chosen sequences, then the rejected."""
        return (torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]]),
                torch.cat([batch["chosen_labels"], batch["rejected_labels"]]))

    @contextlib.contextmanager
    def _reference_mode(self, model):
        """The model as the reference: eval mode, and under LoRA every adapter off."""
        layers = [m for m in model.modules() if hasattr(m, "_disable_adapters")] if self.lora else []
        was = [m._disable_adapters for m in layers]
        training = model.training
        model.eval()
        for m in layers:
            m._disable_adapters = True
        try:
            yield
        finally:
            for m, w in zip(layers, was):
                m._disable_adapters = w
            model.train(training)

    @staticmethod
    def _logps(workload, model, rows: dict, n_seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per sequence (log-prob sum, label count) of the rows: padded (one sequence a row) or
        packed (pack_sequences' rows, with their segments)."""
        if "segment" in rows:
            return segment_logps(workload.logits(model, rows), rows, n_seq)
        return sequence_logps(workload.logits(model, {"input_ids": rows["input_ids"]}), rows["labels"])

    @torch.no_grad()
    def reference_logps(self, workload, model, rows: dict, n_seq: int) -> torch.Tensor:
        if self.reference is not None:
            return self._logps(workload, self.reference, rows, n_seq)[0]
        with self._reference_mode(model):
            return self._logps(workload, model, rows, n_seq)[0]

    def _pairs(self, workload, model, batch: dict):
        ids, labels = self.rows(batch)
        b = batch["chosen_input_ids"].size(0)
        if "chosen_length" in batch:  # data.packing: the 2B sequences packed into rows of seq_len
            rows = pack_sequences(ids, labels, torch.cat([batch["chosen_length"], batch["rejected_length"]]))
            self.packed_positions = rows["input_ids"].numel()
        else:
            rows = {"input_ids": ids, "labels": labels}
        if not self.needs_reference:
            ref = None
        elif self.precomputed:
            ref = torch.cat([batch[k] for k in REFERENCE_KEYS]).float()
        else:
            ref = self.reference_logps(workload, model, rows, 2 * b)
        logps, n = self._logps(workload, model, rows, 2 * b)
        rc, rr = (ref[:b], ref[b:]) if ref is not None else (None, None)
        loss, rew_c, rew_r = pair_losses(self.kind, self.beta, self.gamma, logps[:b], logps[b:], rc, rr, n[:b], n[b:],
                                         self.ipo_sum)
        stats = torch.stack([rew_c, rew_r, rew_c - rew_r, (rew_c > rew_r).float(), logps[:b].detach(),
                             logps[b:].detach()], 1)  # (B, len(METRICS))
        return loss, stats

    def positions(self, batch: dict) -> int:
        """Token positions the policy's forward ran on for this micro-batch (after `loss`): the
        2B padded rows, or with data.packing the rows pack_sequences built from them."""
        if "chosen_length" in batch:
            return self.packed_positions
        return batch["chosen_input_ids"].numel() + batch["rejected_input_ids"].numel()

    def loss(self, workload, model, batch: dict) -> torch.Tensor:
        """The micro-batch's mean pair loss (fp32); its metrics are added to the interval's sums."""
        loss, stats = self._pairs(workload, model, batch)
        row = torch.cat([stats.sum(0), stats.new_tensor([stats.size(0)])]).double()
        self.sums = row if self.sums is None else self.sums + row
        return loss.mean()

    @torch.no_grad()
    def eval_stats(self, workload, model, batch: dict) -> dict[str, torch.Tensor]:
        """Per pair (shape [B]): the loss and every metric (val/loss, val/rewards/accuracies, ...)."""
        loss, stats = self._pairs(workload, model, batch)
        return {"loss": loss.float(), **{k: stats[:, j] for j, k in enumerate(METRICS)}}

    def window(self, acc) -> dict:
        """The interval's metrics, means over every rank's pairs (one all-reduce). Resets the sums."""
        if self.sums is None:
            return {}
        flat = self.sums
        dist = torch.distributed
        if acc.num_processes > 1 and dist.is_available() and dist.is_initialized():
            flat = flat.clone()
            dist.all_reduce(flat)
        vals = flat.tolist()
        self.sums = None
        n = max(vals[-1], 1.0)
        return {k: v / n for k, v in zip(METRICS, vals)}


def frozen_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The reference of full fine-tuning: a copy of the initial model that never trains."""
    import copy
    ref = copy.deepcopy(model)
    ref.requires_grad_(False)
    return ref.eval()


__all__ = ["LOSSES", "METRICS", "REFERENCE_KEYS", "Preference", "dataset_reference_logps", "frozen_copy", "pack_sequences", "pair_losses", "segment_logps",
           "sequence_logps"]


@torch.no_grad()
def dataset_reference_logps(workload, pairs, device, rows: int = 16, first: int = 0,
                            stop: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) reference log-probs, fp32 (N,) each, of records [first, stop) of `pairs`
    (a train/data/preference.py PreferencePairs; stop None = all) under workload.model as it is, in
    eval mode: `zerotrain prepare --reference`. The same rows and code as the live reference,
    `rows` pairs per forward, counted from `first` (a multiple of `rows` gives the forwards of one
    pass over everything)."""
    model = workload.model.to(device).eval()
    stop = len(pairs) if stop is None else min(stop, len(pairs))
    out_c, out_r = [], []
    for start in range(first, stop, rows):
        batch = torch.utils.data.default_collate([pairs[i] for i in range(start, min(start + rows, stop))])
        ids, labels = Preference.rows(batch)
        logps = sequence_logps(workload.logits(model, {"input_ids": ids.to(device)}), labels.to(device))[0].cpu()
        b = batch["chosen_input_ids"].size(0)
        out_c.append(logps[:b])
        out_r.append(logps[b:])
    return torch.cat(out_c), torch.cat(out_r)
