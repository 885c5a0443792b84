"""What a micro-batch adds to a rank's peak: the activations models/gpt.py saves for backward,
and sequence parallelism's all-to-all buffers."""

from __future__ import annotations

from zerotrain.train.plan.shapes import BatchShape


def activation_bytes(cfg, batch: BatchShape, elem: int) -> int:
    """Saved activations of models/gpt.py at the start of backward, per device.

    Per token and layer: RMSNorms keep fp32 input and normalised copies (2 x 2D x 4 bytes);
    attention keeps the qkv input and output, roped q and k, the SDPA output (flash/efficient
    kernels: no T x T matrix) and the proj input (6D + 3kv elements with the MLP input D),
    plus fp32 log-sum-exp per head; SwiGLU keeps gate/up, silu(gate) and their product (4F).
    The head keeps the final norm, lm_head input and fp32 log-probs (+ their gradient and
    the logits while backward starts). Packed rows and document-masked windows add the document
    mask: one (micro, 1, T, T) tensor in the compute dtype that every layer saves (models/gpt.py
    document_mask), not one per layer. Checked against saved-tensor hooks in tests/test_plan.py.
    Sequence parallelism (N): a rank holds 1/N of each row's tokens and every saved tensor is per
    token (attention's q, k, v, output: the whole row for 1/N of the heads, the same count), so
    everything divides by N but the document mask (attention sees whole rows); the all-to-all
    buffers are sp_exchange_bytes."""
    d, kv, f, v, h = cfg.d_model, cfg.n_kv_head * cfg.head_dim, cfg.ffn_dim, cfg.vocab_size, cfg.n_head
    layer = 16 * d + elem * (6 * d + 3 * kv + 4 * f) + 4 * h
    head = 8 * d + elem * d + 4 * v + (4 + elem) * v + 16
    T = batch.seq_len or cfg.seq_len
    tokens = batch.micro * T // batch.sequence_parallel
    mask = batch.micro * T * T * elem if batch.document_mask else 0
    if batch.checkpointing:
        # Only block inputs are saved; one block is recomputed (fully) during backward.
        return tokens * (cfg.n_layer * elem * d + layer + head) + mask
    return tokens * (cfg.n_layer * layer + head) + mask


def sp_exchange_bytes(cfg, batch: BatchShape, elem: int) -> int:
    """Ulysses' all-to-all buffers at their peak, transient in forward (and again for the gradients
    in backward): q, k and v of one layer each as a contiguous send copy and a receive buffer
    (models/ulysses.py), 2 x (D + 2 kv) elements per local token; 0 without SP."""
    if batch.sequence_parallel <= 1:
        return 0
    tokens = batch.micro * (batch.seq_len or cfg.seq_len) // batch.sequence_parallel
    return 2 * elem * tokens * (cfg.d_model + 2 * cfg.n_kv_head * cfg.head_dim)
