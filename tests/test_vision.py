"""Vision: the shapes generator, ImageFolder data, torchvision classifiers (head, local
pretrained weights, freezing) and ResNet-18 training on 2 processes. Their construction under
ZeRO-3 is checked in tests/test_zero3.py."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import REPO, fp32, metrics, run_train
from zerotrain.models import build_workload, resolve
from zerotrain.train.config import DataConfig, ModelConfig
from zerotrain.train.data import build_data
from zerotrain.train.data.make_shapes import main as make_shapes_main
from zerotrain.train.data.make_shapes import make_shapes
from zerotrain.train.errors import CheckpointError, ConfigError, DataError

COLOURS = ["red", "green", "blue", "yellow"]


@pytest.fixture(scope="module")
def colours(tmp_path_factory) -> Path:
    # 4 colour classes: learnable to well above chance (25%) in a few dozen CPU steps.
    # 52 val images: not a multiple of the global eval batch (16), so the last batch is padded.
    return make_shapes(tmp_path_factory.mktemp("colours"), COLOURS, per_class=32, val_per_class=13, size=40)


def imagefolder(path, **kw):
    return build_data(DataConfig(kind="imagefolder", path=str(path), image_size=kw.pop("image_size", 32), **kw),
                      None, 0)


# ----------------------------------------------------------------------------- generator

def test_make_shapes_is_deterministic_and_laid_out_as_imagefolder(tmp_path):
    a = make_shapes(tmp_path / "a", ["circle", "red_square", "blue"], per_class=3, val_per_class=2, size=24, seed=1)
    b = make_shapes(tmp_path / "b", ["circle", "red_square", "blue"], per_class=3, val_per_class=2, size=24, seed=1)
    c = make_shapes(tmp_path / "c", ["circle", "red_square", "blue"], per_class=3, val_per_class=2, size=24, seed=2)
    files = sorted(p.relative_to(a) for p in a.rglob("*.jpg"))
    assert len(files) == 3 * (3 + 2)
    assert {p.parts[0] for p in files} == {"train", "val"}
    assert {p.parts[1] for p in files} == {"circle", "red_square", "blue"}
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    assert any((a / f).read_bytes() != (c / f).read_bytes() for f in files)
    from PIL import Image
    with Image.open(a / files[0]) as im:
        assert im.size == (24, 24) and im.mode == "RGB"


def test_make_shapes_cli_rejects_unknown_class(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        make_shapes_main([str(tmp_path / "x"), "--classes", "circle,purple_blob"])
    assert e.value.code == 2
    assert "purple_blob" in capsys.readouterr().err
    assert make_shapes_main([str(tmp_path / "ok"), "--classes", "circle,ring", "--per-class", "2", "--size", "16"]) == 0
    assert len(list((tmp_path / "ok" / "val" / "ring").glob("*.jpg"))) == 1  # default val = per-class / 4, at least 1


# ----------------------------------------------------------------------------- ImageFolder data

def test_imagefolder_classes_transforms_and_labels(colours):
    data = imagefolder(colours, image_size=32)
    assert data.task == "classify" and data.num_classes == 4
    assert data.class_names == sorted(COLOURS)
    assert (len(data.train), len(data.val)) == (4 * 32, 4 * 13)
    s = data.train[0]
    assert s["pixel_values"].shape == (3, 32, 32) and s["pixel_values"].dtype == torch.float32
    assert s["labels"].dtype == torch.long
    # Labels follow the directory of each file (sorted class order).
    assert [int(data.train[i]["labels"]) for i in (0, 32, 64, 96)] == [0, 1, 2, 3]
    # Normalised with the ImageNet statistics: roughly centred, not [0, 1].
    assert data.val[0]["pixel_values"].min() < 0
    # Validation transforms are deterministic; training ones are random crops/flips, drawn per
    # (seed, epoch, sample): the same epoch-tagged index gives the same image on any rank or
    # resume, another epoch of the same sample another crop, and the caller's RNG is untouched.
    assert torch.equal(data.val[5]["pixel_values"], data.val[5]["pixel_values"])
    rng = torch.get_rng_state()
    assert torch.equal(data.train[5]["pixel_values"], data.train[5]["pixel_values"])
    assert torch.equal(torch.get_rng_state(), rng)
    n = len(data.train)
    assert not all(torch.equal(data.train[5]["pixel_values"], data.train[e * n + 5]["pixel_values"]) for e in (1, 2, 3))
    assert torch.equal(data.train[n + 5]["labels"], data.train[5]["labels"])


def test_imagefolder_layout_errors(tmp_path, colours):
    with pytest.raises(DataError, match="does not exist"):
        imagefolder(tmp_path / "nope")
    with pytest.raises(DataError, match="train"):
        imagefolder(colours / "train")  # pointed one level too deep: no train/ inside
    bad = make_shapes(tmp_path / "bad", ["red", "blue"], per_class=1, val_per_class=1, size=16)
    (bad / "val" / "green").mkdir()
    (bad / "val" / "red" / "red_00000.jpg").rename(bad / "val" / "green" / "g.jpg")
    with pytest.raises(DataError, match="green"):
        imagefolder(bad)
    empty = make_shapes(tmp_path / "empty", ["red", "blue"], per_class=1, val_per_class=0, size=16)
    (empty / "train" / "white").mkdir()
    with pytest.raises(DataError, match="white has no images"):
        imagefolder(empty)


def test_unreadable_image_fails_by_path_or_is_skipped(tmp_path, capsys):
    root = make_shapes(tmp_path / "s", ["red", "blue"], per_class=3, val_per_class=2, size=16)
    broken = root / "train" / "blue" / "blue_00001.jpg"
    broken.write_bytes(b"not a jpeg at all")
    (root / "val" / "red" / "red_00001.jpg").write_bytes(b"\xff\xd8 truncated")
    data = imagefolder(root, image_size=16)
    idx = [p for p, _ in data.train.samples].index(str(broken))
    with pytest.raises(DataError) as e:
        data.train[idx]
    assert str(broken) in str(e.value) and "on_bad_sample" in str(e.value)

    data = imagefolder(root, image_size=16, on_bad_sample="skip")
    assert len(data.val) == 3  # the unreadable val image is dropped at start-up, never substituted
    sample = data.train[idx]  # replaced by the next readable image: the batch keeps its size
    assert sample["pixel_values"].shape == (3, 16, 16)
    err = capsys.readouterr().err
    assert str(broken) in err and "red_00001.jpg" in err


# ----------------------------------------------------------------------------- models

def test_head_sized_for_dataset_and_torchvision_names(colours):
    from zerotrain.models.vision import is_vision
    assert is_vision("resnet50") and is_vision("vit_b_16") and not is_vision("gpt-tiny")
    data = imagefolder(colours)
    wl = build_workload(resolve(ModelConfig(name="resnet18")), data)
    assert wl.family == "vision" and wl.task == "classify"
    assert wl.model.fc.out_features == 4
    assert wl.model_config["class_names"] == sorted(COLOURS)
    assert wl.flops_per_item > 0
    batch = {"pixel_values": torch.randn(3, 3, 32, 32), "labels": torch.tensor([0, 1, 3])}
    stats = wl.eval_stats(wl.model.eval(), batch)
    assert set(stats) == {"loss", "top1", "top5"} and stats["top1"].shape == (3,)
    assert torch.equal(stats["top5"], torch.ones(3))  # 4 classes: the label is always in the top 5
    with pytest.raises(ConfigError, match="num_classes 2 is smaller"):
        build_workload(resolve(ModelConfig(name="resnet18", num_classes=2)), data)


def test_image_size_the_architecture_cannot_take_is_a_config_error(colours):
    data = imagefolder(colours, image_size=32)
    with pytest.raises(ConfigError, match="alexnet cannot classify 32x32"):
        build_workload(resolve(ModelConfig(name="alexnet")), data)


@pytest.fixture(scope="module")
def imagenet_resnet18(tmp_path_factory):
    """A stand-in for torchvision's ImageNet file: a 1000-class resnet18 state_dict, .pth and .safetensors."""
    import torchvision
    from safetensors.torch import save_file
    d = tmp_path_factory.mktemp("weights")
    torch.manual_seed(3)
    sd = torchvision.models.resnet18(num_classes=1000).state_dict()
    torch.save(sd, d / "resnet18-imagenet.pth")
    save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "resnet18-imagenet.safetensors"))
    return d, sd


