"""``stiefkv.generate`` over a compacted prompt: a served model's compacted ``LatentCache`` continued on the
static cache (its entries, positions and β per KV head written into the first slots) and graph-captured
decode.

The reference is transformers' greedy ``generate`` over a copy of the same compacted cache (the dynamic
path, tested against the uncompressed model in test_compaction_latent.py): the tokens must be equal. Tiny
float32 models, GQA 3, ranks 11 and 13 (not powers of two), prompts of odd lengths.
"""

from __future__ import annotations

import copy

import pytest
import torch

import stiefkv
from stiefkv.static_cache import StaticLatentCache
from tests.test_serve import GREEDY, on_gpu, quantized_served, served, windowed_served
from tests.tiny import random_projections, tiny_model


def ids_of(batch: int, n: int, seed: int, device="cpu") -> torch.Tensor:
    return torch.randint(2, 97, (batch, n), generator=torch.Generator().manual_seed(seed)).to(device)


def compacted(model, prompt, keep=0.4, mask=None, **options):
    return stiefkv.compact(model, stiefkv.prefill(model, prompt, attention_mask=mask, window=16), keep=keep,
                           **options)


def both(model, cache, ids, mask=None, new=7, **kwargs):
    """transformers' greedy generate over a copy of ``cache``, and stiefkv.generate over ``cache`` itself."""
    extra = {} if mask is None else dict(attention_mask=mask)
    want = model.generate(ids, past_key_values=copy.deepcopy(cache), max_new_tokens=new, **extra, **GREEDY)
    got = stiefkv.generate(model, ids, past_key_values=cache, max_new_tokens=new, eos_token_id=None,
                           **extra, **kwargs)
    return got, want


def shared_served(key_mode="pre_rope"):
    model = tiny_model("llama", heads=6, kv_heads=2, head_dim=24)
    return stiefkv.load(model, random_projections(model, 19, 23, key_mode, shared=True))


MODELS = {
    "float-pre_rope": lambda: served("pre_rope"),
    # what --bits auto keeps at 50 %: codes behind an exact window (int8 held exact, log8 scales)
    "window-pre_rope": lambda: windowed_served("int8-token-r16", "int4-token-log8-r16-w8", "pre_rope"),
    "window-post_rope": lambda: windowed_served("int4-token-r16", "bf16", "post_rope"),
    "float-post_rope": lambda: served("post_rope"),
    "int8-int4-pre_rope": lambda: quantized_served((8, 4), "pre_rope"),
    "int4-int2-post_rope": lambda: quantized_served((4, 2), "post_rope"),
    "shared-pre_rope": shared_served,
}


@pytest.mark.parametrize("allocation", ["uniform", "global"])
@pytest.mark.parametrize("name", list(MODELS))
def test_generate_over_a_compacted_prompt_gives_transformers_tokens(name, allocation):
    """``global`` keeps a different count in each layer: the static cache pads the shorter layers' slots with
    entries never attended. The compacted cache is copied, not extended: a second question asks it again."""
    torch.manual_seed(0)
    model = MODELS[name]()
    prompt = ids_of(2, 37, 1)
    cache = compacted(model, prompt, allocation=allocation)
    if allocation == "global":
        assert len(set(cache.prefix)) > 1  # the layers hold different counts
    ids = torch.cat([prompt, ids_of(2, 5, 2)], 1)
    got, want = both(model, cache, ids, prefill_chunk=4)  # the question in chunks of 2 tokens a row
    assert torch.equal(got, want)
    assert cache.get_seq_length() == 37 and cache.appended_ids is None  # untouched
    other = torch.cat([prompt, ids_of(2, 3, 3)], 1)
    got, want = both(model, cache, other)
    assert torch.equal(got, want)
    named = stiefkv.generate(model, other, cache=cache, max_new_tokens=7, eos_token_id=None)
    assert torch.equal(named, got)  # cache= is past_key_values=


