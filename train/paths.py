"""Where zerotrain's own files are: one place, so moving a module cannot break a path."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parent.parent   # the checkout (train/ and models/ live here)
DS_CONFIGS = REPO / "ds_configs"                 # the shipped DeepSpeed JSONs and accelerate YAMLs
EXTENSIONS_CACHE = REPO / ".cache" / "torch_extensions"  # DeepSpeed's JIT-built CPU ops (built once)
