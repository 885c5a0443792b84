"""Metric sinks behind one interface: log(metrics, step) / close(). Main process only.

metrics.jsonl is always written so nothing depends on W&B; W&B goes through Accelerate's
tracker API and is imported lazily (see wandb_logger.py).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path


def _clean(v):
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/Inf; keep them visible as strings
    return v


class JsonlLogger:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(self.path, "a", buffering=1)

    def log(self, metrics: dict, step: int):
        self.f.write(json.dumps({"step": step, "time": round(time.time(), 3),
                                 **{k: _clean(v) for k, v in metrics.items()}}) + "\n")

    def close(self):
        self.f.close()


class Loggers:
    """Fans out to every sink; a no-op on non-main ranks."""

    def __init__(self, sinks: list):
        self.sinks = sinks

    def log(self, metrics: dict, step: int):
        for s in self.sinks:
            s.log(metrics, step)

    def close(self):
        for s in self.sinks:
            s.close()


def read_jsonl(path) -> list[dict]:
    rows = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows
