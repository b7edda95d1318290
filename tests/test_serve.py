"""Serving from a static cache: ``StaticLatentCache``, chunked prefill and graph-captured decode
(``stiefkv.generate``), and ``model.generate(cache_implementation="static")`` on a served model.

The reference is transformers' own greedy ``generate`` with the dynamic cache: every path here must give its
tokens exactly (GQA 3, ranks 11 and 13, left padding, prefill chunks that do not divide the prompt).
"""

import copy

import numpy as np
import pytest
import torch

import stiefkv
from stiefkv.attention import is_compressed, projections_of
from stiefkv.quant import quantized_length
from stiefkv.serve import Runner
from stiefkv.static_cache import CacheOverflowError, StaticLatentCache
from tests.tiny import random_projections, tiny_model

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def prompt(batch=3, n=19, seed=0, padded=True, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 97, (batch, n), generator=g)
    mask = torch.ones_like(ids)
    if padded:
        mask[1, :4] = 0
        mask[-1, :7] = 0
    return ids.to(device), mask.to(device)


def served(key_mode="pre_rope", backend="auto", device="cpu", dtype=torch.float32, head_dim=24):
    model = tiny_model("llama", heads=6, kv_heads=2, dtype=dtype, head_dim=head_dim).to(device)
    return stiefkv.load(model, random_projections(model, 11, 13, key_mode), backend=backend)


@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("chunk", [5, 14, 4096])
def test_generate_matches_transformers_greedy(key_mode, chunk):
    model = served(key_mode)
    ids, mask = prompt()
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=9, **GREEDY)
    ours = stiefkv.generate(model, ids, attention_mask=mask, max_new_tokens=9, prefill_chunk=chunk,
                            eos_token_id=None)
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("batch,tokens", [(3, 14), (5, 3), (1, 7), (2, 4096)])
def test_prefill_forwards_take_a_bounded_number_of_tokens_over_the_rows(batch, tokens, monkeypatch):
    """``prefill_chunk`` bounds the tokens of a forward summed over the rows (a row's share at least 1), so
    a prefill's activations do not grow with the batch; the tokens are those of the per-row chunks."""
    model = served()
    ids, _ = prompt(batch=batch, padded=False)
    shapes = []
    forward = Runner.forward

    def counted(self, ids, positions, slots):
        shapes.append(tuple(ids.shape))
        return forward(self, ids, positions, slots)

    monkeypatch.setattr(Runner, "forward", counted)
    stiefkv.generate(model, ids, max_new_tokens=1, prefill_chunk=tokens, eos_token_id=None)
    share = max(1, tokens // batch)
    assert shapes == [(batch, min(share, 19 - lo)) for lo in range(0, 19, share)]
    assert max(b * n for b, n in shapes) <= max(tokens, batch)


@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope", None])
def test_prefill_resumed_from_a_slot_continues_the_one_before(key_mode):
    """``Runner.prefill(start=)`` (bench_serve's filled capacity trials prefill a cache's last chunks with it)
    writes behind the slots a first prefill wrote: the logits of one prefill, on the static latent cache (it
    writes at its own device counter) and on transformers' ``StaticCache`` of an uncompressed model (None:
    it writes at the slots given)."""
    from stiefkv.serve import make_cache

    model = served(key_mode) if key_mode else tiny_model("llama", heads=6, kv_heads=2, head_dim=24)
    ids, _ = prompt(batch=3, n=23, padded=False)
    positions = torch.arange(23)[None].expand(3, 23)
    with torch.inference_mode():
        expected = Runner(model, make_cache(model, 3, 32), None).prefill(ids, positions, 6)
        parts = Runner(model, make_cache(model, 3, 32), None)
        parts.prefill(ids[:, :17], positions[:, :17], 6)
        got = parts.prefill(ids[:, 17:], positions[:, 17:], 6, start=17)
    assert not got.isnan().any()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)  # float32


def test_transformers_static_generate_uses_the_static_latent_cache():
    model = served()
    ids, mask = prompt()
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=7, **GREEDY)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=7, cache_implementation="static",
                         return_dict_in_generate=True, **GREEDY)
    cache = getattr(out, "cache", None) or out.past_key_values
    assert isinstance(cache, StaticLatentCache)
    assert cache.max_length >= 19 + 6 and cache.seen == 19 + 6  # the last token is not fed back
    assert torch.equal(out.sequences, expected)


def test_uncompressed_model_takes_transformers_static_cache():
    """The baseline of the serving benchmark: the same chunking and loop over an uncompressed model."""
    model = tiny_model("llama", heads=6, kv_heads=2)
    ids, mask = prompt()
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=8, **GREEDY)
    assert torch.equal(stiefkv.generate(model, ids, attention_mask=mask, max_new_tokens=8, prefill_chunk=6,
                                        eos_token_id=None), expected)


def test_an_unsupported_model_is_named_before_generating():
    """Found by a tester: stiefkv.generate of an uncompressed model checked no architecture: phi3 failed on
    a missing k_proj, gpt2 on its missing .model.layers, a sliding window shorter than the prompt inside SDPA
    (a size mismatch). The Runner runs a Llama-style decoder over every token, served or not."""
    from transformers import AutoConfig, AutoModelForCausalLM

    small = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=97, max_position_embeddings=128)
    ids = torch.randint(3, 90, (1, 20))
    for kind, settings, message in (
            ("phi3", dict(small, pad_token_id=0), "unsupported architecture 'phi3'; StiefKV supports"),
            ("gpt2", dict(n_embd=32, n_layer=1, n_head=2, vocab_size=97), "unsupported architecture 'gpt2'"),
            ("mistral", dict(small, sliding_window=8), r"mistral with a sliding attention window \(8\)")):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **settings)).eval()
        with pytest.raises(stiefkv.models.ModelLoadError, match=message):
            stiefkv.generate(model, ids, max_new_tokens=2)
        with pytest.raises(stiefkv.models.ModelLoadError, match=message):
            StaticLatentCache(model, 1, 8)


