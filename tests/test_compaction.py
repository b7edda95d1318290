"""Attention-matching compaction of one KV head's block (stiefkv.compaction) against the block it replaces,
on fresh random blocks of odd sizes: exact when every token is kept, and closer than eviction (keeping the
most-attended keys as they are) in output, mass, and attention over the block joined with other tokens."""

from __future__ import annotations

import math

import pytest
import torch

from stiefkv.compaction import compact_head, compacted_attention, log_mass
from tests.utils import assert_close


def block(seed: int, T: int, d: int, dv: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(T, d, generator=g) * 1.5
    keys[:5] *= 2.5  # a few keys that most queries attend to
    values = torch.randn(T, dv, generator=g)
    centre = torch.randn(d, generator=g)

    def queries(n: int) -> torch.Tensor:
        return (centre + torch.randn(n, d, generator=g)).to(dtype)

    return keys.to(dtype), values.to(dtype), queries


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-8), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_keeping_every_token_reproduces_the_block(dtype, tol):
    T, d, dv = 23, 12, 7
    keys, values, queries = block(1, T, d, dv, dtype)
    q = queries(64)  # more reference queries than tokens: the masses determine every weight
    scale = 1 / math.sqrt(d)
    c = compact_head(keys, values, q, T, scale=scale)
    assert c.index.tolist() == list(range(T))
    assert float(c.beta.double().abs().max()) <= tol
    assert rel(c.values.double(), values.double()) <= tol
    out = compacted_attention(q, keys[c.index], c.values, scale=scale, beta=c.beta)
    assert rel(out, compacted_attention(q, keys, values, scale=scale)) <= tol


@pytest.mark.parametrize("seed,T,t", [(2, 97, 13), (3, 151, 21)])
def test_attention_matching_beats_eviction_on_held_out_queries(seed, T, t):
    d, dv = 24, 19
    keys, values, queries = block(seed, T, d, dv)
    reference, held_out = queries(256), queries(128)
    scale = 1 / math.sqrt(d)
    g = torch.Generator().manual_seed(seed + 100)
    other_k, other_v = torch.randn(31, d, generator=g), torch.randn(31, dv, generator=g)
    full = compacted_attention(held_out, keys, values, scale=scale)
    full_mass = log_mass(held_out, keys, scale=scale)
    joined = compacted_attention(held_out, torch.cat([keys, other_k]), torch.cat([values, other_v]),
                                 scale=scale)

    def errors(**options):
        c = compact_head(keys, values, reference, t, scale=scale, **options)
        k = keys[c.index]
        out = compacted_attention(held_out, k, c.values, scale=scale, beta=c.beta)
        mass = log_mass(held_out, k, scale=scale, beta=c.beta)
        both = compacted_attention(held_out, torch.cat([k, other_k]), torch.cat([c.values, other_v]),
                                   scale=scale, beta=torch.cat([c.beta, torch.zeros(len(other_k))]))
        return rel(out, full), float((mass - full_mass).abs().mean()), rel(both, joined)

    am, evict = errors(), errors(fit_beta=False, refit_values=False)
    assert am[0] < 0.85 * evict[0] and am[1] < 0.7 * evict[1] and am[2] < evict[2], (am, evict)
    omp = errors(selection="omp")
    assert omp[1] < evict[1], (omp, evict)  # OMP chooses for the masses


@pytest.mark.parametrize("seed,T,t", [(5, 89, 17), (6, 140, 31)])
def test_the_projected_weight_fit_matches_exact_nnls(seed, T, t):
    """Clamped least squares + projected gradient against scipy's exact NNLS on the same chosen keys: the
    mass residual within 2 % (and well below keeping β = 0)."""
    from stiefkv.compaction import _fit_weights, _logits, _select_attention

    keys, _, queries = block(seed, T, 16, 5)
    E, _ = _logits(queries(200), keys, 0.25)
    mass = E.sum(-1)
    E_sel = E[:, _select_attention(E, mass, t, "rms")]

    def residual(w):
        assert torch.isfinite(w).all() and (w >= 0).all()
        return float(((E_sel @ w) / mass - 1).norm())

    exact = residual(_fit_weights(E_sel, mass, "nnls"))
    projected = residual(_fit_weights(E_sel, mass, "projected"))
    assert projected <= 1.02 * exact + 1e-9, (projected, exact)
    assert projected < 0.75 * residual(torch.ones(t, dtype=torch.float64))


def test_bad_compaction_requests_are_refused():
    keys, values, queries = block(4, 9, 6, 5)
    q = queries(8)
    for t in (0, 10):
        with pytest.raises(ValueError, match="cannot keep .* of 9 tokens"):
            compact_head(keys, values, q, t, scale=0.4)
    with pytest.raises(ValueError, match="selection must be one of attention, omp"):
        compact_head(keys, values, q, 3, scale=0.4, selection="norm")


# ----------------------------------------------------------------------------- compressed-context perplexity
def test_a_cache_kept_whole_scores_as_the_full_forward_and_beta_reaches_attention():
    """Keeping every token (β = 0) through the compacted path gives the full forward's NLL: positions, the
    rebuilt cache and the 4-D mask are right; AM's per-layer β masks run; the mask puts each KV head's β
    before its query heads' causal block."""
    from stiefkv.compacted import CompactedCache
    from stiefkv.longcontext import chunk_nll
    from tests.tiny import tiny_model

    model = tiny_model(layers=2)
    ids = torch.randint(3, 97, (1, 61), generator=torch.Generator().manual_seed(5))
    nll, full, n, t, held, _ = chunk_nll(model, ids, 37, 1.0, "recent", window=9)
    assert t == 37 and held == 37 and n == 23 and math.isfinite(nll)
    assert nll == pytest.approx(full, rel=1e-5)
    nll_am, _, _, t, held, _ = chunk_nll(model, ids, 37, 0.3, "am", window=9)
    assert t == 11 and held == 11 and math.isfinite(nll_am)
    # heads kept to different counts are padded to their layer's largest: more is held than kept
    nll_g, _, _, t, held, _ = chunk_nll(model, ids, 37, 0.3, "am", window=9, allocation="global",
                                        pooling="rms")
    assert t == 11 and held >= 11 and math.isfinite(nll_g)
    nll_m, _, _, t, held, _ = chunk_nll(model, ids, 37, 0.3, "am", window=9, allocation="layers-max")
    assert held <= 11 and math.isfinite(nll_m)
    cache = CompactedCache(40)  # 2 entries standing for 40 tokens, then 4 appended
    beta = torch.tensor([[[0.5, -1.0], [2.0, 0.0]]])
    cache.add_layer(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4), beta)
    cache.masked_for = 0  # as layer 0's hook leaves it before its attention appends
    cache.update(torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 4), 0)
    assert cache.get_seq_length() == 44
    mask = cache.mask(0, new=3, heads=6, dtype=torch.float32)
    assert mask.shape == (1, 6, 3, 9)
    assert mask[0, 2, 1, :2].tolist() == [0.5, -1.0] and mask[0, 3, 0, :2].tolist() == [2.0, 0.0]
    assert not mask[:, :, :, 2:6].any()
    assert mask[0, 0, 0, 7] == torch.finfo(torch.float32).min and mask[0, 0, 2, 8] == 0


def test_bad_compressed_context_requests_are_refused():
    from stiefkv.longcontext import evaluate_compacted
    from tests.tiny import tiny_model

    model = tiny_model(layers=1)
    for keep in (0.0, 1.5):
        with pytest.raises(ValueError, match="keep must be in"):
            evaluate_compacted(model, None, keep=keep)
    with pytest.raises(ValueError, match="method must be one of am, attention, knorm, snapkv"):
        evaluate_compacted(model, None, method="expected")
    with pytest.raises(ValueError, match="allocation must be one of uniform, global"):
        evaluate_compacted(model, None, allocation="heads")
    from stiefkv.longcontext import chunk_nll

    ids = torch.randint(3, 97, (1, 14), generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="reference window must hold at least 1"):
        chunk_nll(model, ids, 10, 0.5, "am", window=0)
    with pytest.raises(ValueError, match="a context of 4 tokens leaves none to score"):
        chunk_nll(model, ids[:, :8], 4, 0.5, "expected_attention")


# ------------------------------------------------------------------------ kvpress's presses, from definitions
def layer_cache(seed: int, B: int, G: int, H: int, T: int, d: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, G, T, d, generator=g), torch.randn(B, G, T, d, generator=g),
            torch.randn(B, H, T, d, generator=g))


def test_presses_keep_the_newest_of_their_window_and_the_first_sinks_below_them():
    """Keeping fewer tokens than SnapKV's window, or than the sinks of StreamingLLM and ExpectedAttention,
    keeps the newest of the window and the first sinks, as documented (``eval --compact-method``: "below 64
    kept tokens it is recency"); they all scored alike and topk kept an arbitrary subset ([51..56, 59,
    62..74] of a 100-token window at 20)."""
    from stiefkv import presses

    B, G, H, T, d = 1, 2, 4, 100, 8
    keys, values, q = layer_cache(0, B, G, H, T, d)
    window = q[:, :, -presses.SNAPKV_WINDOW:]
    for t in (1, 20, 64):
        kept = presses.evict(keys, values, presses.snapkv(keys, window, 0.3), t)[2]
        assert torch.equal(kept, torch.arange(T - t, T).expand(B, G, t)), t
    rotation = presses.averaged_rotation(torch.ones(8, d), torch.zeros(8, d))
    for t in (1, 3):
        assert torch.equal(presses.evict(keys, values, presses.streaming_llm(keys), t)[2],
                           torch.arange(t).expand(B, G, t))
        scores = presses.expected_attention(keys, values, q[:, :, presses.SINKS:], rotation)
        assert torch.equal(presses.evict(keys, values, scores, t)[2], torch.arange(t).expand(B, G, t))
    assert presses.streaming_llm(keys[:, :, :2]).argsort(-1, descending=True).tolist() == [[[0, 1]] * G]


