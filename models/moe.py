"""Sparse mixture-of-experts hf: models: detection, ZeRO-3 leaf blocks, the router's
load-balancing loss and the tokens routed to each expert.

Detection is structural: a sparse-MoE block is a module with two direct children, an expert
set (an nn.ModuleList of >= 2 modules of one class, or a module holding 3-D parameters
[experts, ...], transformers 5's fused experts) and a router (a child whose weight has one row
per expert). Qwen3-MoE, Mixtral, OLMoE and DeepSeek-style blocks are written so in transformers
5.x; no class name is listed here.

Under ZeRO-3 each block is made a DeepSpeed leaf module (the strategy's make_leaf_modules:
deepspeed.utils.set_z3_leaf_modules, what Accelerate's transformer_moe_cls_names does): its
parameters are gathered as one unit when the block starts, so ranks whose tokens reach
different experts still issue the same collectives. The build decides whether to
(`ZEROTRAIN_MOE_LEAF=0`, a test hook, switches it off: it lets a test show what happens without
it).

The loss (MoEStats.loss): the LM loss as models/workload.py computes it, plus
coef x the model's own aux loss (transformers' load_balancing_loss_func over the micro-batch's
routed tokens, every layer). The engines average the micro-batch losses over accumulation and
ranks, so the step's aux term is the mean over (micro-batch, rank) of each micro-batch's aux loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

_TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts")


def _shape(p) -> tuple:
    return tuple(getattr(p, "ds_shape", None) or p.shape)  # ZeRO-3: the full shape, not the shard


def _numel(p) -> int:
    return int(getattr(p, "ds_numel", p.numel()))


def _expert_count(m: nn.Module) -> Optional[int]:
    """Experts in `m` if it is an expert set: a ModuleList of >= 2 same-class modules, or a
    module whose own parameters are all 3-D with one leading (expert) dimension >= 2."""
    if isinstance(m, nn.ModuleList):
        return len(m) if len(m) >= 2 and len({type(c) for c in m}) == 1 else None
    own = list(m.parameters(recurse=False))
    if own and all(len(_shape(p)) == 3 for p in own):
        lead = {_shape(p)[0] for p in own}
        if len(lead) == 1 and next(iter(lead)) >= 2:
            return next(iter(lead))
    return None


def _is_router(m: nn.Module, experts: int) -> bool:
    w = getattr(m, "weight", None)
    return isinstance(w, torch.Tensor) and len(_shape(w)) == 2 and _shape(w)[0] == experts


def sparse_block(m: nn.Module) -> Optional[tuple[str, int]]:
    """(expert child's name, experts) when `m` is a sparse-MoE block, else None."""
    children = dict(m.named_children())
    for name, child in children.items():
        n = _expert_count(child)
        if n is not None and any(_is_router(c, n) for k, c in children.items() if k != name):
            return name, n
    return None


@dataclass
class MoEInfo:
    """What a run needs to know of a model's sparse blocks."""
    block_classes: list                    # the block classes (ZeRO-3 leaves)
    blocks: int                            # sparse layers
    num_experts: int
    top_k: int
    aux_coef: float                        # the router aux loss coefficient used (model config or run file)
    expert_params: int                     # parameters inside the experts of every block
    largest_block_params: int              # one block's parameters: gathered whole under ZeRO-3
    leaf: bool = False                     # made ZeRO-3 leaf modules (Strategy.make_leaf_modules)

    @property
    def active_params_delta(self) -> int:
        """Parameters a token does not use: the experts it is not routed to."""
        return self.expert_params - self.expert_params * self.top_k // self.num_experts

    def banner(self, aux: bool = True) -> str:
        """`aux`: name the router aux loss coefficient (hf: models; a py: model computes its own loss)."""
        names = ", ".join(c.__name__ for c in self.block_classes)
        where = f"{names} as ZeRO-3 leaf" if self.leaf else names
        return (f"MoE: {self.num_experts} experts x {self.top_k} active, {self.blocks} sparse layers, {where}"
                + (f"; router aux loss coef {self.aux_coef:g}" if aux else ""))

    def record(self) -> dict:
        return {"block_classes": [c.__name__ for c in self.block_classes], "blocks": self.blocks,
                "num_experts": self.num_experts, "top_k": self.top_k, "aux_coef": self.aux_coef,
                "expert_params": self.expert_params, "largest_block_params": self.largest_block_params,
                "zero3_leaf": self.leaf}


def detect(model: nn.Module, config, aux_coef: Optional[float] = None) -> Optional[MoEInfo]:
    """The model's sparse-MoE blocks, or None for a dense model. `aux_coef`: the run file's
    override of the config's router_aux_loss_coef."""
    found = [(m, sparse_block(m)) for m in model.modules()]
    found = [(m, b) for m, b in found if b is not None]
    if not found:
        return None
    experts = {n for _, (_, n) in found}
    n_exp = max(experts)
    top_k = next((getattr(config, k) for k in _TOP_K_KEYS if isinstance(getattr(config, k, None), int)), None)
    if top_k is None:
        top_k = next((getattr(c, "top_k") for m, _ in found for c in (*m.children(), m)  # the router's, or the block's
                      if hasattr(c, "top_k")), 1)
    coef = aux_coef if aux_coef is not None else float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    classes = list(dict.fromkeys(type(m) for m, _ in found))
    expert_params = sum(_numel(p) for m, (name, _) in found for p in getattr(m, name).parameters())
    largest = max(sum(_numel(p) for p in m.parameters()) for m, _ in found)
    return MoEInfo(block_classes=classes, blocks=len(found), num_experts=n_exp, top_k=int(top_k),
                   aux_coef=coef, expert_params=expert_params, largest_block_params=largest)


@dataclass
class MoEStats:
    """Per-interval device accumulators (read only at log lines: no per-step host sync)."""
    info: MoEInfo
    lm_sum: Optional[torch.Tensor] = None          # summed micro-batch LM losses
    aux_sum: Optional[torch.Tensor] = None         # summed micro-batch aux losses (unweighted)
    micro: int = 0
    counts: Optional[torch.Tensor] = None          # (sparse layers, experts) routed token slots
    idle_intervals: dict = field(default_factory=dict)  # (layer, expert) -> consecutive idle intervals

    def loss(self, out, lm: torch.Tensor) -> torch.Tensor:
        """lm + coef x aux for one micro-batch; records both and the routed tokens."""
        aux = getattr(out, "aux_loss", None)
        if self.lm_sum is None:
            self.lm_sum = torch.zeros((), dtype=torch.float64, device=lm.device)
            self.aux_sum = torch.zeros((), dtype=torch.float64, device=lm.device)
        self.lm_sum += lm.detach().to(torch.float64)
        self.micro += 1
        self._count(getattr(out, "router_logits", None))
        if aux is None:
            return lm
        aux = aux.to(lm.device).float()
        self.aux_sum += aux.detach().to(torch.float64)
        return lm + self.info.aux_coef * aux if self.info.aux_coef else lm

    @torch.no_grad()
    def _count(self, router_logits):
        if not router_logits:
            return
        e = self.info.num_experts
        # index_add_, not bincount: bincount sizes its output from the data (a host sync on CUDA).
        rows = [torch.zeros(e, dtype=torch.float64, device=r.device).index_add_(
                    0, idx, torch.ones(idx.numel(), dtype=torch.float64, device=r.device))
                for r in router_logits if r is not None and r.shape[-1] == e
                for idx in [r.topk(self.info.top_k, dim=-1).indices.reshape(-1)]]
        if not rows:
            return
        c = torch.stack(rows)
        self.counts = c if self.counts is None or self.counts.shape != c.shape else self.counts + c

    def window(self, acc, idle_share: float = 0.01) -> tuple[dict, list[str]]:
        """The interval's metrics, summed over ranks (one all-reduce), and warnings for experts
        that got under `idle_share` of an even share for many intervals. Resets the sums."""
        if self.lm_sum is None:
            return {}, []
        layers = self.counts.shape[0] if self.counts is not None else 0
        flat = torch.cat([torch.stack([self.lm_sum, self.aux_sum,
                                       torch.tensor(float(self.micro), dtype=torch.float64, device=self.lm_sum.device)]),
                          (self.counts if self.counts is not None else self.lm_sum.new_zeros(0, 0)).reshape(-1)])
        dist = torch.distributed
        if acc.num_processes > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(flat)
        vals = flat.tolist()
        lm, aux, n = vals[:3]
        m = {"loss/lm": lm / n, "loss/aux": aux / n}
        warnings = []
        if layers:
            e = self.info.num_experts
            grid = [[int(v) for v in vals[3 + i * e: 3 + (i + 1) * e]] for i in range(layers)]
            m["moe/expert_tokens"] = grid
            m["moe/load_max_over_mean"] = max(max(r) / max(sum(r) / e, 1e-9) for r in grid)
            m["moe/load_min_over_mean"] = min(min(r) / max(sum(r) / e, 1e-9) for r in grid)
            warnings = self._idle(grid, idle_share)
        self.lm_sum = self.aux_sum = self.counts = None
        self.micro = 0
        return m, warnings

    def _idle(self, grid, share: float, intervals: int = 5) -> list[str]:
        out = []
        e = self.info.num_experts
        for layer, row in enumerate(grid):
            even = sum(row) / e
            idle = []
            for ex, n in enumerate(row):
                key = (layer, ex)
                self.idle_intervals[key] = self.idle_intervals.get(key, 0) + 1 if n < share * even else 0
                if self.idle_intervals[key] == intervals:
                    idle.append(str(ex))
            if idle:
                out.append(f"MoE: expert{'s' if len(idle) > 1 else ''} {', '.join(idle)} of sparse layer {layer} got "
                           f"under {share:.0%} of an even share of tokens for {intervals} log intervals in a row "
                           f"(router collapse?); raise model.router_aux_loss_coef")
        return out