def test_padded_prompts_and_a_padded_question():
    """Prompts of different lengths (prefilled with their mask, compacted row by row) and questions of
    different lengths, padded on the left: the padding behind the prompt is never attended (β)."""
    torch.manual_seed(0)
    model = served("pre_rope")
    prompt = ids_of(3, 29, 4)
    mask = torch.ones_like(prompt)
    mask[1, :6] = 0
    mask[2, :11] = 0
    cache = compacted(model, prompt, mask=mask)
    question = ids_of(3, 6, 5)
    qmask = torch.ones_like(question)
    qmask[0, :2] = 0
    ids, full = torch.cat([prompt, question], 1), torch.cat([mask, qmask], 1)
    got, want = both(model, cache, ids, full)
    assert torch.equal(got, want)


def test_a_second_turn_over_tokens_generate_appended():
    """The cache a first ``generate`` extended, where one row ended early (its padding is held as tokens,
    which the next turn's mask hides), continued by stiefkv.generate for the second turn."""
    torch.manual_seed(0)
    model = quantized_served((8, 4), "pre_rope")
    prompt = ids_of(2, 31, 6)
    cache = compacted(model, prompt)
    first = torch.cat([prompt, ids_of(2, 4, 9)], 1)
    dry = model.generate(first, past_key_values=copy.deepcopy(cache), max_new_tokens=12, **GREEDY)
    eos = int(dry[1, first.shape[1]])  # row 1's first answer token ends it
    assert eos not in dry[0, first.shape[1]:].tolist()
    turn1 = model.generate(first, past_key_values=cache, max_new_tokens=12, do_sample=False,
                           eos_token_id=eos, pad_token_id=0)
    mask = torch.ones_like(turn1)
    mask[1, first.shape[1] + 1:] = 0  # the padding generate fed row 1 after its end
    assert cache.get_seq_length() == turn1.shape[1] - 1  # the last token generated is not in it yet
    question = ids_of(2, 3, 8)
    ids, full = torch.cat([turn1, question], 1), torch.cat([mask, torch.ones_like(question)], 1)
    got, want = both(model, cache, ids, full)
    assert torch.equal(got, want)


