"""models/losses.py: the chunked LM cross-entropy (issue 12) computes F.cross_entropy's fp32
mathematics without an fp32 (N, V) copy of the logits, and Workload uses it for every LM."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from zerotrain.models.losses import cross_entropy, token_losses

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# (N, V, chunk_bytes): several chunks with a ragged last one (small and GPT-2 vocabularies), one row
# per chunk, one chunk for all
SHAPES = [(300, 1000, 4 * 1000 * 7), (37, 50304, 4 * 50304 * 5), (19, 64, 1), (1000, 257, 2 ** 30)]


def _reference(x: torch.Tensor, t: torch.Tensor):
    """F.cross_entropy on the logits upcast to fp32: loss and fp32 gradient."""
    ref_in = x.detach().float().clone().requires_grad_()
    loss = F.cross_entropy(ref_in, t)
    loss.backward()
    return loss.detach(), ref_in.grad


def _ours(x: torch.Tensor, t: torch.Tensor, chunk_bytes: int):
    x = x.detach().clone().requires_grad_()
    loss = cross_entropy(x, t, chunk_bytes=chunk_bytes)
    loss.backward()
    return loss.detach(), x.grad


def _bf16_order(x: torch.Tensor) -> torch.Tensor:
    """bf16 values as integers in the order of the reals: neighbours differ by 1 (= 1 ulp)."""
    b = x.view(torch.int16).to(torch.int32)
    return torch.where(b < 0, -(b & 0x7FFF), b)


def _batch(n, v, dtype, device, ignore_every=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, v, generator=g) * 3).to(dtype).to(device)
    t = torch.randint(0, v, (n,), generator=g)
    if ignore_every:
        t[::ignore_every] = -100
    return x, t.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,v,chunk", SHAPES)
@pytest.mark.parametrize("ignore_every", [None, 7])
def test_fp32_equals_torch_cross_entropy(device, n, v, chunk, ignore_every):
    x, t = _batch(n, v, torch.float32, device, ignore_every)
    ref, ref_grad = _reference(x, t)
    loss, grad = _ours(x, t, chunk)
    assert loss.dtype == torch.float32 and grad.dtype == torch.float32
    assert abs(loss.item() - ref.item()) <= 1e-6 * abs(ref.item())
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-6)
    assert (grad - ref_grad).norm() <= 1e-6 * ref_grad.norm()
    if ignore_every:
        assert grad[::ignore_every].abs().max() == 0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n,v,chunk", SHAPES)
@pytest.mark.parametrize("ignore_every", [None, 5])
def test_bf16_equals_fp32_cross_entropy_rounded_once(device, n, v, chunk, ignore_every):
    x, t = _batch(n, v, torch.bfloat16, device, ignore_every)
    ref, ref_grad = _reference(x, t)              # fp32 mathematics on the bf16 values
    loss, grad = _ours(x, t, chunk)
    assert loss.dtype == torch.float32 and grad.dtype == torch.bfloat16
    assert abs(loss.item() - ref.item()) <= 1e-6 * abs(ref.item())
    ulps = (_bf16_order(grad) - _bf16_order(ref_grad.to(torch.bfloat16))).abs()
    assert ulps.max() <= 1
    assert (ulps == 0).float().mean() > 0.99      # almost always the very same bf16 value


def test_fp16_logits_and_int32_targets():
    x, t = _batch(64, 500, torch.float16, "cpu", 3)
    ref, ref_grad = _reference(x, t)
    loss, grad = _ours(x, t.int(), 4 * 500 * 10)
    assert abs(loss.item() - ref.item()) <= 1e-6 * abs(ref.item())
    torch.testing.assert_close(grad, ref_grad.half(), rtol=2 ** -10, atol=1e-7)


def test_more_accurate_than_torch_against_float64():
    """Not only close to F.cross_entropy: at least as close to the exact (float64) answer."""
    x, t = _batch(64, 50304, torch.float32, "cpu")
    x64 = x.double().requires_grad_()
    exact = F.cross_entropy(x64, t)
    exact.backward()
    exact, exact_grad = exact.detach(), x64.grad
    ref, ref_grad = _reference(x, t)
    loss, grad = _ours(x, t, 2 ** 20)
    assert abs(loss.double() - exact) <= max(abs(ref.double() - exact), 1e-6 * abs(exact))
    assert (grad.double() - exact_grad).norm() <= 2 * (ref_grad.double() - exact_grad).norm()


def test_grad_out_scales_and_loss_is_differentiable_in_a_graph():
    x, t = _batch(50, 100, torch.float32, "cpu")
    w = torch.tensor(2.5, requires_grad=True)
    a = x.clone().requires_grad_()
    (w * cross_entropy(a * 1.0, t, chunk_bytes=4 * 100 * 8)).backward()
    b = x.clone().requires_grad_()
    (2.5 * F.cross_entropy(b, t)).backward()
    torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-6)
    torch.testing.assert_close(w.grad, F.cross_entropy(x, t), rtol=1e-6, atol=0)


def test_all_rows_ignored_is_zero_loss_and_zero_grad():
    """F.cross_entropy gives nan (0/0); a fully masked micro-batch must not poison the run."""
    x = torch.randn(16, 30, requires_grad=True)
    t = torch.full((16,), -100)
    loss = cross_entropy(x, t)
    loss.backward()
    assert loss.item() == 0.0 and x.grad.abs().max() == 0
    assert cross_entropy(x.detach(), t).item() == 0.0


def test_custom_ignore_index_and_no_grad_path():
    x, t = _batch(40, 60, torch.float32, "cpu")
    t[::3] = 0
    ref = F.cross_entropy(x, t, ignore_index=0)
    assert abs(cross_entropy(x, t, ignore_index=0).item() - ref.item()) <= 1e-6 * ref.item()
    with torch.no_grad():
        got = cross_entropy(x.clone().requires_grad_(), t, ignore_index=0)
    assert abs(got.item() - ref.item()) <= 1e-6 * ref.item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_losses_match_reduction_none(dtype):
    x, t = _batch(333, 777, dtype, "cpu", 4)
    ref = F.cross_entropy(x.float(), t, reduction="none")
    got = token_losses(x, t, chunk_bytes=4 * 777 * 50)
    assert got.dtype == torch.float32 and not got.requires_grad
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    assert (got[::4] == 0).all()


def test_bad_shapes_are_errors():
    with pytest.raises(ValueError, match=r"\(N, V\)"):
        cross_entropy(torch.randn(2, 3, 4), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="integer"):
        cross_entropy(torch.randn(2, 3), torch.zeros(2))


def test_autocast_does_not_change_the_result():
    x, t = _batch(64, 300, torch.bfloat16, "cpu")
    plain, plain_grad = _ours(x, t, 4 * 300 * 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto, auto_grad = _ours(x, t, 4 * 300 * 16)
    assert auto.dtype == torch.float32 and auto.item() == plain.item()
    assert torch.equal(auto_grad, plain_grad)


# ----------------------------------------------------------------------------- memory

def _saved_bytes(fn, x, t) -> tuple[int, list]:
    """Bytes autograd keeps for backward (each storage once), and what it keeps."""
    saved = {}

    def pack(tensor):
        saved[(tensor.data_ptr(), tensor.dtype, tuple(tensor.shape))] = tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn(x, t)
    return sum(saved.values()), list(saved)


def test_saves_the_logits_themselves_and_no_fp32_copy():
    n, v = 2048, 4096
    x = torch.randn(n, v, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, v, (n,))
    logits_bytes = x.numel() * x.element_size()
    old, _ = _saved_bytes(lambda a, b: F.cross_entropy(a.float(), b), x, t)
    new, kept = _saved_bytes(cross_entropy, x, t)
    assert old >= 2 * logits_bytes                # the fp32 log-softmax, (N, V)
    assert new <= logits_bytes + 32 * n           # the bf16 logits (no copy) + a few (N,) vectors
    assert (x.data_ptr(), torch.bfloat16, (n, v)) in kept
    assert not any(dtype == torch.float32 and len(shape) == 2 for _, dtype, shape in kept)


# ----------------------------------------------------------------------------- Workload

def _gpt_workload(vocab=97, seq=16):
    from zerotrain.models import build_workload, resolve
    from zerotrain.train.config import ModelConfig
    from zerotrain.train.data import DataBundle
    data = DataBundle(train=None, val=None, task="lm", describe="", vocab_size=vocab, seq_len=seq)
    torch.manual_seed(0)
    return build_workload(resolve(ModelConfig(name="gpt-tiny", n_layer=1, d_model=32, n_head=2, seq_len=seq)), data)


def _lm_batch(vocab, b=3, seq=16):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (b, seq + 1), generator=g)
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def _old_loss(wl, model, batch):
    out = wl.logits(model, batch).float()
    return F.cross_entropy(out.view(-1, out.size(-1)), batch["labels"].reshape(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_workload_lm_loss_and_eval_match_the_fp32_formula(dtype):
    wl = _gpt_workload()
    model = wl.model.to(dtype)
    batch = _lm_batch(97)
    ref = _old_loss(wl, model, batch)
    ref.backward()
    ref_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss = wl.loss(model, batch)
    loss.backward()
    assert loss.dtype == torch.float32
    assert abs(loss.item() - ref.item()) <= 1e-6 * ref.item()
    for p, g in zip(model.parameters(), ref_grads):
        if dtype == torch.float32:
            torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-7)
        else:  # the logits' gradient may differ by 1 bf16 ulp; that propagates
            torch.testing.assert_close(p.grad.float(), g.float(), rtol=0.05, atol=1e-3)
    stats = wl.eval_stats(model, batch)
    with torch.no_grad():
        out = wl.logits(model, batch).float()
        per_tok = F.cross_entropy(out.transpose(1, 2), batch["labels"], reduction="none")
    torch.testing.assert_close(stats["loss"], per_tok.mean(1), rtol=1e-6, atol=1e-6)


def test_hf_workload_uses_the_same_loss(tmp_path):
    pytest.importorskip("transformers")
    from helpers import lm_bundle, save_tiny

    from zerotrain.models import build_workload, resolve
    from zerotrain.train.config import ModelConfig
    for kind in ("gpt2", "llama"):
        d = save_tiny(kind, tmp_path / kind, 120)
        wl = build_workload(resolve(ModelConfig(name=f"hf:{d}")), lm_bundle(120))
        batch = _lm_batch(120, b=2)
        ref = _old_loss(wl, wl.model, batch)
        loss = wl.loss(wl.model, batch)
        assert abs(loss.item() - ref.item()) <= 1e-6 * ref.item(), kind
        loss.backward()
        assert all(p.grad is not None for p in wl.model.parameters() if p.requires_grad)