def test_eos_pads_the_rest_of_the_row():
    model = served()
    ids, mask = prompt(padded=False)
    free = stiefkv.generate(model, ids, max_new_tokens=8, eos_token_id=None)[:, 19:]
    eos = int(free[0, 2])
    out = stiefkv.generate(model, ids, max_new_tokens=8, eos_token_id=eos, pad_token_id=0)[:, 19:]
    for row, row_free in zip(out, free):
        hits = (row_free == eos).nonzero()
        cut = int(hits[0]) + 1 if len(hits) else 8
        assert torch.equal(row[:cut], row_free[:cut]) and bool((row[cut:] == 0).all())
    # by default the end and pad tokens of the model's generation config, as generate takes them
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = eos, 0
    assert torch.equal(stiefkv.generate(model, ids, max_new_tokens=8)[:, 19:], out)


def test_any_of_several_end_tokens_pads_the_rest_as_generate_does():
    """A list of end tokens (Llama-3-Instruct's config has two, the turn's end second): every row pads after
    its first end token of any of them, as ``model.generate`` pads; a bad end token is refused up front."""
    model = served()
    ids, mask = prompt(padded=False)
    free = stiefkv.generate(model, ids, max_new_tokens=8, eos_token_id=None)[:, 19:]
    second = int(free[0, 2])
    first = next(t for t in range(2, 97) if t not in free)  # never generated: only the second one ends
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = [first, second], 0
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)[:, 19:]
    assert bool((expected[0, 3:] == 0).all())
    assert torch.equal(stiefkv.generate(model, ids, max_new_tokens=8)[:, 19:], expected)
    assert torch.equal(stiefkv.generate(model, ids, max_new_tokens=8, eos_token_id=[first, second],
                                        pad_token_id=0)[:, 19:], expected)
    with pytest.raises(ValueError, match="eos_token_id must be a token id"):
        stiefkv.generate(model, ids, max_new_tokens=8, eos_token_id="</s>")


def test_a_deep_copy_of_a_served_model_is_served_on_its_own(tmp_path):
    """The folded weights hold no autograd graph, so a served model copies; the copy's save_pretrained
    writes the copy's weights and bases, and unloading it leaves nothing of ours on it nor touches the
    original."""
    model = served()
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.lm_head.weight.add_(1.0)
    twin.save_pretrained(tmp_path / "twin")
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "twin" / "model.safetensors"))
    head = saved.get("lm_head.weight", saved["model.embed_tokens.weight"])
    assert torch.equal(head, twin.lm_head.weight)
    from stiefkv.projections import PROJECTIONS_FILE

    assert stiefkv.Projections.load(tmp_path / "twin" / PROJECTIONS_FILE).ranks == [(11, 13)] * 2
    assert projections_of(twin) is projections_of(model)
    stiefkv.unload(twin)
    assert not is_compressed(twin) and projections_of(twin) is None
    assert not twin.model._forward_pre_hooks and "save_pretrained" not in vars(twin)
    assert is_compressed(model) and model.model._forward_pre_hooks


def test_a_served_model_compressed_with_other_bases_for_a_block_is_served_with_its_own_after():
    from stiefkv.attention import Switch, compressed

    model = served()
    own, other = projections_of(model), random_projections(model, 7, 5)
    with compressed(model, other):
        assert projections_of(model) is other
    assert projections_of(model) is own and model.model.layers[0].self_attn.P_k.shape[-1] == 11
    switch = Switch(model, other)
    assert projections_of(model) is own
    with switch:
        assert model.model.layers[0].self_attn.P_k.shape[-1] == 7
    assert model.model.layers[0].self_attn.P_k.shape[-1] == 11


@pytest.mark.parametrize("keys_shared", [True, False])
def test_static_cache_of_keys_shared_and_values_per_head_or_the_reverse(keys_shared):
    """Each latent's buffers sized by its own basis: shared keys ``[1, G·d, r]`` beside per-head values (or
    the reverse) generate as ``model.generate`` does."""
    from stiefkv.models import fingerprint
    from tests.tiny import random_bases

    model = tiny_model("llama", heads=6, kv_heads=2, head_dim=24)
    g = torch.Generator().manual_seed(0)
    shared, per_head = (lambda: random_bases(1, 48, 17, g)), (lambda: random_bases(2, 24, 11, g))
    keys = [(shared if keys_shared else per_head)() for _ in range(2)]
    values = [(per_head if keys_shared else shared)() for _ in range(2)]
    stiefkv.load(model, stiefkv.Projections(keys=keys, values=values, key_mode="pre_rope",
                                            fingerprint=fingerprint(model), budget=0.5, method="random"))
    ids, mask = prompt()
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=6, **GREEDY)
    assert torch.equal(stiefkv.generate(model, ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None),
                       expected)


