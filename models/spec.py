"""ModelSpec: the model, resolved once from the run file's `model:` section.

models.resolve (models/__init__.py) makes it at the start of a run: it checks the name, reads
what is known before any data (an LM's context length and vocabulary, the model's width; a
local Hugging Face model's config.json, read this once) and names the family. The run's
build, memory planner and data length then use this spec; the builders take it back to make
the model. What depends on the data (the width of "linear" and vision models, the classes,
the vocabulary a GPT is built with) stays a function of (spec, data).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from zerotrain.models.config import ModelSection


@dataclass(frozen=True)
class ModelSpec:
    config: ModelSection
    """The `model:` section it was resolved from: the options the builders read."""
    family: str
    """One of "gpt", "hf", "linear", "vision", "py" (the user's factory, models/user.py)."""
    context: Optional[int] = None
    """LM context length (the GPT preset with its overrides, or config.json); None: not an LM."""
    vocab_size: Optional[int] = None
    """LM vocabulary before any data (the GPT preset with its overrides, or config.json)."""
    hidden_size: Optional[int] = None
    """The width when it is known before any data (GPT d_model, config.json's hidden size)."""
    hf_config: Optional[dict] = None
    """hf: config.json as transformers parsed it (PretrainedConfig.to_dict()); the builders make
    their own config object from it, so nobody mutates this one."""

    @property
    def name(self) -> str:
        return self.config.name
