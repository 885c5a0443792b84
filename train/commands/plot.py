"""`zerotrain plot RUN_DIR [RUN_DIR ...] [-o out.png]`: loss / learning rate / throughput
curves from each run's metrics.jsonl, several runs on one figure (e.g. ZeRO-2 vs ZeRO-3).
Needs no W&B and no display (matplotlib's Agg canvas)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from zerotrain.train.errors import ConfigError, DataError, user_errors

PANELS = (  # (title, y-axis keys in order of preference); a panel no run has is left out
    ("loss", ("loss",)),
    ("learning rate", ("lr",)),
    ("throughput", ("tokens_per_s", "samples_per_s")),
    ("model FLOPs utilisation", ("mfu",)),
)


def read_series(run_dir: Path) -> dict[str, tuple[list[int], list[float]]]:
    """key -> (steps, values). A resumed run appends steps it already logged before a crash;
    the later row wins, so the curve shows the training that actually continued."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise DataError(f"{run_dir}: no metrics.jsonl here; pass the train.run_dir of a run")
    by_key: dict[str, dict[int, float]] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            # The last line of a run that is still writing (or was killed) may be partial.
            continue
        step = row.get("step")
        if not isinstance(step, int):
            continue
        for k, v in row.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                by_key.setdefault(k, {})[step] = float(v)
    if "loss" not in by_key:
        raise DataError(f"{path}: no training loss logged yet (the run logs every logging.every_steps steps)")
    return {k: (sorted(d), [d[s] for s in sorted(d)]) for k, d in by_key.items()}


def labels_for(run_dirs: list[Path]) -> list[str]:
    """Shortest distinguishing names: the directory names, or the full paths when those clash."""
    names = [p.resolve().name for p in run_dirs]
    return names if len(set(names)) == len(names) else [str(p) for p in run_dirs]


def render(run_dirs: list[Path], out: Path) -> Path:
    from matplotlib.figure import Figure  # OO API: no pyplot state, no GUI backend needed
    from matplotlib.ticker import MaxNLocator

    series = [read_series(d) for d in run_dirs]
    panels = [p for p in PANELS if any(k in s for s in series for k in p[1])]
    fig = Figure(figsize=(6.0 * len(panels), 4.2), layout="constrained")
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    for ax, (title, keys) in zip(axes, panels):
        used = []
        for label, s, color in zip(labels_for(run_dirs), series, _colors(len(series))):
            key = next((k for k in keys if k in s), None)
            if key is None:
                continue
            used.append(key)
            ax.plot(*s[key], color=color, label=label if key == keys[0] else f"{label} ({key})")
            if title == "loss" and "val/loss" in s:
                ax.plot(*s["val/loss"], color=color, linestyle="--", marker="o", markersize=3,
                        label=f"{label} (val)")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.set_ylabel(" / ".join(dict.fromkeys(used)))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def _colors(n: int) -> list[str]:
    cycle = [f"C{i}" for i in range(10)]
    return [cycle[i % 10] for i in range(n)]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="zerotrain plot", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR", help="train.run_dir of each run")
    p.add_argument("-o", "--output", type=Path, default=None,
                   help="PNG to write (default: RUN_DIR/metrics.png for one run, ./compare.png for several)")
    args = p.parse_args(argv)
    with user_errors():
        out = args.output or (args.run_dirs[0] / "metrics.png" if len(args.run_dirs) == 1 else Path("compare.png"))
        if out.suffix.lower() != ".png":
            raise ConfigError(f"-o {out}: the output must be a .png file")
        print(render(args.run_dirs, out))
    return 0