def test_static_cache_bytes_and_counters():
    model = served()
    cache = StaticLatentCache(model, 3, 40)
    L, G, slots = 2, 2, 48  # 40 rounded up to a multiple of 16 (aligned heads for the kernels)
    assert cache.nbytes == L * 3 * G * slots * (11 + 13) * 4 + 3 * slots * 4 + 4
    assert cache.get_max_length() == 40
    ids, mask = prompt()
    model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
    assert cache.seen == 19 and int(cache.filled) == 19 and cache.get_seq_length() == 19
    assert cache.starts.tolist() == [0, 4, 7]
    assert torch.equal(cache.positions[1, :19].long(), torch.arange(19))  # a plain forward counts padding
    cache.crop(-25)  # past the start: empty, as the dynamic cache, and it continues
    assert cache.seen == 0 and int(cache.filled) == 0
    model(ids[:, :4], past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 4


def test_static_cache_continues_like_the_dynamic_one():
    """A forward of several tokens on top of a static cache (a prefill chunk) gives the dynamic cache's
    logits."""
    model = served()
    ids, _ = prompt(padded=False)
    static, dynamic = StaticLatentCache(model, 3, 30), stiefkv.LatentCache()
    for cache in (static, dynamic):
        model(ids[:, :12], past_key_values=cache, use_cache=True)
    a = model(ids[:, 12:], past_key_values=static, use_cache=True).logits
    b = model(ids[:, 12:], past_key_values=dynamic, use_cache=True).logits
    torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_a_step_on_the_reference_is_decoded_eagerly_not_captured(caplog):
    """Where the warm-up step ran a layer on the PyTorch reference (``Runner.capture`` returns False: ranks
    whose kernel tiles fit no GPU config), ``capture="auto"`` decodes the rest eagerly with a warning and
    ``capture=True`` is refused with a clear error."""

    class Stub:
        def __init__(self):
            self.eager = []

        def capture(self, state):
            return False

        def decode_eager(self, state, steps):
            self.eager.append(steps)

    stub = Stub()
    with caplog.at_level("WARNING", logger="stiefkv.serve"):
        Runner.decode_captured(stub, None, 9)
    assert stub.eager == [8] and "decoding eagerly" in caplog.text
    with pytest.raises(ValueError, match="capture=True: a layer of this model attends through the PyTorch "
                                         "reference"):
        Runner.decode_captured(Stub(), None, 9, demanded=True)


def test_bad_input():
    model = served()
    ids, mask = prompt()
    with pytest.raises(ValueError, match="cannot hold the prompt"):
        stiefkv.generate(model, ids, max_new_tokens=5, max_length=20)
    for bad in ("30", 30.7, True):
        with pytest.raises(ValueError, match="max_length must be a whole number"):
            stiefkv.generate(model, ids, max_new_tokens=5, max_length=bad)
    with pytest.warns(UserWarning, match="run past the model's 512 positions"):
        stiefkv.generate(model, ids[:1, :8], max_new_tokens=505)
    cache = StaticLatentCache(model, 3, 20)
    model(ids, past_key_values=cache, use_cache=True)
    with pytest.raises(CacheOverflowError, match="holds 20 tokens per row and already has 19; 2 more do not"):
        model(ids[:, :2], past_key_values=cache, use_cache=True)
    model(ids[:, :1], past_key_values=cache, use_cache=True)  # the 20th slot
    with pytest.raises(CacheOverflowError, match="already has 20; 1 more does not fit.*StaticLatentCache"):
        model(ids[:, :1], past_key_values=cache, use_cache=True)
    G = dict(attention_mask=mask, do_sample=False, pad_token_id=0, eos_token_id=None)
    small = StaticLatentCache(model, 3, 22)  # generate writes 19 + 5 - 1: refused before the first step
    with pytest.raises(CacheOverflowError, match="holds 22 tokens per row; this generate needs 23"):
        model.generate(ids, past_key_values=small, max_new_tokens=5, **G)
    assert small.seen == 0
    assert model.generate(ids, past_key_values=small, max_new_tokens=4, **G).shape == (3, 23)  # 22 fit
    with pytest.raises(ValueError, match="needs the model and ids on a CUDA device"):
        stiefkv.generate(model, ids, max_new_tokens=3, capture=True)
    right = torch.ones_like(ids)
    right[0, -3:] = 0
    empty, twos = torch.ones_like(ids), torch.full_like(ids, 2)
    empty[1] = 0
    for m in (model, tiny_model("llama")):  # the served model and the uncompressed one's static cache
        with pytest.raises(ValueError, match="left-padded batches only"):
            stiefkv.generate(m, ids, attention_mask=right, max_new_tokens=3)
        with pytest.raises(ValueError, match="attention_mask row 1 has no token"):
            stiefkv.generate(m, ids, attention_mask=empty, max_new_tokens=3)
        for bad in (twos, mask * 0.5):
            with pytest.raises(ValueError, match="must hold 0 .padding. and 1 .a token. only"):
                stiefkv.generate(m, ids, attention_mask=bad, max_new_tokens=3)
    for m in (model, tiny_model("llama")):
        with pytest.raises(MemoryError, match="out of memory for a cache of 3 rows × 1000000000000 tokens"):
            stiefkv.generate(m, ids, max_new_tokens=2, max_length=10**12)
    assert torch.equal(stiefkv.generate(model, ids, attention_mask=mask.float(), max_new_tokens=2),
                       stiefkv.generate(model, ids, attention_mask=mask, max_new_tokens=2))
    with pytest.raises(ValueError, match="allocated for batch 3, got 2: allocate one for batch 2"):
        model(ids[:2], past_key_values=StaticLatentCache(model, 3, 30), use_cache=True)
    with pytest.raises(ValueError, match="prepare the model with stiefkv.load"):
        StaticLatentCache(tiny_model("llama"), 1, 8)
    with pytest.raises(ValueError, match="max_new_tokens must be"):
        stiefkv.generate(model, ids, max_new_tokens=0)
    with pytest.raises(ValueError, match="max_new_tokens must be a whole number"):
        stiefkv.generate(model, ids, max_new_tokens=2.0)
    with pytest.raises(ValueError, match="integer token ids"):
        stiefkv.generate(model, ids.float(), max_new_tokens=2)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        stiefkv.generate(model, ids + 1000, max_new_tokens=2)
    with pytest.raises(ValueError, match="a StaticLatentCache keeps its buffers fixed"):
        stiefkv.compact(model, cache, keep=0.5)
    # checked before any work (a bad pad id failed inside torch after the generation; 1.5 became 1), numpy
    # integers taken where Python's are, capture=1 is not True, a mask that is not a tensor is named
    for bad in ("x", 1.5, -1):
        with pytest.raises(ValueError, match=r"pad_token_id must be a token id \(≥ 0\) or None"):
            stiefkv.generate(model, ids, max_new_tokens=2, pad_token_id=bad, eos_token_id=5)
    with pytest.raises(ValueError, match="capture must be one of"):
        stiefkv.generate(model, ids, max_new_tokens=2, capture=1)
    with pytest.raises(ValueError, match="attention_mask must be a .batch, tokens. tensor"):
        stiefkv.generate(model, ids, max_new_tokens=2, attention_mask=mask.tolist())
    want = stiefkv.generate(model, ids, max_new_tokens=3, eos_token_id=[5], pad_token_id=0)
    numpy_ints = stiefkv.generate(model, ids, max_new_tokens=np.int64(3), prefill_chunk=np.int64(64),
                                  eos_token_id=np.int64(5), pad_token_id=np.int64(0))
    assert torch.equal(numpy_ints, want)
    for rows, length in (("2", 20), (2.7, 20), (2, 20.0), (True, 20)):
        with pytest.raises(ValueError, match="needs whole numbers batch_size ≥ 1 and max_length ≥ 1"):
            StaticLatentCache(model, rows, length)


# both key modes for the plain stores and the channel-keyed window; the other windowed stores (slow under the
# interpreter: a 100-token prompt) each in one key mode, the two modes shared between them
FILLED = [(mode, bits, name) for bits, name in ((None, "bf16"), ((8, 4), "int8-int4"), ((3, 2), "int3-int2"),
                                                (0, "int2-channel-int3-r16"))
          for mode in ("pre_rope", "post_rope")] + [
    ("pre_rope", 3, "int8-int4-r16"), ("post_rope", 4, "int3-int2-r16"),
    ("post_rope", 7, "int4-log8-int2-log8-r16")]


@pytest.mark.parametrize("key_mode, bits", [f[:2] for f in FILLED], ids=[f"{f[2]}-{f[0]}" for f in FILLED])
def test_triton_kernels_read_the_filled_count(key_mode, bits):
    """The served model on the Triton kernels (interpreted on the CPU, compiled on CUDA) over a static cache
    of float latents, of codes, or of codes behind a 16-token exact window (the codes read in place, the
    ring beside them, merged by log-sum-exp): the kernels take the key count from device memory (and
    dequantize codes in registers) and give the reference's tokens."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    window = isinstance(bits, int)  # WINDOWED[bits]: codes behind a 16-token exact window
    # long enough that every windowed latent holds codes (channel keys: a whole group past the window)
    ids, mask = prompt(batch=2, n=100 if window else 11, device=device)
    outs = {}
    for backend in ("triton", "reference"):
        kw = dict(key_mode=key_mode, backend=backend, device=device, head_dim=32)  # the kernel's smallest
        if window:
            model = windowed_served(*WINDOWED[bits], **kw)
        else:
            model = served(**kw) if bits is None else quantized_served(bits, **kw)
        # chunks of 4 tokens a row; behind a window, of 20 (the interpreter's prefill tiles are the time)
        outs[backend] = stiefkv.generate(model, ids, attention_mask=mask, max_new_tokens=4,
                                         prefill_chunk=40 if window else 8, capture=False)
    assert torch.equal(outs["triton"], outs["reference"])


@on_gpu
@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
def test_captured_decode_gives_the_eager_tokens(key_mode):
    for model in (served(key_mode, device="cuda", dtype=torch.bfloat16, head_dim=32),
                  quantized_served((8, 4), key_mode, device="cuda", dtype=torch.bfloat16, head_dim=32),
                  quantized_served((3, 2), key_mode, device="cuda", dtype=torch.bfloat16, head_dim=32),
                  windowed_served(*WINDOWED[0], key_mode, device="cuda", dtype=torch.bfloat16, head_dim=32),
                  tiny_model("llama", heads=6, kv_heads=2, dtype=torch.bfloat16).cuda()):
        ids, mask = prompt(device="cuda")
        eager = stiefkv.generate(model, ids, attention_mask=mask, max_new_tokens=12, capture=False)
        graph = stiefkv.generate(model, ids, attention_mask=mask, max_new_tokens=12, capture=True)
        assert torch.equal(graph, eager)


def quantized_served(bits=(8, 4), key_mode="pre_rope", backend="auto", device="cpu", dtype=torch.float32,
                     head_dim=24, recent=0):
    from stiefkv.quant import QuantSpec

    model = tiny_model("llama", heads=6, kv_heads=2, dtype=dtype, head_dim=head_dim).to(device)
    proj = random_projections(model, 11, 13, key_mode)
    proj.quant = [(QuantSpec(bits[0], "token", recent=recent), QuantSpec(bits[1], "token", recent=recent))
                  ] * len(proj.keys)
    return stiefkv.load(model, proj, backend=backend)


@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
def test_static_cache_of_codes_matches_the_dynamic_quantized_cache(key_mode):
    """Token-layout int8 keys and int4 values with no exact window: the static cache writes each token's codes
    as it arrives, as the dynamic cache does, so greedy tokens agree; its bytes are the codes, scales and
    lows of every slot."""
    model = quantized_served(key_mode=key_mode)
    ids, mask = prompt()
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=8, **GREEDY)
    assert torch.equal(stiefkv.generate(model, ids, attention_mask=mask, max_new_tokens=8, prefill_chunk=6,
                                        eos_token_id=None), expected)
    cache = StaticLatentCache(model, 3, 40)
    # codes padded to 8-code words (int8: 16 bytes for 11 channels, int4: 8 for 13), one fp16 scale and low
    per_slot = (16 + 4) + (8 + 4)
    L, B, G, slots = 2, 3, 2, 48  # 40 rounded up to 16
    assert cache.nbytes == L * B * G * slots * per_slot + B * slots * 4 + 4


def windowed_served(key_spec: str, value_spec: str, key_mode="pre_rope", device="cpu", dtype=torch.float32,
                    head_dim=24, backend="auto"):
    from stiefkv.quant import QuantSpec

    model = tiny_model("llama", heads=6, kv_heads=2, dtype=dtype, head_dim=head_dim).to(device)
    proj = random_projections(model, 11, 13, key_mode)
    keys, values = key_spec.split("|"), value_spec.split("|")  # one spec for all layers, or one a layer
    if len(keys) == 1:
        keys, values = keys * len(proj.keys), values * len(proj.keys)
    proj.quant = [(QuantSpec.parse(k), QuantSpec.parse(v)) for k, v in zip(keys, values, strict=True)]
    return stiefkv.load(model, proj, backend=backend)


# what --bits auto picks (channel keys, exact recent tokens, 2-3 bits); a kernel-readable latent beside one
WINDOWED = [("int2-channel-r16", "int3-token-r16"), ("int4-token-r16", "int8-token"),
            ("int3-channel-mse", "int2-token"), ("int8-token-r16", "int4-token-r16"),
            ("int3-token-r16", "int2-token-r16"), ("bf16", "int3-channel-r16"),
            ("int4-token-r40", "int8-token-r16"),  # two windows of different lengths
            ("int4-token-log8", "int2-token-log8-r16"),  # log8 scales, codes read in place
            ("int2-channel-r16-w8", "int3-token-log8-r16-w8"),  # exact tokens held in int8
            ("int8-token-r16|int4-token-r40", "int8-token-r16|int8-token-r16")]  # layers unlike


@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("specs", WINDOWED, ids=lambda s: "_".join(s))
def test_static_cache_of_any_layout_gives_the_dynamic_logits(specs, key_mode):
    """Exact recent windows, channel-layout groups and 2-3-bit codes in the static cache: a prefill in two
    chunks (the second across a 64-token group) and 80 decode steps (across more groups) give the dynamic
    cache's logits at every step, left padding included; the exact band of a chunk and the exact tokens
    laid over the codes in decode are what make them agree."""
    model = windowed_served(*specs, key_mode)
    ids, mask = prompt(batch=2, n=150, seed=1)
    static, dynamic = StaticLatentCache(model, 2, 240), stiefkv.LatentCache()
    assert static.windowed
    # codes behind an exact window: decode reads them in place beside the ring (float keys: read dequantized)
    assert static.split_layers == (set() if specs[0] == "bf16" else {0, 1})

    def run(cache, tokens, upto):
        return model(tokens, attention_mask=mask[:, :upto], past_key_values=cache, use_cache=True).logits

    for lo, hi in ((0, 61), (61, 150)):
        a, b = run(static, ids[:, lo:hi], hi), run(dynamic, ids[:, lo:hi], hi)
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)
    token = b[:, -1:].argmax(-1)
    for step in range(80):
        mask = torch.cat([mask, torch.ones_like(token)], 1)
        a, b = run(static, token, mask.shape[1]), run(dynamic, token, mask.shape[1])
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=lambda m: f"step {step}: {m}")
        token = b[:, -1:].argmax(-1)
    assert static.seen == 230


@pytest.mark.parametrize("specs", [("bf16", "bf16"), *WINDOWED[:5], ("int4-token", "int8-token")],
                         ids=lambda s: "_".join(s))
def test_a_cache_that_cannot_fit_is_refused_before_it_is_allocated(specs, monkeypatch):
    """The bytes counted before allocating are at most those allocated (so no cache that fits is refused)
    and, at 1000 tokens, at least half of them; a cache over the free memory is refused with a
    ``MemoryError`` before any buffer exists (where memory is overcommitted, the zeros' first write kills the
    process instead)."""
    import stiefkv.serve
    import stiefkv.static_cache as sc

    model = served() if specs == ("bf16", "bf16") else windowed_served(*specs, "pre_rope")
    for rows, length in ((3, 19), (2, 240), (1, 1000)):
        cache = StaticLatentCache(model, rows, length)
        counted = sum(sc.latent_cache_bytes(model, rows, cache.positions.shape[1]).values())
        assert counted <= cache.nbytes, (rows, length, counted, cache.nbytes)
    # short caches hold proportionally more exact ring and group padding than codes
    assert counted >= cache.nbytes / 2, (counted, cache.nbytes)
    full = tiny_model("llama", heads=6, kv_heads=2, head_dim=24)
    made = stiefkv.serve.make_cache(full, 2, 40)
    ids, _ = prompt(batch=2, n=7, padded=False)
    full(ids, past_key_values=made, use_cache=True)
    held = sum(t.nbytes for layer in made.layers for t in (layer.keys, layer.values))
    assert sum(sc.full_cache_bytes(full, 2, 40).values()) == held
    allocated = []
    monkeypatch.setattr(sc, "free_bytes", lambda device: 10_000)
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: allocated.append(a) or pytest.fail("allocated"))
    refused = r"cache of 2 rows × 500 tokens: its buffers need .* GiB on cpu, which has 9.31e-06 GiB free"
    with pytest.raises(MemoryError, match=refused):
        StaticLatentCache(model, 2, 500)
    with pytest.raises(MemoryError, match="cache of 2 rows × 40 tokens"):
        stiefkv.serve.make_cache(full, 2, 40)
    assert not allocated


def test_a_reference_backend_keeps_the_pytorch_write():
    """A model loaded with ``backend="reference"`` runs no Triton, the cache's writes included."""
    from stiefkv import kernels
    from stiefkv.quant import QuantSpec
    from stiefkv.static_cache import _fused_write

    spec, cuda = QuantSpec(8, "token"), torch.device("cuda")
    assert not _fused_write(spec, cuda, "reference")
    assert _fused_write(QuantSpec(4, "channel"), cuda) == kernels.triton_available()  # per channel too
    assert not _fused_write(QuantSpec(4, "channel", mse=True), cuda)
    assert not _fused_write(QuantSpec(4, "token", mse=True), cuda)
    model = windowed_served("int8-token", "int4-token-r16", backend="reference")
    cache = StaticLatentCache(model, 2, 40)
    assert {s.backend for s in (*cache.keys_buf, *cache.values_buf)} == {"reference"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run (CUDA: the GPU tests)")
@pytest.mark.parametrize("specs,first", [(("int8-token-r16", "int4-token-r16"), 45),
                                         (("int2-channel-r16", "int3-token-r16"), 90),  # a whole group held
                                         (("int4-token", "int8-token-r16"), 45)], ids=str)
def test_chunked_prefill_with_an_exact_band_on_the_kernels(specs, first, monkeypatch):
    """The Triton backend (interpreted) splits a prefill chunk's attention at its exact band (kernel below,
    reference on the band), the keys below it handed over as codes (no dequantized copy of every held
    token, :class:`~stiefkv.kernels.CodesAndBand`): a windowed store's chunked prefill and decode give the
    reference backend's logits, left padding included."""
    import os

    from stiefkv.kernels import CodesAndBand

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernels run on the CPU interpreted only")
    model = windowed_served(*specs, dtype=torch.float32, head_dim=32, backend="triton")
    ids, mask = prompt(batch=2, n=100, seed=4)
    runs, splits = [], []
    split = stiefkv.kernels._below_and_band
    monkeypatch.setattr(stiefkv.kernels, "_below_and_band",
                        lambda *a, **k: splits.append((type(a[1]), type(a[1][:, :, :a[1].split])))
                        or split(*a, **k))
    for backend in ("triton", "reference"):
        for layer in model.model.layers:
            layer.self_attn.backend = backend
        with torch.no_grad():  # the kernels are inference-only
            runs.append(prefill_then_decode(model, StaticLatentCache(model, 2, 110), ids, mask, first, 3))
    # the second chunk, in each layer (the first chunk's band holds every key), below it codes
    assert splits == [(CodesAndBand, stiefkv.kernels.QuantizedLatents)] * 2
    for step, (a, b) in enumerate(zip(*runs)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=lambda m: f"forward {step}: {m}")


def test_split_decode_before_any_token_is_held_as_codes():
    """A prompt shorter than the exact window: the first decode steps find no code visible (that side's
    log-sum-exp is −inf and must weigh nothing in the merge), then the codes side fills."""
    model = windowed_served("int8-token-r40", "int4-token-r40")
    ids, mask = prompt(batch=2, n=12, seed=3)
    static, dynamic = StaticLatentCache(model, 2, 80), stiefkv.LatentCache()
    assert static.split_layers == {0, 1}
    a = model(ids, attention_mask=mask, past_key_values=static).logits
    b = model(ids, attention_mask=mask, past_key_values=dynamic).logits
    token = b[:, -1:].argmax(-1)
    for step in range(45):  # the window of 40 fills at step 28
        mask = torch.cat([mask, torch.ones_like(token)], 1)
        a = model(token, attention_mask=mask, past_key_values=static).logits
        b = model(token, attention_mask=mask, past_key_values=dynamic).logits
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4, msg=lambda m: f"step {step}: {m}")
        token = b[:, -1:].argmax(-1)


def prefill_then_decode(model, cache, ids, mask, chunk: int, steps: int) -> list:
    """The logits of a prefill in two chunks (``ids[:, :chunk]``, then the rest) and ``steps`` greedy decode
    steps on ``cache``."""
    logits = [model(part, attention_mask=mask[:, :hi], past_key_values=cache).logits
              for part, hi in ((ids[:, :chunk], chunk), (ids[:, chunk:], ids.shape[1]))]
    token = logits[-1][:, -1:].argmax(-1)
    for _ in range(steps):
        mask = torch.cat([mask, torch.ones_like(token)], 1)
        logits.append(model(token, attention_mask=mask, past_key_values=cache).logits)
        token = logits[-1][:, -1:].argmax(-1)
    return logits


# prefill chunks over codes below an exact band: channel codes read by the decode tile (2 or 5 queries) and
# by the prefill tiles, splits that are not multiples of 64, w8 and log8 windows, a plain store beside one
BAND_CASES = [(("int2-channel", "int3-token-r16"), (130, 2, 70)),
              (("int2-channel-r16", "int3-token-r16"), (71, 30, 5, 60)),
              (("int3-token-r16", "int2-channel"), (130, 5, 66, 40)),
              (("int2-channel-r16-w8", "int3-token-log8-r16-w8"), (45, 50, 7, 80)),
              (("int4-token", "int4-token-r16"), (300, 2, 250))]


@on_gpu
@pytest.mark.parametrize("slice_keys", [64, 4096])
@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("specs,chunks", BAND_CASES, ids=str)
def test_compiled_prefill_over_codes_below_a_band(specs, chunks, key_mode, slice_keys, monkeypatch):
    """CUDA: prefill chunks over windowed codes (codes below the band, :class:`~stiefkv.kernels.CodesAndBand`,
    in 64- or 4096-key slices) and three decode steps give the reference backend's logits, left padding
    included. Each forward of the reference reads a copy of the cache the Triton run held before it: run
    side by side, a bf16 rounding in one layer's output moved the next layer's keys across int4 rounding
    boundaries, and the two caches' codes parted (0.13 apart on one token's logits, the kernels agreeing).
    Tolerance: float32 2e-3, bf16 6e-2 (the reference computes in float32 either way)."""
    from stiefkv.kernels import lowrank

    monkeypatch.setattr(lowrank, "PREFILL_CODE_SLICE", slice_keys)
    for dtype, tol in ((torch.float32, 2e-3), (torch.bfloat16, 6e-2)):
        model = windowed_served(*specs, key_mode=key_mode, device="cuda", dtype=dtype, head_dim=64,
                                backend="triton")
        n = sum(chunks)
        ids, mask = prompt(batch=3, n=n, seed=4, device="cuda")
        mask[1, :90] = 0
        cache, lo, step = StaticLatentCache(model, 3, n + 8), 0, 0

        def both(ids, mask):
            twin = copy.deepcopy(cache)
            logits = []
            for backend, held in (("reference", twin), ("triton", cache)):
                for layer in model.model.layers:
                    layer.self_attn.backend = backend
                with torch.no_grad():
                    logits.append(model(ids, attention_mask=mask, past_key_values=held).logits.float())
            b, a = logits
            assert not a.isnan().any()
            torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m: f"{dtype} forward {step}: {m}")
            return a

        for k in chunks:
            logits = both(ids[:, lo:lo + k], mask[:, :lo + k])
            lo, step = lo + k, step + 1
        token, seen = logits[:, -1:].argmax(-1), mask
        for _ in range(3):
            seen = torch.cat([seen, torch.ones_like(token)], 1)
            token = both(token, seen)[:, -1:].argmax(-1)
            step += 1