@pytest.mark.parametrize("suffix", ["pth", "safetensors"])
def test_pretrained_local_file_replaces_only_the_head(colours, imagenet_resnet18, suffix):
    d, sd = imagenet_resnet18
    data = imagefolder(colours)
    wl = build_workload(resolve(ModelConfig(name="resnet18", pretrained=str(d / f"resnet18-imagenet.{suffix}"))), data)
    got = wl.model.state_dict()
    assert wl.model_config["new_head"] == ["fc.weight", "fc.bias"]
    assert got["fc.weight"].shape == (4, 512)
    for k, v in sd.items():
        if not k.startswith("fc."):
            assert torch.equal(got[k], v), k
    assert all(p.requires_grad for p in wl.model.parameters())


def test_freeze_backbone_trains_only_the_head(colours, imagenet_resnet18):
    d, _ = imagenet_resnet18
    data = imagefolder(colours)
    wl = build_workload(resolve(ModelConfig(name="resnet18", pretrained=str(d / "resnet18-imagenet.pth"),
                                    freeze_backbone=True)), data)
    assert [n for n, p in wl.model.named_parameters() if p.requires_grad] == ["fc.weight", "fc.bias"]
    with pytest.raises(ConfigError, match="freeze_backbone needs model.pretrained"):
        build_workload(resolve(ModelConfig(name="resnet18", freeze_backbone=True)), data)


