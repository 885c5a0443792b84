import math

import pytest
import torch
import torch.nn.functional as F

from zerotrain.models.gpt import GPT, PRESETS, Attention, GPTConfig, apply_rope, preset


def tiny(**overrides) -> GPTConfig:
    return preset("gpt-tiny", **overrides)


def build(cfg: GPTConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def lm_loss(model, idx):
    logits = model(idx[:, :-1])
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), idx[:, 1:].reshape(-1))


def test_forward_shape_and_seq_len_check():
    cfg = tiny()
    model = build(cfg)
    idx = torch.randint(0, cfg.vocab_size, (3, 17))
    assert model(idx).shape == (3, 17, cfg.vocab_size)
    assert model(torch.randint(0, cfg.vocab_size, (1, cfg.seq_len))).shape == (1, cfg.seq_len, cfg.vocab_size)
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, cfg.seq_len + 1, dtype=torch.long))


def test_causal():
    cfg = tiny()
    model = build(cfg).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, 32))
    t = 20
    idx2 = idx.clone()
    idx2[:, t] = (idx2[:, t] + 1) % cfg.vocab_size
    a, b = model(idx), model(idx2)
    torch.testing.assert_close(a[:, :t], b[:, :t], rtol=0, atol=0)
    assert not torch.allclose(a[:, t], b[:, t])


@pytest.mark.parametrize("name", list(PRESETS))
def test_analytic_num_params_matches_model(name):
    cfg = preset(name)
    # meta: shapes only, so gpt-7b costs no memory or init time.
    with torch.device("meta"):
        model = GPT(cfg)
    unique = sum(p.numel() for p in model.parameters())  # parameters() dedupes tied weights
    assert cfg.num_params() == unique == model.num_params()
    assert cfg.num_params(non_embedding=True) == model.num_params(non_embedding=True)
    assert all(p.device.type == "meta" for p in model.parameters())


def test_known_param_counts():
    # Llama-7B shape gives Llama-7B's exact count; gpt2-124m is in the GPT-2 124M class.
    assert preset("gpt-7b").num_params() == 6_738_415_616
    assert preset("gpt-7b").ffn_dim == 11008
    assert abs(preset("gpt2-124m").num_params() - 124e6) / 124e6 < 0.01


def test_num_params_untied_counts_lm_head():
    tied, untied = tiny(), tiny(tie_embeddings=False)
    assert untied.num_params() - tied.num_params() == tied.vocab_size * tied.d_model
    assert untied.num_params(non_embedding=True) == tied.num_params(non_embedding=True)
    assert sum(p.numel() for p in build(untied).parameters()) == untied.num_params()


def test_tied_weights_are_same_tensor():
    model = build(tiny())
    assert model.lm_head.weight is model.tok_emb.weight
    untied = build(tiny(tie_embeddings=False))
    assert untied.lm_head.weight is not untied.tok_emb.weight