def test_presses_keep_what_their_definitions_say():
    """Each press against a per-head loop written from kvpress's description (B 2, G 3, H 9, T 83)."""
    from stiefkv import presses

    B, G, H, T, d, t, scale = 2, 3, 9, 83, 10, 17, 0.31
    keys, values, q = layer_cache(6, B, G, H, T, d)
    kept, vals, index = presses.evict(keys, values, presses.knorm(keys), t)
    for b in range(B):
        for g in range(G):
            want = torch.topk(-keys[b, g].norm(dim=-1), t).indices.sort().values
            assert torch.equal(index[b, g], want)
            assert torch.equal(kept[b, g], keys[b, g, want]) and torch.equal(vals[b, g], values[b, g, want])
    _, _, index = presses.evict(keys, values, presses.streaming_llm(keys), t)
    assert index[1, 2].tolist() == list(range(presses.SINKS)) + list(range(T - t + presses.SINKS, T))
    _, _, index = presses.evict(keys, values, presses.recent(keys), t)
    assert index[0, 1].tolist() == list(range(T - t, T))

    w = 8  # SnapKV: the window's mean causal attention over older keys, pooled by 5, averaged per group
    window = q[:, :, -w:]
    scores = presses.snapkv(keys, window, scale, window=w)
    for b in range(B):
        for g in range(G):
            per_head = []
            for h in range(g * H // G, (g + 1) * H // G):
                rows = []
                for i in range(w):
                    visible = T - w + i + 1
                    p = torch.softmax(window[b, h, i] @ keys[b, g, :visible].T * scale, -1)
                    rows.append(torch.cat([p, torch.zeros(T - visible)])[: T - w])
                m = torch.stack(rows).mean(0)
                padded = torch.cat([torch.zeros(2), m, torch.zeros(2)])
                per_head.append(torch.stack([padded[j:j + 5].sum() / 5 for j in range(T - w)]))
            want = torch.stack(per_head).mean(0)
            torch.testing.assert_close(scores[b, g, :-w], want, atol=1e-6, rtol=1e-5)
            assert (scores[b, g, -w:] > scores[b, g, :-w].max()).all()

    last = q[:, :, -1:]  # TOVA: the last query's attention averaged over all heads, the last token kept
    scores = presses.tova(keys, last, scale)
    want = torch.stack([torch.softmax(last[0, h, 0] @ keys[0, h // 3].T * scale, -1)
                        for h in range(H)]).mean(0)
    for g in range(G):
        torch.testing.assert_close(scores[0, g, :-1], want[:-1], atol=1e-6, rtol=1e-5)
        assert scores[0, g, -1] > scores[0, g, :-1].max()


def test_expected_attention_averages_the_future_rotation():
    """The averaged rotation is the mean of RoPE over the positions; the scores are the softmax of
    μ·k/√d + kᵀΣk/(2d) over the non-sink keys, averaged per group, times ‖v‖, with the sinks kept."""
    from stiefkv import presses
    from stiefkv.layers import rotate_with

    B, G, H, T, d = 1, 2, 6, 47, 8
    keys, values, q = layer_cache(7, B, G, H, T, d)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    pos = torch.arange(50, 61, dtype=torch.float64)
    angles = torch.cat([pos[:, None] * inv] * 2, -1)
    cos, sin = angles.cos(), angles.sin()
    R = presses.averaged_rotation(cos, sin)
    x = torch.randn(3, d, dtype=torch.float64)
    rotated = rotate_with(x[None, :, None].expand(1, 3, len(pos), d), cos[None], sin[None])  # each at each
    torch.testing.assert_close(rotated[0].mean(1), x @ R.T)
    scores = presses.expected_attention(keys, values, q, R)
    assert (scores[..., : presses.SINKS] > scores[..., presses.SINKS:].max()).all()
    for g in range(G):
        per = []
        for h in range(g * 3, g * 3 + 3):
            qs = q[0, h].double()
            mu, cov = qs.mean(0) @ R.T, R @ torch.cov(qs.T, correction=0) @ R.T
            k = keys[0, g, presses.SINKS:].double()
            per.append(torch.softmax(k @ mu / math.sqrt(d) + ((k @ cov) * k).sum(-1) / (2 * d), -1))
        want = torch.stack(per).mean(0) * values[0, g, presses.SINKS:].double().norm(dim=-1)
        torch.testing.assert_close(scores[0, g, presses.SINKS:].double(), want, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("B,G,H,T,t", [(1, 3, 9, 71, 13), (2, 2, 8, 45, 7)])
def test_heads_compacted_together_equal_heads_compacted_one_by_one(B, G, H, T, t):
    """The batched layer path (a common count, attention selection, projected fit) against compact_head
    per head: the same keys, β and values (float32 in, float64 inside: 1e-5)."""
    from stiefkv.compaction import choose_and_fit, compact_layer

    d, scale = 11, 0.29
    keys, values, q = layer_cache(12 + B, B, G, H, T, d)
    options = {"pooling": "rms", "solver": "projected"}
    kept, beta, fitted, index = compact_layer(keys, values, q, t, scale=scale, **options)
    per = H // G
    for b in range(B):
        for g in range(G):
            c = choose_and_fit(keys[b, g], values[b, g], q[b, g * per:(g + 1) * per].flatten(0, 1), t,
                               scale=scale, method="am", **options)
            assert torch.equal(index[b, g], c.index)
            torch.testing.assert_close(beta[b, g], c.beta, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(fitted[b, g], c.values, atol=1e-5, rtol=1e-5)
            assert torch.isfinite(fitted[b, g]).all()


def test_per_head_budgets_pad_with_entries_attention_never_reads():
    """A layer whose heads keep different counts: each head's compacted block equals compacting it alone,
    the padding changes no attention output, and the global counts sum to the budget."""
    from stiefkv.compaction import compact_head, compact_layer, compacted_attention, global_budgets

    B, G, H, T, d, scale = 1, 3, 6, 53, 9, 0.33
    keys, values, q = layer_cache(8, B, G, H, T, d)
    budget = torch.tensor([[5, 12, 7]])
    kept, beta, fitted, index = compact_layer(keys, values, q, budget, scale=scale)
    assert kept.shape == (1, 3, 12, d) and beta.shape == (1, 3, 12)
    for g in range(G):
        n = int(budget[0, g])
        alone = compact_head(keys[0, g], values[0, g], q[0, 2 * g:2 * g + 2].flatten(0, 1), n, scale=scale)
        assert torch.equal(index[0, g, :n], alone.index)
        probe = q[0, 2 * g]
        full = compacted_attention(probe, kept[0, g], fitted[0, g], scale=scale, beta=beta[0, g])
        own = compacted_attention(probe, keys[0, g, alone.index], alone.values, scale=scale, beta=alone.beta)
        torch.testing.assert_close(full, own, atol=1e-6, rtol=1e-5)
    ks, qs = [keys, keys.flip(2)], [q, q * 1.7]
    each = global_budgets(ks, qs, 11, scales=[scale, scale], pooling="rms")
    assert sum(int(c.sum()) for c in each) == 11 * 2 * G
    most = global_budgets(ks, qs, 11, scales=[scale, scale], pooling="rms", heads="max")
    assert all(bool((c == c[:, :1]).all()) for c in most)
    assert sum(int(c[0, 0]) for c in most) * G <= 11 * 2 * G


# ---------------------------------------------------------------------------------- stiefkv.compact, generate
def tiny_prompt(seed: int, n: int):
    from tests.tiny import tiny_model

    model = tiny_model(layers=2)
    ids = torch.randint(3, 97, (1, n), generator=torch.Generator().manual_seed(seed))
    return model, ids


def test_a_compacted_cache_continues_at_the_original_positions_in_forward_and_generate():
    """Keeping every token by eviction reproduces the uncompressed continuation exactly (positions, masks
    and cache length right in a multi-token forward and in greedy generate); AM at a tenth generates and
    reports the original length."""
    import stiefkv
    from stiefkv.cache import cache_keyword

    model, ids = tiny_prompt(9, 67)
    C = 53
    key = cache_keyword(model)
    full = model(ids).logits[:, C:]
    cache = stiefkv.compact(model, stiefkv.prefill(model, ids[:, :C], window=16), keep=1.0,
                            method="attention", allocation="uniform")
    assert isinstance(cache, stiefkv.CompactedCache) and cache.get_seq_length() == C
    out = model(ids[:, C:], **{key: cache}).logits
    torch.testing.assert_close(out, full, atol=1e-5, rtol=1e-4)
    assert cache.get_seq_length() == 67

    new = 9
    want = model.generate(ids[:, :C + 1], max_new_tokens=new, do_sample=False)
    cache = stiefkv.compact(model, stiefkv.prefill(model, ids[:, :C], window=16), keep=1.0,
                            method="attention", allocation="uniform")
    got = model.generate(ids[:, :C + 1], **{key: cache}, max_new_tokens=new, do_sample=False)
    assert torch.equal(got, want)

    cache = stiefkv.compact(model, stiefkv.prefill(model, ids[:, :C], window=16), keep=0.1)
    assert sum(cache.prefix) <= round(0.1 * C) * 2
    got = model.generate(ids[:, :C + 1], **{key: cache}, max_new_tokens=new, do_sample=False)
    assert got.shape == (1, C + 1 + new) and cache.get_seq_length() == C + new

    # padding inside the prompt compacted unpadded is refused, not dropped by the cache's own mask
    cache = stiefkv.compact(model, stiefkv.prefill(model, ids[:, :C], window=16), keep=0.1)
    mask = torch.ones(1, 67, dtype=torch.long)
    mask[:, :3] = 0
    with pytest.raises(ValueError, match="pads row.s. 0 inside the prompt of 53 tokens"):
        model(ids[:, C:], attention_mask=mask, **{key: cache})


@pytest.mark.parametrize("served", [False, True])
def test_padding_behind_a_compacted_prompt_is_never_attended(served):
    """Padding among the tokens behind a compacted prompt (a batch's questions of different lengths, or a
    row that ended early in the last turn) gets β = PAD_BETA in the cache, then and in every later forward:
    each row goes on as it does without its padding, at the positions its mask counts, in a forward, in a
    one-token step and in generate, at any keep. Before, the layers' checks read the model's 4-D mask cut to
    the entries held, and at keep 0.4 the padding was attended silently."""
    import copy

    import stiefkv
    from tests.tiny import random_projections, tiny_model

    model = tiny_model(layers=2)
    if served:
        stiefkv.load(model, random_projections(model, 13, 11))
    ids = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    C = 31
    gap = [C, C + 1]  # row 0: two padding tokens first behind the prompt
    mask = torch.ones_like(ids)
    mask[0, gap] = 0
    positions = (mask.cumsum(1) - 1)[:, C:]
    keep_cols = [c for c in range(C, 40) if c not in gap]
    G = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    for keep in (0.4, 1.0):
        base = stiefkv.compact(model, stiefkv.prefill(model, ids[:, :C], window=8), keep=keep)
        cache = copy.deepcopy(base)
        got = model(ids[:, C:], attention_mask=mask, position_ids=positions, past_key_values=cache).logits
        alone = copy.deepcopy(base)
        alone.batch_select_indices(torch.tensor([0]))
        want = model(ids[:1, keep_cols], position_ids=torch.arange(C, 38)[None], past_key_values=alone).logits
        torch.testing.assert_close(got[0, 2:], want[0], atol=1e-5, rtol=1e-4)
        # a later one-token step, padded or not, still never reads the padding
        step = torch.tensor([[5], [6]])
        more = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        nxt = model(step, attention_mask=more, position_ids=positions[:, -1:] + 1,
                    past_key_values=cache).logits
        ref = model(step[:1], position_ids=torch.tensor([[38]]), past_key_values=alone).logits
        torch.testing.assert_close(nxt[0], ref[0], atol=1e-5, rtol=1e-4)
        out = model.generate(ids, attention_mask=mask, past_key_values=copy.deepcopy(base), **G)
        solo = copy.deepcopy(base)
        solo.batch_select_indices(torch.tensor([0]))
        one = model.generate(ids[:1, list(range(C)) + keep_cols], past_key_values=solo, **G)
        assert torch.equal(out[0, 40:], one[0, 38:])


@pytest.mark.parametrize("served", [False, True])
def test_a_refused_forward_leaves_a_compacted_cache_to_continue_and_other_rows_are_refused_clearly(served):
    """A forward refused part way (a step padded inside the prompt) had its ids recorded already, so the
    correct continuation was then refused as another question; and a forward of another
    number of rows than the compacted cache holds failed inside torch's cat (and was recorded too)."""
    import copy

    import stiefkv
    from tests.tiny import random_projections, tiny_model

    model = tiny_model(layers=2)
    if served:
        stiefkv.load(model, random_projections(model, 13, 11))
    ids = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    C, G = 31, dict(max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)
    compacted = stiefkv.compact(model, stiefkv.prefill(model, ids[:, :C], window=8), keep=0.4)
    want = model.generate(ids, past_key_values=copy.deepcopy(compacted), **G)

    cache = copy.deepcopy(compacted)
    model(ids[:, C:C + 2], past_key_values=cache)
    mask = torch.ones(2, C + 4, dtype=torch.long)
    mask[1, 4] = 0  # inside the prompt: read back on forwards of several tokens (a turn's first)
    with pytest.raises(ValueError, match="inside the prompt"):
        model(ids[:, C + 2:C + 4], attention_mask=mask, past_key_values=cache)
    assert torch.equal(model.generate(ids, past_key_values=cache, **G), want)

    cache = copy.deepcopy(compacted)
    for rows in (ids[:1, C:], ids[:, C:].repeat(2, 1)):
        with pytest.raises(ValueError, match=f"holds 2 row\\(s\\) and the forward brings {rows.shape[0]}"):
            model(rows, past_key_values=cache)
    assert torch.equal(model.generate(ids, past_key_values=cache, **G), want)


@pytest.mark.parametrize("served", [False, True])
def test_a_reset_compacted_cache_is_an_empty_cache(served):
    """``reset()`` of a CompactedCache kept its compacted prefix's lengths and β over emptied layers: it
    reported the prompt's length less the entries held, and the next generate failed inside torch (or was
    refused as another question after a turn). Now, as a reset LatentCache, it starts from nothing."""
    import stiefkv
    from tests.tiny import random_projections, tiny_model

    model = tiny_model(layers=2)
    if served:
        stiefkv.load(model, random_projections(model, 13, 11))
    ids = torch.randint(3, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    G = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=None)
    want = model.generate(ids, **G)
    for turns in (0, 1):
        cache = stiefkv.compact(model, stiefkv.prefill(model, ids[:, :31], window=8), keep=0.4)
        if turns:
            model.generate(ids, past_key_values=cache, **G)
        cache.reset()
        assert cache.get_seq_length() == 0
        assert torch.equal(model.generate(ids, past_key_values=cache, **G), want)


def test_a_compacted_cache_continued_by_a_model_without_the_hooks_is_refused():
    """β reaches attention through hooks that compact installs on the model it is given: another instance
    of the same model (a copy, a reload) read the prefix without β (0.31 on the logits) or failed inside
    torch on a mask of the wrong length. Refused now, with the way to install them; installed, the same."""
    import stiefkv
    from stiefkv.compacted import install_hooks
    from tests.tiny import tiny_model

    model, other = tiny_model(layers=2), tiny_model(layers=2)
    ids = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    C = 31
    for allocation in ("uniform", "layers-max"):
        cache = stiefkv.compact(model, stiefkv.prefill(model, ids[:, :C], window=8), keep=0.4,
                                allocation=allocation)
        with pytest.raises(ValueError, match="without its β.*install_hooks"):
            other(ids[:, C:], past_key_values=cache)
    want = model(ids[:, C:], past_key_values=stiefkv.compact(
        model, stiefkv.prefill(model, ids[:, :C], window=8), keep=0.4)).logits
    install_hooks(other)
    got = other(ids[:, C:], past_key_values=stiefkv.compact(
        model, stiefkv.prefill(model, ids[:, :C], window=8), keep=0.4)).logits
    assert torch.equal(got, want)


def test_self_study_adds_the_queries_of_a_sampled_continuation_and_leaves_the_cache_as_it_was():
    import stiefkv

    model, ids = tiny_prompt(11, 40)
    plain = stiefkv.prefill(model, ids, window=16)
    studied = stiefkv.prefill(model, ids, window=16, self_study=7, seed=2)
    again = stiefkv.prefill(model, ids, window=16, self_study=7, seed=2)
    only = stiefkv.prefill(model, ids, window=0, self_study=7, seed=2)
    for a, b, c, d in zip(plain.reference_queries, studied.reference_queries, again.reference_queries,
                          only.reference_queries):
        assert b.shape[2] == 23 and d.shape[2] == 7 and torch.isfinite(b).all()
        assert torch.equal(b[:, :, :16], a) and torch.equal(b, c) and torch.equal(b[:, :, 16:], d)
    ask = torch.tensor([5, 6, 7])  # an instruction read before greedy tokens: its 3 queries are kept too
    told = stiefkv.prefill(model, ids, window=0, self_study=4, study_prompt=ask, study_greedy=True)
    again = stiefkv.prefill(model, ids, window=0, self_study=4, study_prompt=ask, study_greedy=True, seed=9)
    assert all(q.shape[2] == 7 and torch.equal(q, r) for q, r in zip(told.reference_queries,
                                                                      again.reference_queries))
    for same in (ask[None], [5, 6, 7]):  # what a tokenizer returns, and a list of ids
        as_given = stiefkv.prefill(model, ids, window=0, self_study=4, study_prompt=same, study_greedy=True)
        assert all(torch.equal(q, r) for q, r in zip(told.reference_queries, as_given.reference_queries))
    for bad, message in (({"study_prompt": ask.repeat(2, 1)}, r"study_prompt must be token ids \[p\]"),
                         ({"study_prompt": ["a"]}, r"study_prompt must be token ids \[p\]"),
                         ({"study_prompt": ask + 1000}, "study_prompt hold ids outside"),
                         ({"study_prompt": ask, "self_study": 0}, "give self_study > 0 too"),
                         ({"self_study": 2.5}, "self_study must be a whole number"),
                         ({"window": "8"}, "window must be a whole number")):
        with pytest.raises(ValueError, match=message):
            stiefkv.prefill(model, ids, **({"self_study": 4} | bad))
    for la, lb in zip(plain.layers, told.layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
    for la, lb in zip(plain.layers, studied.layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
    assert studied.get_seq_length() == 40
    assert stiefkv.compact(model, studied, keep=0.2).get_seq_length() == 40

    from stiefkv.compacted import repeat_queries

    again = repeat_queries(model, ids, plain, 25, every=3)  # the last 25 tokens read again, every 3rd query
    assert all(q.shape[2] == 9 and torch.isfinite(q).all() for q in again)
    fresh = stiefkv.prefill(model, ids, window=16)
    for la, lb in zip(plain.layers, fresh.layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
    # prefill(repeat=N): those queries instead of the window's, the cache as without them
    read = stiefkv.prefill(model, ids, repeat=25)
    expected = repeat_queries(model, ids, stiefkv.prefill(model, ids), 25)
    assert all(torch.equal(q, r) for q, r in zip(read.reference_queries, expected))
    for la, lb in zip(plain.layers, read.layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
    assert stiefkv.compact(model, read, keep=0.2).get_seq_length() == 40
    with pytest.raises(ValueError, match="prompt of 511 tokens leaves 1 of the model's 512"):
        stiefkv.prefill(model, torch.randint(2, 97, (1, 511)), repeat=300)


def test_reading_again_past_the_positions_goes_in_segments():
    """A prompt of 300 tokens read again on a model of 512 positions: segments of the 212 positions left,
    each after a lead-in whose queries are dropped. The last segment's queries are those of one reading of
    its lead-in and itself (the same tokens at the same positions), every-th queries are a slice of all,
    and the cache comes back as it was."""
    import stiefkv
    from stiefkv.compacted import REPEAT_LEAD, repeat_queries

    model, _ = tiny_prompt(11, 40)
    ids = torch.randint(2, 97, (2, 300), generator=torch.Generator().manual_seed(5))
    cache = stiefkv.prefill(model, ids, window=16)
    before = [(la.keys.clone(), la.values.clone()) for la in cache.layers]
    whole = repeat_queries(model, ids, cache, 300)

    def last_segment(lead):
        """Where the last segment starts (segments of 212 − lead from token 0), and one reading of it with
        its lead-in: the same tokens at the same positions."""
        last = range(0, 300, 212 - lead)[-1]
        return last, repeat_queries(model, ids, cache, 300 - last + lead)  # fits: one reading

    last, tail = last_segment(REPEAT_LEAD)  # segments at 0, 148 and 296
    # every 3rd: the later segments start at 148 and 296, so their first kept queries are not their first
    thirds = repeat_queries(model, ids, cache, 300, every=3)
    for q, t, q3 in zip(whole, tail, thirds):
        assert q.shape[2] == 300 and torch.isfinite(q).all()
        torch.testing.assert_close(q[:, :, last:], t[:, :, REPEAT_LEAD:], rtol=1e-5, atol=1e-5)  # float32
        assert q3.shape[2] == 100 and torch.equal(q3, q[:, :, ::3])
    for la, (k, v) in zip(cache.layers, before):
        assert torch.equal(la.keys, k) and torch.equal(la.values, v)
    with pytest.raises(ValueError, match="tokens ≥ 1, every ≥ 1 and lead ≥ 0; got 0, 1 and 64"):
        repeat_queries(model, ids, cache, 0)
    longer = repeat_queries(model, ids, cache, 300, lead=100)  # segments at 0, 112 and 224
    last, tail = last_segment(100)
    for q, t in zip(longer, tail):
        torch.testing.assert_close(q[:, :, last:], t[:, :, 100:], rtol=1e-5, atol=1e-5)
    # past=True: one reading at positions 300 … 599, as on the same model with positions enough for it
    past = repeat_queries(model, ids, cache, 300, past=True)
    model.config.max_position_embeddings = 600
    try:
        roomy = repeat_queries(model, ids, cache, 300)
    finally:
        model.config.max_position_embeddings = 512
    for p, r, q in zip(past, roomy, whole):
        assert torch.equal(p, r) and not torch.allclose(p[:, :, 150:], q[:, :, 150:])
    read = stiefkv.prefill(model, ids, repeat=300)
    assert all(torch.equal(q, r) for q, r in zip(read.reference_queries, whole))
    assert stiefkv.compact(model, read, keep=0.2).get_seq_length() == 300


def test_bad_compact_requests_are_refused():
    from transformers import DynamicCache

    import stiefkv
    from stiefkv.cache import cache_keyword
    from tests.tiny import tiny_model

    model, ids = tiny_prompt(10, 20)
    cache = stiefkv.prefill(model, ids, window=8)
    for keep in (0.0, 1.2):
        with pytest.raises(ValueError, match="keep must be in"):
            stiefkv.compact(model, cache, keep=keep)
    with pytest.raises(ValueError, match="method must be one of am, attention"):
        stiefkv.compact(model, cache, method="snapkv")
    with pytest.raises(ValueError, match="the cache is empty"):
        stiefkv.compact(model, DynamicCache())
    with pytest.raises(ValueError, match="does not belong to this model"):
        stiefkv.compact(tiny_model(layers=3), cache)
    with pytest.raises(ValueError, match="too few to compact"):
        stiefkv.compact(model, _one_token_cache(model, ids))
    with pytest.raises(ValueError, match="reference queries"):
        plain = DynamicCache()
        model(ids, **{cache_keyword(model): plain})
        stiefkv.compact(model, plain)
    with pytest.raises(ValueError, match="compacted already"):
        stiefkv.compact(model, stiefkv.compact(model, cache))
    with pytest.raises(ValueError, match="allocation must be one of"):
        stiefkv.compact(model, cache, allocation="heads")
    two = "at least one row and 2 tokens"
    for bad, match in ((ids[0], two), (ids[:, :1], two), (ids.tolist(), "got list"),
                       (ids.float(), "integer token ids, got torch.float32"),
                       (ids + 10 ** 6, "outside the model's vocabulary")):
        with pytest.raises(ValueError, match=match):
            stiefkv.prefill(model, bad)
    with pytest.raises(ValueError, match="not all 0"):
        stiefkv.prefill(model, ids, window=0)
    positions = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"self_study 20 tokens after the prompt's {positions - 10} run"):
        stiefkv.prefill(model, torch.randint(3, 90, (1, positions - 10)), self_study=20)
    for options, match in (({"block": 0}, "block must be"), ({"block": -5}, "block must be"),
                           ({"ridge": -1.0}, "ridge must be"), ({"foo": 1}, "unknown compaction option"),
                           ({"solver": "lsq"}, "solver must be one of"), ({"pooling": "sum"}, "pooling must"),
                           ({"selection": "best"}, "selection must be"), ({"fit_beta": "y"}, "fit_beta is")):
        with pytest.raises(ValueError, match=match):
            stiefkv.compact(model, cache, 0.3, **options)
    # the fit's options with eviction (they did nothing: the same entries, β 0)
    for options in ({"fit_beta": True}, {"selection": "omp", "refit_values": True}, {"solver": "nnls"},
                    {"ridge": 0.1}, {"block": 64}):
        with pytest.raises(ValueError, match="of method 'am' .the fit.; method 'attention' keeps"):
            stiefkv.compact(model, cache, 0.3, method="attention", **options)
    stiefkv.compact(model, cache, 0.3, method="attention", pooling="max", allocation="global")
    other = tiny_model(layers=2)  # the same shapes, other key weights: another checkpoint
    with torch.no_grad():
        other.model.layers[0].self_attn.k_proj.weight.mul_(1.01)
    with pytest.raises(ValueError, match="prefilled by a model with other key weights"):
        stiefkv.compact(other, cache, keep=0.3)
    with pytest.raises(ValueError, match=r"holds 2 layers of keys \[1, 2, 20, 24\], the model has 3 layers"):
        stiefkv.compact(tiny_model(layers=3), cache, keep=0.3)  # other shapes are named so
    for bad in ("half", "0.5", True):  # float() would take the string, and True as "keep everything"
        with pytest.raises(ValueError, match="keep must be a number"):
            stiefkv.compact(model, cache, keep=bad)
    assert stiefkv.compact(model, cache, keep=torch.tensor(0.3)).get_seq_length() == 20
    queries = cache.reference_queries
    for bad, match in ((queries[:1], "one tensor a layer"), ([q[..., :5] for q in queries], "of layer 0"),
                       ([q[:, :, :0] for q in queries], "≥ 1 queries"),
                       ([q.expand(2, -1, -1, -1) for q in queries], "batch 1"),
                       ([queries[0], queries[1].index_fill(2, torch.tensor([1]), float("nan"))],
                        "layer 1 hold NaN or infinite"),  # gave NaN logits at the next forward
                       ([q.long() for q in queries], "layer 0 hold torch.int64")):
        with pytest.raises(ValueError, match=match):
            stiefkv.compact(model, cache, 0.3, queries=bad)
    mixed = stiefkv.prefill(model, ids, window=0, repeat=10, self_study=3)
    assert all(q.shape[2] == 13 for q in mixed.reference_queries)  # the repeat's 10 beside the studied 3


def test_surprise_is_the_models_loss_on_each_prompt_token():
    """``prefill`` records each prompt token's loss from the prompt's own forward (the first token +inf),
    the same in slices of any size as all at once."""
    import stiefkv
    from stiefkv.compacted import surprise

    model, ids = tiny_prompt(12, 41)
    cache = stiefkv.prefill(model, ids, window=8)
    logits = model(ids).logits.float()
    want = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="none")
    got = cache.prompt_surprise
    assert got.shape == (1, 41) and got[0, 0] == float("inf")
    torch.testing.assert_close(got[0, 1:], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(surprise(logits, ids, rows=7), got, atol=1e-5, rtol=1e-5)


def test_pinned_tokens_stay_exact_beside_the_compacted_rest():
    """``pin``: the most surprising tokens sit behind the compacted rest as they are (β = 0), the rest is the
    compaction of the other tokens to the entries left; kept whole by eviction with half the tokens pinned,
    the continuation is the uncompressed one (attention over a block split in two is attention over both)."""
    import stiefkv
    from stiefkv.cache import cache_keyword
    from stiefkv.compaction import compact_layers
    from stiefkv.models import decoder_layers

    model, ids = tiny_prompt(13, 67)
    C = 53
    key = cache_keyword(model)
    full = model(ids).logits[:, C:]
    whole = stiefkv.compact(model, stiefkv.prefill(model, ids[:, :C], window=16), keep=1.0, pin=0.5,
                            method="attention", allocation="uniform")
    torch.testing.assert_close(model(ids[:, C:], **{key: whole}).logits, full, atol=1e-5, rtol=1e-4)

    cache = stiefkv.prefill(model, ids[:, :C], window=16)
    t = round(0.3 * C)
    p = int(0.4 * t)
    pins = cache.prompt_surprise.topk(p, dim=1).indices.sort(dim=1).values
    assert 0 in pins[0].tolist()  # the first token, which nothing predicts
    rest = [i for i in range(C) if i not in pins[0].tolist()]
    layers = decoder_layers(model)
    keys = [cache.layers[i].keys for i in range(len(layers))]
    values = [cache.layers[i].values for i in range(len(layers))]
    scales = [la.self_attn.scaling for la in layers]
    want = list(compact_layers([k[:, :, rest] for k in keys], [v[:, :, rest] for v in values],
                               cache.reference_queries, t - p, scales=scales))
    got = stiefkv.compact(model, cache, keep=0.3, pin=0.4)
    for i, (kept, beta, fitted, _) in enumerate(want):
        n = kept.shape[2]
        assert got.prefix[i] == n + p
        torch.testing.assert_close(got.layers[i].keys[:, :, :n], kept)
        torch.testing.assert_close(got.layers[i].values[:, :, :n], fitted)
        torch.testing.assert_close(got.beta[i][..., :n], beta)
        assert torch.equal(got.layers[i].keys[:, :, n:n + p], keys[i][:, :, pins[0]])
        assert torch.equal(got.layers[i].values[:, :, n:n + p], values[i][:, :, pins[0]])
        assert not got.beta[i][..., n:n + p].any()
    out = model.generate(ids[:, :C + 1], **{key: got}, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, C + 6) and got.get_seq_length() == C + 5


@pytest.mark.parametrize("t,method,want", [(205, "am", 51), (410, "am", 64), (768, "am", 76),
                                           (2000, "am", 200), (128, "am", 32), (127, "am", 0),
                                           (102, "am", 0), (3, "am", 0), (410, "attention", 0)])
def test_the_default_pin_is_a_tenth_with_a_floor_of_64_capped_at_a_quarter_from_128_kept(t, method, want):
    from stiefkv.compacted import pin_count

    assert pin_count(None, t, method) == want
    assert pin_count(0, t, method) == 0 and pin_count(0.3, t, method) == int(0.3 * t)


def test_the_default_compaction_pins_the_default_count_and_a_cache_without_surprise_pins_none():
    """``pin=None`` (the default) is the explicit share that gives :func:`pin_count`'s count; a cache that
    :func:`stiefkv.prefill` did not make (no surprise recorded) compacts without pins, as ``pin=0``."""
    from transformers import DynamicCache

    import stiefkv
    from stiefkv.cache import cache_keyword
    from stiefkv.compacted import pin_count

    model, ids = tiny_prompt(21, 331)
    cache = stiefkv.prefill(model, ids, window=12)
    t = round(0.4 * 331)
    p = pin_count(None, t, "am")
    assert p == 33  # a quarter of 132 under the floor of 64
    default = stiefkv.compact(model, cache, keep=0.4)
    explicit = stiefkv.compact(model, cache, keep=0.4, pin=(p + 0.5) / t)
    unpinned = stiefkv.compact(model, cache, keep=0.4, pin=0)
    few = stiefkv.compact(model, cache, keep=0.3)  # 99 kept entries: none pinned by default
    few_unpinned = stiefkv.compact(model, cache, keep=0.3, pin=0)
    for a, b in zip(few.layers, few_unpinned.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    for i in range(len(default.layers)):
        assert torch.equal(default.layers[i].keys, explicit.layers[i].keys)
        assert torch.equal(default.beta[i], explicit.beta[i])
    assert not all(torch.equal(a.keys, b.keys) for a, b in zip(default.layers, unpinned.layers))
    plain = DynamicCache()
    model(ids, **{cache_keyword(model): plain})
    plain.reference_queries = cache.reference_queries
    quiet = stiefkv.compact(model, plain, keep=0.4)
    for i in range(len(quiet.layers)):
        torch.testing.assert_close(quiet.layers[i].keys, unpinned.layers[i].keys)
        torch.testing.assert_close(quiet.beta[i], unpinned.beta[i])


def test_pins_of_a_cache_cropped_after_prefill_are_among_its_own_tokens():
    """A cache cropped after :func:`stiefkv.prefill` pins the most surprising of the tokens it still holds;
    a share given as a numpy scalar is a share."""
    import numpy as np

    import stiefkv

    model, ids = tiny_prompt(23, 61)
    cache = stiefkv.prefill(model, ids, window=12)
    score = cache.prompt_surprise
    for layer in cache.layers:  # crop (whose argument's meaning changed across transformers releases)
        layer.keys, layer.values = layer.keys[:, :, :40], layer.values[:, :, :40]
    got = stiefkv.compact(model, cache, keep=0.5, pin=np.float32(0.3))
    p = int(float(np.float32(0.3)) * 20)
    pins = score[:, :40].topk(p, dim=1).indices.sort(dim=1).values
    assert int(pins.max()) < 40 and int(score[0].argmax()) in pins[0].tolist()
    for i in range(len(got.layers)):
        n = got.prefix[i] - p
        assert torch.equal(got.layers[i].keys[:, :, n:n + p], cache.layers[i].keys[:, :, pins[0]])
    default = stiefkv.compact(model, cache, keep=0.5)
    assert default.get_seq_length() == 40


def test_bad_pins_are_refused():
    from transformers import DynamicCache

    import stiefkv
    from stiefkv.cache import cache_keyword
    from stiefkv.compacted import build

    model, ids = tiny_prompt(14, 30)
    cache = stiefkv.prefill(model, ids, window=8)
    for pin in (-0.1, 1.0, True, False, "0.1", float("nan")):
        with pytest.raises(ValueError, match="pin is the share"):
            stiefkv.compact(model, cache, pin=pin)
    plain = DynamicCache()
    model(ids, **{cache_keyword(model): plain})
    plain.reference_queries = cache.reference_queries
    with pytest.raises(ValueError, match="records on the cache"):
        stiefkv.compact(model, plain, pin=0.5)
    with pytest.raises(ValueError, match="not of kvpress"):
        build(model, cache, cache.reference_queries, 10, "snapkv", pin=0.5)


def _one_token_cache(model, ids):
    from transformers import DynamicCache

    from stiefkv.cache import cache_keyword
    cache = DynamicCache()
    model(ids[:, :1], **{cache_keyword(model): cache})
    cache.reference_queries = []
    return cache


# ------------------------------------------------------------------------------------ compaction in blocks
@pytest.mark.parametrize("solver", ["projected", "nnls"])
def test_keeping_every_token_with_fewer_queries_than_tokens_is_the_uncompressed_cache(solver):
    """One query head a KV head and a reference window of 16 for 45 tokens: the masses alone do not decide
    45 weights. Keeping every token continues exactly as the full forward, and a fit of every token from
    16 queries leans to no bias (β ≈ 0), not to weights of 0 (which evicted most of them)."""
    import stiefkv
    from stiefkv.cache import cache_keyword
    from stiefkv.compaction import compact_head, compacted_attention
    from tests.tiny import tiny_model

    model = tiny_model(layers=2, heads=4, kv_heads=4)
    ids = torch.randint(3, 97, (1, 52), generator=torch.Generator().manual_seed(4))
    C = 45
    with torch.no_grad():
        full = model(ids).logits[:, C:]
        cache = stiefkv.compact(model, stiefkv.prefill(model, ids[:, :C], window=16), keep=1.0, solver=solver)
        got = model(ids[:, C:], position_ids=torch.arange(C, 52)[None],
                    **{cache_keyword(model): cache}).logits
    assert (got - full).abs().max() < 1e-4
    keys, values, queries = block(7, 45, 16, 16)
    fit = compact_head(keys, values, queries(16), 45, scale=0.25, solver=solver)
    assert fit.beta.abs().max() < 1e-3
    held_out = queries(64)
    exact = compacted_attention(held_out, keys, values, scale=0.25)
    assert rel(compacted_attention(held_out, keys[fit.index], fit.values, scale=0.25, beta=fit.beta),
               exact) < 1e-4


@pytest.mark.parametrize("options", [{}, {"block": 16}, {"block": 16, "allocation": "uniform"}])
def test_each_row_of_a_batch_is_compacted_as_it_would_be_alone(options):
    """The default allocation (``layers-max``) cuts each row by its own keys: a row batched with another keeps
    the counts and continues with the logits it gets compacted alone. In blocks too: each block's count was
    its share of the whole batch's top keys (0.14 on the logits), now of the row's."""
    import stiefkv
    from stiefkv.cache import cache_keyword
    from tests.tiny import tiny_model

    model = tiny_model(layers=3)
    ids = torch.randint(3, 97, (2, 70), generator=torch.Generator().manual_seed(12))
    C, key = 60, cache_keyword(model)
    pos = torch.arange(C, 70)[None]
    with torch.no_grad():
        both = stiefkv.compact(model, stiefkv.prefill(model, ids[:, :C], window=16), keep=0.3, **options)
        alone = stiefkv.compact(model, stiefkv.prefill(model, ids[:1, :C], window=16), keep=0.3, **options)
        a = model(ids[:1, C:], position_ids=pos, **{key: alone}).logits
        b = model(ids[:, C:], position_ids=pos.expand(2, -1), **{key: both}).logits[:1]
    assert (a - b).abs().max() < 1e-4


def test_block_counts_follow_the_top_keys_and_sum_to_the_budget():
    from stiefkv.compaction import block_counts

    g = torch.Generator().manual_seed(21)
    scores = torch.rand(2, 3, 250, generator=g)
    scores[..., 100:140] += 1.0  # the top keys sit in the second block of 64
    counts = block_counts(scores, 37, 64)
    assert len(counts) == 4 and sum(counts) == 37 and min(counts) >= 1
    assert counts[1] == max(counts) and counts[1] >= 24  # 24 of the 40 boosted keys lie in block 1
    assert block_counts(scores, 250, 64) == [64, 64, 64, 58]  # everything kept: each block whole
    assert sum(block_counts(scores, 3, 64)) == 3  # fewer than blocks: no block below what the budget allows
    assert block_counts(scores, 1, 64) == [0, 1, 0, 0]  # ... and the block of the top keys keeps its entry
    top_first = torch.rand(2, 100, generator=g) * 0.01
    top_first[:, :3] = 10.0
    assert block_counts(top_first, 3, 16) == [3, 0, 0, 0, 0, 0, 0]


@pytest.mark.parametrize("B,G,H,T,t,block", [(1, 3, 9, 131, 29, 40), (2, 2, 8, 97, 11, 64)])
def test_a_layer_compacted_in_blocks_reproduces_its_attention(B, G, H, T, t, block):
    """Blocks compacted on their own, joined: every token kept reproduces the layer exactly; at a fraction,
    attention output and mass on held-out queries stay close to those of the whole-layer compaction and far
    better than eviction (float32 in, float64 fits)."""
    from stiefkv.compaction import compact_layer

    d, scale = 13, 0.31
    keys, values, q = layer_cache(40 + B, B, G, H, T, d)
    held = torch.randn(B, H, 64, d, generator=torch.Generator().manual_seed(7))
    per = H // G

    def errors(kept, beta, fitted):
        out, mass = [], []
        for b in range(B):
            for g in range(G):
                hq = held[b, g * per:(g + 1) * per].flatten(0, 1)
                full = compacted_attention(hq, keys[b, g], values[b, g], scale=scale)
                got = compacted_attention(hq, kept[b, g], fitted[b, g], scale=scale, beta=beta[b, g])
                out.append(rel(got, full))
                mass.append(float((log_mass(hq, kept[b, g], scale=scale, beta=beta[b, g])
                                   - log_mass(hq, keys[b, g], scale=scale)).abs().mean()))
        return sum(out) / len(out), sum(mass) / len(mass)

    whole = compact_layer(keys, values, q, T, scale=scale, pooling="rms", solver="projected", block=block)
    assert torch.equal(whole[3], torch.arange(T).expand(B, G, T))
    assert errors(*whole[:3])[0] < 1e-4 and errors(*whole[:3])[1] < 1e-4

    options = dict(pooling="rms", solver="projected")
    blocked = errors(*compact_layer(keys, values, q, t, scale=scale, block=block, **options)[:3])
    plain = errors(*compact_layer(keys, values, q, t, scale=scale, **options)[:3])
    evicted = errors(*compact_layer(keys, values, q, t, scale=scale, method="attention", pooling="rms")[:3])
    assert all(math.isfinite(x) for x in blocked + plain + evicted)
    assert blocked[0] < evicted[0] and blocked[1] < 0.7 * evicted[1], (blocked, evicted)
    assert blocked[0] < 1.5 * plain[0] + 0.02, (blocked, plain)
    few = compact_layer(keys, values, q, 2, scale=scale, block=block, **options)  # fewer entries than blocks
    assert few[3].shape == (B, G, 2) and torch.isfinite(few[2]).all()


@pytest.mark.parametrize("options", [{"selection": "omp"}, {"solver": "nnls"}, {"solver": "projected"}])
def test_block_is_honoured_by_the_fits_without_a_batched_form(options):
    """OMP selection, the NNLS solver and counts that differ between heads (``allocation="global"``) took
    the per-head fit, which dropped ``block``: a long layer was fitted whole, its logits spanning every
    token. Each head is now compacted in blocks, each block to its share of the head's top keys
    (:func:`block_counts` of the layer's scores), exactly as that block compacted alone (float32 in,
    float64 fits: 1e-6)."""
    from stiefkv.compaction import block_counts, compact_head, compact_layer, layer_scores

    B, G, H, T, d, block, scale = 2, 2, 6, 83, 11, 24, 0.29
    keys, values, q = layer_cache(9, B, G, H, T, d)
    q = q[:, :, :40]
    budget = torch.tensor([[9, 13], [11, 7]])  # heads of unequal counts: the per-head path
    kept, beta, fitted, index = compact_layer(keys, values, q, budget, scale=scale, block=block, **options)
    scores = layer_scores(keys, q, scale, "mean")
    per = H // G
    for b in range(B):
        for g in range(G):
            n, at = int(budget[b, g]), 0
            for s, c in zip(range(0, T, block), block_counts(scores[b, g][None], n, block)):
                if c == 0:
                    continue
                want = compact_head(keys[b, g, s:s + block], values[b, g, s:s + block],
                                    q[b, g * per:(g + 1) * per].flatten(0, 1), c, scale=scale, **options)
                assert torch.equal(index[b, g, at:at + c], want.index + s)
                assert_close(beta[b, g, at:at + c], want.beta, atol=1e-6, rtol=1e-6, what="β of a block")
                assert_close(fitted[b, g, at:at + c], want.values, atol=1e-6, rtol=1e-6, what="values")
                at += c
            assert at == n and bool((beta[b, g, n:] < -1e3).all())  # the rest: padding, never attended
    whole = compact_layer(keys, values, q, budget, scale=scale, **options)
    assert not torch.equal(whole[3], index)


@pytest.mark.parametrize("B,G,H,T,block,counts", [(1, 3, 9, 137, 40, [3, 17, 1, 6]),
                                                  (2, 2, 8, 97, 64, [0, 11])])
@pytest.mark.parametrize("batch_bytes", [None, 1])
def test_blocks_fitted_together_equal_each_block_fitted_alone(B, G, H, T, block, counts, batch_bytes,
                                                               monkeypatch):
    """The blocked fit pads every block to the largest count and fits them in one batch (or, past
    BATCH_BYTES, in batches of fewer blocks): each block's keys, β and values equal fitting that block alone
    (counts uneven, a block dropped; float32 in, float64 inside: 1e-5), and padding never leaks into the
    result."""
    from stiefkv import compaction
    from stiefkv.compaction import FIT_LOGITS, _fit_chosen, _group_queries, _logits, compact_heads_blocked

    if batch_bytes is not None:
        monkeypatch.setattr(compaction, "BATCH_BYTES", batch_bytes)

    d, scale = 9, 0.33
    keys, values, queries = layer_cache(60 + B, B, G, H, T, d)
    q = _group_queries(queries[:, :, :50], G)
    scores = torch.rand(B, G, T, generator=torch.Generator().manual_seed(3))
    index, beta, fitted = compact_heads_blocked(keys, values, q, scale=scale, scores=scores, counts=counts,
                                                block=block)
    assert index.shape == (B, G, sum(counts)) and torch.isfinite(fitted).all() and torch.isfinite(beta).all()
    at = 0
    for s, n in zip(range(0, T, block), counts):
        if n == 0:
            continue
        k, v = keys[..., s:s + block, :], values[..., s:s + block, :]
        want_index = scores[..., s:s + block].topk(n, -1).indices.sort(-1).values
        E, top = _logits(q, k, scale, FIT_LOGITS)
        want_beta, want_values = _fit_chosen(q, k, v, E, top, E.sum(-1), want_index, scale=scale,
                                             fit_beta=True, refit_values=True, ridge=1e-3)
        assert torch.equal(index[..., at:at + n], want_index + s)
        torch.testing.assert_close(beta[..., at:at + n], want_beta, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fitted[..., at:at + n, :], want_values, atol=1e-5, rtol=1e-5)
        at += n


@pytest.mark.parametrize("gap", [60.0, 130.0])
def test_a_query_far_above_every_chosen_key_leaves_the_fit_finite(gap):
    """A reference query whose best key (not kept) lies ``gap`` above every kept key in logits: float32's
    exponential is 0 there from 104 on, so the kept keys' logits are exponentiated in float64 and a row that
    still vanishes drops out of the value fit instead of making it 0/0 (NaN)."""
    from stiefkv.compaction import compact_heads_blocked

    d, T, scale = 8, 40, 1.0
    g = torch.Generator().manual_seed(5)
    keys, values = torch.randn(1, 1, T, d, generator=g), torch.randn(1, 1, T, d, generator=g)
    queries = torch.randn(1, 1, 30, d, generator=g)
    keys[0, 0, 0] = 0.0
    keys[0, 0, 0, 0] = gap
    queries[..., 0] = 0.0  # key 0 is a logit of 0 to every query but the first
    queries[0, 0, 0] = 0.0
    queries[0, 0, 0, 0] = 1.0  # query 0: logit gap on key 0, 0 on every other key
    scores = torch.rand(1, 1, T, generator=g)
    scores[..., 0] = -1.0  # key 0 is never kept
    for counts, block in (([5], T), ([2, 3], 20)):
        index, beta, fitted = compact_heads_blocked(keys, values, queries, scale=scale, scores=scores,
                                                    counts=counts, block=block)
        assert 0 not in index.tolist()[0][0]
        assert torch.isfinite(beta).all() and torch.isfinite(fitted).all(), (gap, counts)


def test_unpinned_layers_are_gathered_one_at_a_time_and_let_go():
    """The tokens left to compact are gathered from each layer when it is read (not every layer up front,
    which held a second copy of the cache), equal to indexing them; a layer set to None is dropped."""
    from stiefkv.compacted import _unpinned

    g = torch.Generator().manual_seed(7)
    keys = [torch.randn(2, 3, 29, 5, generator=g) for _ in range(4)]
    values = [torch.randn(2, 3, 29, 7, generator=g) for _ in range(4)]
    pins = torch.stack([torch.tensor([0, 4, 17]), torch.tensor([0, 11, 28])])
    k, v = _unpinned(keys, values, pins)
    assert len(k) == len(v) == 4
    for b in range(2):
        rest = [i for i in range(29) if i not in pins[b].tolist()]
        for i in range(4):
            assert torch.equal(k[i][b], keys[i][b][:, rest]) and torch.equal(v[i][b], values[i][b][:, rest])
    assert [x.shape for x in k] == [(2, 3, 26, 5)] * 4
    k[1] = None
    assert k[1] is None and torch.equal(k[2], list(k)[2]) and keys[1] is not None
    with pytest.raises(TypeError, match="read-only"):
        k[0] = keys[0]
    with pytest.raises(TypeError, match="one at a time"):
        k[1:3]
    assert _unpinned(keys, values, None) == (keys, values)


def test_the_uncompressed_pass_key_answers_follow_the_model_as_served_now(monkeypatch):
    """The whole context's answers are remembered per model and prompt, and per the bases the model is
    served with: after ``stiefkv.load`` or ``unload`` on the same object they are asked again (they were
    reused, so the column reported the model as it had been)."""
    import stiefkv
    from stiefkv import longcontext
    from stiefkv.attention import projections_of
    from tests.tiny import random_projections, tiny_model

    asked = []

    def retrieve(model, tokenizer, ctx, question, keep, method, **kw):
        served = projections_of(model) is not None
        asked.append((keep, served))
        return ("KEY" if not served else "nothing"), 1, 1.0

    monkeypatch.setattr(longcontext, "retrieve", retrieve)
    prompt = (torch.arange(3, 60), torch.arange(60, 70), "KEY")  # ids the vocabulary check reads
    monkeypatch.setattr(longcontext, "passkey_sample", lambda tok, context, rng: prompt)
    model = tiny_model()
    kw = dict(context=64, keep=0.5, method="attention", samples=2)
    assert longcontext.evaluate_retrieval(model, None, **kw).accuracy_full == 1.0
    stiefkv.load(model, random_projections(model, 8, 8))
    assert longcontext.evaluate_retrieval(model, None, **kw).accuracy_full == 0.0
    stiefkv.unload(model)
    asked.clear()
    assert longcontext.evaluate_retrieval(model, None, **kw).accuracy_full == 1.0
    assert [k for k, _ in asked].count(None) == 0  # remembered for the uncompressed model: not asked again


def test_what_a_compacted_cache_cannot_be_given_is_refused():
    """Found by a walkthrough (silently wrong before): a sliding-window model compacted as if it attended to
    every token; ids of other prompts (rows that are not each row repeated) given to generate, which
    repeated the cache's rows; prompt-lookup generate, which reads the prompt again over the compacted cache;
    a crop into the compacted prompt (a failure inside torch at the next forward)."""
    import copy

    from transformers import MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM

    import stiefkv
    from stiefkv.cache import cache_keyword
    from stiefkv.models import ModelLoadError

    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=512)
    windowed = MistralForCausalLM(MistralConfig(**small, sliding_window=16)).eval()
    mixed = Qwen3ForCausalLM(Qwen3Config(**small, sliding_window=16,
                                         layer_types=["sliding_attention", "full_attention"])).eval()
    for m in (windowed, mixed):
        with pytest.raises(ModelLoadError, match="sliding"):
            stiefkv.prefill(m, torch.randint(1, 128, (1, 40)))

    model, ids = tiny_prompt(11, 46)
    key = cache_keyword(model)
    two = torch.cat([ids[:, :40], torch.randint(3, 97, (1, 40), generator=torch.Generator().manual_seed(3))])
    cache = stiefkv.compact(model, stiefkv.prefill(model, two, window=16), keep=1.0, method="attention")
    q = ids[:, 40:].expand(2, -1)
    with pytest.raises(ValueError, match="holds 2 rows and generate runs 4"):
        model.generate(torch.cat([two, q], 1).repeat(2, 1), **{key: copy.deepcopy(cache)}, max_new_tokens=2,
                       do_sample=False, pad_token_id=0)
    beams = model.generate(torch.cat([two, q], 1), **{key: copy.deepcopy(cache)}, max_new_tokens=3,
                           do_sample=False, num_beams=2, num_return_sequences=2, pad_token_id=0)
    want = model.generate(torch.cat([two, q], 1), max_new_tokens=3, do_sample=False, num_beams=2,
                          num_return_sequences=2, pad_token_id=0)
    assert torch.equal(beams, want)  # generate's own repeats are still taken

    one = stiefkv.compact(model, stiefkv.prefill(model, ids[:, :40], window=16), keep=1.0, method="attention")
    with pytest.raises(ValueError, match="Assisted and prompt-lookup generate re-read the prompt"):
        model.generate(ids, **{key: copy.deepcopy(one)}, prompt_lookup_num_tokens=3, max_new_tokens=4,
                       do_sample=False, pad_token_id=0)

    model(ids[:, 40:43], **{key: one})  # 3 tokens behind the prompt
    with pytest.raises(ValueError, match="only those can be removed"):
        one.crop(-5)
    one.crop(-2)
    one.crop(0)  # transformers ≥ 5: nothing (generate's stop checks call it every step)
    assert one.get_seq_length() == 41
    torch.testing.assert_close(model(ids[:, 41:42], **{key: one}).logits,
                               model(ids[:, :42]).logits[:, -1:], atol=1e-5, rtol=1e-4)


def test_keeping_every_token_over_codes_pins_nothing():
    """With every token kept the default pins only moved some behind the rest, and channel-layout codes,
    grouped by the entries' order, then rounded differently from the uncompacted cache."""
    import copy

    import stiefkv
    from tests.tiny import random_projections, tiny_model

    model = tiny_model()
    proj = random_projections(model, 16, 12)
    proj.quant = [("int4-channel", "int4-channel")] * len(proj.keys)
    stiefkv.load(model, stiefkv.Projections(**vars(proj)))
    ids = torch.randint(3, 97, (1, 150), generator=torch.Generator().manual_seed(2))
    nxt = torch.randint(3, 97, (1, 4), generator=torch.Generator().manual_seed(4))
    cache = stiefkv.prefill(model, ids, window=32)
    want = model(nxt, past_key_values=copy.deepcopy(cache)).logits
    got = model(nxt, past_key_values=stiefkv.compact(model, cache, keep=1.0)).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_the_random_press_follows_the_runs_seed():
    from stiefkv.compacted import build, prefill_with_queries

    model, ids = tiny_prompt(12, 40)
    picks = []
    for seed in (1, 2, 1):
        torch.manual_seed(seed)
        cache, queries = prefill_with_queries(model, ids, 8)
        picks.append(build(model, cache, queries, 12, "random").layers[0].keys)
    assert torch.equal(picks[0], picks[2]) and not torch.equal(picks[0], picks[1])


def test_another_model_continuing_a_compacted_cache_is_refused(monkeypatch):
    """Found by a walkthrough (silently wrong before): a compacted cache continued by another checkpoint of
    the same shapes that was given the hooks (``install_hooks``, as a copy or a reload needs) read entries
    fitted to the compacting model's keys. It is refused at its first forward, and so are other weights
    loaded into the same modules; the compacting model, a copy of it and a press's cache continue as before,
    the check is made once per model (not at every step), and the cache still pickles after forwards."""
    import copy
    import pickle

    import stiefkv
    from stiefkv import compacted
    from stiefkv.cache import cache_keyword
    from stiefkv.compacted import build, install_hooks
    from tests.tiny import tiny_model

    model, ids = tiny_prompt(5, 30)
    key = cache_keyword(model)
    other = tiny_model(layers=2)  # the same shapes, other key weights
    with torch.no_grad():
        other.model.layers[0].self_attn.k_proj.weight.mul_(1.01)
    install_hooks(other)
    twin = copy.deepcopy(model)
    install_hooks(twin)
    prefilled = stiefkv.prefill(model, ids[:, :24], window=8)
    for cache in (stiefkv.compact(model, copy.deepcopy(prefilled), keep=0.5),
                  build(model, copy.deepcopy(prefilled), prefilled.reference_queries, 12, "knorm")):
        with pytest.raises(ValueError, match="compacted on a model with other key weights"):
            other(ids[:, 24:26], **{key: copy.deepcopy(cache)})
        want = model(ids[:, 24:26], **{key: copy.deepcopy(cache)}).logits
        torch.testing.assert_close(twin(ids[:, 24:26], **{key: copy.deepcopy(cache)}).logits, want)
        model(ids[:, 24:25], **{key: cache})
        assert cache.probed_by[0]() is model.model.layers[0].self_attn.k_proj.weight  # remembered
        with monkeypatch.context() as m:  # not read again at the next step
            m.setattr(compacted, "_probe_of", lambda attn: pytest.fail("the probe was read again"))
            model(ids[:, 25:26], **{key: cache})
        pickle.loads(pickle.dumps(cache))  # after forwards too (a weak reference does not pickle)
    # other weights loaded into the same modules are checked again
    again = stiefkv.compact(model, copy.deepcopy(prefilled), keep=0.5)
    twin(ids[:, 24:25], **{key: again})
    assert again.probed_by[0]() is twin.model.layers[0].self_attn.k_proj.weight
    twin.load_state_dict(other.state_dict())
    with pytest.raises(ValueError, match="compacted on a model with other key weights"):
        twin(ids[:, 25:26], **{key: again})


@pytest.mark.parametrize("question", [4, 1])
@pytest.mark.parametrize("served", [False, True])
def test_padding_a_row_was_fed_in_the_last_turn_is_hidden_by_the_next_turns_mask(served, question):
    """A row that ended early in turn 1 holds the padding generate fed it as tokens (mask 1). Turn 2's mask
    hides them: the cache takes the mask over the tokens it holds behind the prompt on a turn's first
    forward, and on generate's first step however many tokens it brings (a question of one token), so the
    row goes on as it does without them (before: generate was refused as re-reading the prompt, and a
    forward attended the padding, 0.04-0.20 on the logits; a one-token question attended it, 0.29)."""
    import copy

    import stiefkv
    from tests.tiny import random_projections, tiny_model

    model = tiny_model(layers=2)
    if served:
        stiefkv.load(model, random_projections(model, 13, 11))
    g = torch.Generator().manual_seed(3)
    ids, q2 = torch.randint(3, 97, (2, 36), generator=g), torch.randint(3, 97, (2, 4), generator=g)
    q2 = q2[:, :question]
    C, pad = 30, 0
    G = dict(max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=pad, eos_token_id=None)
    base = stiefkv.compact(model, stiefkv.prefill(model, ids[:, :C], window=8), keep=0.4)
    answers = torch.randint(3, 97, (2, 5), generator=g)
    answers[0, 2:] = pad  # row 0 ended after two answer tokens: generate fed it padding, mask 1
    held = torch.cat([ids, answers], 1)
    cache = copy.deepcopy(base)
    model(held[:, C:], past_key_values=cache)  # turn 1 as generate leaves it: the padding held as tokens
    mask = torch.ones(2, 41 + question, dtype=torch.long)
    mask[0, 38:41] = 0
    out = model.generate(torch.cat([held, q2], 1), attention_mask=mask, past_key_values=cache, **G)
    solo = stiefkv.compact(model, stiefkv.prefill(model, ids[:1, :C], window=8), keep=0.4)
    model(held[:1, C:38], past_key_values=solo)  # row 0 alone: its question and two answer tokens
    want = model.generate(torch.cat([held[:1, :38], q2[:1]], 1), past_key_values=solo, **G)
    assert torch.equal(out[0, 41 + question:], want[0, 38 + question:])


def test_a_mask_of_another_width_over_a_compacted_cache_is_refused_by_its_width():
    """The mask's columns are the prompt's, the tokens held since and the new ones': a mask of another width
    (one of the new tokens only, or wider) is refused by its width, not read at the wrong columns (before:
    padding in it was blamed on the prompt, or the pads it meant were attended)."""
    import stiefkv
    from tests.tiny import tiny_model

    model = tiny_model(layers=2)
    ids = torch.randint(3, 97, (2, 36), generator=torch.Generator().manual_seed(4))
    C = 30
    cache = stiefkv.compact(model, stiefkv.prefill(model, ids[:, :C], window=8), keep=0.4)
    for width in (6, 39):
        with pytest.raises(ValueError, match=f"attention_mask is {width} columns wide.*pass a mask of 36"):
            model(ids[:, C:], attention_mask=torch.ones(2, width, dtype=torch.long), past_key_values=cache)
    with pytest.raises(ValueError, match=r"2-D attention_mask .*got \[2, 1, 6, 36\]"):
        model(ids[:, C:], attention_mask=torch.zeros(2, 1, 6, 36), past_key_values=cache)
    # the whole sequence fed again (assisted and prompt-lookup generate): named so, not by the mask's width
    mask = torch.ones(1, 36, dtype=torch.long)
    mask[0, 33] = 0
    one = stiefkv.compact(model, stiefkv.prefill(model, ids[:1, :C], window=8), keep=0.4)
    with pytest.raises(ValueError, match="Assisted and prompt-lookup generate re-read the prompt"):
        model.generate(ids[:1], attention_mask=mask, past_key_values=one, prompt_lookup_num_tokens=3,
                       max_new_tokens=2, do_sample=False)


@pytest.mark.parametrize("served", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_a_one_token_step_over_a_compacted_cache_reads_nothing_back(served, padded):
    """A decode step of one token over a compacted cache, with its mask and positions, reads nothing back
    to the host from StiefKV's code (on a GPU each read waits for the device): the mask's and positions'
    checks run on a turn's first forward, of several tokens; the padding of the step reaches β on the
    device."""
    import traceback

    from torch.overrides import TorchFunctionMode

    import stiefkv
    from tests.test_compaction_padded import Q, batch, question_mask
    from tests.tiny import random_projections, tiny_model

    reads = {torch.Tensor.cpu, torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.tolist,
             torch.Tensor.__int__, torch.equal, torch.Tensor.nonzero}
    seen = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in reads:
                frames = [f for f in traceback.extract_stack()[:-1] if "/stiefkv/" in f.filename]
                if frames:
                    where = frames[-1].filename.split("/stiefkv/")[1]
                    seen.append(f"{func.__name__} {where}:{frames[-1].lineno}")
            return func(*args, **(kwargs or {}))

    model = tiny_model(layers=2)
    if served:
        stiefkv.load(model, random_projections(model, 13, 11))
    ids, mask, _ = batch(41)
    if not padded:
        ids, mask = ids[2:], mask[2:]  # the longest row: no padding
    C, B = mask.shape[1], mask.shape[0]
    with torch.no_grad():
        cache = stiefkv.compact(model, stiefkv.prefill(model, ids[:, :C], attention_mask=mask, window=8),
                                keep=0.3)
        full = question_mask(mask, Q)
        positions = (full.cumsum(1) - 1)[:, C:]
        model(ids[:, C:], attention_mask=full, position_ids=positions, past_key_values=cache)
        step = torch.cat([full, torch.ones(B, 1, dtype=full.dtype)], 1)
        with Spy():
            model(ids[:, -1:], attention_mask=step, position_ids=positions[:, -1:] + 1, past_key_values=cache)
    assert seen == []


def test_a_compacted_cache_without_padding_keeps_no_padding_record():
    """Without padding behind the prompt nothing is recorded per appended token (no mask built or grown at
    each decode step) where generate passes no mask for them; transformers 5.17 passes a mask of ones at
    every step, which the record follows on the device (still no padding). Padding then starts one, with
    every earlier token marked as a token."""
    import stiefkv
    from tests.tiny import tiny_model

    model = tiny_model(layers=2)
    ids = torch.randint(3, 97, (2, 40), generator=torch.Generator().manual_seed(6))
    C = 30
    cache = stiefkv.compact(model, stiefkv.prefill(model, ids[:, :C], window=8), keep=0.4)
    model.generate(ids[:, :36], past_key_values=cache, max_new_tokens=2, do_sample=False, pad_token_id=0,
                   eos_token_id=None)
    record = cache.appended_mask
    assert (record is None or bool(record.all())) and cache.get_seq_length() == 37  # the last token not fed
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, 39] = 0
    model(ids[:, 37:40], attention_mask=mask, position_ids=torch.arange(37, 40)[None], past_key_values=cache)
    assert cache.appended_mask.tolist() == [[True] * 10, [True] * 9 + [False]]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_prefill_takes_integer_ids_of_any_width(dtype):
    """int32 ids (numpy's default on some systems) reached the prompt's loss as targets torch refuses, and
    int16 and uint8 the embedding: prefill takes them as int64, and compaction then gives the same cache."""
    import stiefkv
    from tests.tiny import tiny_model

    model = tiny_model(layers=2)
    ids = torch.randint(3, 97, (2, 30), generator=torch.Generator().manual_seed(8))
    caches = [stiefkv.compact(model, stiefkv.prefill(model, x, window=8), keep=0.5)
              for x in (ids, ids.to(dtype))]
    follow = torch.randint(3, 97, (2, 2), generator=torch.Generator().manual_seed(9))
    at = torch.arange(30, 32)[None]
    logits = [model(follow, past_key_values=c, position_ids=at).logits for c in caches]
    assert torch.isfinite(logits[0]).all()
    torch.testing.assert_close(logits[1], logits[0], atol=0, rtol=0)
