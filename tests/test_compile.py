"""hardware.compile: the model is compiled in place (nn.Module.compile, what train/training/build.py calls),
so parameter names - checkpoints, exports - do not change, and it trains the same model.

In process on a one-layer GPT with the "aot_eager" backend: Dynamo's graph capture and AOT
autograd as in a real compile, without TorchInductor's code generation (80 s on a cold cache on
2 cores; its kernels are torch's to test). The full-trainer run with the default backend is a
measurement in docs/gpus.md (same losses as eager).
"""

from __future__ import annotations

import torch

from zerotrain.models import gpt


def test_compiled_gpt_keeps_names_and_matches_eager():
    torch.manual_seed(0)
    cfg = gpt.preset("gpt-tiny", n_layer=1, d_model=32, n_head=2, n_kv_head=1, seq_len=16)
    eager = gpt.GPT(cfg)
    compiled = gpt.GPT(cfg)
    compiled.load_state_dict(eager.state_dict())
    names = list(compiled.state_dict())
    compiled.compile(backend="aot_eager")
    assert list(compiled.state_dict()) == names  # no "_orig_mod." prefix: checkpoints stay compatible

    from torch._dynamo.utils import counters
    counters.clear()
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    losses = []
    for model in (eager, compiled):
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        losses.append(loss.detach())
    assert counters["stats"]["unique_graphs"] >= 1  # Dynamo really captured the forward
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