def test_kernels_read_the_compacted_static_cache_as_the_reference():
    """The Triton kernels (interpreted on the CPU, compiled on CUDA) over the static cache of a compacted
    prompt: positions and β per KV head, the key count from device memory; codes behind an exact window
    through the split decode (codes in place, then the ring, their positions and β per KV head)."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompt = ids_of(2, 23, 9, device)
    ids = torch.cat([prompt, ids_of(2, 4, 10, device)], 1)

    def windowed(**kw):
        return windowed_served("int8-token-r16", "int4-token-r16", **kw)

    makers = {"float": served, "codes": quantized_served, "windowed": windowed}
    outs = {}
    for backend in ("triton", "reference"):
        for name, maker in makers.items():
            model = maker(key_mode="pre_rope", backend=backend, device=device, head_dim=32)
            cache = compacted(model, prompt, allocation="global")
            outs[backend, name] = stiefkv.generate(model, ids, past_key_values=cache, max_new_tokens=3,
                                                   capture=False)
    for name in makers:
        assert torch.equal(outs["triton", name], outs["reference", name]), name


@on_gpu
@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
def test_captured_decode_over_a_compacted_prompt_gives_the_eager_tokens(key_mode):
    for model in (served(key_mode, device="cuda", dtype=torch.bfloat16, head_dim=32),
                  quantized_served((8, 4), key_mode, device="cuda", dtype=torch.bfloat16, head_dim=32),
                  windowed_served("int8-token-r16", "int4-token-r16", key_mode, device="cuda",
                                  dtype=torch.bfloat16, head_dim=32)):
        prompt = ids_of(2, 41, 11, "cuda")
        cache = compacted(model, prompt)
        ids = torch.cat([prompt, ids_of(2, 5, 12, "cuda")], 1)
        eager = stiefkv.generate(model, ids, past_key_values=cache, max_new_tokens=10, capture=False)
        graph = stiefkv.generate(model, ids, past_key_values=cache, max_new_tokens=10, capture=True)
        assert torch.equal(graph, eager)


def test_bad_input():
    torch.manual_seed(0)
    model = served("pre_rope")
    prompt = ids_of(2, 21, 13)
    cache = compacted(model, prompt)
    ids = torch.cat([prompt, ids_of(2, 3, 14)], 1)

    def refused(match, **kwargs):
        kwargs = dict(dict(past_key_values=cache, max_new_tokens=2), **kwargs)
        with pytest.raises(ValueError, match=match):
            stiefkv.generate(model, kwargs.pop("ids", ids), **kwargs)

    refused("no new tokens", ids=prompt)
    refused("holds 2 row", ids=ids[:1])
    other = ids.clone()
    other[1, 4] = (other[1, 4] + 1) % 97
    refused("do not begin with the prompt", ids=other)
    right = torch.ones_like(ids)
    right[0, -1] = 0
    refused("last token of every row must be real", attention_mask=right)
    inside = torch.ones_like(ids)
    inside[1, 3] = 0
    refused("inside the prompt", attention_mask=inside)
    refused("cannot hold", max_length=5)
    refused("not both", cache=cache)
    refused("uncompacted LatentCache", past_key_values=stiefkv.prefill(model, prompt))
    refused("got DynamicCache", past_key_values=__import__("transformers").DynamicCache())
    plain = tiny_model("llama", heads=6, kv_heads=2, head_dim=24)
    plain_cache = compacted(plain, prompt)
    with pytest.raises(ValueError, match="uncompressed model's"):
        stiefkv.generate(plain, ids, past_key_values=plain_cache, max_new_tokens=2)
    other_model = served("post_rope")
    with pytest.raises(ValueError, match="other bases"):
        stiefkv.generate(other_model, ids, past_key_values=cache, max_new_tokens=2)
    channel = windowed_served("int4-channel-r16", "int4-token-r16")
    with pytest.raises(ValueError, match="channel layout"):
        stiefkv.generate(channel, ids, past_key_values=compacted(channel, prompt), max_new_tokens=2)
    assert cache.get_seq_length() == 21 and cache.appended_ids is None  # nothing refused changed it


def test_static_cache_holds_the_compacted_entries_and_their_bytes():
    model = quantized_served((8, 4), "post_rope")
    cache = compacted(model, ids_of(2, 30, 15), allocation="global")
    static = StaticLatentCache(model, 2, 64)
    before = static.nbytes
    S = static.hold_compacted(cache, None)
    assert S == max(cache.prefix) and static.get_seq_length() == S and int(static.filled) == S
    # positions (int32) and β (float32 beside codes) per layer, row, KV head and slot
    assert static.nbytes - before == 2 * 2 * 2 * 64 * (4 + 4)
    for i, t in enumerate(cache.prefix):  # each layer's entries end at slot S, padding before them
        assert torch.equal(static.head_positions[i][..., S - t:S], cache.head_positions[i])
        assert torch.equal(static.beta[i][..., S - t:S], cache.beta[i].float())
        assert bool((static.beta[i][..., :S - t] == -1e4).all())
        assert bool((static.beta[i][..., S:] == 0).all())
        assert bool((static.keys_buf[i].codes[:, :, :S - t] == 0).all())
    with pytest.raises(ValueError, match="empty static cache"):
        static.hold_compacted(cache, None)


@pytest.mark.parametrize("value_spec", ["int4-token-log8-r16", "int4-token-r16-w8"])
def test_codes_behind_a_window_are_held_as_the_compacted_cache_holds_them(value_spec):
    """A compacted prompt of more entries than the exact window, so that codes lie below it: the static cache
    holds the store's own codes and exact window. Codes quantized again from their dequantized latents are
    other codes (log8 scales; window8's int8 round trip before the codes), and the answer then differed from
    transformers' (from its 7th token at a prompt of 160, keep 0.6)."""
    model = windowed_served("int8-token-r16", value_spec, "pre_rope")
    prompt = ids_of(2, 160, 4)
    cache = compacted(model, prompt, keep=0.6)
    static = StaticLatentCache(model, 2, 128)
    S = static.hold_compacted(cache, None)
    for i, layer in enumerate(cache.layers):
        store = layer.stores[1]
        assert store.held > 0  # codes below the window
        held = static.values_buf[i].read(static.filled, torch.float32)[:, :, S - store.length:S]
        assert torch.equal(held, store.read(torch.float32))
    ids = torch.cat([prompt, ids_of(2, 5, 5)], 1)
    got, want = both(model, cache, ids, new=20)
    assert torch.equal(got, want)


def test_a_mask_of_other_values_than_0_and_1_is_refused():
    """Positions are the mask's running sum: a 2 read the new tokens at other positions, silently (the
    uncompacted path refuses it)."""
    model = served("pre_rope")
    prompt = ids_of(2, 21, 13)
    cache = compacted(model, prompt)
    ids = torch.cat([prompt, ids_of(2, 3, 14)], 1)
    for value in (2, -1):
        mask = torch.ones_like(ids)
        mask[:, 21:] = value
        with pytest.raises(ValueError, match=r"0 \(padding\) and 1 \(a token\) only"):
            stiefkv.generate(model, ids, attention_mask=mask, past_key_values=cache, max_new_tokens=2)
    with pytest.raises(ValueError, match=rf"{max(cache.prefix)} entries, the 3 input ids after them and 2 "):
        stiefkv.generate(model, ids, past_key_values=cache, max_new_tokens=2, max_length=5)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.uint8])
