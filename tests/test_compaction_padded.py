"""Prompts of different lengths, left-padded in one batch, prefilled and compacted row by row
(stiefkv.padded): each row continues as it does compacted alone, in a forward and in generate."""

from __future__ import annotations

import copy

import pytest
import torch

import stiefkv
from stiefkv.cache import cache_keyword
from tests.tiny import tiny_model

LENGTHS = (41, 29, 53)  # odd, unequal: each row kept to its own count, the layers padded to the largest
Q = 7  # question tokens behind every prompt, unpadded


def batch(seed: int, lengths=LENGTHS, q: int = Q):
    """Left-padded prompts of ``lengths`` tokens with ``q`` question tokens each: ids ``[B, C + q]``, the
    prompts' mask ``[B, C]``, and each row's own prompt and question."""
    g = torch.Generator().manual_seed(seed)
    C = max(lengths)
    ids = torch.zeros(len(lengths), C + q, dtype=torch.long)
    mask = torch.zeros(len(lengths), C, dtype=torch.long)
    rows = []
    for b, L in enumerate(lengths):
        own = torch.randint(3, 97, (1, L + q), generator=g)
        ids[b, C - L:] = own[0]
        mask[b, C - L:] = 1
        rows.append(own)
    return ids, mask, rows


def compacted(model, ids: torch.Tensor, mask: torch.Tensor, *, window: int, **options):
    """The padded prompts ``ids`` (the prompts' columns of ``mask``) prefilled and compacted."""
    cache = stiefkv.prefill(model, ids[:, :mask.shape[1]], attention_mask=mask, window=window)
    return stiefkv.compact(model, cache, **options)


def question_mask(mask: torch.Tensor, q: int) -> torch.Tensor:
    return torch.cat([mask, torch.ones(mask.shape[0], q, dtype=mask.dtype, device=mask.device)], 1)


@pytest.mark.parametrize("method,options", [("am", {}), ("am", {"allocation": "global", "pin": 0.2}),
                                            ("attention", {}), ("am", {"block": 16, "selection": "omp"})])
def test_each_padded_row_continues_as_it_does_compacted_alone(method, options):
    """Logits of the questions behind a padded batch's compacted cache equal each row's behind its own,
    within float32 rounding (1e-4): the padding entries (β = PAD_BETA) are never read, each row's positions
    are its own."""
    model = tiny_model(layers=3)
    key = cache_keyword(model)
    ids, mask, rows = batch(3)
    C = mask.shape[1]
    with torch.no_grad():
        cache = compacted(model, ids, mask, window=16, keep=0.3, method=method, **options)
        assert isinstance(cache, stiefkv.CompactedCache) and cache.get_seq_length() == C
        lengths = torch.tensor(LENGTHS)
        positions = lengths[:, None] + torch.arange(Q)
        got = model(ids[:, C:], position_ids=positions, attention_mask=question_mask(mask, Q),
                    **{key: cache}).logits
        assert cache.get_seq_length() == C + Q
        for b, (own, L) in enumerate(zip(rows, LENGTHS)):
            alone = stiefkv.compact(model, stiefkv.prefill(model, own[:, :L], window=16), keep=0.3,
                                    method=method, **options)
            want = model(own[:, L:], position_ids=torch.arange(L, L + Q)[None], **{key: alone}).logits
            assert torch.isfinite(got[b]).all()
            assert (got[b] - want[0]).abs().max() < 1e-4, b
            assert alone.prefix <= [max(p, 1) for p in cache.prefix]


def test_generate_over_a_padded_compacted_batch_gives_each_rows_own_tokens():
    """Greedy generate over the joined cache, with the prompts' mask, equals each row generated over its
    own compacted cache; beams repeat the rows' lengths with the rows."""
    model = tiny_model(layers=2)
    key = cache_keyword(model)
    ids, mask, rows = batch(5)
    C, new = mask.shape[1], 6
    with torch.no_grad():
        cache = compacted(model, ids, mask, window=16, keep=0.25)
        beams = copy.deepcopy(cache)
        # min_new_tokens on both sides: a row that ends at once is padded in the batch and not alone
        got = model.generate(ids, attention_mask=question_mask(mask, Q), max_new_tokens=new, do_sample=False,
                             min_new_tokens=new, **{key: cache})
        for b, (own, L) in enumerate(zip(rows, LENGTHS)):
            alone = stiefkv.compact(model, stiefkv.prefill(model, own[:, :L], window=16), keep=0.25)
            want = model.generate(own, max_new_tokens=new, do_sample=False, min_new_tokens=new,
                                  **{key: alone})
            assert torch.equal(got[b, C + Q:], want[0, L + Q:]), b
        out = model.generate(ids, attention_mask=question_mask(mask, Q), max_new_tokens=3, num_beams=2,
                             do_sample=False, **{key: beams})
        assert out.shape == (3, C + Q + 3)


