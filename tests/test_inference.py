"""LowRankAttention and LatentCache on tiny random models of every supported architecture."""

from dataclasses import replace

import pytest
import torch

import stiefkv
from stiefkv.cache import cache_keyword
from stiefkv.models import dims_of, rope_spec
from tests.tiny import ARCHS, random_projections, tiny_model
from tests.utils import assert_close, greedy_by_backend

KEY_MODES = ["pre_rope", "post_rope"]


def ids(batch=2, n=11, vocab=97, seed=0):
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kv_heads", [6, 2])  # MHA and GQA 3
@pytest.mark.parametrize("key_mode", KEY_MODES)
def test_full_rank_reproduces_logits(arch, kv_heads, key_mode):
    model = tiny_model(arch, kv_heads=kv_heads)
    x = ids()
    expected = model(x).logits
    d = dims_of(model.config).d
    stiefkv.load(model, random_projections(model, d, d, key_mode))
    actual = model(x).logits
    assert (actual - expected).abs().max() <= 1e-4, (actual - expected).abs().max()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("key_mode", KEY_MODES)
def test_cached_decoding_equals_full_forward(arch, key_mode):
    model = tiny_model(arch)
    stiefkv.load(model, random_projections(model, 16, 8, key_mode))
    x = ids(n=13)
    full = model(x, use_cache=False).logits
    cache = stiefkv.LatentCache()
    steps = [model(x[:, :7], past_key_values=cache).logits]
    for t in range(7, 13):
        steps.append(model(x[:, t:t + 1], past_key_values=cache).logits)
    assert_close(torch.cat(steps, dim=1), full, atol=2e-5, rtol=1e-4, what="cached vs full")
    assert cache.get_seq_length() == 13


@pytest.mark.parametrize("key_mode", KEY_MODES)
def test_generate_with_and_without_cache_agree(key_mode):
    model = tiny_model("llama")
    stiefkv.load(model, random_projections(model, 16, 16, key_mode))
    x = ids(batch=2, n=5)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with_cache = model.generate(x, attention_mask=torch.ones_like(x), use_cache=True, **kw)
    without = model.generate(x, attention_mask=torch.ones_like(x), use_cache=False, **kw)
    assert torch.equal(with_cache, without)


def test_generate_uses_latent_cache():
    model = tiny_model("llama")
    stiefkv.load(model, random_projections(model, 8, 16))
    out = model.generate(ids(n=4), max_new_tokens=3, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    assert isinstance(cache, stiefkv.LatentCache)
    assert cache.layers[0].keys.shape[-1] == 8 and cache.layers[0].values.shape[-1] == 16


@pytest.mark.parametrize("key_mode", KEY_MODES)
def test_left_padding_is_masked(key_mode):
    model = tiny_model("qwen3")
    stiefkv.load(model, random_projections(model, 16, 16, key_mode))
    short = ids(batch=1, n=6, seed=3)
    alone = model(short).logits
    pad = 4
    padded = torch.cat([torch.zeros(1, pad, dtype=torch.long), short], dim=1)
    batch = torch.cat([padded, ids(batch=1, n=10, seed=4)])
    mask = torch.ones_like(batch)
    mask[0, :pad] = 0
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(batch, attention_mask=mask, position_ids=position_ids).logits
    assert_close(out[:1, pad:], alone, atol=2e-5, rtol=1e-4, what="left-padded row")


def test_left_padded_generate_matches_unpadded():
    model = tiny_model("llama")
    stiefkv.load(model, random_projections(model, 16, 16))
    short = ids(batch=1, n=5, seed=5)
    kw = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    alone = model.generate(short, attention_mask=torch.ones_like(short), **kw)[0, 5:]
    batch = torch.cat([torch.cat([torch.zeros(1, 3, dtype=torch.long), short], 1), ids(batch=1, n=8, seed=6)])
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    together = model.generate(batch, attention_mask=mask, **kw)[0, 8:]
    assert torch.equal(alone, together)


@pytest.mark.parametrize("rope_parameters", [
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128},
])
@pytest.mark.parametrize("key_mode", KEY_MODES)
def test_rope_from_config_rope_parameters(rope_parameters, key_mode):
    model = tiny_model("llama", rope_parameters=rope_parameters)
    spec = rope_spec(model.config)
    assert_close(spec.inv_freq, model.model.rotary_emb.inv_freq.float(), atol=0, rtol=1e-6, what="inv_freq")
    assert spec.attention_scaling == pytest.approx(model.model.rotary_emb.attention_scaling)
    x = ids(n=40)
    expected = model(x).logits
    stiefkv.load(model, random_projections(model, 24, 24, key_mode))
    assert (model(x).logits - expected).abs().max() <= 1e-4