FUSED_WRITES = [("int8-token", "int4-token"), ("int4-token-log8", "int2-token-log8-r16"),
                ("int8-token-r16", "int3-token-r16"), ("int2-channel-r16", "int4-token-r40"),
                ("int4-channel-w8", "int2-token-log8-r16-w8")]


@pytest.mark.parametrize("specs", FUSED_WRITES, ids=lambda s: "_".join(s))
def test_quantize_on_write_kernel_fills_the_buffers_as_pytorch(specs, monkeypatch):
    """The quantize-on-write kernel and, for an int8 window, the round-trip kernel (Triton's interpreter here;
    CUDA takes them by default) against the PyTorch write: a chunked prefill of 136 tokens and 10 decode
    steps leave every code, scale, low and ring byte the same, so the logits are those of the PyTorch path
    at every step. The decode steps write every ring past its first lap and, at token 143, move the channel
    layout's second group of 64 out of a 16-token ring into codes."""
    import stiefkv.static_cache as sc

    pytest.importorskip("triton")
    cuda = torch.cuda.is_available()  # there the attention kernels run too, which take head dims of 32
    model = windowed_served(*specs, device="cuda" if cuda else "cpu",
                            dtype=torch.bfloat16 if cuda else torch.float32, head_dim=32 if cuda else 24)
    ids, mask = prompt(batch=2, n=136, seed=2, device="cuda" if cuda else "cpu")
    steps = 10
    caches, calls, write, ring_calls, ring_write = [], [], sc._quantize_into, [], sc._round_trip_into
    prefill_writes = []  # a windowed store's prefill chunk: codes written without its ring
    monkeypatch.setattr(sc, "_quantize_into", lambda *a, **k: (
        calls.append(a[0]), prefill_writes.append(a[0]) if "ring" not in k else None, write(*a, **k)))
    monkeypatch.setattr(sc, "_round_trip_into",
                        lambda *a, **k: (ring_calls.append(a[0]), ring_write(*a, **k)))
    for fused in (False, True):
        monkeypatch.setattr(sc, "FUSED_WRITES", fused)
        cache = StaticLatentCache(model, 2, 170)
        caches.append((cache, prefill_then_decode(model, cache, ids, mask, 37, steps)))
    (plain, a), (fused, b) = caches
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    stores = [s for layer in zip(plain.keys_buf, fused.keys_buf, plain.values_buf, fused.values_buf)
              for s in (layer[:2], layer[2:])]
    for p_store, f_store in stores:
        for name in ("codes", "scale", "low", "ring"):
            x, y = getattr(p_store, name, None), getattr(f_store, name, None)
            if x is not None:
                assert torch.equal(x, y), name
    # the kernel wrote every per-token latent of the fused cache, on every forward, and nothing else did
    kernel_written = {id(s) for _, s in stores if hasattr(s, "spec") and sc._fused_write(s.spec, ids.device)}
    assert kernel_written and {id(s) for s in calls} == kernel_written
    per_store = [sum(c is s for c in calls) for _, s in stores if id(s) in kernel_written]
    assert min(per_store) >= steps  # every decode step (a CodeBuffer's prefill chunks too)
    # a windowed store's prefill chunks (37 tokens, then 99) that made tokens due, by the kernel too: token
    # layout, recent 16 both chunks and recent 40 the second only; channel (whole groups), the second only
    windowed = [s for _, s in stores if id(s) in kernel_written and isinstance(s, sc.WindowedCodes)]
    assert any(s.spec.layout == "channel" for s in windowed) == any("channel" in x for x in specs)
    assert [sum(c is s for c in prefill_writes) for s in windowed] == [
        (quantized_length(37, s.spec) > 0) + (quantized_length(136, s.spec) > quantized_length(37, s.spec))
        for s in windowed]
    # a window8 store's tokens went into its int8 window by the round-trip kernel: every decode step and
    # every prefill chunk (two: 37 tokens, then 99)
    window8 = [s for _, s in stores if getattr(getattr(s, "spec", None), "window8", False)]
    assert [sum(c is s for c in ring_calls) for s in window8] == [steps + 2] * len(window8)
    assert bool(window8) == any("w8" in spec for spec in specs)