def test_integer_ids_of_any_width_are_taken(dtype):
    """Ids of a narrower integer dtype than int64 pass the checks as integer ids: int16 and uint8 failed
    inside the embedding (torch's 'Expected tensor for argument #1 indices …'), with or without a cache."""
    model = served("pre_rope")
    prompt = ids_of(2, 21, 13)
    cache = compacted(model, prompt)
    ids = torch.cat([prompt, ids_of(2, 3, 14)], 1)
    want = stiefkv.generate(model, ids, past_key_values=cache, max_new_tokens=3)
    assert torch.equal(stiefkv.generate(model, ids.to(dtype), past_key_values=cache, max_new_tokens=3), want)
    plain = stiefkv.generate(model, ids, max_new_tokens=3)
    assert torch.equal(stiefkv.generate(model, ids.to(dtype), max_new_tokens=3), plain)


def test_cropping_a_static_cache_behind_a_compacted_prompt():
    """crop (transformers' assisted decoding) cuts tokens behind the held entries: a token written again in
    a cut slot is a token (β 0), not the padding the cut one was; cutting into the held entries (layers of
    different counts padded to slot S) is refused, not left to read the next tokens at the entries' β."""
    from stiefkv.compaction import PAD_BETA
    from stiefkv.serve import Runner

    model = served("pre_rope")
    prompt = ids_of(2, 30, 15)
    cache = compacted(model, prompt, allocation="global")
    static = StaticLatentCache(model, 2, 64)
    question = torch.tensor([[False, False, True]] * 2)  # the question's first two tokens padding
    S = static.hold_compacted(cache, None, question)
    assert all(bool((beta[..., S:S + 2] == PAD_BETA).all()) for beta in static.beta)
    Runner(model, static, None).prefill(ids_of(2, 3, 16), torch.arange(30, 33)[None].expand(2, 3), 8, start=S)
    static.crop(S)
    assert static.get_seq_length() == S
    for beta in static.beta:
        assert bool((beta[..., S:] == 0).all())
    with pytest.raises(ValueError, match="compacted prompt"):
        static.crop(S - 1)
    assert static.get_seq_length() == S
