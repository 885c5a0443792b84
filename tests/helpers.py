"""Test helpers: launch train/main.py through the real launchers, read results (fixtures
live in conftest.py).

Multi-process tests start real processes (2 ranks, gloo on CPU). They use gpt-tiny, a
small slice of the default corpus and fp32 JSON variants where bf16 would only cost time
(bf16 matmuls are ~80x slower than fp32 on AVX2-only CPUs).
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MAIN = str(REPO / "train" / "main.py")
sys.path.insert(0, str(REPO))

# The suite runs on CPU everywhere, GPU machines included: its 2-rank launches would put rank 1
# on a second GPU that a 1-GPU machine lacks. Hidden before anything here imports torch, and
# for every launched process (subprocess_env; train/launch/device_env.py re-applies it inside each rank,
# since the deepspeed launcher rewrites CUDA_VISIBLE_DEVICES for its workers).
CPU_ONLY = {"ZEROTRAIN_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu"}
os.environ.update(CPU_ONLY)  # (conftest imports this module first, before any test imports torch)

# Small and fast: a 115k-parameter GPT on 300 kB of text, 64-token sequences.
TINY = ["--model.name", "gpt-tiny", "--data.seq_len", "64", "--data.max_bytes", "300000",
        "--train.micro_batch_size", "4", "--logging.progress", "false", "--train.sample_tokens", "0",
        "--train.eval_batches", "4", "--logging.every_steps", "1", "--optim.warmup_steps", "2",
        "--optim.lr", "3e-3", "--checkpoint.export", "false", "--checkpoint.save_at_end", "false"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env(extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", WANDB_MODE=env.get("WANDB_MODE", "disabled"),
               TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore", **CPU_ONLY)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    # The venv's tools first (its ninja builds DeepSpeed's JIT ops; Debian's would rebuild them).
    env["PATH"] = os.pathsep.join([str(BIN), *[p for p in env.get("PATH", "").split(os.pathsep) if p != str(BIN)]])
    for k, v in (extra or {}).items():  # None: unset (e.g. PYTHONWARNINGS, to see what a user sees)
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def launch_cmd(launcher: str, nproc: int, args: list[str], accelerate_config: str | None = None) -> list[str]:
    port = str(free_port())
    if launcher == "python":
        assert nproc == 1
        return [sys.executable, MAIN, *args]
    if launcher == "torchrun":
        return [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", port, MAIN, *args]
    if launcher == "deepspeed":
        return [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", port, MAIN, *args]
    if launcher == "accelerate":
        cfg = accelerate_config or str(REPO / "ds_configs" / "accelerate" / "zero2.yaml")
        return [str(BIN / "accelerate"), "launch", "--config_file", cfg, "--num_processes", str(nproc),
                "--main_process_port", port, MAIN, *args]
    raise ValueError(launcher)


def run_train(launcher: str, nproc: int, args: list[str], *, timeout: int = 600, env: dict | None = None,
              check: bool = True, accelerate_config: str | None = None, cwd: str | Path | None = None):
    cmd = launch_cmd(launcher, nproc, args, accelerate_config)
    proc = subprocess.run(cmd, cwd=cwd or REPO, env=subprocess_env(env), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}\nexit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                             f"--- stderr\n{proc.stderr[-6000:]}")
    return proc


def metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run_dir) if "loss" in r}


def ds_variant(tmp_path: Path, base: str, name: str | None = None, **changes) -> str:
    """A copy of ds_configs/<base>.json with top-level keys replaced (e.g. bf16={"enabled": False})."""
    data = json.loads((REPO / "ds_configs" / f"{base}.json").read_text())
    for k, v in changes.items():
        if v is None:
            data.pop(k, None)
        else:
            data[k] = v
    out = tmp_path / f"{name or base}.json"
    out.write_text(json.dumps(data, indent=1))
    return str(out)


def fp32(tmp_path: Path, base: str) -> str:
    return ds_variant(tmp_path, base, f"{base}_fp32", bf16={"enabled": False}, fp16={"enabled": False})


def accelerate_yaml(tmp_path: Path, ds_json: str | None, nproc: int = 2) -> str:
    """An accelerate config like ds_configs/accelerate/*.yaml, pointing at `ds_json` (None = DDP)."""
    import yaml
    base = "zero2" if ds_json else "ddp"
    cfg = yaml.safe_load((REPO / "ds_configs" / "accelerate" / f"{base}.yaml").read_text())
    cfg["num_processes"] = nproc
    if ds_json:
        cfg["deepspeed_config"]["deepspeed_config_file"] = ds_json
    out = tmp_path / f"accelerate_{Path(ds_json).stem if ds_json else 'ddp'}.yaml"
    out.write_text(yaml.safe_dump(cfg))
    return str(out)


def rank_infos(run_dir: Path) -> list[dict]:
    files = sorted((Path(run_dir) / "ranks").glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    return [json.loads(p.read_text()) for p in files]


def data_trace(run_dir: Path, rank: int) -> list[dict]:
    path = Path(run_dir) / "ranks" / f"rank{rank}.data.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


_RUNS: dict = {}


def cached_run(tmp_path_factory, launcher: str, nproc: int, args: list[str], **kw) -> Path:
    """Run once per session for identical (launcher, nproc, args); returns the run dir (the
    launcher's stdout is kept in <run_dir>/launcher.out, its stderr in launcher.err). Lets several test modules assert on
    the same real launch instead of relaunching: a launch costs ~15-20 s on 2 cores."""
    key = (launcher, nproc, tuple(args), tuple(sorted((k, str(v)) for k, v in kw.items())))
    if key not in _RUNS:
        run_dir = tmp_path_factory.mktemp(f"{launcher}{nproc}")
        proc = run_train(launcher, nproc, [*args, "--train.run_dir", str(run_dir)], **kw)
        (run_dir / "launcher.out").write_text(proc.stdout)
        (run_dir / "launcher.err").write_text(proc.stderr)
        _RUNS[key] = run_dir
    return _RUNS[key]


def assert_resumable_checkpoint(ckpt_root: Path, step: int) -> dict:
    """`latest` names step `step`'s checkpoint, every file in it matches the manifest (size and
    sha256: what --resume checks before loading), and its train state puts the data position
    at that step's boundary. What a resume needs from a save, without a launch (resuming a
    complete checkpoint exactly is tests/test_checkpoint.py's promise). Returns meta.json."""
    from zerotrain.train.checkpoint import files as io
    ckpt = ckpt_root / (ckpt_root / io.LATEST).read_text().strip()
    assert ckpt.name == io.step_dir_name(step), ckpt
    manifest = io.read_manifest(ckpt)
    assert manifest["step"] == step and io.META in manifest["files"]
    assert [io.check_file(ckpt, n, rec) for n, rec in manifest["files"].items()] == [None] * len(manifest["files"])
    assert not [p.name for p in ckpt_root.iterdir() if p.name.startswith(io.TMP_PREFIX)]  # no half-written save
    meta = io.read_json(ckpt / io.META, "meta")
    st, data = meta["train_state"], meta["data"]
    assert st["step"] == step
    assert st["epoch"] * data["steps_per_epoch"] * data["global_batch"] + st["offset"] == step * data["global_batch"]
    return meta


def assert_zero3_planned_to_the_byte(row: dict):
    """A ZeRO-3 run's measured model states against the plan: parameters and gradients exactly, the
    optimizer states up to torch AdamW's 4-byte `step` scalar per stepped tensor (the plan leaves it
    out; one per optimizer sub-group under ZeRO-3)."""
    assert row["mem/params_bytes"] == row["plan/params_bytes"], row
    assert row["mem/grads_bytes"] == row["plan/grads_bytes"], row
    assert 0 <= row["mem/optimizer_bytes"] - row["plan/optimizer_bytes"] <= 4 * 4, row
    for measured, planned in zip(row["mem/model_states_bytes_per_rank"], row["plan/model_states_bytes_per_rank"]):
        assert 0 <= measured - planned <= 4 * 4, row


def small_run_args(ds_json: str, steps: int = 4) -> list[str]:
    """The tiny GPT for a few steps with every rank's data recorded: the launcher, multi-node
    and bf16 tests share these launches (same args = one launch per session)."""
    return [*TINY, "--ds-config", ds_json, "--train.max_steps", str(steps), "--train.eval_every", "0",
            "--debug.trace_data", "true"]


# d_model 256: every matrix and the tied embedding exceed ZeRO-3's persistence threshold ("auto":
# 10 x d_model) and are partitioned; accumulation 2 shows ZeRO-1's full gradients.
STAGE_STEPS = 6
STAGE_ARGS = [*TINY, "--model.d_model", "256", "--model.n_layer", "2", "--train.grad_accum_steps", "2",
              "--train.max_steps", str(STAGE_STEPS), "--train.eval_every", "0", "--train.eval_batches", "1"]



def run_main(capsys, argv) -> tuple[int, str]:
    """train/main.py's main() in this process, expected to exit: (exit code, stderr)."""
    import pytest
    from zerotrain.train.main import main as train_main
    with pytest.raises(SystemExit) as e:
        train_main(argv)
    err = capsys.readouterr().err
    return e.value.code, err


# Tiny local text and Hugging Face tokenizers (tokens, hf and sft tests).

def make_tokenizer(out_dir: Path, texts: list[str], vocab_size: int = 384):
    """A small byte-level BPE tokenizer trained on `texts`, saved as a local HF tokenizer dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>")
    fast.save_pretrained(str(out_dir))
    return fast


def random_text(n: int, seed: int) -> str:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "zeta", "theta", "kappa", "sigma", "omega", "lambda"]
    out, size = [], 0
    while size < n:
        w = rng.choice(words) + rng.choice([" ", " ", " ", ", ", ".\n"])
        out.append(w)
        size += len(w)
    return "".join(out)[:n]


def write_texts(d: Path, texts: dict[str, str]) -> Path:
    for name, text in texts.items():
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
    return d


# Tiny local Hugging Face causal LMs (hf, lora and sft tests).

SEQ = 32


def save_tiny(kind: str, out: Path, vocab: int, tokenizer_dir: Path | None = None, weights: bool = True) -> Path:
    """A randomly initialised tiny GPT-2 (tied embeddings) or Llama (GQA, untied), saved locally."""
    import torch  # (here and below: this module is imported before torch may be, see CPU_ONLY)
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = GPT2Config(vocab_size=vocab, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                         eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = GPT2LMHeadModel(cfg)
    else:
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
        model = LlamaForCausalLM(cfg)
    if weights:
        model.save_pretrained(str(out))
    else:
        cfg.save_pretrained(str(out))
    if tokenizer_dir is not None:
        for f in tokenizer_dir.iterdir():
            (out / f.name).write_bytes(f.read_bytes())
    return out


def lm_bundle(vocab: int, max_token: int | None = None):
    from zerotrain.train.data import DataBundle
    return DataBundle(train=None, val=None, task="lm", describe="", vocab_size=vocab, seq_len=SEQ,
                      extra={} if max_token is None else {"max_token": max_token, "token_file": "x.bin"})


def hf_val_loss(model, tokens_path: Path) -> tuple[float, int]:
    """Mean per-sequence loss over the whole validation file, as the trainer defines it."""
    import torch
    import torch.nn.functional as F

    from zerotrain.train.config import DataConfig
    from zerotrain.train.data import build_data
    data = build_data(DataConfig(kind="tokens", path=str(tokens_path)), SEQ, 0)
    losses = []
    with torch.no_grad():
        for i in range(len(data.val)):
            s = data.val[i]
            logits = model(input_ids=s["input_ids"][None]).logits[0]
            losses.append(float(F.cross_entropy(logits.float(), s["labels"])))
    return sum(losses) / len(losses), len(losses)


# Bad instruction-data records (data.kind sft), each as line 2 of d.jsonl after a good one, and
# the one line that names it: the reliability catalogue runs them through training, test_sft
# through `zerotrain prepare --sft`.
BAD_SFT_RECORDS = {
    "not JSONL": ("this is not json", "d.jsonl:2: not JSON"),
    "missing response": ('{"prompt": "x"}', 'd.jsonl:2: missing "response"'),
    "wrong type": ('{"prompt": "x", "response": 3}', 'd.jsonl:2: "response" must be a string (got int)'),
    "empty after truncation": (json.dumps({"prompt": "x" * 100, "response": "y"}),
                               "d.jsonl:2: the response is empty after truncation to data.seq_len 32"),
    "unknown role": (json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}),
                     'd.jsonl:2: messages[1] has the unknown role "bot"'),
}


# Token files as `zerotrain prepare` writes them (.bin + sidecar .json): the mixture tests.

def write_token_file(path: Path, tokens, tokenizer: str = "bytes", vocab_size: int = 256) -> Path:
    import numpy as np
    arr = np.asarray(tokens, dtype=np.uint16)
    path.parent.mkdir(parents=True, exist_ok=True)
    arr.tofile(path)
    meta = {"format": "zerotrain-tokens", "version": 1, "dtype": "uint16", "vocab_size": vocab_size,
            "num_tokens": int(arr.size), "max_token": int(arr.max()), "tokenizer": tokenizer, "files": 1}
    path.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    return path


def source_tokens(source: int, num_sequences: int, seq_len: int, seed: int = 0):
    """Random tokens of `num_sequences` windows of seq_len (+1): source s draws ids from its own
    band [64 s, 64 s + 64), so a sample tells which source it came from (ids // 64)."""
    import numpy as np
    rng = np.random.default_rng([seed, source])
    return rng.integers(64 * source, 64 * source + 64, size=num_sequences * seq_len + 1)


def write_shard_dir(path: Path, tokens, shard_tokens: int, vocab_size: int = 256) -> Path:
    """A shard directory (manifest.json + shard_*.bin) of `tokens`, written by the real writer
    (train/data/prepare_pool.py ShardWriter + manifest_meta) without tokenizing anything."""
    import numpy as np

    from zerotrain.train.data.prepare_pool import ShardWriter, manifest_meta, write_manifest
    path.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(path, "shard", np.uint16, shard_tokens, [], on_shard=lambda entry: None)
    writer.write(np.asarray(tokens, dtype=np.uint16), lambda k: None)
    writer.close(None)
    write_manifest(path, manifest_meta(np.uint16, vocab_size, "bytes", shard_tokens, {"shards": writer.entries}, 0,
                                       {"test": str(path)}))
    return path


# A tiny sparse mixture-of-experts causal LM (the MoE tests, docs/workloads.md's walk-through).

MOE_VOCAB, MOE_EXPERTS = 64, 8


def save_tiny_moe(out: Path, kind: str = "qwen3_moe") -> Path:
    """A random 2-layer Qwen3-MoE or Mixtral (8 experts, top-2) whose first sparse layer routes
    by token band: ids below MOE_VOCAB / 2 go to experts 0-3, the others to experts 4-7. Its
    first attention output is zero and each embedding's first coordinate is +-3 by band, so the
    router of layer 0 sees the band; the router's rows weight that coordinate +1 (experts 0-3)
    or -1 (experts 4-7). Data whose ranks hold different bands routes to disjoint experts."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(0)
    common = dict(vocab_size=MOE_VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2,
                  router_aux_loss_coef=0.01, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    if kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(**common, head_dim=8, intermediate_size=64, moe_intermediate_size=16,
                             num_experts=MOE_EXPERTS, decoder_sparse_step=1, norm_topk_prob=True)
        model = Qwen3MoeForCausalLM(cfg)
    else:
        cfg = MixtralConfig(**common, intermediate_size=16, num_local_experts=MOE_EXPERTS)
        model = MixtralForCausalLM(cfg)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb.normal_(0, 0.02)
        emb[:, 0] = torch.where(torch.arange(MOE_VOCAB) < MOE_VOCAB // 2, 3.0, -3.0)
        layer = model.model.layers[0]
        layer.self_attn.o_proj.weight.zero_()
        router = layer.mlp.gate.weight
        router.normal_(0, 0.02)
        router[:, 0] = torch.where(torch.arange(MOE_EXPERTS) < MOE_EXPERTS // 2, 1.0, -1.0)
    model.save_pretrained(str(out))
    return out


def layer0_experts(model_dir: Path, input_ids) -> set[int]:
    """The experts layer 0 of the saved model routes these tokens to (top-k of its router logits)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(input_ids).reshape(1, -1), output_router_logits=True)
    return set(out.router_logits[0].topk(model.config.num_experts_per_tok, dim=-1).indices.reshape(-1).tolist())


def banded_tokens(path: Path, seed: int, n_windows: int = 40) -> Path:
    """A token file whose training windows reach rank 0 only with ids < MOE_VOCAB/2 and rank 1
    only with ids above, in a 2-process run of data.seq_len SEQ, micro-batch 1 and train.seed
    `seed`: the epoch order is the sampler's, positions alternate ranks (Accelerate's split_batches)."""
    import numpy as np
    import torch

    from zerotrain.train.config import DataConfig
    from zerotrain.train.data import build_data
    rng = np.random.default_rng(0)
    write_token_file(path, rng.integers(0, MOE_VOCAB, n_windows * SEQ + 1), vocab_size=MOE_VOCAB)
    n_train = len(build_data(DataConfig(kind="tokens", path=str(path)), SEQ, seed).train)
    order = torch.randperm(n_train, generator=torch.Generator().manual_seed(seed * 1_000_003)).tolist()
    tokens = rng.integers(0, MOE_VOCAB, n_windows * SEQ + 1)
    half = MOE_VOCAB // 2
    for pos, w in enumerate(order):
        band = rng.integers(0, half, SEQ) if pos % 2 == 0 else rng.integers(half, MOE_VOCAB, SEQ)
        tokens[w * SEQ:(w + 1) * SEQ] = band
    return write_token_file(path, tokens, vocab_size=MOE_VOCAB)


def zero3_all_partitioned(tmp: Path) -> str:
    """fp32 ZeRO-3 with persistence threshold 0: every tensor, router rows and norms included, is partitioned."""
    z = json.loads((REPO / "ds_configs" / "zero3.json").read_text())["zero_optimization"]
    return ds_variant(tmp, "zero3", "zero3_fp32_all", bf16={"enabled": False}, fp16={"enabled": False},
                      zero_optimization={**z, "stage3_param_persistence_threshold": 0})


# A Hugging Face Hub on 127.0.0.1 (HF_ENDPOINT), for Hub ids (tests/test_hub.py).

class FakeHub:
    """The part of the Hub's HTTP API huggingface_hub's snapshot_download speaks: repo info by
    revision, the file tree, HEAD/GET of /<repo>/resolve/<revision>/<file> (X-Repo-Commit, ETag),
    and the X-Error-Code of a missing repo / revision / file. `downloads` counts the GETs of each
    (repo, file): what a real Hub would serve."""

    def __init__(self):
        from collections import Counter
        self.repos: dict = {}      # repo -> {commit: {path: bytes}}
        self.refs: dict = {}       # (repo, branch or tag) -> commit
        self.downloads = Counter()

    def add(self, repo: str, directory: Path, tags=(), repo_type: str = "model") -> str:
        """Every file of `directory` as one commit of `repo` (on main and `tags`); its hash. A
        dataset repository is kept as "datasets/<repo>", as its URLs name it."""
        import hashlib
        repo = repo if repo_type == "model" else f"datasets/{repo}"
        files = {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}
        commit = hashlib.sha1(json.dumps(sorted((k, hashlib.sha1(v).hexdigest()) for k, v in files.items()))
                              .encode()).hexdigest()
        self.repos.setdefault(repo, {})[commit] = files
        for ref in ("main", *tags):
            self.refs[(repo, ref)] = commit
        return commit

    def _commit(self, repo: str, rev: str):
        return rev if rev in self.repos.get(repo, {}) else self.refs.get((repo, rev))

    def serve(self) -> str:
        """Start serving on a free port (a daemon thread); returns the endpoint URL."""
        import hashlib
        import threading
        import urllib.parse
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, body=b"", headers=None, head=False):
                self.send_response(code)
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if not head:
                    self.wfile.write(body)

            def _error(self, kind, head):
                self._send(404, json.dumps({"error": kind}).encode(), {"X-Error-Code": kind, "X-Error-Message": kind},
                           head)

            def _answer(self, head: bool):
                parts = [urllib.parse.unquote(p) for p in urllib.parse.urlparse(self.path).path.strip("/").split("/")]
                prefix = ""
                if parts[:2] == ["api", "datasets"] or parts[:1] == ["datasets"]:  # a dataset repository's URLs
                    prefix = "datasets/"
                    parts = ["api", "models", *parts[2:]] if parts[0] == "api" else parts[1:]
                api = parts[:2] == ["api", "models"] and len(parts) >= 6
                if not api and not (len(parts) >= 5 and parts[2] == "resolve"):
                    return self._error("NotFound", head)
                repo = prefix + "/".join(parts[2:4] if api else parts[:2])
                if repo not in hub.repos:
                    return self._error("RepoNotFound", head)
                commit = hub._commit(repo, parts[5] if api else parts[3])
                if commit is None:
                    return self._error("RevisionNotFound", head)
                files = hub.repos[repo][commit]
                if api and parts[4] == "revision":
                    body = {"id": repo.removeprefix("datasets/"), "sha": commit, "siblings": [{"rfilename": f} for f in files]}
                    return self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head)
                if api:  # the tree
                    body = [{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                            for f, b in files.items()]
                    return self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"}, head)
                name = "/".join(parts[4:])
                if name not in files:
                    return self._error("EntryNotFound", head)
                if not head:
                    hub.downloads[(repo, name)] += 1
                self._send(200, files[name], {"X-Repo-Commit": commit,
                                              "ETag": f'"{hashlib.sha1(files[name]).hexdigest()}"'}, head)

            def do_GET(self):
                self._answer(False)

            def do_HEAD(self):
                self._answer(True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"