def test_an_unpadded_mask_is_the_plain_prefill_and_a_padded_cache_continues_uncompacted():
    """A mask of ones prefills as without it; the padded prompts' cache itself, uncompacted, is the
    left-padded cache a model reads with the mask and each row's positions (as the rows alone)."""
    model = tiny_model(layers=2)
    key = cache_keyword(model)
    ids, mask, rows = batch(7)
    C = mask.shape[1]
    with torch.no_grad():
        plain = stiefkv.prefill(model, rows[0][:, :20], window=8)
        masked = stiefkv.prefill(model, rows[0][:, :20], window=8, attention_mask=torch.ones(1, 20))
        assert type(masked) is type(plain)
        torch.testing.assert_close(masked.layers[1].keys, plain.layers[1].keys)
        cache = stiefkv.prefill(model, ids[:, :C], attention_mask=mask, window=8)
        got = model(ids[:, C:], attention_mask=question_mask(mask, Q),
                    position_ids=torch.tensor(LENGTHS)[:, None] + torch.arange(Q), **{key: cache}).logits
        for b, (own, L) in enumerate(zip(rows, LENGTHS)):
            want = model(own).logits[0, L:]
            torch.testing.assert_close(got[b], want, atol=1e-4, rtol=1e-4)


def test_a_padded_compacted_batch_read_at_other_positions_or_padding_is_refused():
    model = tiny_model(layers=2)
    key = cache_keyword(model)
    ids, mask, _ = batch(9)
    C = mask.shape[1]
    with torch.no_grad():
        cache = compacted(model, ids, mask, window=8, keep=0.3)
        full = question_mask(mask, Q)
        with pytest.raises(ValueError, match="of 41, 29, 53 tokens left-padded to 53: pass position_ids"):
            model(ids[:, C:], **{key: cache})
        wrong = torch.arange(C - 12, C - 12 + Q)[None].expand(3, -1)
        with pytest.raises(ValueError, match=r"start at \[41, 41, 41\].*continue at \[41, 29, 53\]"):
            model(ids[:, C:], position_ids=wrong, attention_mask=full, **{key: cache})
        with pytest.raises(ValueError, match="pass the attention_mask they were prefilled with"):
            model.generate(ids, max_new_tokens=2, do_sample=False, **{key: cache})  # no mask: all ones
        shifted = full.clone()
        shifted[1, C - LENGTHS[1]] = 0
        with pytest.raises(ValueError, match="pass the attention_mask they were prefilled with"):
            model.generate(ids, attention_mask=shifted, max_new_tokens=2, do_sample=False, **{key: cache})
        assert cache.get_seq_length() == C  # nothing appended by the refused forwards
        other = ids.clone()
        other[1, C - 3] += 1  # a real token of row 1; its padding's ids are not checked
        other[1, 0] += 1
        with pytest.raises(ValueError, match=f"do not begin with the prompt .*row 1, position {C - 3}"):
            model.generate(other, attention_mask=full, max_new_tokens=2, do_sample=False, **{key: cache})
        other[1, C - 3] -= 1
        model.generate(other, attention_mask=full, max_new_tokens=1, do_sample=False,
                       **{key: copy.deepcopy(cache)})
        out = model.generate(ids, attention_mask=full, max_new_tokens=2, do_sample=False, **{key: cache})
        assert out.shape == (3, C + Q + 2)


