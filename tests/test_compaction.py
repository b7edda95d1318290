"""Attention-matching compaction of one KV head's block (stiefkv.compaction) against the block it replaces,
on fresh random blocks of odd sizes: exact when every token is kept, and closer than eviction (keeping the
most-attended keys as they are) in output, mass, and attention over the block joined with other tokens."""

from __future__ import annotations

import math

import pytest
import torch

from stiefkv.compaction import compact_head, compacted_attention, log_mass


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
    from stiefkv.longcontext import bias_mask, chunk_nll
    from tests.tiny import tiny_model

    model = tiny_model(layers=2)
    ids = torch.randint(3, 97, (1, 61), generator=torch.Generator().manual_seed(5))
    nll, full, n, t = chunk_nll(model, ids, 37, 1.0, "recent", window=9)
    assert t == 37 and n == 23 and math.isfinite(nll)
    assert nll == pytest.approx(full, rel=1e-5)
    nll_am, _, _, t = chunk_nll(model, ids, 37, 0.3, "am", window=9)
    assert t == 11 and math.isfinite(nll_am)
    mask = bias_mask(torch.tensor([[[0.5, -1.0], [2.0, 0.0]]]), heads=6, n_new=3, dtype=torch.float32)
    assert mask.shape == (1, 6, 3, 5)
    assert mask[0, 2, 1, :2].tolist() == [0.5, -1.0] and mask[0, 3, 0, :2].tolist() == [2.0, 0.0]
    assert mask[0, 0, 0, 3] == torch.finfo(torch.float32).min and mask[0, 0, 2, 4] == 0


def test_bad_compressed_context_requests_are_refused():
    from stiefkv.longcontext import evaluate_compacted
    from tests.tiny import tiny_model

    model = tiny_model(layers=1)
    for keep in (0.0, 1.5):
        with pytest.raises(ValueError, match="keep must be in"):
            evaluate_compacted(model, None, keep=keep)
    with pytest.raises(ValueError, match="method must be one of am, attention, tova, knorm, sink, recent"):
        evaluate_compacted(model, None, method="expected")


def test_evictions_keep_what_their_scores_say():
    from stiefkv.compaction import SINK_TOKENS, choose_and_fit

    keys, values, queries = block(6, 41, 8, 5)
    norms = keys.norm(dim=-1)
    c = choose_and_fit(keys, values, queries(16), 7, scale=0.35, method="knorm")
    assert set(c.index.tolist()) == set(torch.topk(-norms, 7).indices.tolist())
    assert torch.equal(c.values, values[c.index]) and not c.beta.any()
    c = choose_and_fit(keys, values, queries(16), 7, scale=0.35, method="sink")
    assert c.index.tolist() == list(range(SINK_TOKENS)) + [38, 39, 40]
    q = queries(1)
    c = choose_and_fit(keys, values, q, 7, scale=0.35, method="tova")
    attention = torch.softmax(q.double() @ keys.double().T * 0.35, -1)[0]
    assert set(c.index.tolist()) == set(torch.topk(attention, 7).indices.tolist())