def test_pretrained_errors_say_what_to_do(tmp_path, colours, imagenet_resnet18, monkeypatch):
    d, _ = imagenet_resnet18
    data = imagefolder(colours)
    # A file of another architecture is refused, naming the keys, instead of half-loading.
    with pytest.raises(CheckpointError, match="does not fit resnet34"):
        build_workload(resolve(ModelConfig(name="resnet34", pretrained=str(d / "resnet18-imagenet.pth"))), data)
    (tmp_path / "junk.pth").write_bytes(b"\x80\x04 not a pickle")
    with pytest.raises(CheckpointError, match="junk.pth: cannot read"):
        build_workload(resolve(ModelConfig(name="resnet18", pretrained=str(tmp_path / "junk.pth"))), data)
    with pytest.raises(ConfigError, match="does not exist"):
        build_workload(resolve(ModelConfig(name="resnet18", pretrained=str(tmp_path / "missing.pth"))), data)
    # Hub weights by tag: never downloaded; the message names the URL and the flag.
    monkeypatch.setattr(torch.hub, "_hub_dir", str(tmp_path / "hub"))
    with pytest.raises(ConfigError) as e:
        build_workload(resolve(ModelConfig(name="resnet18", pretrained="IMAGENET1K_V1")), data)
    msg = str(e.value)
    assert "does not download" in msg and "resnet18-f37072fd.pth" in msg and "--model.pretrained" in msg
    # ... but a tag whose file is already in the local hub cache is used.
    cached = tmp_path / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    cached.parent.mkdir(parents=True)
    cached.write_bytes((d / "resnet18-imagenet.pth").read_bytes())
    wl = build_workload(resolve(ModelConfig(name="resnet18", pretrained="IMAGENET1K_V1")), data)
    assert wl.model_config["new_head"] == ["fc.weight", "fc.bias"]


