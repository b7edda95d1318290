"""Bases shared by a layer's KV heads (``[1, G·d, r]``) in calibration's differentiable layer."""

import pytest
import torch
import torch.nn.functional as F

from stiefkv.layers import attention_block, attention_queries_keys, project_qkv, rotate_with, to_latent
from stiefkv.models import rope_spec
from stiefkv.quant import QuantSpec
from tests.tiny import random_bases, tiny_model
from tests.utils import assert_close


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def dense_projection(x: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """``[B, G, N, d]`` with the heads' channels side by side, through ``P Pᵀ`` (``P`` ``[G·d, r]``)."""
    B, G, N, d = x.shape
    flat = x.double().permute(0, 2, 1, 3).reshape(B, N, G * d)
    return (flat @ P.double() @ P.double().T).reshape(B, N, G, d).permute(0, 2, 1, 3).to(x.dtype)


def dense_attention(attn, h, P_k, P_v, key_mode, pe):
    """The layer's attention block with keys and values projected densely (no latents, no lowrank path)."""
    cos, sin = pe
    q, k, v = project_qkv(attn, h)
    q = rotate_with(q, cos, sin)
    k = rotate_with(dense_projection(k, P_k), cos, sin) if key_mode == "pre_rope" \
        else dense_projection(rotate_with(k, cos, sin), P_k)
    v = dense_projection(v, P_v)
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                         is_causal=True, scale=attn.scaling)
    return attn.o_proj(out.transpose(1, 2).reshape(h.shape[0], h.shape[1], -1))


def setup(arch="llama", heads=6, kv_heads=3, head_dim=24, n=29):
    model = tiny_model(arch, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    attn = model.model.layers[1].self_attn
    x = torch.randn(2, n, model.config.hidden_size, generator=gen(1))
    pos = torch.arange(n)[None].expand(2, -1)
    return model, attn, x, pos, model.model.rotary_emb(x, pos)


@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("arch,heads,kv_heads", [("llama", 6, 3), ("qwen3", 4, 2)])
def test_shared_bases_match_the_dense_projection(key_mode, arch, heads, kv_heads):
    """A random shared basis (columns mixing the heads' channels, odd ranks) gives the attention of keys and
    values projected onto its span, in float32 to 1e-5."""
    model, attn, x, pos, pe = setup(arch, heads, kv_heads)
    G, d = kv_heads, attn.head_dim
    P_k, P_v = random_bases(1, G * d, 17, gen(2)), random_bases(1, G * d, 23, gen(3))
    with torch.no_grad():
        got = attention_block(attn, x, P_k, P_v, key_mode=key_mode, rope=rope_spec(model.config),
                              position_embeddings=pe, positions=pos)
        want = dense_attention(attn, x, P_k[0], P_v[0], key_mode, pe)
    assert_close(got, want, atol=1e-5, rtol=1e-4, what=f"{arch} {key_mode}")
    full = dense_attention(attn, x, torch.eye(G * d), torch.eye(G * d), key_mode, pe)
    assert (got - full).abs().max() > 1e-3  # the projection is not the identity


@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
def test_block_diagonal_shared_bases_equal_the_per_head_ones(key_mode):
    """Per-head bases laid on the diagonal of a shared one (rank G·r) give the per-head path's output."""
    model, attn, x, pos, pe = setup()
    G, d = 3, attn.head_dim
    per_k, per_v = random_bases(G, d, 7, gen(4)), random_bases(G, d, 5, gen(5))
    shared_k, shared_v = torch.block_diag(*per_k)[None], torch.block_diag(*per_v)[None]
    kw = dict(key_mode=key_mode, rope=rope_spec(model.config), position_embeddings=pe, positions=pos)
    with torch.no_grad():
        assert_close(attention_block(attn, x, shared_k, shared_v, **kw),
                     attention_block(attn, x, per_k, per_v, **kw), atol=1e-5, rtol=1e-4, what=key_mode)


def test_shared_latents_are_one_per_token_and_keys_rebuild_alike():
    model, attn, x, pos, pe = setup()
    G, d = 3, attn.head_dim
    P = random_bases(1, G * d, 11, gen(6))
    _, k, _ = project_qkv(attn, x)
    z = to_latent(k, P)
    assert z.shape == (2, 1, x.shape[1], 11)
    _, k_rot, k_low = attention_queries_keys(attn, x, P, key_mode="pre_rope", position_embeddings=pe)
    assert_close(k_low, rotate_with(dense_projection(k, P[0]), *pe), atol=1e-5, rtol=1e-4,
                 what="rebuilt keys")
    with pytest.raises(ValueError, match="G·d = 72 rows"):
        to_latent(k, random_bases(1, 60, 11, gen(7)))


def test_shared_latents_quantize_and_stay_differentiable():
    """Quantized shared latents (int4 per token, exact recent tokens) run through the layer, and gradients
    reach the shared bases through the straight-through quantizer."""
    model, attn, x, pos, pe = setup()
    P_k = random_bases(1, 72, 19, gen(8)).requires_grad_()
    P_v = random_bases(1, 72, 13, gen(9)).requires_grad_()
    quant = (QuantSpec(4, "token", recent=5), QuantSpec(4, "token", recent=5))
    out = attention_block(attn, x, P_k, P_v, key_mode="pre_rope", rope=rope_spec(model.config),
                          position_embeddings=pe, positions=pos, quant=quant, straight_through=True)
    with torch.no_grad():
        exact = attention_block(attn, x, P_k, P_v, key_mode="pre_rope", rope=rope_spec(model.config),
                                position_embeddings=pe, positions=pos)
    err = float((out.detach() - exact).norm() / exact.norm())
    assert 1e-4 < err < 0.2, err
    out.pow(2).sum().backward()
    for P in (P_k, P_v):
        assert P.grad is not None and torch.isfinite(P.grad).all() and P.grad.abs().max() > 0
