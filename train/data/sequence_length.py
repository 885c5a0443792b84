"""Tokens per sample of language-model data: data.seq_len, else the model's context, checked
against the data kind and the model (one message naming the setting to change)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from zerotrain.train.config import RunConfig
from zerotrain.train.errors import ConfigError

if TYPE_CHECKING:
    from zerotrain.models.spec import ModelSpec

LM_KINDS = ("text", "tokens", "sft", "preference", "stream")  # data kinds whose samples are token sequences


def resolve_seq_len(cfg: RunConfig, spec: ModelSpec) -> Optional[int]:
    """The run's tokens per sample (None for data that is not token sequences)."""
    ctx = spec.context
    seq_len = cfg.data.seq_len or ctx
    if cfg.data.kind in LM_KINDS and seq_len is None and spec.family == "py":
        raise ConfigError(f'data.seq_len: model.name "{cfg.model.name}" is your own model, whose context zerotrain '
                          f"does not know; set data.seq_len (tokens per sample)")
    if cfg.data.kind in LM_KINDS and seq_len is None:
        raise ConfigError(f'data.kind "{cfg.data.kind}" is language-model data but model.name "{cfg.model.name}" '
                          f"is not a language model; use a GPT preset or hf:<dir>, or another data.kind")
    if ctx is not None and seq_len > ctx:
        raise ConfigError(f"data.seq_len {seq_len} exceeds the model's context length {ctx} (model.seq_len)")
    return seq_len
