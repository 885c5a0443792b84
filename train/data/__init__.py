"""Datasets by `data.kind`, all returning dict samples, plus what the model needs to know."""

from __future__ import annotations

from typing import Optional

from zerotrain.train.config import DataSection
from zerotrain.train.data.bundle import DataBundle  # noqa: F401 (what every builder returns; importable from here)


def build_data(cfg: DataSection, seq_len: Optional[int], seed: int, tokenizer: Optional[str] = None) -> DataBundle:
    """`seq_len`: the LM sequence length (data.seq_len or the model's context); `tokenizer`:
    sft's and stream's local Hugging Face tokenizer directory (None: bytes)."""
    if cfg.kind == "text":
        from zerotrain.train.data.text import VOCAB, TokenSequences, decode, read_bytes
        tokens, what = read_bytes(cfg.path, cfg.max_bytes, cfg.subset, cfg.split)
        n_val = int(len(tokens) * cfg.val_fraction)
        train_tok, val_tok = tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:]
        val = TokenSequences(val_tok, seq_len) if n_val > seq_len + 1 else None
        return DataBundle(train=TokenSequences(train_tok, seq_len), val=val, task="lm",
                          describe=f"bytes of {what} ({len(tokens) / 1e6:.1f} MB)", items_per_sample=seq_len,
                          vocab_size=VOCAB, seq_len=seq_len, decode=decode)
    if cfg.kind == "regression":
        from zerotrain.train.data.regression import Regression
        n_val = max(1, int(cfg.num_samples * cfg.val_fraction)) if cfg.val_fraction > 0 else 0
        return DataBundle(train=Regression(cfg.num_samples, cfg.num_features, cfg.noise, seed, "train"),
                          val=Regression(n_val, cfg.num_features, cfg.noise, seed, "val") if n_val else None,
                          task="regress", describe=f"synthetic regression ({cfg.num_features} features)",
                          num_features=cfg.num_features)
    if cfg.kind == "tokens" and cfg.sources:
        from zerotrain.train.data.mixture import build_mixture
        return build_mixture(cfg, seq_len, seed)
    if cfg.kind == "tokens":
        from zerotrain.train.data.tokens import build_tokens
        return build_tokens(cfg, seq_len)
    if cfg.kind == "sft":
        from zerotrain.train.data.sft import build_sft
        return build_sft(cfg, seq_len, tokenizer, seed)
    if cfg.kind == "preference":
        from zerotrain.train.data.preference import build_preference
        return build_preference(cfg, seq_len, tokenizer)
    if cfg.kind == "stream":
        from zerotrain.train.data.stream import build_stream
        return build_stream(cfg, seq_len, seed, tokenizer)
    if cfg.kind == "py":
        from zerotrain.train.data.user import build_user_data
        return build_user_data(cfg)
    if cfg.kind == "imagefolder":
        from zerotrain.train.data.imagefolder import build_imagefolder
        return build_imagefolder(cfg, seed)
    raise AssertionError(cfg.kind)  # the loader knows no other kinds (DATA_KINDS)
