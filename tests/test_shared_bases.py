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


# ------------------------------------------------------------------ calibration, checkpoint and serving


class _Projected:
    """``k_proj``/``v_proj`` outputs replaced by their projection onto shared bases (keys before RoPE): the
    dense model a ``pre_rope`` cache of those latents reproduces."""

    def __init__(self, model, proj):
        self.model, self.proj, self.hooks = model, proj, []

    def __enter__(self):
        for layer, P_k, P_v in zip(self.model.model.layers, self.proj.keys, self.proj.values):
            for name, P in (("k_proj", P_k[0]), ("v_proj", P_v[0])):
                Pi = (P.double() @ P.double().T).float()
                self.hooks.append(getattr(layer.self_attn, name).register_forward_hook(
                    lambda _m, _i, out, Pi=Pi: out @ Pi))
        return self

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()


def shared_calibration(corpus, head_dim=24, **kw):
    import stiefkv
    from tests.utils import CharTokenizer

    model = tiny_model(heads=6, kv_heads=3, head_dim=head_dim)
    settings = dict(budget=0.5, bits="16", share_heads=True, data=str(corpus), num_sequences=6, seq_len=33,
                    steps=4, step_sequences=2, seed=3) | kw
    return model, stiefkv.calibrate(model, CharTokenizer(), **settings)


@pytest.mark.parametrize("allocation", ["uniform", "dp"])
def test_calibration_with_shared_heads_writes_shared_bases(corpus, tmp_path, allocation):
    """``share_heads``: one ``[1, G·d, r]`` basis per latent and layer at ranks in steps of ``G · 8``, at the
    budget's bytes (``r / (G·d)`` of them), orthonormal, through a checkpoint of format 8 and back."""
    from stiefkv.projections import CheckpointError, Projections

    model, proj = shared_calibration(corpus, allocation=allocation)
    assert proj.shared and proj.format_version == 8
    for P in proj.keys + proj.values:
        assert P.shape[:2] == (1, 72) and P.shape[2] % 24 == 0
        assert_close(P[0].T @ P[0], torch.eye(P.shape[2]), atol=1e-5, rtol=0, what="orthonormal")
    if allocation == "uniform":  # 0.5 · 24 rounds down to 8 a head: 24 shared by 3 heads
        assert proj.ranks == [(24, 24)] * 2
    bf16_cache = 2 * 2 * 72 * 2  # L · G·d · (k, v) · 2 bytes
    assert proj.kv_bytes_per_token() - 4 == sum(2 * (rk + rv) for rk, rv in proj.ranks)
    assert proj.achieved_budget == pytest.approx(sum(rk + rv for rk, rv in proj.ranks) * 2 / bf16_cache)
    path = proj.save(tmp_path / "shared.safetensors")
    back = Projections.load(path)
    assert back.ranks == proj.ranks and all(torch.equal(a, b) for a, b in zip(back.keys, proj.keys))
    _with_version(path, 7)
    with pytest.raises(CheckpointError, match="they need 8|exceeds the head dimension"):  # ranks > d
        Projections.load(path)