def test_cache_and_past_key_values_keywords():
    model = tiny_model("llama")
    stiefkv.load(model, random_projections(model, 8, 8))
    x = ids(n=9)
    results = []
    # transformers < 5.24 has no `cache=` keyword at the model level: only the old one applies there.
    keywords = ["past_key_values"] + (["cache"] if stiefkv.attention.cache_keyword(model) == "cache" else [])
    for keyword in keywords:
        cache = stiefkv.LatentCache()
        first = model(x[:, :6], **{keyword: cache}).logits
        second = model(x[:, 6:], **{keyword: cache}).logits
        assert cache.get_seq_length() == 9, keyword
        results.append(torch.cat([first, second], 1))
    assert_close(results[0], results[-1], what="cache= vs past_key_values=")
    assert_close(results[0], model(x, use_cache=False).logits, atol=2e-5, rtol=1e-4, what="vs full")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_holds_only_latents_and_reports_bytes(dtype):
    model = tiny_model("llama", dtype=dtype)
    rk, rv = 8, 16
    stiefkv.load(model, random_projections(model, rk, rv))
    cache = stiefkv.LatentCache()
    B, N = 2, 11
    model(ids(batch=B, n=N), past_key_values=cache)
    dims = dims_of(model.config)
    for layer in cache.layers:
        assert layer.keys.shape == (B, dims.G, N, rk) and layer.values.shape == (B, dims.G, N, rv)
        assert layer.keys.dtype == dtype
    size = torch.tensor([], dtype=dtype).element_size()
    expected = dims.L * B * N * dims.G * (rk + rv) * size + B * N * 4  # latents + int32 positions
    assert isinstance(cache.nbytes, int) and cache.nbytes == expected


def test_unload_restores_the_model():
    model = tiny_model("mistral")
    x = ids()
    expected = model(x).logits
    stiefkv.load(model, random_projections(model, 8, 8))
    assert (model(x).logits - expected).abs().max() > 1e-3
    stiefkv.unload(model)
    assert torch.equal(model(x).logits, expected)
    with stiefkv.compressed(model, random_projections(model, 8, 8)):
        assert stiefkv.attention.is_compressed(model)
    assert not stiefkv.attention.is_compressed(model)


def test_loading_again_replaces_the_bases():
    model = tiny_model("llama")
    x = ids()
    first, second = random_projections(model, 8, 8, seed=1), random_projections(model, 16, 24, seed=2)
    stiefkv.load(model, second)
    expected = model(x).logits
    stiefkv.load(model, first)
    stiefkv.load(model, second)  # on a loaded model: the original attention underneath is reused
    assert torch.equal(model(x).logits, expected)
    stiefkv.unload(model)
    assert not stiefkv.attention.is_compressed(model)


def test_switch_equals_compressed():
    model = tiny_model("qwen3", kv_heads=2)
    x, proj = ids(), random_projections(model, 16, 8)
    with stiefkv.compressed(model, proj):
        expected = model(x).logits
    switch = stiefkv.attention.Switch(model, proj)
    original = model(x).logits
    for _ in range(2):
        with switch:
            assert torch.equal(model(x).logits, expected)
        assert torch.equal(model(x).logits, original)


@pytest.mark.parametrize("key_mode", KEY_MODES)
@pytest.mark.parametrize("quant", [None, "int4-token"])
def test_a_right_padded_batch_is_scored_in_one_forward_and_not_continued(key_mode, quant):
    """Scoring pads on the right (tokenizers' default): from an empty cache every real query sees the keys its
    unpadded row would; the cache it filled holds the padding, so a step after it is refused."""
    model = tiny_model("llama")
    proj = random_projections(model, 16, 12, key_mode)
    if quant:
        proj = replace(proj, quant=[(quant, quant)] * len(proj.keys))
    stiefkv.load(model, proj)
    short, full = ids(batch=1, n=7, seed=7), ids(batch=1, n=10, seed=8)
    alone = model(short).logits
    batch = torch.cat([torch.cat([short, torch.zeros(1, 3, dtype=torch.long)], 1), full])
    mask = torch.ones_like(batch)
    mask[0, 7:] = 0
    out = model(batch, attention_mask=mask)
    assert_close(out.logits[:1, :7], alone, atol=2e-5, rtol=1e-4, what="right-padded row")
    assert_close(out.logits[1:], model(full).logits, atol=2e-5, rtol=1e-4, what="its unpadded neighbour")
    step = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    with pytest.raises(ValueError, match="cannot be continued"):
        model(ids(batch=2, n=1, seed=9), attention_mask=step, past_key_values=out.past_key_values)
    late = torch.ones(2, 4, dtype=torch.long)  # right padding behind a cache that already holds tokens
    late[0, -1] = 0
    cache = model(batch[:, :6]).past_key_values
    with pytest.raises(ValueError, match="left-padded batches only"):
        model(batch[:, 6:], attention_mask=torch.cat([torch.ones(2, 6, dtype=torch.long), late], 1),
              past_key_values=cache)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])  # k/v biases; a key norm; neither
