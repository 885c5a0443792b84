"""model.activation_checkpointing for every workload: the same loss, gradients and BatchNorm
statistics with it on and off (in process, fp32), really recomputing, names unchanged, and a
clear error where a model cannot. ZeRO-3 on 2 processes: tests/test_stages.py (GPT) and
tests/test_hf.py (Llama); the memory it saves: bench/activation_checkpointing.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zerotrain.models import build_workload, resolve
from zerotrain.train.config import ModelConfig
from zerotrain.train.data import DataBundle
from zerotrain.train.errors import ConfigError

IMAGES = DataBundle(train=None, val=None, task="classify", describe="", num_classes=4, class_names=list("abcd"),
                    extra={"image_size": 32})


def step(model, x, y):
    """One training forward/backward: (loss, {name: grad})."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(5)  # the same dropout masks (MobileNet's classifier)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["resnet18", "mobilenet_v3_small", "vit_b_32"])
def test_torchvision_blocks_recompute_with_identical_results(name):
    extra = {"image_size": 64 if name.startswith("vit") else 32}
    data = DataBundle(**{**IMAGES.__dict__, "extra": extra})
    models = {}
    for on in (False, True):
        torch.manual_seed(0)
        models[on] = build_workload(resolve(ModelConfig(name=name, activation_checkpointing=on)), data).model
    off, on = models[False], models[True]
    assert list(off.state_dict()) == list(on.state_dict())           # nothing renamed
    calls = []
    unit = next(m for m in on.modules() if type(m).__name__.startswith("Checkpointed"))
    unit.register_forward_pre_hook(lambda *a: calls.append(1))  # (recomputation may stop before post-hooks)
    x = torch.randn(4, 3, extra["image_size"], extra["image_size"], generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 2, 3])
    loss_off, grads_off = step(off, x, y)
    loss_on, grads_on = step(on, x, y)
    assert len(calls) == 2                                          # forward, then recomputed in backward
    assert loss_on == loss_off and grads_on.keys() == grads_off.keys()
    for n in grads_off:
        torch.testing.assert_close(grads_on[n], grads_off[n], rtol=1e-5, atol=1e-6, msg=n)
    # BatchNorm statistics moved once per step, not twice (the recomputation leaves them alone).
    for (n, a), b in zip(off.named_buffers(), on.buffers()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=n)
    with torch.no_grad():                                           # evaluation: no checkpointing involved
        torch.testing.assert_close(on.eval()(x), off.eval()(x), rtol=0, atol=0)


def test_models_that_cannot_recompute_say_so_up_front():
    with pytest.raises(ConfigError, match=r"vgg11 has no blocks zerotrain can recompute.*resnet\*"):
        build_workload(resolve(ModelConfig(name="vgg11", activation_checkpointing=True)), IMAGES)
    with pytest.raises(ConfigError, match="^model.activation_checkpointing is not a key of model family linear"):
        ModelConfig(name="linear", activation_checkpointing=True)  # nothing to recompute: no such key


def test_hf_model_uses_transformers_non_reentrant_checkpointing_also_with_frozen_embeddings(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 bos_token_id=1, eos_token_id=2)).save_pretrained(tmp_path / "llama")
    lm = DataBundle(train=None, val=None, task="lm", describe="", vocab_size=128, seq_len=16)
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(2))
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    results = {}
    for on in (False, True):
        wl = build_workload(resolve(ModelConfig(name=f"hf:{tmp_path / 'llama'}", activation_checkpointing=on)), lm)
        wl.model.get_input_embeddings().weight.requires_grad_(False)  # frozen input: reentrant would lose grads
        wl.model.train()
        loss = wl.loss(wl.model, batch)
        loss.backward()
        assert wl.model.is_gradient_checkpointing == on
        results[on] = (loss.item(), {n: p.grad for n, p in wl.model.named_parameters() if p.requires_grad})
    (loss_off, g_off), (loss_on, g_on) = results[False], results[True]
    assert loss_on == pytest.approx(loss_off, rel=1e-6)
    assert all(g_on[n] is not None and g_on[n].abs().sum() > 0 for n in g_off), "a parameter got no gradient"
    for n in g_off:
        torch.testing.assert_close(g_on[n], g_off[n], rtol=1e-5, atol=1e-6, msg=n)