@pytest.mark.parametrize("spec", ["int3-channel-r16", "int2-channel-w8", "int4-channel-r5-w8",
                                  "int4-token-r16-w8"])
def test_windowed_store_writes_by_kernel_as_pytorch(spec, monkeypatch):
    """A windowed store alone (no model): prefill chunks of 100, 70, 120 and 10 tokens (channel groups due
    with none held, then from slot 64 and 128 on, two in one chunk) and 36 decode steps (a group due from the
    ring in each, an int8 window's among them), a NaN in one chunk: the kernel writes (the interpreter here)
    leave every code, scale, low and ring byte the PyTorch writes leave."""
    import stiefkv.static_cache as sc
    from stiefkv.quant import QuantSpec

    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    quant = QuantSpec.parse(spec)
    g = torch.Generator().manual_seed(5)
    B, G, r, chunks, steps = 2, 3, 40, (100, 70, 120, 10), 36
    tokens = torch.randn(B, G, sum(chunks) + steps, r, generator=g) * torch.logspace(-2, 1, r)
    tokens[1, 2, 130, 7] = float("nan")  # in the second chunk: its group's scale and low NaN, codes 0
    tokens = tokens.to(device)
    stores = []
    for fused in (False, True):
        monkeypatch.setattr(sc, "FUSED_WRITES", fused)
        store = sc.WindowedCodes(quant, B, G, 400, r, torch.float32, device)
        start = 0
        for n in chunks:
            store.write_many(start, tokens[:, :, start:start + n])
            start += n
        for slot in range(start, start + steps):
            store.write_one(torch.tensor([slot], device=device), tokens[:, :, slot:slot + 1])
        stores.append(store)
    plain, fused = stores
    assert quantized_length(sum(chunks) + steps, quant) > quantized_length(sum(chunks), quant)
    for name in ("codes", "scale", "low", "ring"):
        x, y = getattr(plain, name), getattr(fused, name)
        if x is None:
            continue
        assert torch.equal(x.isnan(), y.isnan()), name
        assert torch.equal(x.nan_to_num(0.0), y.nan_to_num(0.0)), name