@pytest.mark.parametrize("kv_heads", [6, 2, 1])
@pytest.mark.parametrize("key_mode", KEY_MODES)
def test_serving_path_equals_the_differentiable_layer_path(arch, kv_heads, key_mode):
    """Serving folds the bases into k_proj/v_proj (where it can) and P_v into o_proj and casts P_k once; the
    layer path of calibration and evaluation projects to d, then onto the bases. Same output in float32."""
    from stiefkv.attention import LowRankAttention
    from stiefkv.layers import attention_block

    model = tiny_model(arch, kv_heads=kv_heads)
    proj = random_projections(model, 16, 8, key_mode)
    attn = model.model.layers[1].self_attn
    served = LowRankAttention(attn, proj.keys[1], proj.values[1], key_mode=key_mode,
                              rope=rope_spec(model.config), backend="reference")
    assert (served.zk_weight is not None) == (key_mode == "pre_rope" and arch != "qwen3")
    assert (served.zk_bias is not None) == (served.zk_weight is not None and arch == "qwen2")
    x = torch.randn(2, 9, 48)
    pos = torch.arange(3, 12)[None].expand(2, 9)
    pe = model.model.rotary_emb(x, pos)
    with torch.no_grad():
        plain = attention_block(attn, x, proj.keys[1], proj.values[1], key_mode=key_mode,
                                rope=rope_spec(model.config), position_embeddings=pe, positions=pos)
        folded, _ = served(x, position_embeddings=pe, position_ids=pos)
    assert_close(folded, plain, atol=1e-5, rtol=1e-5, what=f"serving vs layer path ({arch}, {key_mode})")


def test_cast_key_basis_follows_the_module():
    """The key basis handed to the kernels is cast once per dtype and again after the module moves."""
    model = tiny_model("llama")
    stiefkv.load(model, random_projections(model, 16, 8))
    attn = model.model.layers[0].self_attn
    half = attn.key_basis(torch.float16)
    assert half.dtype == torch.float16 and attn.key_basis(torch.float16) is half
    assert torch.equal(half, attn.P_k.to(torch.float16))
    attn.P_k.mul_(-1)
    assert torch.equal(attn.key_basis(torch.float16), -half)
    model.double()
    assert attn.key_basis(torch.float16) is not half
    assert attn.zv_weight.dtype == torch.float64 and attn.P_k.dtype == torch.float64


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton kernels)")
@pytest.mark.parametrize("key_mode", KEY_MODES)
def test_generate_on_gpu_triton_matches_reference(key_mode):
    model = tiny_model("llama", head_dim=64, heads=8, kv_heads=2).cuda()  # fp32: no near-tie token flips
    proj = random_projections(model, 24, 40, key_mode)
    x = ids(batch=3, n=37).cuda()
    outs = greedy_by_backend(model, proj, x)
    assert torch.equal(outs["triton"], outs["reference"])


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_key_modes_per_layer_are_served_layer_by_layer(arch):
    """A checkpoint whose layers differ in key mode serves each layer in its own. A full-rank layer is exact
    in either mode, so a mixed model equals the uniform model of the cut layer's mode (cached decode too),
    and differs from the other uniform one: a layer served in the wrong mode fails this."""
    model = tiny_model(arch, kv_heads=2, layers=2)
    d = dims_of(model.config).d
    x = ids(n=13, seed=4)
    for cut_mode, full_mode in (("pre_rope", "post_rope"), ("post_rope", "pre_rope")):
        full = random_projections(model, d, d, full_mode, seed=1)
        cut = random_projections(model, 10, 7, cut_mode, seed=2)  # ranks not powers of two
        keys, values = [full.keys[0], cut.keys[1]], [full.values[0], cut.values[1]]

        def served(modes):
            proj = stiefkv.Projections(keys=keys, values=values, key_mode=modes[0], layer_key_modes=modes,
                                       fingerprint=full.fingerprint, budget=0.5)
            stiefkv.load(model, proj)
            logits = model(x, use_cache=False).logits
            cache = stiefkv.LatentCache()
            steps = [model(x[:, :6], past_key_values=cache).logits]
            steps += [model(x[:, t:t + 1], past_key_values=cache).logits for t in range(6, 13)]
            stiefkv.unload(model)
            return logits, torch.cat(steps, dim=1)

        mixed, mixed_cached = served([full_mode, cut_mode])
        same, _ = served([cut_mode, cut_mode])
        other, _ = served([full_mode, full_mode])
        assert_close(mixed, same, atol=1e-4, rtol=0, what=f"mixed vs all {cut_mode}")
        assert_close(mixed_cached, mixed, atol=2e-5, rtol=1e-4, what="mixed, cached vs full forward")
        assert (mixed - other).abs().max() > 1e-2