def test_bad_padded_prompts_are_refused():
    model = tiny_model(layers=2)
    ids, mask, _ = batch(11)
    C = mask.shape[1]
    prompts = ids[:, :C]
    right = mask.flip(1)
    for bad, match in ((right, "left-padded prompts .* row 0 of the attention_mask has padding after"),
                       (mask[:, :-1], "attention_mask must be a tensor of the ids' shape"),
                       (mask * 2, "only 1 .a token. and 0"),
                       ([[1] * C] * 3, "attention_mask must be a tensor")):
        with pytest.raises(ValueError, match=match):
            stiefkv.prefill(model, prompts, attention_mask=bad)
    short = mask.clone()
    short[1, :-1] = 0
    with pytest.raises(ValueError, match=r"row\(s\) 1 of the attention_mask hold fewer than 2 tokens"):
        stiefkv.prefill(model, prompts, attention_mask=short)
    cache = stiefkv.prefill(model, prompts, attention_mask=mask, window=8)
    with torch.no_grad():
        model(ids[:, C:C + 1], attention_mask=question_mask(mask, 1),
              position_ids=torch.tensor(LENGTHS)[:, None], **{cache_keyword(model): cache})
    with pytest.raises(ValueError, match="no longer holds its 3 prompts of 41, 29, 53 tokens .* Compact"):
        stiefkv.compact(model, cache, keep=0.5)


# (storages, prompt lengths, tolerance on the logits): channel groups hold 64 tokens, so only rows that keep
# more than 64 entries exercise them
SERVED_CASES = [(None, LENGTHS, 1e-4), (("int4-token", "int2-token-r5"), LENGTHS, 1e-4),
                (("int3-token-log8-r7-w8", "int3-token-log8"), LENGTHS, 1e-4),
                (("int2-channel-r5-w8", "int4-channel"), (150, 97, 201), 5e-2)]


@pytest.mark.parametrize("specs,lengths,tol", SERVED_CASES)
@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
def test_padded_prompts_on_a_served_model_continue_as_each_row_compacted_alone(specs, lengths, tol, key_mode):
    """A served model's padded prompts: each row's latent cache prefilled and compacted alone, the rows
    joined into one compacted LatentCache (entries padded in front by the first one again, β = PAD_BETA),
    its codes carried from the rows. Each row's logits behind it equal its own compacted alone, to 1e-4
    (float32), for float latents and per-token codes (min–max, log8 with an int8 window) in both key modes;
    channel groups (codes over 64 tokens) fall otherwise behind the padding, and stay within 0.05 of the row
    alone (its own quantization error against the uncompacted cache is of that size: 0.009-0.023 in a
    trial)."""
    from stiefkv.attention import compressed
    from stiefkv.models import dims_of
    from stiefkv.quant import QuantSpec
    from tests.tiny import random_projections

    model = tiny_model(layers=2)
    key = cache_keyword(model)
    ids, mask, rows = batch(13, lengths)
    C = mask.shape[1]
    proj = random_projections(model, 9, 7, key_mode=key_mode)
    if specs:
        proj.quant = [tuple(QuantSpec.parse(s) for s in specs)] * dims_of(model.config).L
    with compressed(model, proj), torch.no_grad():
        padded = stiefkv.prefill(model, ids[:, :C], attention_mask=mask, window=16)
        assert padded.get_seq_length() == C and padded.nbytes == sum(r.nbytes for r in padded.rows) > 0
        with pytest.raises(ValueError, match="holds each row's latents apart, for stiefkv.compact only"):
            model(ids[:, C:C + 1], **{key: padded})
        keep = 0.3 if tol < 1e-3 else 0.9
        cache = stiefkv.compact(model, padded, keep=keep)
        assert isinstance(cache, stiefkv.LatentCache) and cache.get_seq_length() == C
        positions = torch.tensor(lengths)[:, None] + torch.arange(Q)
        got = model(ids[:, C:], position_ids=positions, attention_mask=question_mask(mask, Q),
                    **{key: cache}).logits
        for b, (own, L) in enumerate(zip(rows, lengths)):
            alone = stiefkv.compact(model, stiefkv.prefill(model, own[:, :L], window=16), keep=keep)
            want = model(own[:, L:], position_ids=torch.arange(L, L + Q)[None], **{key: alone}).logits
            assert torch.isfinite(got[b]).all()
            assert (got[b] - want[0]).abs().max() < tol, b
        out = model.generate(torch.cat([ids, got.argmax(-1)[:, -1:]], 1), num_beams=2, max_new_tokens=3,
                             attention_mask=question_mask(mask, Q + 1), do_sample=False, **{key: cache})
        assert out.shape == (3, C + Q + 4)


