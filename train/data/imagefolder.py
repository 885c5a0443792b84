"""ImageFolder classification data: root/train/<class>/*.jpg and root/val/<class>/*.jpg.

Standard ImageNet recipe: train = RandomResizedCrop(S) + horizontal flip, val = Resize(S*256/224)
+ CenterCrop(S), both normalised with the ImageNet mean/std (what torchvision's pretrained
weights expect). Classes are the sorted sub-directory names of train/; val/ may hold a
subset of them. The file lists are sorted, so every rank indexes the same samples.

The training augmentation draws from a generator seeded by (train.seed, epoch, sample index),
not from the process's global RNG: a sample gets the same crop and flip whichever rank, world
size, accumulation split or resume loads it (the sampler tags each index with its epoch:
DataBundle.epoch_tagged), so `zerotrain verify` compares one run with the same images.

Unreadable images (data.on_bad_sample):
  fail: the run stops with the file's path.
  skip: a training image is replaced by the next readable one (the batch keeps its size;
        the path is printed once); validation images are header-checked at start-up and
        the unreadable ones dropped, so val metrics never count a substitute.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from torch.utils.data import Dataset

from zerotrain.train.config import ImageFolderData
from zerotrain.train.data.bundle import DataBundle
from zerotrain.train.errors import DataError

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def _images_in(d: Path) -> list[str]:
    out = []
    for dirpath, dirnames, filenames in os.walk(d, followlinks=True):
        dirnames[:] = sorted(x for x in dirnames if not x.startswith("."))
        out += [os.path.join(dirpath, f) for f in filenames
                if f.lower().endswith(IMAGE_EXTENSIONS) and not f.startswith(".")]
    return sorted(out)


def find_classes(train_dir: Path) -> list[str]:
    if not train_dir.is_dir():
        raise DataError(f"data.path: {train_dir} is not a directory; data.kind = imagefolder expects "
                        f"<root>/train/<class>/*.jpg and <root>/val/<class>/*.jpg "
                        f"(`zerotrain make-shapes <root>` writes a small example)")
    classes = sorted(e.name for e in os.scandir(train_dir) if e.is_dir() and not e.name.startswith("."))
    if not classes:
        raise DataError(f"{train_dir} has no class sub-directories; put each class's images in "
                        f"{train_dir}/<class name>/")
    return classes


def scan_split(split_dir: Path, classes: list[str], split: str) -> list[tuple[str, int]]:
    """[(path, class index)] sorted by class then path."""
    present = sorted(e.name for e in os.scandir(split_dir) if e.is_dir() and not e.name.startswith("."))
    if not present and _images_in(split_dir):
        raise DataError(f"{split_dir} holds images but no class sub-directories; arrange it as "
                        f"{split_dir}/<class>/*.jpg with the class names of train/")
    unknown = [c for c in present if c not in classes]
    if unknown:
        raise DataError(f"{split_dir} has classes that train/ does not: {', '.join(unknown[:5])}; "
                        f"{split} classes must be a subset of the training classes")
    samples = []
    for c in present:
        files = _images_in(split_dir / c)
        if split == "train" and not files:
            raise DataError(f"{split_dir / c} has no images ({', '.join(IMAGE_EXTENSIONS)}); add some or "
                            f"remove the directory")
        samples += [(f, classes.index(c)) for f in files]
    return samples


def _open_rgb(path: str, draft: int | None = None):
    from PIL import Image
    with Image.open(path) as im:
        if draft:
            im.draft("RGB", (draft, draft))  # JPEG: decode at a reduced scale when that is still >= draft
        return im.convert("RGB")


_BAD_IMAGE_ERRORS = (OSError, ValueError, SyntaxError)  # PIL: truncated/unknown files, bad headers


class ImageFolderSet(Dataset):
    """`seed` set (the training split): indices are epoch * len + i (epoch-tagged) and each
    sample's random transform is seeded by (seed, epoch, i). None: plain indices, the
    transform is deterministic (validation)."""

    def __init__(self, samples: list[tuple[str, int]], transform, on_bad_sample: str, draft: int | None = None,
                 seed: int | None = None):
        self.samples, self.transform, self.on_bad = samples, transform, on_bad_sample
        self.draft, self.seed = draft, seed
        self._reported: set[str] = set()

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict:
        n = len(self.samples)
        if self.seed is None:
            return self._load(int(index))
        epoch, i = divmod(int(index), n)
        with torch.random.fork_rng(devices=[]):  # the caller's global RNG is left as it was
            torch.manual_seed(_sample_seed(self.seed, epoch, i))
            return self._load(i)

    def _load(self, i: int) -> dict:
        n = len(self.samples)
        for attempt in range(n):
            path, label = self.samples[(i + attempt) % n]
            try:
                img = _open_rgb(path, self.draft)
            except _BAD_IMAGE_ERRORS as e:
                reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                if self.on_bad == "fail":
                    raise DataError(f"unreadable image {path} ({reason}); fix or delete it, or set "
                                    f"data.on_bad_sample skip to train on without it") from None
                if path not in self._reported:
                    self._reported.add(path)
                    print(f"zerotrain: warning: skipping unreadable image {path} ({reason})", file=sys.stderr,
                          flush=True)
                continue
            return {"pixel_values": self.transform(img), "labels": torch.tensor(label, dtype=torch.long)}
        raise DataError("no image of the dataset could be read (see the warnings above)")


def _sample_seed(seed: int, epoch: int, i: int) -> int:
    """A 63-bit seed per (seed, epoch, sample): splitmix64 of the three, so neighbours differ."""
    x = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + i * 0x94D049BB133111EB) & (2**64 - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
    return (x ^ (x >> 31)) >> 1


def readable_header(path: str) -> bool:
    from PIL import Image
    try:
        with Image.open(path) as im:
            im.verify()
        return True
    except _BAD_IMAGE_ERRORS:
        return False


def transforms(image_size: int):
    """(train, val) torchvision transforms for square `image_size` inputs."""
    from torchvision import transforms as T
    norm = [T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    resize = round(image_size * 256 / 224)  # 224 -> 256, the ImageNet eval ratio
    train = T.Compose([T.RandomResizedCrop(image_size), T.RandomHorizontalFlip(), *norm])
    val = T.Compose([T.Resize(resize), T.CenterCrop(image_size), *norm])
    return train, val, resize


def build_imagefolder(cfg: ImageFolderData, seed: int = 0):
    if cfg.path is None:
        raise DataError("data.kind = imagefolder needs data.path (the root holding train/ and val/); "
                        "`zerotrain make-shapes data/shapes` writes a small generated set")
    root = Path(cfg.path).expanduser()
    if not root.exists():
        raise DataError(f"data.path {root} does not exist")
    classes = find_classes(root / "train")
    train_tf, val_tf, resize = transforms(cfg.image_size)
    train_samples = scan_split(root / "train", classes, "train")
    train = ImageFolderSet(train_samples, train_tf, cfg.on_bad_sample, seed=seed)
    val = None
    val_note = "no val/ split"
    if (root / "val").is_dir():
        val_samples = scan_split(root / "val", classes, "val")
        if cfg.on_bad_sample == "skip":
            bad = {p for p, _ in val_samples if not readable_header(p)}
            for p in sorted(bad):
                print(f"zerotrain: warning: dropping unreadable validation image {p}", file=sys.stderr, flush=True)
            val_samples = [s for s in val_samples if s[0] not in bad]
        val = ImageFolderSet(val_samples, val_tf, cfg.on_bad_sample, draft=resize) if val_samples else None
        val_note = f"{len(val_samples)} val"
    return DataBundle(train=train, val=val, task="classify",
                      describe=f"ImageFolder {root}: {len(classes)} classes, {len(train_samples)} train / "
                               f"{val_note} images at {cfg.image_size}px",
                      num_classes=len(classes), class_names=classes, extra={"image_size": cfg.image_size},
                      epoch_tagged=True)