@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
def test_a_served_model_computes_with_the_weights_it_has_now(key_mode):
    """The bases are folded into k_proj, v_proj and o_proj at load; weights written afterwards
    (``load_state_dict``, an in-place edit) are folded again (the served model kept computing with the old
    ones). At full rank the served model is the unserved one: it stays so after the writes. A cast moves
    the folds with the module instead."""
    import copy

    model = tiny_model()
    d = dims_of(model.config).d
    stiefkv.load(model, random_projections(model, d, d, key_mode))
    ids = torch.randint(3, 90, (2, 13))
    before = model(ids).logits
    changed = {k: v * 1.5 if ("o_proj" in k or "v_proj" in k) else v for k, v in model.state_dict().items()}
    model.load_state_dict(changed)
    with torch.no_grad():
        model.model.layers[0].self_attn.original.k_proj.weight.mul_(0.8)
    after = model(ids).logits
    plain = stiefkv.unload(copy.deepcopy(model))(ids).logits
    assert (after - before).abs().max() > 1e-2
    assert_close(after, plain, 1e-5, 1e-5, what="served at full rank after the weights were written")
    model.to(torch.bfloat16)  # a cast: the folds were cast with the module, not made again
    folded = model.model.layers[1].self_attn.o_fold
    model(ids)
    assert model.model.layers[1].self_attn.o_fold is folded and folded.dtype == torch.bfloat16


def test_a_served_model_refuses_to_pickle_and_deep_copies():
    """Pickling succeeded and unpickling failed (the installed methods pickle by their function's name):
    now pickling refuses with the way out; a deep copy still serves, and an unloaded model pickles."""
    import copy
    import io
    import pickle

    from stiefkv.attention import projections_of

    model = tiny_model()
    stiefkv.load(model, random_projections(model, 8, 8))
    for save in (pickle.dumps, lambda m: torch.save(m, io.BytesIO())):
        with pytest.raises(TypeError, match="does not pickle.*save_pretrained"):
            save(model)
    twin = copy.deepcopy(model)
    ids = torch.randint(3, 90, (2, 9))
    assert projections_of(twin) is not None
    assert torch.equal(twin.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0),
                       model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0))
    with pytest.raises(TypeError, match="does not pickle"):
        pickle.dumps(twin)
    back = pickle.loads(pickle.dumps(stiefkv.unload(twin)))
    assert torch.equal(back(ids).logits, twin(ids).logits)


def test_refolding_keeps_inference_tensors_and_compiled_graphs_working():
    """The version check of the folds' weights: a model made under inference_mode (no versions) is served,
    and torch.compile sees no graph break in it (review of the refold, 2026-12-07)."""
    with torch.inference_mode():
        model = tiny_model()
    stiefkv.load(model, random_projections(model, 16, 16))
    ids = torch.randint(3, 90, (1, 7))
    with torch.inference_mode():
        assert torch.isfinite(model(ids).logits).all()
    served = tiny_model()
    stiefkv.load(served, random_projections(served, 16, 16))
    import warnings

    with warnings.catch_warnings():  # transformers' own code warns under dynamo in some versions
        warnings.simplefilter("ignore")
        explained = torch._dynamo.explain(served)(ids)
    # the refold's own check (a mask's checks may break a graph where transformers passes a 4-D mask)
    ours = [r for r in explained.break_reasons
            if any(frame.name in ("refold", "_fold_sources") for frame in getattr(r, "user_stack", []) or [])]
    assert not ours, ours