def test_a_padded_prompts_cache_continues_uncompacted_on_a_model_that_compacted_another():
    """compact installs checks on the model that read a padded compacted cache's ``length``; the padded
    prompts' cache, not compacted, has none (before: AttributeError at every forward and generate)."""
    model = tiny_model(layers=2)
    key = cache_keyword(model)
    ids, mask, rows = batch(15)
    C = mask.shape[1]
    with torch.no_grad():
        stiefkv.compact(model, stiefkv.prefill(model, ids[:, :C], attention_mask=mask, window=8), keep=0.3)
        cache = stiefkv.prefill(model, ids[:, :C], attention_mask=mask, window=8)
        got = model(ids[:, C:], attention_mask=question_mask(mask, Q),
                    position_ids=torch.tensor(LENGTHS)[:, None] + torch.arange(Q), **{key: cache}).logits
        for b, (own, L) in enumerate(zip(rows, LENGTHS)):
            torch.testing.assert_close(got[b], model(own).logits[0, L:], atol=1e-4, rtol=1e-4)
        cache = stiefkv.prefill(model, ids[:, :C], attention_mask=mask, window=8)
        model.generate(ids, attention_mask=question_mask(mask, Q), max_new_tokens=2, do_sample=False,
                       **{key: cache})


def test_prompts_padded_alike_are_read_at_their_own_positions():
    """Rows of one length padded alike (pad_to_multiple_of, padding="max_length"): a forward without
    position_ids would place them after the padding, not at their length (before: accepted, silently)."""
    model = tiny_model(layers=2)
    key = cache_keyword(model)
    ids, mask, rows = batch(17, lengths=(30, 30))
    pad = 3
    ids = torch.cat([torch.zeros(2, pad, dtype=ids.dtype), ids], 1)
    mask = torch.cat([torch.zeros(2, pad, dtype=mask.dtype), mask], 1)
    C, L = mask.shape[1], 30
    with torch.no_grad():
        cache = compacted(model, ids, mask, window=8, keep=0.3)
        full = question_mask(mask, Q)
        with pytest.raises(ValueError, match="left-padded to 33: pass position_ids"):
            model(ids[:, C:], attention_mask=full, **{key: copy.deepcopy(cache)})
        got = model.generate(ids, attention_mask=full, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                             **{key: cache})
        for b, own in enumerate(rows):
            alone = stiefkv.compact(model, stiefkv.prefill(model, own[:, :L], window=8), keep=0.3)
            want = model.generate(own, max_new_tokens=3, min_new_tokens=3, do_sample=False, **{key: alone})
            assert torch.equal(got[b, C + Q:], want[0, L + Q:]), b


@pytest.mark.parametrize("padded", [True, False])
def test_the_prompt_recorded_is_not_the_callers_buffer(padded):
    """The ids prefill records are a copy: a buffer the caller fills with the next prompt is that prompt, and
    refused (before: the record followed the buffer, and the other prompt was accepted), padded or not."""
    model = tiny_model(layers=2)
    key = cache_keyword(model)
    ids, mask, _ = batch(19)
    if not padded:
        ids, mask = ids[2:], mask[2:]  # the longest row: no padding
    C = mask.shape[1]
    prompts = ids[:, :C].clone()
    with torch.no_grad():
        cache = stiefkv.compact(model, stiefkv.prefill(model, prompts, attention_mask=mask, window=8),
                                keep=0.3)
        prompts[:, -1] += 1
        with pytest.raises(ValueError, match="do not begin with the prompt"):
            model.generate(torch.cat([prompts, ids[:, C:]], 1), attention_mask=question_mask(mask, Q),
                           max_new_tokens=1, do_sample=False, **{key: cache})


def test_another_model_continuing_a_padded_compacted_cache_is_refused():
    """The other-model check of layer 0 runs for padded prompts too (before: it sat under the padding
    check, which padded prompts skip, and another checkpoint of the same shapes continued silently)."""
    from stiefkv.compacted import install_hooks

    model, other = tiny_model(layers=2), tiny_model(layers=2)
    with torch.no_grad():
        for layer in other.model.layers:
            layer.self_attn.k_proj.weight.add_(0.1)
    install_hooks(other)
    ids, mask, _ = batch(23)
    with torch.no_grad():
        cache = compacted(model, ids, mask, window=8, keep=0.3)
        with pytest.raises(ValueError, match="compacted on a model with other key weights"):
            other.generate(ids, attention_mask=question_mask(mask, Q), max_new_tokens=1, do_sample=False,
                           **{cache_keyword(model): cache})


