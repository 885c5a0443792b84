"""Generate a small labelled image set (shapes and colours) as an ImageFolder tree.

    python -m zerotrain.train.data.make_shapes data/shapes                    # 6 shape classes
    python -m zerotrain.train.data.make_shapes data/shapes --classes red,green,blue --per-class 300
    zerotrain make-shapes data/colour_shapes --classes red_circle,blue_circle,red_square

A class name is a shape (any colour), a colour (any shape) or colour_shape. Each image
has a noisy gradient background, one filled shape at a random position, size and
rotation, and JPEG artefacts, so it is a real (if easy) vision task, not a lookup.
Output is a pure function of the arguments: same seed, same bytes.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

import numpy as np

SHAPES = ("circle", "square", "triangle", "star", "cross", "ring", "diamond", "hexagon")
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 210, 40),
           "magenta": (200, 50, 200), "cyan": (40, 200, 210), "orange": (245, 140, 30), "white": (245, 245, 245)}
DEFAULT_CLASSES = ("circle", "square", "triangle", "star", "cross", "ring")


def parse_class(name: str) -> tuple[str | None, str | None]:
    """'red_circle' -> ('red', 'circle'); 'circle' -> (None, 'circle'); 'red' -> ('red', None)."""
    parts = name.split("_")
    colour = parts[0] if parts[0] in COLOURS else None
    shape = parts[-1] if parts[-1] in SHAPES else None
    if (colour, shape) == (None, None) or len(parts) > 2 or (len(parts) == 2 and not (colour and shape)):
        raise ValueError(f"class {name!r}: use a shape ({', '.join(SHAPES)}), a colour ({', '.join(COLOURS)}) "
                         f"or colour_shape")
    return colour, shape


def _polygon(cx, cy, r, n, rot, inner=None):
    pts = []
    for k in range(n * (2 if inner else 1)):
        rad = (inner if inner and k % 2 else r)
        a = rot + k * math.pi / (n if inner else n / 2)
        pts.append((cx + rad * math.cos(a), cy + rad * math.sin(a)))
    return pts


def _jitter(rgb, rng, amount=25):
    return tuple(max(0, min(255, c + rng.randint(-amount, amount))) for c in rgb)


def draw(cls: str, size: int, rng: random.Random):
    from PIL import Image, ImageDraw, ImageFilter
    colour, shape = parse_class(cls)
    shape = shape or rng.choice(SHAPES)
    fill = _jitter(COLOURS[colour] if colour else COLOURS[rng.choice(list(COLOURS))], rng)
    # Background: a dim two-colour vertical gradient plus pixel noise.
    top, bottom = (np.array([rng.randint(0, 110) for _ in range(3)], dtype=np.float32) for _ in range(2))
    t = np.linspace(0.0, 1.0, size, dtype=np.float32)[:, None, None]                  # (S, 1, 1)
    noise = np.random.default_rng(rng.getrandbits(64)).integers(-12, 13, (size, size, 3))
    bg = np.clip(top + (bottom - top) * t + noise, 0, 255).astype(np.uint8)            # (S, S, 3)
    img = Image.fromarray(bg, "RGB")
    d = ImageDraw.Draw(img)
    r = size * rng.uniform(0.22, 0.4)
    cx, cy = rng.uniform(r, size - r), rng.uniform(r, size - r)
    rot = rng.uniform(0, 2 * math.pi)
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "circle":
        d.ellipse(box, fill=fill)
    elif shape == "ring":
        d.ellipse(box, outline=fill, width=max(2, int(r * 0.35)))
    elif shape == "square":
        d.polygon(_polygon(cx, cy, r * 1.15, 4, rot), fill=fill)
    elif shape == "diamond":
        d.polygon([(cx, cy - r), (cx + r * 0.6, cy), (cx, cy + r), (cx - r * 0.6, cy)], fill=fill)
    elif shape == "triangle":
        d.polygon(_polygon(cx, cy, r * 1.1, 3, rot), fill=fill)
    elif shape == "hexagon":
        d.polygon(_polygon(cx, cy, r, 6, rot), fill=fill)
    elif shape == "star":
        d.polygon(_polygon(cx, cy, r * 1.15, 5, rot, inner=r * 0.45), fill=fill)
    elif shape == "cross":
        w = r * 0.38
        for a in (rot, rot + math.pi / 2):
            dx, dy = math.cos(a), math.sin(a)
            nx, ny = -dy, dx
            d.polygon([(cx + dx * r + nx * w, cy + dy * r + ny * w), (cx + dx * r - nx * w, cy + dy * r - ny * w),
                       (cx - dx * r - nx * w, cy - dy * r - ny * w), (cx - dx * r + nx * w, cy - dy * r + ny * w)],
                      fill=fill)
    return img.filter(ImageFilter.GaussianBlur(radius=rng.uniform(0.0, 0.8)))


def make_shapes(out: str | Path, classes=DEFAULT_CLASSES, per_class: int = 120, val_per_class: int | None = None,
                size: int = 64, seed: int = 0) -> Path:
    out = Path(out)
    val_per_class = max(1, per_class // 4) if val_per_class is None else val_per_class
    for cls in classes:
        parse_class(cls)
    for split, n in (("train", per_class), ("val", val_per_class)):
        for cls in classes:
            d = out / split / cls
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                # A string seed is hashed with SHA-512: stable across processes and Python runs.
                rng = random.Random(f"{seed}/{split}/{cls}/{i}")
                draw(cls, size, rng).save(d / f"{cls}_{i:05d}.jpg", quality=90)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="zerotrain make-shapes", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="root directory to create (gets train/<class>/ and val/<class>/)")
    p.add_argument("--classes", default=",".join(DEFAULT_CLASSES),
                   help=f"comma list of shape, colour or colour_shape classes (default {','.join(DEFAULT_CLASSES)})")
    p.add_argument("--per-class", type=int, default=120, help="training images per class (default 120)")
    p.add_argument("--val-per-class", type=int, default=None, help="validation images per class (default per-class/4)")
    p.add_argument("--size", type=int, default=64, help="image side in pixels (default 64)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    classes = [c.strip() for c in a.classes.split(",") if c.strip()]
    if len(set(classes)) < 2:
        p.error("--classes needs at least two distinct classes")
    if a.per_class < 1 or a.size < 8 or (a.val_per_class is not None and a.val_per_class < 0):
        p.error("--per-class must be >= 1, --val-per-class >= 0 and --size >= 8")
    try:
        for c in classes:
            parse_class(c)
    except ValueError as e:
        p.error(str(e))
    root = make_shapes(a.out, classes, a.per_class, a.val_per_class, a.size, a.seed)
    n_val = max(1, a.per_class // 4) if a.val_per_class is None else a.val_per_class
    print(f"wrote {len(classes)} classes x ({a.per_class} train + {n_val} val) {a.size}px images to {root}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