@pytest.mark.parametrize("specs", WINDOWED[:1], ids=lambda s: "_".join(s))
def test_generate_with_any_layout_matches_transformers(specs):
    model = windowed_served(*specs)
    ids, mask = prompt(batch=3, n=70)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=40, **GREEDY)
    for chunk in (23, 4096):
        assert torch.equal(stiefkv.generate(model, ids, attention_mask=mask, max_new_tokens=40,
                                            prefill_chunk=chunk, eos_token_id=None), expected)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=40, cache_implementation="static",
                         return_dict_in_generate=True, **GREEDY)
    assert isinstance(getattr(out, "cache", None) or out.past_key_values, StaticLatentCache)
    assert torch.equal(out.sequences, expected)


@on_gpu
@pytest.mark.parametrize("specs", WINDOWED[1:], ids=lambda s: "_".join(s))
def test_captured_decode_of_windowed_stores_gives_the_eager_tokens(specs):
    """The other pairs of stores with an exact window (split decode over codes and ring, float keys beside
    windowed values): captured decode gives the eager tokens, across 64-token groups."""
    model = windowed_served(*specs, device="cuda", dtype=torch.bfloat16, head_dim=32)
    ids, mask = prompt(device="cuda")
    eager = stiefkv.generate(model, ids, attention_mask=mask, max_new_tokens=70, capture=False)
    graph = stiefkv.generate(model, ids, attention_mask=mask, max_new_tokens=70, capture=True)
    assert torch.equal(graph, eager)


