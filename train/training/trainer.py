"""The training loop: accumulation, clipping, LR, evaluation, logging, stopping cleanly.

An optimizer step's loss is the mean over its global batch: of samples, or for language-model
data with masked labels (sft) of labelled tokens, counted over every micro-batch and rank before
the first backward (_token_denominator).

Everything here is the same for DDP and every ZeRO stage; the differences live in the
Accelerator (distributed.py) and the two small `if self.ds.is_deepspeed` branches below
(DeepSpeed steps and clips inside `backward`, DDP here).

The Trainer's fields are every component it works with, declared in one place; build.py
assembles them and nothing is attached to a Trainer afterwards.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch

from models.losses import IGNORE_INDEX
from train.checkpoint.cadence import SaveCadence
from train.checkpoint.state import TrainState
from train.optim import loss_scale
from train.optim.optimizer import set_lr
from train.training import faults

if TYPE_CHECKING:
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from models.workload import Workload
    from train.checkpoint.manager import Checkpointer
    from train.config import Batch, RunConfig
    from train.data.bundle import DataBundle
    from train.data.sampler import GlobalBatchSampler
    from train.dsconfig import DSSetup
    from train.launch.distributed import Topology
    from train.launch.elastic import ElasticRun
    from train.launch.sequence_parallel import SPRun
    from train.observe.metrics import Loggers
    from train.observe.wandb_logger import WandbSink
    from train.plan.rank_plan import RankPlan


class StopRequested:
    """SIGTERM/SIGINT: finish the current step, checkpoint, exit 0. A second SIGINT aborts."""

    def __init__(self):
        self.flag = False
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.flag and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.flag = True

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)


class StopVote:
    """Every rank agrees on stopping without a blocking collective per step (measured: ~5% of
    a small model's step on CPU). Each step starts an async all-reduce of this rank's flag and
    reads the one started a step earlier, long finished in the background; so all ranks stop
    together, one step after the signal. The flag is a CPU tensor on a gloo group (the default
    group under gloo, a side group under NCCL): reading it never waits for the accelerator, and
    gloo's wait() returns at once for a reduction finished a step ago, where NCCL's would only
    order the streams. A second number rides along: rank 0's checkpoint.every_minutes ticket
    (train/checkpoint/cadence.py), summed, read back as `.ticket` in the same step on every rank."""

    def __init__(self, acc):
        dist = torch.distributed
        self.dist = acc.num_processes > 1 and dist.is_available() and dist.is_initialized()
        self.group = None
        if self.dist and dist.get_backend() != "gloo":
            self.group = dist.new_group(backend="gloo")  # collective: every rank builds its StopVote
        self.buffers = [torch.zeros(2), torch.zeros(2)]  # one in flight, one being filled: [stop, ticket]
        self.views = [b.numpy() for b in self.buffers]    # filled through numpy: ~0.3 us, torch indexing ~10
        self.turn = 0
        self.pending = None  # (work, flag tensor) of the previous step
        self.ticket = 0.0    # the sum of the tickets of the vote read last

    def __call__(self, flag: bool, ticket: float = 0.0) -> bool:
        if not self.dist:
            self.ticket = ticket
            return flag
        t, view = self.buffers[self.turn], self.views[self.turn]
        self.turn ^= 1
        view[0], view[1] = float(flag), ticket
        work = torch.distributed.all_reduce(t, async_op=True, group=self.group)
        previous, self.pending = self.pending, (work, t)
        return self._read(previous)

    def finish(self) -> bool:
        """Collect the vote still in flight (every rank has one); True if it asks to stop."""
        previous, self.pending = self.pending, None
        return self._read(previous)

    def _read(self, vote) -> bool:
        if vote is None:
            self.ticket = 0.0
            return False
        vote[0].wait()
        stop, self.ticket = vote[1].tolist()  # a CPU tensor: no device sync
        return stop > 0


@dataclass(eq=False, repr=False, kw_only=True)
class Trainer:
    """One run: start() -> fit() -> finish() -> close(). Every collaborator is a field below,
    passed in by build.py; the fields after them are the loop's own bookkeeping."""

    # -- what the run is
    cfg: RunConfig                        # the run config, read only
    resolved_config: dict                 # <run_dir>/config.json's content: also the W&B run's config
    topo: Topology                        # this rank, the world size, nodes, launcher, device
    ds: DSSetup                           # the strategy: DDP or a ZeRO stage, precision, offload
    batch: Batch                          # micro x accum x world samples per optimizer step
    max_steps: int
    run_dir: Path
    # -- the distributed runtime and what it prepared
    acc: Accelerator                      # device, accumulate / backward / clip, gather, DDP's GradScaler
    model: torch.nn.Module                # accelerate.prepare's: a DeepSpeed engine, a DDP wrapper or the module
    optimizer: torch.optim.Optimizer      # accelerate.prepare's wrapper: steps and zeroes gradients under DDP
    raw_optimizer: torch.optim.Optimizer  # the torch optimizer inside it: its LR is set every step
    # -- the model's task and its data
    workload: Workload                    # loss, eval statistics, FLOPs per item of the model family
    data: DataBundle                      # the splits and what they hold (tokens per sample, decode)
    train_loader: DataLoader
    sampler: GlobalBatchSampler           # the resumable global data order, positioned from `state`
    val_loader: Optional[DataLoader]
    # -- services
    loggers: Loggers                      # metrics sinks: metrics.jsonl on rank 0, W&B added by start()
    checkpointer: Optional[Checkpointer]  # save / export; None: the run writes no checkpoint
    memory: Optional[RankPlan]            # the planner's view of this rank: banner lines, plan/* metrics
    # -- where training stands: saved in checkpoints; a resumed run passes the restored one
    state: TrainState
    # -- torchrun's elastic agent: this attempt of the job (restarts, membership); None otherwise
    elastic: Optional[ElasticRun] = None
    # -- distributed.sequence_parallel > 1: this rank's SP group (its slice of each row); None: off
    seq_parallel: Optional[SPRun] = None

    # -- the loop's own bookkeeping (not passed in)
    param_dtype: torch.dtype = field(init=False)  # batches are cast to it under DeepSpeed bf16/fp16
    last_eval: dict = field(init=False, default_factory=dict)
    stop_reason: Optional[str] = field(init=False, default=None)       # None | "signal" | "diverged"
    diverged_reason: str = field(init=False, default="")
    last_grad_norm: Optional[float] = field(init=False, default=None)  # read at the last health check
    wandb: Optional[WandbSink] = field(init=False, default=None)        # rank 0's W&B sink, once start() ran
    wandb_status: Optional[str] = field(init=False, default=None)      # rank 0's banner line about W&B
    start_counts: tuple = field(init=False, default=(0, 0, 0))         # (step, samples, tokens) at start()
    _it: object = field(init=False, default=None)       # the batch iterator; None: re-made at `state`'s position
    _order: tuple = field(init=False, default=(None, None))  # (epoch, sampler.slicer) for counting real tokens
    _bad_run: int = field(init=False, default=0)        # consecutive non-finite steps
    _health: list = field(init=False, default_factory=list)  # (step, grad norm, fp16 scale) not yet read
    _t_start: float = field(init=False, default=0.0)
    _finished: bool = field(init=False, default=False)  # finish() completed: close() reports success to W&B

    def __post_init__(self):
        self.param_dtype = next(p for p in self.model.parameters()).dtype if self.ds.is_deepspeed else torch.float32

    # ------------------------------------------------------------------ data
    def _next_batch(self):
        if self._it is None:
            self.sampler.set_position(self.state.epoch, self.state.offset)
            self._it = iter(self.train_loader)
        b = next(self._it, None)
        if b is None:  # cannot happen mid-step: an epoch is a whole number of steps
            raise RuntimeError("data loader ran out inside an optimizer step")
        if self.cfg.train.trace_data:
            self._trace(b)
        if self.seq_parallel is not None:
            b = self.seq_parallel.slice_batch(b)  # this rank's contiguous slice of each row
        if self.ds.is_deepspeed and self.param_dtype != torch.float32:
            # DeepSpeed bf16/fp16 keeps the parameters themselves in half precision.
            b = {k: v.to(self.param_dtype) if v.is_floating_point() else v for k, v in b.items()}
        return b

    def _trace(self, b):
        import json
        import zlib
        key = next(iter(b))
        rows = [zlib.crc32(t.cpu().numpy().tobytes()) for t in b[key]]
        path = self.run_dir / "ranks" / f"rank{self.topo.rank}.data.jsonl"
        with open(path, "a") as f:
            f.write(json.dumps({"step": self.state.step, "epoch": self.state.epoch, "crc": rows}) + "\n")

    def _advance_position(self):
        g = self.batch.global_size
        if self.data.mixture is not None:
            # The step's samples per source, from the plan (host arithmetic, the same on every rank).
            counts = self.sampler.step_counts(self.state.epoch, self.state.offset)
            per = self.state.source_tokens
            for name, n in zip(self.data.mixture.names, counts.tolist()):
                per[name] = per.get(name, 0) + n * self.data.items_per_sample
        self.state.offset += g
        if self.data.stream is not None:  # where a resume restarts reading (a dict lookup, once per step)
            self.state.data_cursor = self.data.stream.cursor_at(self.state.offset)
        self.state.samples_seen += g
        self.state.tokens_seen += g * self.data.items_per_sample
        if self.state.offset >= self.sampler.steps_per_epoch * g:
            self.state.epoch += 1
            self.state.offset = 0
            self._it = None

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict:
        acc, model = self.acc, self.model
        lr = self.cfg.optim.lr_at(self.state.step, self.max_steps)
        set_lr(self.raw_optimizer, lr)
        t_data = 0.0
        # Summed where it is computed: reading a loss is a host-device sync, so the trainer reads
        # its device values only at logging intervals (tests/test_sync_free.py counts).
        loss_sum = self._zero()
        grad_norm = None
        prefetched, denominator = [], None
        if self.data.masked_labels or self.seq_parallel is not None:
            # The step's micro-batches first: their labelled tokens, counted over every rank,
            # normalise the loss before the first backward (_token_denominator).
            t0 = time.perf_counter()
            prefetched = [self._next_batch() for _ in range(self.batch.accum)]
            t_data += time.perf_counter() - t0
            denominator = self._token_denominator(prefetched)
        for i in range(self.batch.accum):
            t0 = time.perf_counter()
            batch = prefetched[i] if prefetched else self._next_batch()
            t_data += time.perf_counter() - t0
            with acc.accumulate(model):
                loss = self.workload.loss(model, batch, denominator)
                if faults.nan_loss_at(self.state.step + 1, self.topo.rank):
                    loss = loss * float("nan")
                acc.backward(loss)
                if acc.sync_gradients:
                    grad_norm = self._clip_and_step()
            # reduce_window logs the mean over micro-batches and ranks: with a token denominator
            # that mean is the step's normalised loss, sum / global count.
            loss_sum += loss.detach().to(torch.float64)
        real = self._real_tokens()
        self._advance_position()
        self.state.step += 1
        self._health.append((self.state.step, grad_norm, self._scale_now()))
        return {"loss_sum": loss_sum, "lr": lr, "data_s": t_data, "real_tokens": real}

    def _real_tokens(self) -> Optional[int]:
        """Non-pad tokens of this step's global batch (sft records or packed rows: their
        real_tokens), from the step's sample indices: host arithmetic, no device read."""
        count = getattr(self.data.train, "real_tokens", None)
        if count is None:
            return None
        if self._order[0] != self.state.epoch:
            self._order = (self.state.epoch, self.sampler.slicer(self.state.epoch))
        return count(self._order[1](self.state.offset, self.state.offset + self.batch.global_size))

    def _token_denominator(self, batches: list[dict]) -> torch.Tensor:
        """What each micro-batch's summed token loss is divided by, so that the step's gradient
        is d(sum of every labelled token's loss / their number) over the whole global batch.

        Both engines average the micro-batch losses of a step: accelerate's backward divides the
        loss by the accumulation steps (DDP), DeepSpeed's engine.backward does it itself
        (scale_wrt_gas), and DDP / ZeRO average the gradients over the ranks. The gradient of a
        step is therefore mean over (micro-batch, rank) of d(loss); with loss = summed loss /
        (N / (accum x world)), N the step's global count of labelled tokens, it is d(sum / N).
        N costs one all-reduce of a scalar per step (on the device: no host read). Uniform data
        (every label counted, masked_labels false) keeps the per-micro-batch mean: the same number,
        since there N / (accum x world) is exactly the micro-batch's own count, without the
        collective. A step whose global batch has no labelled token divides by 1 (loss 0)."""
        count = torch.stack([(b["labels"] != IGNORE_INDEX).sum() for b in batches]).sum()  # int64 scalar
        dist = torch.distributed
        if self.acc.num_processes > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(count)
        return (count.clamp(min=1).to(torch.float64) / (self.batch.accum * self.acc.num_processes)).to(torch.float32)

    def _clip_and_step(self):
        """Returns the global gradient norm as the engine has it (a tensor on the device, or a
        float): it is read at the next health check, not here."""
        clip = self.cfg.train.grad_clip
        if self.ds.is_deepspeed:
            # The engine already unscaled, clipped and stepped inside backward().
            norm = self.model.get_global_grad_norm()
        else:
            norm = self.acc.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf"))
            # A non-finite global norm is the same on every rank (gradients are all-reduced
            # first), so every rank skips together, decided on the device: the fused AdamW
            # (train/optim/optimizer.py) applies nothing, moments and step count included, when found_inf
            # is 1. DeepSpeed does the same inside its step. Under fp16 the GradScaler sets
            # found_inf itself (it also lowers the scale).
            if norm is not None and self.ds.precision != "fp16":
                self.raw_optimizer.found_inf = (~torch.isfinite(norm)).to(torch.float32)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def _check_health(self) -> bool:
        """Count skipped non-finite steps since the last check; True when the run must stop
        (nan_policy / max_bad_steps / fp16 loss-scale collapse). Runs at logging intervals and
        before checkpoints (the norms are read from the device in one transfer there), so a stop
        comes at most logging.every_steps steps after its cause; a skipped step never touched the
        weights, so the checkpoint written on stop is the last good state. The decision uses the
        global gradient norm, identical on every rank, so all ranks stop together."""
        entries, self._health = self._health, []
        if not entries:
            return False
        norms, scales = _read_numbers([e[1] for e in entries]), _read_numbers([e[2] for e in entries])
        if norms[-1] is not None:
            self.last_grad_norm = norms[-1]
        for (step, _, _), norm, scale in zip(entries, norms, scales):
            if self._health_step(step, norm, scale):
                return True
        return False

    def _health_step(self, step: int, norm, scale) -> bool:
        bad = norm is not None and not math.isfinite(norm)
        t = self.cfg.train
        if self.ds.precision == "fp16":
            if bad and not self.ds.is_deepspeed:
                self.state.skipped_steps += 1  # the GradScaler skipped it (DeepSpeed counts its own)
            floor = float(self.ds.resolved.get("fp16", {}).get("min_loss_scale", 1)) if self.ds.is_deepspeed else 1.0
            self._bad_run = self._bad_run + 1 if (bad and scale is not None and scale <= floor) else 0
            if self._bad_run >= t.max_bad_steps:
                self.diverged_reason = (f"fp16 loss scale collapsed to {scale:g} with {self._bad_run} consecutive "
                                        f"overflowing steps at step {step}; the model's values exceed "
                                        f"fp16's range: use bf16 (set \"bf16\": {{\"enabled\": true}} in "
                                        f"{self.ds.path}) or lower optim.lr")
                return True
            return False
        if not bad:
            self._bad_run = 0
            return False
        self._bad_run += 1
        self.state.skipped_steps += 1
        if self.acc.is_main_process:
            print(f"zerotrain: warning: step {step}: non-finite gradient norm ({norm}); step skipped, "
                  f"weights unchanged ({self._bad_run} in a row, {self.state.skipped_steps} in total)", flush=True)
        if t.nan_policy == "stop" or self._bad_run >= t.max_bad_steps:
            why = "train.nan_policy is \"stop\"" if t.nan_policy == "stop" else \
                f"{self._bad_run} consecutive non-finite steps (train.max_bad_steps = {t.max_bad_steps})"
            self.diverged_reason = (f"training diverged at step {step}: {why}; the checkpoint holds "
                                    f"the last good weights; lower optim.lr, check the data, or raise train.grad_clip")
            return True
        return False

    def _scale_now(self):
        """This step's fp16 loss scale without a sync: DeepSpeed keeps it as a Python float, the
        GradScaler as a device tensor (copied, since it changes in place)."""
        if self.ds.precision != "fp16":
            return None
        if self.ds.is_deepspeed:
            return loss_scale.current(self.model.optimizer)
        scaler = getattr(self.acc, "scaler", None)
        return None if scaler is None else scaler._get_scale_async().detach().clone()

    def _loss_scale(self):
        """(scale, DeepSpeed's skipped-step count) for the log line; a sync: log intervals only."""
        if self.ds.precision != "fp16":
            return None, None
        if self.ds.is_deepspeed:
            return loss_scale.current(self.model.optimizer), int(self.model.skipped_steps)
        return loss_scale.current(scaler=self.acc.scaler), None

    # ------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict:
        """Under sequence parallelism every rank evaluates whole rows of its own samples."""
        if self.seq_parallel is None:
            return self._evaluate()
        with self.seq_parallel.detached(self.workload.model):
            return self._evaluate()

    @torch.no_grad()
    def _evaluate(self) -> dict:
        self.workload.sync_norm_stats(self.model)  # also what the end-of-run export then writes
        if self.val_loader is None:
            return {}
        self.model.eval()
        sums, count = {}, 0
        for batch in self.val_loader:
            if self.ds.is_deepspeed and self.param_dtype != torch.float32:
                batch = {k: v.to(self.param_dtype) if v.is_floating_point() else v for k, v in batch.items()}
            stats = self.acc.gather_for_metrics(self.workload.eval_stats(self.model, batch))
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
        if "val/loss" in out and self.workload.task == "lm":
            out["val/ppl"] = math.exp(min(50.0, out["val/loss"]))
        return out

    # ------------------------------------------------------------------ sample text
    @torch.no_grad()
    def sample_text(self, prompt: bytes = b"def ") -> Optional[str]:
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

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict:
        acc, st = self.acc, self.state
        log_every = self.cfg.logging.every_steps
        eval_every = self.cfg.train.eval_every
        bar = None
        if acc.is_main_process and self.cfg.train.progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=self.max_steps, initial=st.step, desc="train", unit="step", dynamic_ncols=True)
        # Per logging interval; train_s counts only step time (not eval / checkpoint pauses).
        window = {"loss": self._zero(), "micro": 0, "data_s": 0.0, "train_s": 0.0, "steps": 0, "real": None}
        last = {}
        self.model.train()
        if self.checkpointer:
            self.checkpointer.on_fit_start()  # a resumed run's RNG streams, right before the first step
        from train.observe.memory import MemoryReport
        # Measured model-state bytes of one early step (mem/* metrics), next to the plan's.
        mem = MemoryReport(acc=acc, model=self.model, raw_optimizer=self.raw_optimizer,
                           is_deepspeed=self.ds.is_deepspeed, start_step=st.step, max_steps=self.max_steps,
                           plan=self.memory.estimate if self.memory else None, log=self.loggers.log)
        vote = StopVote(acc)
        cadence = SaveCadence(self.cfg.checkpoint.every_steps, self.cfg.checkpoint.every_minutes, acc.is_main_process)
        saved_at = None  # the step the loop last saved (a signal at that step needs no second save)
        with StopRequested() as stop:
            while st.step < self.max_steps:
                t_step = time.perf_counter()
                mem.before_step(st.step)
                out = self.train_step()
                window["loss"] += out["loss_sum"]
                window["micro"] += self.batch.accum
                window["data_s"] += out["data_s"]
                window["steps"] += 1
                if out["real_tokens"] is not None:
                    window["real"] = (window["real"] or 0) + out["real_tokens"]
                # Every rank agrees on stopping (a signal may reach the ranks at different steps;
                # stopping alone would hang the others): an async vote, read one step later.
                # The vote also carries rank 0's checkpoint.every_minutes clock (cadence.py).
                stopping = vote(stop.flag, cadence.ticket())
                window["train_s"] += time.perf_counter() - t_step
                mem.after_step(st.step)
                done = st.step >= self.max_steps
                saving = bool(self.checkpointer and cadence.due(st.step, vote.ticket, done))
                logging_now = st.step % log_every == 0 or done or stopping
                # The interval's one read of device values (also before a checkpoint, whose state
                # counts the skipped steps).
                diverged = self._check_health() if (logging_now or saving) else False
                if logging_now or diverged:
                    last = self._log_window(window, out, bar)
                if eval_every and st.step % eval_every == 0 and not done:
                    self.last_eval = self.evaluate()
                    if self.last_eval:
                        self.loggers.log(self.last_eval, st.step)
                if saving and not diverged:
                    self.checkpointer.save(st)
                    cadence.saved()
                    saved_at = st.step
                if bar:
                    bar.update(1)
                faults.kill_after(st.step, self.topo.rank)
                if self.elastic:
                    self.elastic.progress(st.step)  # rank 0: what a restart counts as lost
                    faults.kill_node_after(st.step)
                    faults.hold_for_signal(st.step, stop)
                if stopping or diverged:
                    self.stop_reason = "diverged" if diverged else "signal"
                    break
            if vote.finish() and self.stop_reason is None:  # a signal during the last step
                self.stop_reason = "signal"
        if bar:
            bar.close()
        if self.stop_reason is None:
            self.last_eval = self.evaluate()
            if self.last_eval:
                self.loggers.log(self.last_eval, st.step)
        if self.checkpointer and (self.cfg.checkpoint.save_at_end or self.stop_reason) and saved_at != st.step:
            with StopRequested():  # a SIGTERM arriving now (another node's elastic restart) waits for the save
                self.checkpointer.save(st)
        return {**last, **self.last_eval}

    def _zero(self) -> torch.Tensor:
        """A loss accumulator on the device (read at log lines only)."""
        return torch.zeros((), dtype=torch.float64, device=self.acc.device)

    def _log_window(self, w, out, bar) -> dict:
        from train.observe import report
        from train.observe.metrics import reduce_window
        from train.observe.perf import device_peak_flops, throughput
        steps, elapsed = w["steps"], w["train_s"]
        red = reduce_window(self.acc, w["loss"], w["micro"], w["data_s"])
        m = {"loss": red["loss"], "lr": out["lr"], "epoch": self.state.epoch,
             **throughput(samples=self.batch.global_size * steps, seconds=elapsed,
                          items_per_sample=self.data.items_per_sample, flops_per_item=self.workload.flops_per_item,
                          world_size=self.topo.world_size,
                          peak_per_device=self.cfg.logging.peak_flops or device_peak_flops(), real_items=w["real"]),
             "step_time_s": elapsed / steps, "data_wait_s": red["data_wait_s"] / steps,
             "compute_s": (elapsed - red["data_wait_s"]) / steps,
             "samples_seen": self.state.samples_seen, "tokens_seen": self.state.tokens_seen,
             **{f"data/tokens/{name}": n for name, n in self.state.source_tokens.items()},
             "peak_mem_bytes": red["peak_mem_bytes"]}
        if self.last_grad_norm is not None:
            m["grad_norm"] = self.last_grad_norm  # pre-clip, at the last step of the interval
        scale, skipped = self._loss_scale()
        if scale is not None:
            m["loss_scale"] = scale
        if skipped is not None:
            self.state.skipped_steps = skipped
        m["skipped_steps"] = self.state.skipped_steps
        if self.workload.moe is not None:  # loss/lm, loss/aux, tokens per expert (models/moe.py)
            moe_metrics, warnings = self.workload.moe.window(self.acc)
            m.update(moe_metrics)
            for line in warnings if self.acc.is_main_process else ():
                print(f"zerotrain: WARNING: {line}", flush=True)
        self.loggers.log(m, self.state.step)
        if bar:
            post = {"loss": f"{m['loss']:.4f}"}
            if "tokens_per_s" in m:
                post["tok/s"] = report.human(m["tokens_per_s"])
            bar.set_postfix(post, refresh=False)
        elif self.acc.is_main_process:  # no bar (train.progress false, e.g. log files): one line per interval
            print(report.progress_line(m, self.state.step, self.max_steps), flush=True)
        w.update(loss=self._zero(), micro=0, data_s=0.0, train_s=0.0, steps=0, real=None)
        return m

    # ------------------------------------------------------------------ start / finish / close
    def start(self):
        from train.observe import report, wandb_logger
        # After build() restored the checkpoint state: a resumed run continues its W&B run.
        self.wandb, self.wandb_status = wandb_logger.start(self.acc, self.cfg, self.state, self.run_dir,
                                                           self.resolved_config)
        if self.wandb:
            self.loggers.sinks.append(self.wandb)
        if self.elastic:
            self.elastic.note_wandb(self.state.wandb_run_id)
        self._t_start = time.perf_counter()
        self.start_counts = (self.state.step, self.state.samples_seen, self.state.tokens_seen)
        if self.acc.is_main_process:
            # The full resolved config is <run_dir>/config.json (build.py); the banner names it.
            print(report.banner(self), flush=True)
            if self.elastic and self.elastic.event:  # a membership change: one line, one metrics/W&B row
                print(self.elastic.line, flush=True)
                self.loggers.event(self.elastic.event, self.state.step)

    def finish(self, result: dict):
        from train.observe import report
        elapsed = time.perf_counter() - self._t_start
        sample = self.sample_text() if self.stop_reason is None else None
        ckpt = self.checkpointer.latest_path() if self.checkpointer else None
        exported = None
        if self.checkpointer and self.cfg.checkpoint.export and self.stop_reason is None:
            exported = self.checkpointer.export()
        if self.acc.is_main_process:
            final = {"final/" + k: v for k, v in result.items() if not isinstance(v, str)}
            final["final/elapsed_s"] = elapsed
            if self.elastic:
                final["final/elastic_restarts"] = self.elastic.restarts
                final["final/steps_recomputed"] = self.elastic.steps_recomputed
            self.loggers.log(final, self.state.step)
            if self.wandb and self.stop_reason == "signal":
                self.wandb.mark_preempting()
            print(report.summary(self, result, elapsed, sample, exported, ckpt), flush=True)
        self._finished = True

    def close(self):
        if self.data.stream is not None:
            self.data.stream.close()  # its tokenizer pool, before the exit hooks join it (train/data/stream.py)
        self.loggers.close(failed=not self._finished or self.stop_reason == "diverged")
        if self.elastic:
            self.elastic.close()
        try:
            self.acc.end_training()
        finally:
            # Local for gloo (no collective), so safe after a failure on only some ranks too.
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()


def _read_numbers(values: list) -> list:
    """Python floats (None kept) for a list of device tensors / numbers, in one device-to-host copy."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if tensors:
        device = tensors[0].device
        host = iter(torch.stack([t.detach().to(device, torch.float64).reshape(()) for t in tensors]).tolist())
    return [None if v is None else next(host) if isinstance(v, torch.Tensor) else float(v) for v in values]