def test_rope_tables_are_fp32_whatever_dtype_or_device_construction_had():
    """RoPE tables are derived, never parameters or state, and exact fp32 angles whatever
    dtype the model is cast to or built under (zero.Init bf16 built them in bf16: off by
    up to 1.7 at position 1023; tests/test_zero3.py checks that path with DeepSpeed itself)."""
    cfg = tiny(seq_len=1024)
    model = build(cfg)
    assert not any("rotary" in n for n, _ in model.named_parameters())
    assert not any("rotary" in k for k in model.state_dict()) and not list(model.buffers())
    cos, sin = model.rotary(1024, torch.device("cpu"))
    pos = torch.arange(1024, dtype=torch.float64)[:, None]
    inv = 10000.0 ** (-torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (1024, cfg.head_dim // 2)
    torch.testing.assert_close(cos.double(), (pos * inv).cos(), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin.double(), (pos * inv).sin(), rtol=0, atol=1e-6)
    # Casting the model, or building it while floating tensors default to bf16, changes nothing.
    model.to(torch.bfloat16)
    torch.testing.assert_close(model.rotary(1024, torch.device("cpu"))[0], cos, rtol=0, atol=0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        m = GPT(cfg)
    finally:
        torch.set_default_dtype(old)
    torch.testing.assert_close(m.rotary(1024, torch.device("cpu"))[0], cos, rtol=0, atol=0)
    # Built on the meta device and materialised: real tables, not uninitialised memory.
    with torch.device("meta"):
        m = GPT(cfg)
    m.to_empty(device="cpu")
    torch.testing.assert_close(m.rotary(1024, torch.device("cpu"))[0], cos, rtol=0, atol=0)


def reference_attention(attn: Attention, x, cos, sin):
    """Plain-math GQA: expand k/v per query head explicitly, masked softmax by hand."""
    B, T, D = x.shape
    H, K, Hd = attn.n_head, attn.n_kv_head, attn.head_dim
    wq, wk, wv = attn.qkv.weight.split([H * Hd, K * Hd, K * Hd], dim=0)
    q = (x @ wq.T).view(B, T, H, Hd).transpose(1, 2)
    k = (x @ wk.T).view(B, T, K, Hd).transpose(1, 2)
    v = (x @ wv.T).view(B, T, K, Hd).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    group = H // K
    k = torch.stack([k[:, h // group] for h in range(H)], dim=1)  # (B, H, T, Hd)
    v = torch.stack([v[:, h // group] for h in range(H)], dim=1)
    scores = q @ k.transpose(-2, -1) / math.sqrt(Hd)
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    y = scores.softmax(-1) @ v
    return attn.proj(y.transpose(1, 2).reshape(B, T, H * Hd))


@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
def test_gqa_matches_explicit_reference(n_kv_head):
    cfg = tiny(n_kv_head=n_kv_head)
    model = build(cfg)
    attn = model.blocks[0].attn
    T = 24
    x = torch.randn(2, T, cfg.d_model)
    cos, sin = model.rotary(T, x.device)
    torch.testing.assert_close(attn(x, cos, sin), reference_attention(attn, x, cos, sin), rtol=1e-5, atol=1e-5)


def test_activation_checkpointing_identical_loss_and_grads():
    cfg = tiny()
    idx = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    results = []
    for ckpt in (False, True):
        model = build(tiny(activation_checkpointing=ckpt)).train()
        loss = lm_loss(model, idx)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (l0, g0), (l1, g1) = results
    torch.testing.assert_close(l0, l1, rtol=0, atol=0)
    assert g0.keys() == g1.keys()
    for n in g0:
        torch.testing.assert_close(g0[n], g1[n], rtol=1e-6, atol=1e-7, msg=n)


def test_tiny_model_overfits_fixed_batch():
    cfg = tiny()
    model = build(cfg).train()
    idx = torch.randint(0, cfg.vocab_size, (4, 33), generator=torch.Generator().manual_seed(2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    first = None
    for _ in range(50):
        loss = lm_loss(model, idx)
        first = loss.item() if first is None else first
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    final = lm_loss(model, idx).item()
    assert first == pytest.approx(math.log(cfg.vocab_size), rel=0.1)  # small init => near-uniform start
    assert final < 0.5 * first, (first, final)


def test_flops_per_token_gpt2_124m_by_hand():
    cfg = preset("gpt2-124m")
    L, D, V, T, Fh = 12, 768, 50304, 1024, 2048
    assert cfg.ffn_dim == Fh  # floor(8*768/3) = 2048, already a multiple of 64
    per_layer = 4 * D * D + 3 * D * Fh + 2 * D  # qkv+proj (no GQA), SwiGLU, 2 norms
    assert per_layer == 7_079_424
    n_matmul = L * per_layer + D + V * D  # + final norm + lm_head (tied, counted once)
    assert n_matmul == 123_587_328
    expected = 6 * n_matmul + 12 * L * D * T
    assert expected == 854_770_176
    assert cfg.flops_per_token() == expected
    approx = 6 * 124e6 + 12 * L * D * T
    assert abs(cfg.flops_per_token() - approx) / approx < 0.10
    assert cfg.flops_per_token(seq_len=256) == 6 * n_matmul + 12 * L * D * 256


def test_generate_shape_and_determinism():
    cfg = tiny()
    model = build(cfg).eval()
    prompt = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(3))
    out1 = model.generate(prompt, 10, temperature=0.8, top_k=20, generator=torch.Generator().manual_seed(7))
    out2 = model.generate(prompt, 10, temperature=0.8, top_k=20, generator=torch.Generator().manual_seed(7))
    assert out1.shape == (2, 15)
    assert torch.equal(out1[:, :5], prompt)
    assert torch.equal(out1, out2)
    assert out1.min() >= 0 and out1.max() < cfg.vocab_size
    # Longer than seq_len: context is cropped instead of overflowing the RoPE tables.
    long = model.generate(prompt, cfg.seq_len + 3, generator=torch.Generator().manual_seed(7))
    assert long.shape == (2, 5 + cfg.seq_len + 3)
    greedy = model.generate(prompt, 4, temperature=0.0)
    assert torch.equal(greedy, model.generate(prompt, 4, temperature=0.0))


def test_init_deterministic_given_seed():
    a, b, c = build(tiny(), seed=123), build(tiny(), seed=123), build(tiny(), seed=124)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_init_std():
    cfg = preset("gpt-small-cpu")
    model = build(cfg)
    scaled = cfg.init_std / math.sqrt(2 * cfg.n_layer)
    assert model.tok_emb.weight.std().item() == pytest.approx(cfg.init_std, rel=0.05)
    assert model.blocks[0].attn.qkv.weight.std().item() == pytest.approx(cfg.init_std, rel=0.05)
    assert model.blocks[0].attn.proj.weight.std().item() == pytest.approx(scaled, rel=0.05)
    assert model.blocks[0].mlp.down.weight.std().item() == pytest.approx(scaled, rel=0.05)
    assert torch.equal(model.norm.weight, torch.ones(cfg.d_model))


@pytest.mark.parametrize(
    "field, kwargs",
    [
        ("vocab_size", dict(vocab_size=0)),
        ("seq_len", dict(seq_len=-1)),
        ("n_layer", dict(n_layer=0)),
        ("n_head", dict(d_model=64, n_head=3, n_kv_head=1)),  # 64 % 3
        ("n_kv_head", dict(n_head=4, n_kv_head=3)),
        ("head_dim", dict(d_model=60, n_head=4, n_kv_head=2)),  # head_dim 15 is odd
        ("dropout", dict(dropout=1.0)),
        ("dropout", dict(dropout=-0.1)),
        ("ffn_hidden", dict(ffn_hidden=0)),
        ("d_model", dict(d_model=0)),
        ("norm_eps", dict(norm_eps=0.0)),
    ],
)
def test_invalid_config_raises_naming_field(field, kwargs):
    base = dict(vocab_size=256, seq_len=64, n_layer=2, n_head=4, n_kv_head=2, d_model=64)
    with pytest.raises(ValueError, match=field):
        GPTConfig(**{**base, **kwargs})


def test_preset_overrides_and_unknown_name():
    cfg = preset("gpt-tiny", n_layer=3, dropout=None)
    assert cfg.n_layer == 3 and cfg.dropout == 0.0
    assert PRESETS["gpt-tiny"].n_layer == 2  # presets are not mutated
    with pytest.raises(ValueError) as e:
        preset("gpt-nope")
    for name in PRESETS:
        assert name in str(e.value)
    with pytest.raises(ValueError, match="n_kv_head"):
        preset("gpt-tiny", n_kv_head=3)
    with pytest.raises(ValueError, match="bogus"):
        preset("gpt-tiny", bogus=1)


def test_config_dict_round_trip():
    for name in PRESETS:
        cfg = preset(name)
        assert GPTConfig.from_dict(cfg.to_dict()) == cfg
    d = tiny().to_dict()
    d["bogus"] = 1
    with pytest.raises(ValueError, match="bogus"):
        GPTConfig.from_dict(d)