def test_windowed_static_cache_bytes_and_crop():
    """Codes, scales and lows of every slot (whole groups for the channel layout) plus the exact ring of
    recent + 64 tokens; a crop, which would need cut tokens back exact, is refused."""
    model = windowed_served("int2-channel-r16", "int3-token-r16")
    cache = StaticLatentCache(model, 3, 100)
    slots, rank_k, rank_v = 128, 11, 13  # 100 slots in whole groups of 64
    # codes in 8-code words of `bits` bytes: int2 11 codes in 4 bytes, int3 13 in 6; fp16 scale and low per
    # group (channel: per 64 slots and channel; token: per slot); an fp32 ring of 16 + 64 exact tokens
    keys = slots * 4 + 2 * 2 * (slots // 64) * rank_k + 80 * rank_k * 4
    values = slots * 6 + 2 * 2 * slots + 80 * rank_v * 4
    assert cache.nbytes == 2 * 3 * 2 * (keys + values) + 3 * 112 * 4 + 4  # positions: 100 rounded to 16
    with pytest.raises(ValueError, match="cannot be cropped"):
        cache.crop(10)
    # log8 scales: one uint8 code a group, no low, as the dynamic cache and the budget count them
    cache = StaticLatentCache(windowed_served("int4-token-log8", "int2-token-log8-r16"), 3, 100)
    keys = 112 * 8 + 112  # int4: 11 codes in two 8-code words of 4 bytes; one scale code a slot (112 slots)
    values = slots * 4 + slots + 80 * rank_v * 4  # int2 behind a window: whole groups of slots
    assert cache.nbytes == 2 * 3 * 2 * (keys + values) + 3 * 112 * 4 + 4  # positions: 100 rounded to 16


@pytest.mark.parametrize("specs", [("int2-channel-r16", "int3-token-r16"),
                                   ("int4-token-r40", "int8-token-r16")], ids=lambda s: "_".join(s))
def test_windowed_read_of_a_prefill_equals_the_whole_read(specs):
    """A prefill forward's read of a windowed store (``upto``: codes dequantized once, the exact tokens laid
    over the last ``window`` slots from the ring) gives the whole-buffer read's first slots, exact tokens
    included, after chunks that end inside a group and inside the window."""
    from stiefkv.static_cache import WindowedCodes

    model = windowed_served(*specs)
    ids, _ = prompt(batch=2, n=157, seed=4, padded=False)
    cache = StaticLatentCache(model, 2, 200)
    checked = 0
    for lo, hi in ((0, 70), (70, 101), (101, 157)):
        model(ids[:, lo:hi], past_key_values=cache, use_cache=True)
        for buf in (*cache.keys_buf, *cache.values_buf):
            if isinstance(buf, WindowedCodes):
                whole = buf.read(cache.filled, torch.float32)[:, :, :hi]
                part = buf.read(cache.filled, torch.float32, upto=hi)
                assert part.shape == whole.shape and not part.isnan().any()
                torch.testing.assert_close(part, whole, atol=0, rtol=0)  # the same values, moved
                checked += 1
    assert checked == 3 * 2 * len(cache.keys_buf)