@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
def test_a_mask_the_latent_attention_cannot_follow_is_refused(key_mode):
    """Only a 4-D mask's last row was read: two packed documents looked like left padding, and every logit
    of the first document was wrong, silently. A causal 4-D mask, and left padding, still serve."""
    base = tiny_model()
    served = tiny_model()
    stiefkv.load(served, random_projections(served, 24, 24, key_mode))
    ids = torch.randint(3, 90, (2, 12))
    packed = torch.zeros(12, 12, dtype=torch.bool)
    packed[:6, :6] = packed[6:, 6:] = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    positions = torch.cat([torch.arange(6), torch.arange(6)])[None].expand(2, 12)
    with pytest.raises(ValueError, match="this 4-D attention_mask hides other keys"):
        served(ids, attention_mask=packed[None, None].expand(2, 1, 12, 12), position_ids=positions)
    causal = torch.tril(torch.ones(12, 12, dtype=torch.bool))[None, None].expand(2, 1, 12, 12)
    assert_close(served(ids, attention_mask=causal).logits, base(ids, attention_mask=causal).logits,
                 1e-5, 1e-5, what="a causal 4-D mask")
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    assert_close(served(ids, attention_mask=mask).logits[1, 4:], base(ids, attention_mask=mask).logits[1, 4:],
                 1e-5, 1e-5, what="left padding")


def test_a_mask_edited_in_place_or_made_anew_is_checked_again():
    """The check of a 4-D mask was remembered by the tensor's address and version: under inference mode
    (no versions) a causal mask edited in place into two packed documents passed as the one checked before
    (0.40 off on the logits), and so did a new packed mask at a freed one's address. Each forward checks its
    mask now, and the memory holds the object, not its address."""
    served = tiny_model()
    stiefkv.load(served, random_projections(served, 24, 24))
    ids = torch.randint(3, 90, (1, 16))
    with torch.inference_mode():
        mask = torch.ones(1, 1, 16, 16, dtype=torch.bool).tril()
        served(ids, attention_mask=mask)
        mask[:, :, 8:, :8] = False  # two packed documents
        with pytest.raises(ValueError, match="this 4-D attention_mask hides other keys"):
            served(ids, attention_mask=mask)
    from stiefkv.cache import _check_causal_rows

    lengths, ends = torch.tensor([16]), torch.tensor([16])
    with torch.inference_mode():  # another object at the same address with the same (no) version
        buf = torch.ones(1, 1, 16, 16, dtype=torch.bool).tril()
        _check_causal_rows(buf.view(1, 1, 16, 16), lengths, ends, 1, 16)
        buf[:, :, 8:, :8] = False
        with pytest.raises(ValueError, match="this 4-D attention_mask hides other keys"):
            _check_causal_rows(buf.view(1, 1, 16, 16), lengths, ends, 1, 16)


@pytest.mark.parametrize("static", [False, True])
def test_a_refused_forward_leaves_the_cache_as_it_was(static):
    """A mask refused at layer 0 was read after that layer wrote its latents (the dynamic cache) or after
    the slots, positions and count advanced (the static one): the next forward read a slot never written as
    a token (0.04 off, silently), or was refused for the wrong reason. The mask is read before anything is
    written now: the next forward equals one over a cache that never saw the refused call."""
    served = tiny_model()
    stiefkv.load(served, random_projections(served, 11, 13))
    ids, nxt = torch.randint(3, 90, (2, 12)), torch.randint(3, 90, (2, 1))
    hole = torch.ones(2, 13, dtype=torch.long)
    hole[0, 5] = 0
    kw = {cache_keyword(served): None, "use_cache": True}

    def cache():
        c = stiefkv.StaticLatentCache(served, 2, 20) if static else stiefkv.LatentCache()
        served(ids, **{**kw, cache_keyword(served): c})
        return c

    refused = cache()
    with pytest.raises(ValueError, match="left-padded batches only"):
        served(nxt, attention_mask=hole, **{**kw, cache_keyword(served): refused})
    assert refused.get_seq_length() == 12
    got = served(nxt, **{**kw, cache_keyword(served): refused}).logits
    want = served(nxt, **{**kw, cache_keyword(served): cache()}).logits
    assert torch.equal(got, want)


def test_what_a_served_model_does_not_do_is_said_once(monkeypatch):
    """Training through a served model leaves k_proj, v_proj and o_proj without gradients, and its latent
    attention returns no weights: each is said once a process, not silently."""
    import stiefkv.attention

    monkeypatch.setattr(stiefkv.attention, "_SAID", set())
    model = tiny_model()
    stiefkv.load(model, random_projections(model, 8, 8))
    ids = torch.randint(3, 90, (1, 9))
    model.train()
    with pytest.warns(UserWarning, match="no gradient through it"):
        model(ids, labels=ids).loss.backward()
    assert model.model.layers[0].self_attn.original.o_proj.weight.grad is None
    model.eval()
    with torch.no_grad(), pytest.warns(UserWarning, match="returns no attention weights"):
        model(ids, output_attentions=True)