def _with_version(path, version: int) -> None:
    """Rewrite ``path``'s header with another format version (its tensors and checksum unchanged)."""
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        doc = json.loads(f.metadata()["stiefkv"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, str(path), metadata={"stiefkv": json.dumps(doc | {"format_version": version})})


@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
def test_served_shared_bases_match_the_dense_projection_and_decode_alike(corpus, key_mode):
    """``stiefkv.load`` of a shared checkpoint: a forward equals the model whose keys and values are
    projected densely, and token-by-token decoding through the latent cache (one latent a token) gives the
    logits of the one forward."""
    import stiefkv
    from stiefkv.cache import LatentCache

    model, proj = shared_calibration(corpus, key_mode=key_mode, method="pca")
    ids = torch.randint(0, 97, (2, 19), generator=gen(11))
    with torch.no_grad():
        if key_mode == "pre_rope":
            with _Projected(model, proj):
                want = model(ids).logits
        stiefkv.load(model, proj, backend="reference")
        full = model(ids).logits
        cache = LatentCache()
        model(ids[:, :12], past_key_values=cache)
        steps = [model(ids[:, i:i + 1], past_key_values=cache).logits for i in range(12, 19)]
    if key_mode == "pre_rope":
        assert_close(full, want, atol=2e-4, rtol=1e-4, what="served vs dense")
    assert_close(torch.cat(steps, 1), full[:, 12:], atol=2e-4, rtol=1e-4, what="decode vs forward")
    z = cache.layers[0].keys
    assert z.shape[:3] == (2, 1, 19) and z.shape[3] == proj.ranks[0][0]


def test_generate_over_shared_latents_is_greedy_decoding(corpus):
    """``model.generate`` on a shared checkpoint (the latent cache it makes) picks, token by token, the
    argmax of a forward over the whole sequence so far."""
    import stiefkv

    model, proj = shared_calibration(corpus, method="pca")
    stiefkv.load(model, proj, backend="reference")
    ids = torch.randint(1, 97, (1, 11), generator=gen(14))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        seq = ids
        for _ in range(6):
            seq = torch.cat([seq, model(seq).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(out, seq)


@pytest.mark.parametrize("budget", [0.3, 0.15])
def test_shared_heads_with_quantized_latents_serve_what_they_count(corpus, budget):
    """``share_heads`` with ``--bits auto`` (the default): the knapsack over ranks and storages of one latent
    a token; the served cache holds the bytes the checkpoint counts, and decoding through it gives the one
    forward's logits (quantized latents, exact recent tokens)."""
    import stiefkv

    model, proj = shared_calibration(corpus, budget=budget, bits="auto")
    assert proj.shared and proj.quantized and proj.format_version == 8
    assert proj.achieved_budget <= budget + 1e-9
    stiefkv.load(model, proj, backend="reference")
    ids = torch.randint(0, 97, (1, 40), generator=gen(15))
    with torch.no_grad():
        full = model(ids).logits
        cache = stiefkv.LatentCache()
        model(ids[:, :30], past_key_values=cache)
        steps = torch.cat([model(ids[:, i:i + 1], past_key_values=cache).logits for i in range(30, 40)], 1)
    assert_close(steps, full[:, 30:], atol=2e-4, rtol=1e-4, what="decode vs forward")
    assert cache.nbytes / 40 == pytest.approx(proj.kv_bytes_per_token(40), rel=0.02)


def test_cli_offers_share_heads_and_inspect_names_it(corpus, tmp_path):
    from click.testing import CliRunner

    from stiefkv.cli import main

    result = CliRunner().invoke(main, ["calibrate", "--help"])
    assert result.exit_code == 0 and "--share-heads" in result.output
    _, proj = shared_calibration(corpus, method="pca")
    result = CliRunner().invoke(main, ["inspect", str(proj.save(tmp_path / "s.safetensors"))])
    assert result.exit_code == 0 and "bases shared by each layer's KV heads" in result.output


def test_the_kernels_read_shared_latents_as_the_reference(corpus):
    """The Triton kernels (the interpreter on a CPU) over one latent a token, read by every head through a
    stride-0 view: prefill and decode give the reference backend's logits."""
    import stiefkv
    from stiefkv.cache import LatentCache

    model, proj = shared_calibration(corpus, head_dim=32, method="pca")  # the kernels take d = 2^k ≥ 32
    assert proj.shared
    ids = torch.randint(0, 97, (1, 21), generator=gen(13))
    out = {}
    with torch.no_grad():
        for backend in ("reference", "triton"):
            stiefkv.load(model, proj, backend=backend)
            cache = LatentCache()
            prefill = model(ids[:, :17], past_key_values=cache).logits
            steps = [model(ids[:, i:i + 1], past_key_values=cache).logits for i in range(17, 21)]
            out[backend] = torch.cat([prefill, *steps], 1)
    assert_close(out["triton"], out["reference"], atol=2e-4, rtol=1e-4, what="triton vs reference")


@pytest.mark.parametrize("storages", ["bf16", ("int4-token", "int4-token"),
                                      ("int4-token-r5-w8", "int2-channel-r5"), "auto"])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_static_cache_generation_over_shared_latents(corpus, backend, storages):
    """``stiefkv.generate`` over latents shared by the KV heads (``[B, 1, slots, …]``, eager on the CPU; the
    kernels under the interpreter): bf16 latents, codes the kernels read in place, codes beside exact windows
    (the ring split of decode), and what ``--bits auto`` chose; greedy tokens equal ``model.generate``'s over
    the dynamic cache."""
    import stiefkv
    from stiefkv.quant import QuantSpec

    if storages == "auto":
        model, proj = shared_calibration(corpus, head_dim=32, budget=0.3, bits="auto", method="pca")
    else:
        model, proj = shared_calibration(corpus, head_dim=32, method="pca")
        if storages != "bf16":
            proj.quant = [tuple(QuantSpec.parse(s) for s in storages)] * len(proj.keys)
    assert proj.shared and proj.quantized == (storages != "bf16")
    stiefkv.load(model, proj, backend=backend)
    ids = torch.randint(1, 97, (2, 13), generator=gen(17))
    with torch.no_grad():
        ours = stiefkv.generate(model, ids, max_new_tokens=7, eos_token_id=None)
        theirs = model.generate(ids, max_new_tokens=7, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, theirs)
