"""The backend registry (train/strategy/registry.py): each backend module registers itself, and the
run's Strategy, the planner's options, --ds-config auto's candidates and `zerotrain verify
--matrix`'s rows all come from it. In-process: reads the shipped JSONs, launches nothing."""

from __future__ import annotations

import json

import pytest

from helpers import REPO
from zerotrain.train import paths
from zerotrain.train.config import load_config
from zerotrain.train.strategy import for_setup, registry
from zerotrain.train.strategy.ds_config import load_ds_setup
from zerotrain.train.strategy.option import Option

SHIPPED = [("DDP", "ddp.json"), ("ZeRO-1", "zero1.json"), ("ZeRO-2", "zero2.json"), ("ZeRO-3", "zero3.json"),
           ("ZeRO-2 + opt offload", "zero2_offload.json"), ("ZeRO-3 + param/opt offload", "zero3_offload.json")]


def test_the_planner_auto_and_the_verify_matrix_list_the_registered_options_fastest_first():
    """The same six shipped options, in the order the planner has always priced them."""
    from zerotrain.train.commands.verify import matrix_strategies
    from zerotrain.train.plan.estimate import OPTIONS
    assert [(o.label, o.file) for o in registry.planner_options()] == SHIPPED
    assert list(OPTIONS) == SHIPPED
    # The matrix adds the options no auto choice takes: FSDP2's two (no sequence parallelism).
    assert matrix_strategies() == tuple((f.removesuffix(".json"), f != "ddp.json") for _, f in SHIPPED) + (
        ("fsdp2_keep", False), ("fsdp2", False))
    assert {b.name for b in registry.backends()} == {"ddp", "deepspeed", "fsdp2"}


@pytest.mark.parametrize("label,fname", SHIPPED)
def test_each_shipped_file_is_read_and_run_by_the_backend_owning_its_block(label, fname):
    """The file's block picks the backend: its Strategy runs it, its option prices it, and the
    file is one of its planner options."""
    path = paths.DS_CONFIGS / fname
    backend = registry.for_json(json.loads(path.read_text()))
    assert registry.for_option_file(fname) is backend
    cfg = load_config(str(REPO / "examples" / "default.yaml"), [])
    ds = load_ds_setup(str(path), cfg, cfg.train.batch(2), 3, cuda=False, hidden_size=64)
    assert ds.backend == backend.name
    strategy = for_setup(ds)
    assert type(strategy) is backend.strategy and strategy.backend == backend.name
    for option in (Option.from_json(label, path, "fp32", 64), Option.from_setup(ds), Option.default(label, fname, "fp32")):
        assert option.backend == backend.name and option.splits_sequences == backend.splits_sequences


def test_a_file_without_a_backend_block_is_deepspeed_zero0():
    """DeepSpeed's own default: no "zero_optimization" block is ZeRO-0."""
    assert registry.for_json({"train_batch_size": 8}).name == "deepspeed"
    assert registry.for_json({"ddp": {}}).name == "ddp"


def test_a_backend_cannot_claim_a_block_or_the_default_another_one_registered():
    before = registry.backends()
    ddp, zero = registry.get("ddp"), registry.get("deepspeed")
    with pytest.raises(ValueError, match="claims what 'ddp' registered"):
        registry.register(registry.Backend(name="other", block="ddp", strategy=ddp.strategy, setup=ddp.setup,
                                           option=ddp.option, default_option=ddp.default_option, describe=ddp.describe))
    with pytest.raises(ValueError, match="claims what 'deepspeed' registered"):
        registry.register(registry.Backend(name="other", block="other", strategy=zero.strategy, setup=zero.setup,
                                           option=zero.option, default_option=zero.default_option, describe=zero.describe,
                                           default=True))
    assert registry.backends() == before