def test_batchnorm_keeps_fp32_statistics_when_parameters_are_bf16(colours):
    """DeepSpeed bf16 casts parameters, not buffers: BatchNorm then computes with its affine
    parameters upcast, statistics and their momentum updates stay fp32 (as under DDP)."""
    wl = build_workload(resolve(ModelConfig(name="resnet18")), imagefolder(colours, image_size=16))
    ref = copy.deepcopy(wl.model).train()
    for p in wl.model.parameters():  # what DeepSpeed's _cast_module_mixed_precision does
        p.data = p.data.to(torch.bfloat16)
    x = torch.randn(2, 3, 16, 16)
    with pytest.raises(RuntimeError):
        copy.deepcopy(wl.model)(x.to(torch.bfloat16))  # plain BatchNorm refuses the mix
    assert wl.keep_norm_stats_fp32(wl.model) == 20  # every BatchNorm of a resnet18
    out = wl.model(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and wl.model.bn1.running_var.dtype == torch.float32
    ref(x)
    # The statistics were updated from the same batch as in fp32 (inputs differ only by bf16 rounding).
    torch.testing.assert_close(wl.model.bn1.running_mean, ref.bn1.running_mean, rtol=0.02, atol=1e-3)
    assert int(wl.model.bn1.num_batches_tracked) == 1
    out.float().sum().backward()
    assert wl.model.bn1.weight.grad.dtype == torch.bfloat16 and wl.model.bn1.weight.grad.abs().sum() > 0


# ----------------------------------------------------------------------------- training on 2 processes

def _recompute(export_dir: Path, data) -> dict:
    """Val loss / top-1 of the exported weights, in this single process, one sample at a time."""
    from zerotrain.models.vision import load_exported
    model, meta = load_exported(export_dir)
    xs = torch.stack([data.val[i]["pixel_values"] for i in range(len(data.val))])
    ys = torch.stack([data.val[i]["labels"] for i in range(len(data.val))])
    with torch.no_grad():
        logits = torch.cat([model(x[None]) for x in xs])
    return {"n": len(ys), "correct": int((logits.argmax(-1) == ys).sum()),
            "loss": float(F.cross_entropy(logits, ys)), "class_names": meta["class_names"]}


@pytest.mark.multiproc
@pytest.mark.parametrize("launcher,strategy", [("torchrun", "ddp"), ("torchrun", "zero2")])
def test_resnet18_trains_above_chance_and_val_metrics_match_a_recomputation(tmp_path, colours, launcher, strategy):
    run_dir = tmp_path / "run"
    args = ["--ds-config", fp32(tmp_path, strategy), "--model.name", "resnet18", "--data.kind", "imagefolder",
            "--data.path", str(colours), "--data.image_size", "32", "--train.micro_batch_size", "8",
            "--train.max_steps", "16", "--train.eval_every", "0", "--train.eval_batches", "null",
            "--optim.lr", "2e-3", "--optim.warmup_steps", "2", "--logging.progress", "false",
            "--logging.every_steps", "1", "--checkpoint.save_at_end", "false",
            "--checkpoint.export", "true", "--checkpoint.export_dtype", "fp32", "--train.run_dir", str(run_dir)]
    run_train(launcher, 2, args)
    rows = metrics(run_dir)
    losses = [r["loss"] for r in rows if "loss" in r]
    val = [r for r in rows if "val/top1" in r][-1]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4
    # 4 balanced classes: chance is 25%.
    assert val["val/top1"] >= 0.6, val
    # Every validation image counted exactly once (52 = 3 full global batches of 16 + 4 padded).
    assert val["val/samples"] == 4 * 13
    assert json.loads((run_dir / "classes.json").read_text()) == sorted(COLOURS)
    # The gathered 2-rank metrics equal a 1-process recomputation with the exported weights.
    again = _recompute(run_dir / "export", imagefolder(colours, image_size=32))
    assert again["n"] == val["val/samples"]
    assert again["correct"] == round(val["val/top1"] * again["n"])
    assert math.isclose(again["loss"], val["val/loss"], rel_tol=1e-4, abs_tol=1e-5)
    assert again["class_names"] == sorted(COLOURS)


@pytest.mark.parametrize("name", ["resnet50_imagefolder", "resnet18_shapes", "linear_regression", "hf_finetune",
                                  "gpt_tokens"])
def test_example_run_files_are_valid(name):
    from zerotrain.train.config import load_config
    cfg = load_config(REPO / "examples" / f"{name}.yaml")
    assert cfg.data.kind in ("imagefolder", "regression", "tokens")