def test_a_refused_generate_with_beams_leaves_the_cache_for_the_corrected_call():
    """generate's checks run on one row of each repeated group before the cache is repeated for beams: a
    call refused (no mask, another prompt) leaves the cache's rows as they were, and its message names the
    prompts' own lengths (before: the cache kept the beams' rows, and the corrected call was refused)."""
    model = tiny_model(layers=2)
    key = cache_keyword(model)
    ids, mask, _ = batch(29)
    C = mask.shape[1]
    beams = dict(max_new_tokens=2, num_beams=2, do_sample=False)
    with torch.no_grad():
        cache = compacted(model, ids, mask, window=8, keep=0.3)
        with pytest.raises(ValueError, match="prompts of 41, 29, 53 tokens left-padded"):
            model.generate(ids, **beams, **{key: cache})
        other = ids.clone()
        other[0, -Q - 1] += 1
        with pytest.raises(ValueError, match="do not begin with the prompt"):
            model.generate(other, attention_mask=question_mask(mask, Q), **beams, **{key: cache})
        assert cache.beta[0].shape[0] == 3 and len(cache.row_lengths) == 3
        out = model.generate(ids, attention_mask=question_mask(mask, Q), **beams, **{key: cache})
        assert out.shape == (3, C + Q + 2)


def test_a_padded_prompts_cache_reordered_compacts_each_row_with_its_own_length():
    """Rows reordered, repeated or selected keep their lengths, queries and ids (before: the rows' keys
    moved and their lengths did not, so each row was compacted from another's columns, silently)."""
    model = tiny_model(layers=2)
    key = cache_keyword(model)
    ids, mask, _ = batch(21)
    C = mask.shape[1]
    order = torch.tensor([2, 1, 0, 0])  # the edits below, in turn
    with torch.no_grad():
        cache = stiefkv.prefill(model, ids[:, :C], attention_mask=mask, window=8)
        want = stiefkv.compact(model, copy.deepcopy(cache), keep=0.3)
        cache.batch_select_indices(torch.tensor([0, 1, 2, 0]))
        cache.reorder_cache(torch.tensor([2, 1, 0, 3]))
        cache.batch_repeat_interleave(2)
        cache.batch_select_indices(torch.arange(8)[::2])
        got = stiefkv.compact(model, cache, keep=0.3)
        assert got.row_lengths.tolist() == [LENGTHS[i] for i in order.tolist()]
        assert torch.equal(got.prompt_ids, ids[order, :C])
        positions = torch.tensor(LENGTHS)[order, None] + torch.arange(Q)
        full = question_mask(mask, Q)
        logits = model(ids[order, C:], position_ids=positions, attention_mask=full[order],
                       **{key: got}).logits
        expected = model(ids[:, C:], position_ids=torch.tensor(LENGTHS)[:, None] + torch.arange(Q),
                         attention_mask=full, **{key: want}).logits
        torch.testing.assert_close(logits, expected[order], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("specs", [None, ("int4-token", "int4-token-r5")])
def test_a_served_padded_compacted_batch_is_read_by_the_kernels_as_by_the_reference(specs):
    """The Triton kernels (the interpreter on a CPU, compiled on CUDA) read the joined rows, their padding
    entries at β = PAD_BETA in front, as the PyTorch reference does."""
    from stiefkv.attention import compressed
    from stiefkv.models import dims_of
    from stiefkv.quant import QuantSpec
    from tests.tiny import random_projections

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_model(layers=2, heads=6, kv_heads=2, head_dim=32).to(device)
    ids, mask, _ = batch(31, (23, 37, 30))
    ids, mask = ids.to(device), mask.to(device)
    C = mask.shape[1]
    proj = random_projections(model, 24, 19)
    if specs:
        proj.quant = [tuple(QuantSpec.parse(s) for s in specs)] * dims_of(model.config).L
    positions = torch.tensor((23, 37, 30), device=device)[:, None] + torch.arange(Q, device=device)
    out = {}
    for backend in ("reference", "triton"):
        with compressed(model, proj, backend=backend), torch.no_grad():
            cache = compacted(model, ids, mask, window=12, keep=0.3)
            out[backend] = model(ids[:, C:], position_ids=positions, attention_mask=question_mask(mask, Q),
                                 **{cache_keyword(model): cache}).logits
    assert torch.isfinite(out["triton"]).all()
    torch.testing.assert_close(out["triton"], out["reference"], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("specs", [("int2-channel", "int2-channel"), ("int4-channel-r5", "int2-channel-r5")])
def test_a_short_row_joined_with_a_long_one_keeps_its_channel_groups_and_exact_tail(specs):
    """Channel stores of one ``recent``: a short row's entries, held exact alone (the group still filling),
    stay exact beside a long row, and each row's codes stay in groups of their own, so every row's logits
    behind the joined cache equal its own compacted alone (before, padded in front to the largest count:
    0.16 for the short row, whose tail fell in a full int2 group, against 0.06 for the row alone from its
    uncompacted cache). The first question token's: the tokens appended fill the one group still filling
    of the joined layer, which quantizes at another count than each row's alone (not compared)."""
    from stiefkv.attention import compressed
    from stiefkv.models import dims_of
    from stiefkv.quant import QuantSpec
    from tests.tiny import random_projections

    model = tiny_model(layers=2)
    key = cache_keyword(model)
    lengths = (60, 400)
    ids, mask, rows = batch(13, lengths)
    C = mask.shape[1]
    proj = random_projections(model, 9, 7)
    proj.quant = [tuple(QuantSpec.parse(s) for s in specs)] * dims_of(model.config).L
    with compressed(model, proj), torch.no_grad():
        cache = compacted(model, ids, mask, window=16, keep=0.5)
        positions = torch.tensor(lengths)[:, None] + torch.arange(Q)
        got = model(ids[:, C:], position_ids=positions, attention_mask=question_mask(mask, Q),
                    **{key: cache}).logits
        for b, (own, L) in enumerate(zip(rows, lengths)):
            alone = stiefkv.compact(model, stiefkv.prefill(model, own[:, :L], window=16), keep=0.5)
            want = model(own[:, L:], position_ids=torch.arange(L, L + Q)[None], **{key: alone}).logits
            assert (got[b, 0] - want[0, 0]).abs().max() < 1e-4, b


def test_wrong_queries_for_padded_prompts_are_named():
    """queries= of another batch, or not a list: the message names the layer and what it holds (before: the
    same sentence for every mistake, naming nothing given)."""
    model = tiny_model(layers=2)
    ids, mask, _ = batch(33)
    C = mask.shape[1]
    with torch.no_grad():
        cache = stiefkv.prefill(model, ids[:, :C], attention_mask=mask, window=8)
        one_row = [q[:1] for q in cache.row_queries[0]]
        with pytest.raises(ValueError, match=r"of the padded batch; got layer 0 of shape \[1, "):
            stiefkv.compact(model, cache, keep=0.3, queries=one_row)
        with pytest.raises(ValueError, match="got a Tensor"):
            stiefkv.compact(model, cache, keep=0.3, queries=one_row[0])


@pytest.mark.parametrize("served", [False, True])
def test_padding_behind_padded_prompts_is_never_attended(served):
    """Padding among the tokens behind padded prompts (a row that ended early in the last turn, questions of
    different lengths) is held at β = PAD_BETA, and each row's positions count its tokens only: the row goes
    on as it does alone without that padding, in a forward and in generate (before: refused)."""
    from tests.tiny import random_projections

    model = tiny_model(layers=2)
    if served:
        stiefkv.load(model, random_projections(model, 13, 11))
    key = cache_keyword(model)
    ids, mask, rows = batch(41)
    C = mask.shape[1]
    full = question_mask(mask, Q)
    full[1, C:C + 2] = 0  # row 1: its first two tokens behind the prompt are padding
    positions = (full.cumsum(1) - 1)[:, C:]
    with torch.no_grad():
        base = compacted(model, ids, mask, window=8, keep=0.3)
        got = model(ids[:, C:], attention_mask=full, position_ids=positions,
                    **{key: copy.deepcopy(base)}).logits
        out = model.generate(ids, attention_mask=full, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                             **{key: copy.deepcopy(base)})
        L, own = LENGTHS[1], rows[1]
        kept = torch.cat([own[:, :L], own[:, L + 2:]], 1)
        alone = stiefkv.compact(model, stiefkv.prefill(model, own[:, :L], window=8), keep=0.3)
        want = model(kept[:, L:], position_ids=torch.arange(L, L + Q - 2)[None],
                     **{key: copy.deepcopy(alone)})
        torch.testing.assert_close(got[1, 2:], want.logits[0], atol=1e-5, rtol=1e-4)
        solo = model.generate(kept, max_new_tokens=4, min_new_tokens=4, do_sample=False, **{key: alone})
        assert torch.equal(out[1, C + Q:], solo[0, L + Q - 2:])
