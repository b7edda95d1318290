"""Quantized latents (issue 13): packing, the quantizer against a float64 reference, the cache's stores and
bytes, the served model, the checkpoint format, the byte knapsack and the bad inputs.

Tolerances: the quantizer is compared with a float64 reference that rounds its scale and low to float16 as
the quantizer does; a code may differ by one where ``(x − low) / scale`` lies within float32 rounding of
a half step (allowed: at most 0.1 % of elements, off by exactly one step), and dequantized values of an
agreeing code match to 1e-6 relative in float32. A bf16/fp16 latent's dequantized output is compared after
the same cast. NaN never passes: every output is checked finite.
"""

import itertools
import json
import math

import pytest
import torch
from click.testing import CliRunner

import stiefkv
from stiefkv.cache import LatentStore
from stiefkv.calibrate.allocate import knapsack_options, smallest_budget, storage_dp
from stiefkv.calibrate.profile import LayerProfile, spreading_rotation
from stiefkv.evaluate import BASELINES, baseline_projections
from stiefkv.kernels._common import KERNEL_BITS
from stiefkv.models import dims_of
from stiefkv.projections import FORMAT_VERSION, CheckpointError, Projections
from stiefkv.quant import (
    CLIP_RATIOS,
    GROUP,
    LAYOUTS,
    LOG8_LARGEST,
    POSITION_BYTES,
    QUANT_BITS,
    QuantSpec,
    _pack_words,
    dequantize,
    fake_quant,
    log8_scale,
    pack,
    packed_bytes,
    quantize,
    unpack,
)
from tests.tiny import random_projections, tiny_model
from tests.utils import CharTokenizer, greedy_by_backend

SPECS = [QuantSpec(b, layout) for b in QUANT_BITS for layout in LAYOUTS]
MSE_SPECS = [QuantSpec(b, layout, mse=True) for b in (4, 3, 2) for layout in LAYOUTS]
# exact recent windows shorter, longer than and not a multiple of a group
RECENT_SPECS = [QuantSpec(4, "token", recent=7), QuantSpec(2, "channel", recent=37),
                QuantSpec(3, "channel", recent=GROUP), QuantSpec(2, "token", mse=True, recent=70)]
LOG8_SPECS = [QuantSpec(b, "token", log8=True) for b in QUANT_BITS] + [
    QuantSpec(2, "token", recent=9, log8=True)]
# exact tokens held in int8: a recent window, a filling channel group alone, both, with log8 and mse codes
WINDOW8_SPECS = [QuantSpec(2, "token", recent=9, log8=True, window8=True),
                 QuantSpec(4, "channel", window8=True), QuantSpec(3, "channel", recent=21, window8=True),
                 QuantSpec(2, "token", mse=True, recent=70, window8=True)]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def latents(shape, seed, dtype=torch.float32):
    """Latents with channels of very different ranges and a few outliers, as PCA latents have."""
    g = gen(seed)
    x = torch.randn(*shape, generator=g) * torch.logspace(0.5, -1, shape[-1])
    x[..., 0, 0] += 25.0
    return x.to(dtype)


@pytest.mark.parametrize("bits", QUANT_BITS)
@pytest.mark.parametrize("n", [1, 5, 8, 13, 64, 77])
def test_pack_round_trip(bits, n):
    codes = torch.randint(0, 2 ** bits, (3, 7, n), generator=gen(n * bits))
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape[-1] == packed_bytes(n, bits) == math.ceil(n / 8) * bits
    assert torch.equal(unpack(packed, bits, n), codes)
    assert torch.equal(packed, _pack_words(codes, bits))  # the byte-wise 8/4-bit paths: the same bytes


def reference_fake_quant(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Float64 min–max quantization of full groups, scale and low rounded to float16 first."""
    x = x.double()
    levels = 2 ** spec.bits - 1
    out = x.clone()
    N, r = x.shape[-2:]
    if spec.layout == "token":
        groups = [(slice(None), slice(c, min(r, c + GROUP))) for c in range(0, r, GROUP)]
        reduce = -1
    else:
        groups = [(slice(t, t + GROUP), slice(None)) for t in range(0, N // GROUP * GROUP, GROUP)]
        reduce = -2
    for rows, cols in groups:
        g = x[..., rows, cols]
        lo, hi = g.amin(reduce, keepdim=True), g.amax(reduce, keepdim=True)
        best, best_err = None, None
        for ratio in CLIP_RATIOS if spec.mse else (1.0,):  # every range the encoder may choose
            mid, half = (lo + hi) / 2, (hi - lo) / 2 * ratio
            c_lo = (mid - half).half().double()
            scale = ((mid + half - c_lo) / levels).half().double()
            step = torch.where(scale > 0, scale, torch.ones_like(scale))
            deq = torch.round((g - c_lo) / step).clamp(0, levels) * scale + c_lo
            err = (deq - g).pow(2).sum(reduce, keepdim=True)
            if best is None:
                best, best_err = deq, err
            else:
                best = torch.where(err < best_err, deq, best)
                best_err = torch.minimum(err, best_err)
        out[..., rows, cols] = best
    return out


@pytest.mark.parametrize("spec", SPECS + MSE_SPECS, ids=str)
@pytest.mark.parametrize("r", [13, 77])
def test_quantizer_matches_float64_reference(spec, r):
    N = 2 * GROUP + 19  # a float window of 19 tokens in the channel layout
    x = latents((2, 3, N, r), seed=r + spec.bits)
    got = fake_quant(x, spec)
    want = reference_fake_quant(x, spec)
    assert torch.isfinite(got).all()
    diff = (got.double() - want).abs()
    # where codes agree the values agree; a code off by one lies one step (the group's scale) away
    agree = diff <= 1e-6 * (1 + want.abs())
    if spec.mse:
        # two ranges whose errors tie within float32 rounding may be chosen either way, which changes a
        # whole group: require the error of the range chosen to be the least, to 1e-5, in every group
        dim = -1 if spec.layout == "token" else -2
        full = x[..., :N // GROUP * GROUP, :] if spec.layout == "channel" else x
        n = full.shape[-2]
        err_got = (got[..., :n, :].double() - full.double()).pow(2)
        err_want = (want[..., :n, :] - full.double()).pow(2)
        if spec.layout == "channel":
            err_got, err_want = err_got.unflatten(-2, (-1, GROUP)), err_want.unflatten(-2, (-1, GROUP))
        assert (err_got.sum(dim) <= err_want.sum(dim) * (1 + 1e-5) + 1e-9).all()
        assert agree.float().mean() >= 0.99, f"{(~agree).sum()} of {agree.numel()} differ"
    else:
        assert agree.float().mean() >= 0.999, f"{(~agree).sum()} of {agree.numel()} differ"
        assert (diff[~agree] <= diff.new_tensor(3 * 32.0 / 2 ** spec.bits) + 1e-6).all()
    if spec.layout == "channel":
        assert torch.equal(got[..., 2 * GROUP:, :], x[..., 2 * GROUP:, :])  # the window is untouched


def reference_log8(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """Float64 symmetric quantization per token group on the smallest scale 2^(j/8) (mantissa rounded to
    float16, j ≥ -112) ≥ 2·max|x| / levels, the low -scale · levels / 2 rounded to float16."""
    x = x.double()
    levels = 2 ** spec.bits - 1
    j = torch.arange(LOG8_LARGEST[spec.bits] + 1)  # larger steps clip: their low is no float16
    table = torch.tensor([2.0 ** (i / 8) for i in range(8)]).half().double()[j % 8] * 2.0 ** (j // 8 - 14)
    out = x.clone()
    for c in range(0, x.shape[-1], GROUP):
        g = x[..., c:c + GROUP]
        need = g.abs().amax(-1, keepdim=True) * 2 / levels
        scale = table[torch.searchsorted(table, need.contiguous()).clamp(max=len(table) - 1)]
        low = (-scale * levels / 2).half().double()
        out[..., c:c + GROUP] = torch.round((g - low) / scale).clamp(0, levels) * scale + low
    return out


@pytest.mark.parametrize("spec", LOG8_SPECS[:-1], ids=str)
@pytest.mark.parametrize("r", [13, 77])
def test_log8_quantizer_matches_float64_reference(spec, r):
    x = latents((2, 3, 41, r), seed=r + spec.bits) * 0.03  # small latents: scales below 1
    q = quantize(x, spec)
    assert q.low is None and q.scale.dtype == torch.uint8
    assert q.nbytes == q.codes.nbytes + q.scale.numel()  # one byte a group, no low
    got, want = dequantize(q).double(), reference_log8(x, spec)
    assert torch.isfinite(got).all()
    scale = q.float_scales()[0].double().repeat_interleave(GROUP, -1)[..., :r]
    # float32 dequantization (code · scale + low, the low levels/2 steps below zero) rounds to ~1e-7 of
    # levels · scale
    agree = (got - want).abs() <= 1e-6 * (want.abs() + (2 ** spec.bits) * scale)
    # a value at a half step may round either way in float32: then it is one step away
    assert agree.float().mean() >= 0.999, f"{(~agree).sum()} of {agree.numel()} differ"
    assert ((got - want).abs()[~agree] <= scale[~agree] * (1 + 1e-6)).all()
    # nothing clips beyond the float16 rounding of the low
    assert ((got - x.double()).abs() <= scale / 2 * (1 + 1e-3) + 2 ** -11 * x.abs().amax()).all()


def test_log8_scales_span_small_and_large_latents_and_zero_groups():
    for magnitude in (1e-5, 1.0, 1e3):
        x = latents((1, 2, 9, 24), seed=3) * magnitude
        for spec in LOG8_SPECS:
            err = (fake_quant(x, spec) - x).abs().amax(-1)
            rng = x.abs().amax(-1)
            assert torch.isfinite(err).all()
            # half a step of at most 2^(1/8) times the group's need (the steps floored at 2^-14), and the
            # float16 rounding of the low
            step = (rng * 2 / (2 ** spec.bits - 1) * 2 ** (1 / 8)).clamp(min=2.0 ** -14)
            assert (err <= step / 2 * (1 + 1e-3) + 2 ** -11 * rng).all(), (spec, magnitude)
    zero = torch.zeros(1, 1, 5, 16)
    assert (fake_quant(zero, LOG8_SPECS[0]).abs() <= 2.0 ** -14).all()
    # near float16's largest: the largest scale whose low is finite, the rest clips; never inf
    for spec in LOG8_SPECS[:-1]:  # (the last keeps these few tokens exact)
        x = torch.tensor([6.5e4, -2e4, 1.0, 3e5]).repeat(1, 1, 3, 1)
        got = fake_quant(x, spec)
        assert torch.isfinite(got).all() and (got.abs() <= 65504).all(), spec
        largest = log8_scale(torch.tensor(LOG8_LARGEST[spec.bits])).item()  # the step the 3e5 clamps to
        assert (got[..., :3] - x[..., :3]).abs().max() <= largest / 2 * (1 + 1e-3), spec
    # a group that is not finite comes back NaN (as float16 scales give), not as finite numbers
    bad = latents((1, 1, 4, 9), seed=2)
    bad[0, 0, 1, 3] = float("nan")
    bad[0, 0, 2, 0] = float("inf")
    got = fake_quant(bad, LOG8_SPECS[2])
    assert got[0, 0, 1:3].isnan().all() and torch.isfinite(got[0, 0, [0, 3]]).all()


def test_log8_quantization_copies_nothing_from_the_host(monkeypatch):
    """The static cache quantizes inside a captured CUDA graph, where a tensor built from host data (a copy
    to the device) is not allowed: log8 scales come from Python constants, not a tensor of them."""
    x = latents((1, 2, 9, 24), seed=4)
    want = [dequantize(quantize(x, spec)) for spec in LOG8_SPECS]

    def refuse(*args, **kwargs):
        raise AssertionError("torch.tensor called while quantizing")

    monkeypatch.setattr(torch, "tensor", refuse)
    for spec, w in zip(LOG8_SPECS, want):
        assert torch.equal(dequantize(quantize(x, spec)), w)


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float16, 1e-3)])
def test_quantizer_half_dtypes(dtype, tol):
    x = latents((1, 2, GROUP, 21), seed=5, dtype=dtype)
    for spec in SPECS:
        got = fake_quant(x, spec)
        assert got.dtype == dtype and torch.isfinite(got).all()
        want = reference_fake_quant(x.float(), spec).to(dtype).double()
        # one rounding of the output to dtype, or one quantization step apart (codes at a half step)
        err = (got.double() - want).abs()
        step = (x.float().amax() - x.float().amin()).item() / (2 ** spec.bits - 1)
        assert (err <= tol * want.abs() + 1e-3 + step * (err > tol * want.abs() + 1e-3)).all()


def test_quantization_error_is_within_half_a_step():
    x = latents((2, 2, 2 * GROUP, 40), seed=3)
    for spec in SPECS:
        q = quantize(x, spec)
        step = q.scale.float()
        step = step.repeat_interleave(GROUP, -1)[..., :40] if spec.layout == "token" \
            else step.repeat_interleave(GROUP, -2)
        err = (dequantize(q) - x).abs()
        assert torch.isfinite(err).all() and (err <= step / 2 + 1e-4 * x.abs() + 1e-5).all(), spec


def test_mse_encoder_never_loses_to_min_max_and_ignores_the_padding():
    for r, seed in ((13, 1), (77, 2), (64, 3)):
        x = latents((2, 3, 2 * GROUP, r), seed=seed)
        x = x + torch.randn(x.shape, generator=gen(seed)) ** 3
        for spec in MSE_SPECS:
            plain = QuantSpec(spec.bits, spec.layout)
            err, base = (fake_quant(x, spec) - x).pow(2), (fake_quant(x, plain) - x).pow(2)
            dim = -1 if spec.layout == "token" else -2
            if spec.layout == "token" and r > GROUP:  # compare group by group
                err, base = err[..., :GROUP], base[..., :GROUP]
            assert torch.isfinite(err).all()
            assert (err.sum(dim) <= base.sum(dim) * (1 + 1e-5) + 1e-9).all(), (spec, r)
            if spec.bits == 2:  # on heavy-tailed groups the search pays (about half the error at 2 bits)
                assert err.sum() < 0.8 * base.sum(), (spec, r)
        # the short last group (r mod GROUP channels) is encoded on its real channels only: padding with
        # copies of its last channel would weigh that channel more, which the reference does not
        spec = QuantSpec(2, "token", mse=True)
        torch.testing.assert_close(fake_quant(x, spec)[..., GROUP:].double(),
                                   reference_fake_quant(x[..., GROUP:], spec), rtol=0, atol=1e-6)


def test_spec_names_round_trip():
    for spec in SPECS + MSE_SPECS + RECENT_SPECS + LOG8_SPECS + WINDOW8_SPECS + [QuantSpec(16)]:
        assert QuantSpec.parse(str(spec)) == spec
    assert str(QuantSpec(2, "token", recent=16, log8=True, window8=True)) == "int2-token-log8-r16-w8"
    assert str(QuantSpec(2, "channel", window8=True)) == "int2-channel-w8"
    # nothing held exact (per token, no recent window), or a float latent: no window to hold
    assert QuantSpec(2, "token", window8=True) == QuantSpec(2, "token")
    assert QuantSpec(16, window8=True) == QuantSpec()
    assert str(QuantSpec(2, "token", recent=16, log8=True)) == "int2-token-log8-r16"
    assert QuantSpec(16, log8=True) == QuantSpec()
    for layout, mse in (("channel", False), ("token", True)):  # log8 is symmetric, per token, min–max
        with pytest.raises(ValueError, match="log8"):
            QuantSpec(2, layout, mse=mse, log8=True)
    assert QuantSpec(2, "token", log8=True).bytes_per_token(13, context=GROUP) == 2 * 2 + 1
    assert str(QuantSpec(2, "token", mse=True)) == "int2-token-mse"
    assert str(QuantSpec(2, "channel", mse=True, recent=64)) == "int2-channel-mse-r64"
    assert QuantSpec(16, "channel", mse=True, recent=9) == QuantSpec()
    assert str(QuantSpec(16, mse=True)) == "bf16"
    for bad in ("int4-token-fast", "int4-token-mse-x", "int-token", "float4", "int4-token-r", "int4-r64-mse"):
        with pytest.raises(ValueError):
            QuantSpec.parse(bad)


@pytest.mark.parametrize("spec", SPECS + MSE_SPECS + LOG8_SPECS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_round_trip_is_dequantize_of_quantize_bit_for_bit(spec, dtype):
    """The unpacked shortcut that calibration reads gives the stored cache's values exactly (odd rank, a
    short last channel group, a constant group, a zero group, huge and tiny magnitudes, NaN where the input
    has one)."""
    from stiefkv.quant import dequantize, quantize, round_trip

    x = latents((2, 3, 2 * GROUP, 77), seed=spec.bits + 3, dtype=dtype)
    x[0, 0, :GROUP] = 1.5  # constant groups (both layouts)
    x[0, 1, :GROUP] = 0.0
    x[1, 2, 5:9] *= 1e4 if dtype != torch.float16 else 1e2
    x[1, 1, 3:7] *= 1e-6
    x[1, 0, GROUP + 2, 40] = float("nan")
    x[1, 2, -3:] = -1e-9  # codes rounded from tiny negatives (−0 unless made +0)
    got, want = round_trip(x, spec), dequantize(quantize(x, spec), dtype)
    assert got.dtype == want.dtype == dtype
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan) and nan.any() and torch.isfinite(got[0]).all()
    bits = torch.int32 if dtype == torch.float32 else torch.int16  # bit for bit: the sign of zero too
    assert torch.equal(got[~nan].view(bits), want[~nan].view(bits))


def test_constant_groups_come_back_exactly():
    x = torch.full((1, 1, GROUP, 9), 3.25)
    for spec in SPECS + MSE_SPECS:
        assert torch.equal(fake_quant(x, spec), x)


def test_straight_through_gradient_is_identity():
    x = latents((1, 2, GROUP + 3, 11), seed=1).requires_grad_()
    for spec in SPECS + MSE_SPECS:
        (g,) = torch.autograd.grad((fake_quant(x, spec, straight_through=True) * 3).sum(), x)
        assert torch.equal(g, torch.full_like(x, 3.0))


STORE_SPECS = SPECS + MSE_SPECS[-2:] + RECENT_SPECS + LOG8_SPECS[-2:] + WINDOW8_SPECS


@pytest.mark.parametrize("spec", STORE_SPECS, ids=str)
def test_store_appends_in_chunks_as_one_quantization(spec):
    r, total = 19, 3 * GROUP + 29
    x = latents((2, 3, total, r), seed=spec.bits)
    store = LatentStore(spec)
    cuts = sorted(torch.randint(1, total, (6,), generator=gen(7)).tolist())
    for a, b in itertools.pairwise([0, *cuts, total]):
        if b > a:
            store.append(x[..., a:b, :])
    assert store.length == total
    assert torch.equal(store.read(x.dtype), fake_quant(x, spec))
    # a cut through a group keeps what was read before: exactly, or for an int8 window, codes brought back
    # to it within half an int8 step (log8 scales overshoot the largest magnitude by under 1/8 octave)
    before = store.read(x.dtype)
    for n in (total - 3, 2 * GROUP + 5, GROUP, 17):
        store.keep(n)
        assert store.length == n
        after, want = store.read(x.dtype), before[..., :n, :]
        if spec.window8:
            half_step = want.abs().amax(-1, keepdim=True) * 1.1 / 255
            assert ((after - want).abs() <= half_step).all()
        else:
            assert torch.equal(after, want)


@pytest.mark.parametrize("spec", STORE_SPECS, ids=str)
@pytest.mark.parametrize("r,N", [(13, 2 * GROUP), (77, 3 * GROUP + 10), (8, 100), (5, 30)])
def test_store_bytes_equal_the_accounting(spec, r, N):
    store = LatentStore(spec)
    store.append(latents((1, 1, N, r), seed=r, dtype=torch.bfloat16))
    assert store.nbytes == pytest.approx(spec.bytes_per_token(r, context=N) * N, abs=1e-9)


def quantized_projections(model, rk=13, rv=11, specs=None):
    proj = random_projections(model, rk, rv)
    proj.quant = specs or [(QuantSpec(4, "token"), QuantSpec(3, "token")),
                           (QuantSpec(16), QuantSpec(2, "token"))]
    return Projections(keys=proj.keys, values=proj.values, key_mode=proj.key_mode,
                       fingerprint=proj.fingerprint, budget=proj.budget, method="random", quant=proj.quant)


def decode_logits(model, ids, prefill):
    cache = stiefkv.LatentCache()
    steps = [model(ids[:, :prefill], use_cache=True, past_key_values=cache).logits]
    for t in range(prefill, ids.shape[1]):
        steps.append(model(ids[:, t:t + 1], use_cache=True, past_key_values=cache).logits)
    return torch.cat(steps, 1), cache


@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
def test_cached_decoding_matches_full_forward_per_token(key_mode):
    """Per-token storage quantizes each token on arrival: cached decoding sees what one full forward sees."""
    model = tiny_model()
    proj = quantized_projections(model)
    proj.key_mode = key_mode
    stiefkv.load(model, proj)
    ids = torch.randint(0, 97, (2, 41), generator=gen(0))
    full = model(ids, use_cache=False).logits
    inc, cache = decode_logits(model, ids, 20)
    assert torch.isfinite(inc).all()
    torch.testing.assert_close(inc, full, rtol=1e-4, atol=1e-4)
    assert cache.get_seq_length() == 41


@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("specs", [
    [(QuantSpec(4, "channel"), QuantSpec(2, "channel")), (QuantSpec(3, "token"), QuantSpec(16))],
    [(QuantSpec(4, "token", recent=5), QuantSpec(2, "channel", recent=37)),
     (QuantSpec(2, "channel", recent=GROUP), QuantSpec(3, "token", mse=True, recent=70))],
    [(QuantSpec(4, "token", recent=5, window8=True), QuantSpec(2, "channel", recent=37, window8=True)),
     (QuantSpec(2, "channel", window8=True), QuantSpec(3, "token", log8=True, recent=70, window8=True))],
], ids=["windowless", "recent", "window8"])
def test_decoding_token_by_token_matches_one_forward_for_every_layout(key_mode, specs, monkeypatch):
    """A token is quantized once newer tokens pass it (a filling group, the recent window), so the keys a
    query reads exact depend on when it was decoded. One forward computes that band of exact keys: it must
    give what decoding the same tokens one by one gives, at every step and in every layer, and so must a
    prefill in uneven chunks."""
    model = tiny_model()
    proj = quantized_projections(model, specs=specs)
    proj.key_mode = key_mode
    stiefkv.load(model, proj)
    ids = torch.randint(0, 97, (2, 2 * GROUP + 23), generator=gen(1))
    full = model(ids, use_cache=False).logits
    inc, cache = decode_logits(model, ids, 50)
    assert torch.isfinite(inc).all()
    torch.testing.assert_close(inc, full, rtol=2e-4, atol=2e-4)
    assert cache.get_seq_length() == ids.shape[1]
    chunked = stiefkv.LatentCache()
    parts = [model(ids[:, a:b], use_cache=True, past_key_values=chunked).logits
             for a, b in itertools.pairwise([0, 3, 70, 71, 140, ids.shape[1]])]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=2e-4, atol=2e-4)
    # the band matters: reading every key as the cache holds it after the forward gives other logits
    monkeypatch.setattr(stiefkv.attention, "exact_band", lambda *a: None)
    assert (model(ids, use_cache=False).logits - full).abs().max() > 1e-2


@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
def test_calibration_layer_path_reads_the_int8_window_as_the_served_model(key_mode, monkeypatch):
    """Calibration's differentiable layer (``attention_block``) over ``-w8`` storages gives the served
    attention's output for a forward longer than the window: its exact band reads the int8 values a cache
    holds, not the float latents (which would give other outputs). On qwen3 (query and key norms): serving
    folds no key basis into its ``k_proj`` there, whose other rounding could move a latent across a 2-bit
    code's edge."""
    from stiefkv.attention import LowRankAttention
    from stiefkv.layers import attention_block
    from stiefkv.models import rope_spec

    model = tiny_model("qwen3")
    proj = random_projections(model, 13, 11, key_mode)
    quant = (QuantSpec(2, "channel", recent=5, window8=True), QuantSpec(3, "token", recent=9, log8=True,
                                                                          window8=True))
    attn = model.model.layers[1].self_attn
    served = LowRankAttention(attn, proj.keys[1], proj.values[1], key_mode=key_mode,
                              rope=rope_spec(model.config), backend="reference", quant=quant)
    x = torch.randn(2, GROUP + 37, model.config.hidden_size, generator=gen(3))
    pos = torch.arange(x.shape[1])[None].expand(2, -1)
    pe = model.model.rotary_emb(x, pos)

    def layer_path():
        return attention_block(attn, x, proj.keys[1], proj.values[1], key_mode=key_mode,
                               rope=rope_spec(model.config), position_embeddings=pe, positions=pos,
                               quant=quant)

    with torch.no_grad():
        want, _ = served(x, position_embeddings=pe, position_ids=pos)
        got = layer_path()
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
        monkeypatch.setattr(stiefkv.layers, "held_exact", lambda z, spec, **kw: z)  # the band's floats
        assert (layer_path() - want).abs().max() > 1e-4


def test_band_inputs_are_checked_and_float_latents_need_none():
    from stiefkv.kernels import ExactTail
    from stiefkv.kernels.reference import lowrank_attention
    from stiefkv.layers import exact_band

    g = gen(6)
    q, zk, zv = torch.randn(1, 4, 9, 16, generator=g), torch.randn(1, 2, 9, 5), torch.randn(1, 2, 9, 3)
    P_k, P_v = torch.linalg.qr(torch.randn(2, 16, 5))[0], torch.linalg.qr(torch.randn(2, 16, 3))[0]
    frm = torch.full((9,), 4)
    for bad, message in ((ExactTail(zk[:, :, 4:], zv[:, :, 3:], frm, frm), "same last Ne"),
                         (ExactTail(zk[:, :, 4:], zv[:, :, 4:], frm[:5], frm), r"key_from must be \[Nq\]"),
                         (ExactTail(zk[:, :, 4:], zv[:, :, 4:], frm - 1, frm), "at least Nk − Ne = 4")):
        with pytest.raises(ValueError, match=message):
            lowrank_attention(q, zk, zv, P_k, P_v, key_mode="post_rope", exact=bad)
    # a float latent beside a quantized one reads no tail: the band starts at the quantized one's
    quant = (QuantSpec(), QuantSpec(4, recent=3))
    band = exact_band(quant, 9, (zk, zv), ((zk, 0), (zv, 0)))
    assert (band.key_from == 9).all() and torch.equal(band.value_from, (torch.arange(9) - 2).clamp(min=0))
    assert exact_band(quant, 1, (zk, zv), ((zk, 0), (zv, 0))) is None  # one query reads the cache as it is


def test_a_prefill_leaves_no_exact_copy_behind():
    """After a prefill the stores hold what the accounting counts: the exact latents the band needed are
    handed over once, and the recent window is its own tensor, not a view of the whole prefill."""
    model = tiny_model(dtype=torch.bfloat16)
    stiefkv.load(model, quantized_projections(model, specs=[(QuantSpec(2, recent=16), QuantSpec(16))] * 2))
    cache = stiefkv.LatentCache()
    model(torch.randint(0, 97, (1, 300), generator=gen(8)), use_cache=True, past_key_values=cache)
    for layer in cache.layers:
        store = layer.stores[0]
        assert store.tail is None and store.window.untyped_storage().nbytes() == store.window.nbytes
        assert store.held == 300 - 16


def test_banded_reference_matches_attention_query_by_query():
    """The reference's band against attention written out per query: keys below ``key_from[i]`` quantized,
    from it on exact (values likewise), with GQA, left padding and a key bias; float32 and bfloat16."""
    from stiefkv.kernels import ExactTail, RopeSpec
    from stiefkv.kernels.reference import lowrank_attention, rebuild_keys

    g = gen(5)
    B, H, G, d, rk, rv, Nk, Nq, Ne = 2, 6, 3, 16, 7, 5, 29, 11, 17
    rope = RopeSpec(1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)))
    P_k = torch.linalg.qr(torch.randn(G, d, rk, generator=g))[0]
    P_v = torch.linalg.qr(torch.randn(G, d, rv, generator=g))[0]
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        q = torch.randn(B, H, Nq, d, generator=g).to(dtype)
        zk, zv = torch.randn(B, G, Nk, rk, generator=g), torch.randn(B, G, Nk, rv, generator=g)
        ek, ev = torch.randn(B, G, Ne, rk, generator=g), torch.randn(B, G, Ne, rv, generator=g)
        positions = torch.arange(Nk)[None].expand(B, Nk) + torch.tensor([[0], [4]])
        lengths, bias = torch.tensor([Nk, Nk - 4]), torch.randn(B, G, Nk, generator=g)
        key_from = torch.randint(Nk - Ne, Nk + 1, (Nq,), generator=g)
        value_from = torch.randint(Nk - Ne, Nk + 1, (Nq,), generator=g)
        for key_mode in ("pre_rope", "post_rope"):
            out = lowrank_attention(q, zk.to(dtype), zv.to(dtype), P_k, P_v, key_mode=key_mode,
                                    positions=positions, rope=rope, bias=bias, lengths=lengths,
                                    exact=ExactTail(ek.to(dtype), ev.to(dtype), key_from, value_from))
            assert torch.isfinite(out).all()
            want = torch.zeros(B, H, Nq, d, dtype=torch.float64)
            for i in range(Nq):
                k_i, v_i = zk.to(dtype).float().clone(), zv.to(dtype).float().clone()
                use_k = torch.arange(Nk - Ne, Nk) >= key_from[i]
                use_v = torch.arange(Nk - Ne, Nk) >= value_from[i]
                k_i[:, :, Nk - Ne:][:, :, use_k] = ek.to(dtype).float()[:, :, use_k]
                v_i[:, :, Nk - Ne:][:, :, use_v] = ev.to(dtype).float()[:, :, use_v]
                keys = rebuild_keys(k_i, P_k, key_mode="pre_rope", positions=positions, rope=rope)
                if key_mode == "post_rope":
                    keys = torch.einsum("bgnr,gdr->bgnd", k_i, P_k)
                keys = keys.double().repeat_interleave(H // G, 1)
                logits = torch.einsum("bhd,bhkd->bhk", q[:, :, i].double(), keys) * d**-0.5
                logits = logits + bias.double().repeat_interleave(H // G, 1)
                hidden = (torch.arange(Nk) > Nk - Nq + i)[None, None] | (
                    torch.arange(Nk)[None] < (Nk - lengths)[:, None])[:, None]
                p = logits.masked_fill(hidden, float("-inf")).softmax(-1)
                values = torch.einsum("bgnr,gdr->bgnd", v_i.double(), P_v.double())
                values = values.repeat_interleave(H // G, 1)
                want[:, :, i] = torch.einsum("bhk,bhkd->bhd", p, values)
            torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


def test_cache_nbytes_counts_everything():
    model = tiny_model(dtype=torch.bfloat16)
    specs = [(QuantSpec(4, "channel"), QuantSpec(3, "token")), (QuantSpec(16), QuantSpec(8, "channel"))]
    stiefkv.load(model, quantized_projections(model, specs=specs))
    for N in (2 * GROUP, 2 * GROUP + 21):
        cache = stiefkv.LatentCache()
        model(torch.randint(0, 97, (1, N), generator=gen(N)), use_cache=True, past_key_values=cache)
        proj = stiefkv.attention.projections_of(model)
        assert cache.nbytes == pytest.approx(proj.kv_bytes_per_token(context=N) * N)


def test_generate_greedy_and_beams_on_quantized_latents():
    model = tiny_model()
    stiefkv.load(model, quantized_projections(model))
    ids = torch.randint(1, 97, (2, 9), generator=gen(2))
    cached = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    plain = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0, use_cache=False)
    assert torch.equal(cached, plain)
    beams = model.generate(ids, max_new_tokens=6, do_sample=False, num_beams=3, pad_token_id=0)
    assert beams.shape == (2, 15)


@pytest.mark.parametrize("mixed", [False, True])
@pytest.mark.parametrize("size", [-12, 13, 0, 40, -40])
def test_crop_then_continue_matches_a_fresh_prefill(mixed, size):
    """Either reading of crop's argument (transformers ≥ 5.24: tokens to remove; earlier: the length to
    keep) crops every layer alike. A checkpoint of quantized and float layers had its quantized layers
    cropped to a positive length, then failed in transformers' float layers, the cache left half cut."""
    model = tiny_model()
    specs = [(QuantSpec(4, "token"), QuantSpec(3, "token")), (QuantSpec(16), QuantSpec(16))]
    specs = specs if mixed else None
    stiefkv.load(model, quantized_projections(model, specs=specs))
    ids = torch.randint(0, 97, (1, 30), generator=gen(4))
    _, cache = decode_logits(model, ids, 25)
    cache.crop(size)
    keep = {-12: 18, 13: 13, 0: 30, 40: 30, -40: 0}[size]  # of the 30 held
    assert cache.get_seq_length() == keep and cache.positions.shape[1] == keep
    assert all(layer.get_seq_length() == keep for layer in cache.layers)
    if 0 < keep < 30:
        nxt = model(ids[:, keep:keep + 1], use_cache=True, past_key_values=cache).logits
        fresh = model(ids[:, :keep + 1], use_cache=False).logits[:, -1:]
        torch.testing.assert_close(nxt, fresh, rtol=1e-4, atol=1e-4)


def test_quantized_checkpoint_round_trip_and_versions(tmp_path):
    model = tiny_model()
    proj = quantized_projections(model)
    path = proj.save(tmp_path / "q.safetensors")
    back = Projections.load(path)
    assert back.specs == proj.specs and back.header()["format_version"] == 3
    assert back.header()["quant"][0] == ["int4-token", "int3-token"]
    plain = random_projections(model, 8, 8)
    assert plain.header()["format_version"] == 2 and "quant" not in plain.header()  # older readers take it
    newer = FORMAT_VERSION + 1
    with pytest.raises(CheckpointError, match=f"version {newer}; this StiefKV reads up to {FORMAT_VERSION}"):
        _edited(tmp_path, path, lambda h: h.update(format_version=newer))
    with pytest.raises(CheckpointError, match="'quant' in a format version 2"):
        _edited(tmp_path, path, lambda h: h.update(format_version=2))
    with pytest.raises(CheckpointError, match="bits must be one of"):
        _edited(tmp_path, path, lambda h: h["quant"].__setitem__(0, ["int5-token", "bf16"]))
    # each storage feature needs the version that introduced it: earlier readers would misread it
    mse_values = (QuantSpec(4), QuantSpec(3, "token", mse=True))
    features = [  # (specs, version, layer, its names, how a file one version older is refused)
        ([(QuantSpec(2, "channel", mse=True), QuantSpec(16)), mse_values],
         4, 1, ["int4-token", "int3-token-mse"], "an -mse storage in a format version 3 file"),
        ([(QuantSpec(2, "channel", recent=64), QuantSpec(16)), mse_values],
         5, 0, ["int2-channel-r64", "bf16"], r"exact recent tokens \(-r\) in a format version 4 file"),
        ([(QuantSpec(2, "channel", recent=16), QuantSpec(16)),
          (QuantSpec(4), QuantSpec(2, "token", recent=16, log8=True))],
         6, 1, ["int4-token", "int2-token-log8-r16"], "log8 scales in a format version 5 file"),
        ([(QuantSpec(2, "channel", recent=16, window8=True), QuantSpec(16)),
          (QuantSpec(4), QuantSpec(2, "token", recent=16, log8=True))],
         7, 0, ["int2-channel-r16-w8", "bf16"], r"int8 exact tokens \(-w8\) in a format version 6 file"),
    ]
    for specs, version, layer, names, refusal in features:
        proj = quantized_projections(model, specs=specs)
        path = proj.save(tmp_path / f"v{version}.safetensors")
        back = Projections.load(path)
        assert back.specs == proj.specs and back.header()["format_version"] == version
        assert back.header()["quant"][layer] == names
        with pytest.raises(CheckpointError, match=refusal):
            _edited(tmp_path, path, lambda h, v=version: h.update(format_version=v - 1))


def _edited(tmp_path, path, edit):
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        header = json.loads(f.metadata()["stiefkv"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(header)
    out = tmp_path / "edited.safetensors"
    save_file(tensors, str(out), metadata={"stiefkv": json.dumps(header)})
    return Projections.load(out)


def test_knapsack_options_is_exact():
    g = gen(9)
    for trial in range(30):
        groups = [[(int(torch.randint(1, 7, (1,), generator=g)), float(torch.rand(1, generator=g)))
                   for _ in range(int(torch.randint(1, 7, (1,), generator=g)))] for _ in range(4)]
        capacity = int(torch.randint(4, 20, (1,), generator=g))
        feasible = [c for c in itertools.product(*[range(len(o)) for o in groups])
                    if sum(groups[i][j][0] for i, j in enumerate(c)) <= capacity]
        if not feasible:
            with pytest.raises(ValueError):
                knapsack_options(groups, capacity)
            continue
        best = min(sum(groups[i][j][1] for i, j in enumerate(c)) for c in feasible)
        got = knapsack_options(groups, capacity)
        assert sum(groups[i][j][0] for i, j in enumerate(got)) <= capacity
        assert sum(groups[i][j][1] for i, j in enumerate(got)) == pytest.approx(best)


def test_knapsack_frontier_keeps_only_options_nothing_beats():
    from calibrate.allocate import frontier

    options = [(5, 0.3), (3, 0.5), (5, 0.2), (7, 0.2), (2, 0.9), (3, 0.5), (9, 0.0), (4, float("nan"))]
    # (5, 0.3) costs as much as (5, 0.2) for more error; the second (3, 0.5) repeats the first; NaN never
    # wins; (7, 0.2) stays: as good as (5, 0.2), and a tie goes to the more cost used
    assert frontier(options) == [1, 2, 3, 4, 6]


def _knapsack_every_option(groups, capacity):
    """The knapsack as it was before the frontier: every option of every group, in index order."""
    import numpy as np

    best = np.full(capacity + 1, np.inf)
    best[0] = 0.0
    picks = []
    for options in groups:
        new = np.full(capacity + 1, np.inf)
        pick = np.full(capacity + 1, -1, dtype=np.int32)
        for j, (cost, err) in enumerate(options):
            if cost <= capacity:
                cand = best[: capacity + 1 - cost] + err
                better = cand < new[cost:]
                new[cost:][better] = cand[better]
                pick[cost:][better] = j
        best = new
        picks.append(pick)
    c = int(np.flatnonzero(best == best.min()).max())
    chosen = []
    for options, pick in zip(reversed(groups), reversed(picks)):
        chosen.append(int(pick[c]))
        c -= options[chosen[-1]][0]
    return chosen[::-1]


def test_knapsack_over_the_frontier_chooses_as_over_every_option():
    """Errors from a few values (ties everywhere, as KL profiles clamped at 0 give): the same choice, not
    only the same summed error, as the knapsack over every option."""
    g = gen(4)
    def draw(high):
        return int(torch.randint(0, high, (1,), generator=g))

    def option():
        return 1 + draw(8), draw(4) / 4

    for trial in range(200):
        groups = [[option() for _ in range(1 + draw(7))] for _ in range(5)]
        capacity = 5 + draw(25)
        if sum(min(c for c, _ in o) for o in groups) > capacity:
            continue  # nothing fits: test_knapsack_options_is_exact checks the error
        assert knapsack_options(groups, capacity) == _knapsack_every_option(groups, capacity), groups


def fake_profile(d=32, step=8, rank_cost=1.0, quant_cost=0.01):
    ranks = list(range(step, d + 1, step))
    prof = LayerProfile(ranks=ranks, metric="kl")
    for which in "kv":
        setattr(prof, which, [rank_cost * (d - r) / d for r in ranks])
        prof.quant[which] = {str(s): [rank_cost * (d - r) / d + quant_cost * 2 ** (8 - s.bits) for r in ranks]
                             for s in SPECS}
    return prof


def test_storage_dp_stays_in_budget_and_can_answer_quantization_only():
    G, d, L = 2, 32, 3
    full = L * G * 2 * d * 2
    specs = SPECS + [QuantSpec(16)]
    for budget in (0.5, 0.25, 0.14):
        ranks, quant = storage_dp([fake_profile()] * L, budget, G, d, 8, specs)
        proj_bytes = sum(G * (qk.bytes_per_token(rk) + qv.bytes_per_token(rv))
                         for (rk, rv), (qk, qv) in zip(ranks, quant)) + 4
        assert proj_bytes <= budget * full
    # rank is expensive, bits are cheap: full rank at some bit width everywhere
    ranks, quant = storage_dp([fake_profile(rank_cost=100.0)] * L, 0.3, G, d, 8, specs)
    assert all(r == (d, d) for r in ranks) and all(q.quantized for pair in quant for q in pair)
    floor = smallest_budget(L, G, d, 8, specs)
    with pytest.raises(ValueError, match=f"{floor:.4g}"):
        storage_dp([fake_profile()] * L, floor * 0.9, G, d, 8, specs)


def test_storage_dp_coarsens_huge_knapsacks_and_stays_in_budget(monkeypatch):
    """Exact bytes with a window of 5 tokens make 16.8 M knapsack units at Llama-3-8B's shapes and 50 %: the
    allocation coarsens them beyond MAX_UNITS (lowered here so the test is quick), rounding costs up, and
    the choice still fits the budget."""
    import stiefkv.calibrate.allocate as allocate

    G, d, L = 8, 128, 32
    specs = [QuantSpec(b, layout, recent=5) for b in QUANT_BITS for layout in LAYOUTS] + [QuantSpec(16)]
    prof = fake_profile(d=d)
    for which in "kv":
        prof.quant[which] = {str(s): [e + 0.01 * 2 ** (8 - s.bits) for e in getattr(prof, which)]
                             for s in specs}
    for max_units in (1 << 12, 1 << 14):
        monkeypatch.setattr(allocate, "MAX_UNITS", max_units)
        ranks, quant = storage_dp([prof] * L, 0.5, G, d, 8, specs)
        used = sum(G * (qk.cache_bytes(rk) + qv.cache_bytes(rv)) for (rk, rv), (qk, qv) in zip(ranks, quant))
        full = L * G * 2 * d * 2 * 2048
        assert used + 4 * 2048 <= 0.5 * full and used > 0.45 * full  # in budget, and not wasted by rounding


def test_spreading_rotation_is_orthogonal_and_flat():
    for r in (8, 24, 64, 40):
        R = spreading_rotation(r).double()
        torch.testing.assert_close(R.T @ R, torch.eye(r, dtype=torch.float64), atol=1e-6, rtol=0)
        assert R.abs().max() <= (2 / r) ** 0.5 + 1e-6


def test_calibrate_auto_fits_the_budget_and_bits16_stays_bf16(corpus):
    pytest.importorskip("geoopt")  # the GPU image has none
    common = {"data": str(corpus), "num_sequences": 6, "seq_len": 70, "seed": 1, "steps": 4,
              "step_sequences": 2, "profile_sequences": 2}
    for budget in (0.3, 0.12):
        proj = stiefkv.calibrate(tiny_model(), CharTokenizer(), budget=budget, **common)
        assert proj.quantized and proj.kv_bytes_per_token() <= budget * 2 * 2 * 2 * 24 * 2 + 1e-9
        assert proj.settings["bits"] == "auto"
    plain = stiefkv.calibrate(tiny_model(), CharTokenizer(), budget=0.5, bits=16, **common)
    assert not plain.quantized and plain.achieved_budget <= 0.5
    # the least-squared-error encoder on the values only: keys never carry it, ≤ 4-bit values always do
    vmse = stiefkv.calibrate(tiny_model(), CharTokenizer(), budget=0.12, mse="values", **common)
    assert vmse.kv_bytes_per_token() <= 0.12 * 2 * 2 * 2 * 24 * 2 + 1e-9
    assert not any(qk.mse for qk, _ in vmse.specs)
    assert all(qv.mse == (qv.bits <= 4) for _, qv in vmse.specs)
    with pytest.raises(ValueError, match="mse must be one of none, values, all"):
        stiefkv.calibrate(tiny_model(), CharTokenizer(), budget=0.12, mse="keys", **common)


def test_baselines_are_identity_bases_with_quantized_storage():
    model = tiny_model()
    for name, (qk, qv) in BASELINES.items():
        proj = baseline_projections(model, name)
        assert proj.ranks == [(24, 24)] * 2 and proj.specs == [(qk, qv)] * 2
        assert proj.kv_bytes_per_token() == pytest.approx(2 * 2 * (qk.bytes_per_token(24)
                                                                    + qv.bytes_per_token(24)) + 4)


def test_cli_rejects_unsupported_bits_and_budgets_below_the_smallest(tmp_path, monkeypatch):
    pytest.importorskip("geoopt")
    from stiefkv.cli import main

    monkeypatch.setattr(stiefkv, "load_model", lambda spec, **kw: (tiny_model(), CharTokenizer()))
    out = tmp_path / "new" / "folder" / "c.safetensors"  # nothing written: not even its folder
    floor = "below the smallest cache --bits auto can make for this model: 0.0"  # and names it
    for args, message in ((["--bits", "5"], "bits must be one of 16, 8, 4, 3, 2, auto; got '5'"),
                          (["--budget", "0.01"], floor)):
        result = CliRunner().invoke(main, ["calibrate", "tiny", "-o", str(out), *args])
        lines = [x for x in result.output.splitlines() if x.strip() and not x.startswith(("INFO", "WARN"))]
        assert result.exit_code == 2 and len(lines) == 1 and message in lines[0], result.output
        assert list(tmp_path.iterdir()) == [], list(tmp_path.rglob("*"))
    # --bits auto is suggested where it fits the budget (tiny model: floors 0.067 auto and int2, 0.19 int8)
    for bits, budget, suggested in (("8", "0.1", True), ("2", "0.05", False)):
        result = CliRunner().invoke(main, ["calibrate", "tiny", "-o", str(out), "--bits", bits,
                                           "--budget", budget])
        assert result.exit_code == 2 and f"--bits {bits} can make" in result.output
        assert ("(--bits auto)" in result.output) is suggested, result.output


def test_recent_tokens_are_checked_and_counted_in_the_smallest_budget(tmp_path, monkeypatch):
    from stiefkv.calibrate.allocate import smallest_budget
    from stiefkv.calibrate.pipeline import CalibrationConfig, storages
    from stiefkv.cli import main

    for bad in (-1, 2.5, "16"):
        with pytest.raises(ValueError, match="recent must be an integer ≥ 0"):
            CalibrationConfig(recent=bad).validate()
    with pytest.raises(ValueError, match="profile_storages must be one of all, anchors"):
        CalibrationConfig(profile_storages="some").validate()
    with pytest.raises(ValueError, match="recent .* must be an integer ≥ 0"):
        QuantSpec(4, recent=-2)
    # exact tokens cost bytes: the smallest cache grows with them (a per-channel cache of 2048 tokens holds
    # its last 64 exact for any recent from 1 to 64: groups quantize whole)
    floors = [smallest_budget(30, 3, 64, 8, storages(CalibrationConfig(recent=w).validate()))
              for w in (0, 16, 64, 65)]
    assert floors[0] < floors[1] == floors[2] < floors[3]
    monkeypatch.setattr(stiefkv, "load_model", lambda spec, **kw: (tiny_model(), CharTokenizer()))
    out = tmp_path / "c.safetensors"
    result = CliRunner().invoke(main, ["calibrate", "tiny", "-o", str(out), "--recent", "-3"])
    assert result.exit_code == 2 and "--recent" in result.output and not out.exists()


def test_uniform_allocation_records_the_bf16_latents_it_stores(corpus):
    from stiefkv.calibrate.pipeline import CalibrationConfig

    assert CalibrationConfig(allocation="uniform").validate().bits == "16"  # not the default's auto
    assert CalibrationConfig(allocation="uniform", bits="16").validate().bits == "16"
    assert CalibrationConfig().validate().bits == "auto"
    proj = stiefkv.calibrate(tiny_model(layers=2), CharTokenizer(), data=str(corpus), method="pca",
                             allocation="uniform", num_sequences=2, seq_len=17)
    assert proj.settings["bits"] == "16" and all(k is None or not k.quantized for pair in proj.specs
                                                 for k in pair)


@pytest.mark.parametrize("bits, budget, shared, kernel", [(4, 0.25, False, False), (8, 0.4, False, True),
                                                        (2, 0.2, True, False)])
def test_uniform_allocation_at_a_fixed_width(corpus, bits, budget, shared, kernel):
    """``allocation="uniform"`` with a fixed width: every latent at it in per-token groups (no window with
    ``kernel_storage``), one rank everywhere, the largest whose bytes fit the budget; the model it serves
    runs."""
    from stiefkv.calibrate import allocate
    from stiefkv.calibrate.pipeline import CalibrationConfig

    model = tiny_model(layers=2)
    step = 4
    cfg = dict(data=str(corpus), method="pca", allocation="uniform", bits=bits, budget=budget, rank_step=step,
               num_sequences=2, seq_len=17, share_heads=shared, kernel_storage=kernel)
    proj = stiefkv.calibrate(model, CharTokenizer(), **cfg)
    assert proj.settings["bits"] == str(bits) and len(set(proj.ranks)) == 1
    default = CalibrationConfig(budget=budget).validate()  # the exact window, held in int8 by default
    spec = QuantSpec(bits, "token", recent=0 if kernel else default.recent,
                     window8=default.window8 and not kernel)
    assert all(pair == (spec, spec) for pair in proj.specs), proj.specs
    dims = dims_of(model.config)
    full = allocate.cache_bytes(dims.L, dims.G, dims.d)
    assert proj.kv_bytes_per_token() <= budget * full + 1e-6
    R, heads = proj.ranks[0][0], dims.G if shared else 1
    if R < heads * dims.d:  # a step more would not have fit
        copies = 1 if shared else dims.G
        more = dims.L * copies * 2 * spec.bytes_per_token(R + heads * step) + POSITION_BYTES
        assert more > budget * full, (R, more, budget * full)
    stiefkv.load(model, proj)
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(3, 90, (2, 30))).logits).all()
    with pytest.raises(ValueError, match=f"below the smallest cache of {spec} keys"):
        allocate.uniform_storage(2, 2, 24, step, 0.01, spec, spec)


def test_the_default_recent_window_follows_the_budget():
    from stiefkv.calibrate.pipeline import CalibrationConfig, default_recent, storages

    # 16 exact tokens, 8 below a budget of 0.1; a given recent always wins
    assert [CalibrationConfig(budget=b).validate().recent for b in (1.0, 0.5, 0.1, 0.09375, 0.0625)] == [
        16, 16, 16, 8, 8]
    assert [CalibrationConfig(budget=b, recent=w).validate().recent for b, w in ((0.0625, 16), (0.5, 8),
                                                                                 (0.0625, 0))] == [16, 8, 0]
    assert default_recent(0.0999) == 8 and default_recent(0.1) == 16
    # the storages the knapsack chooses among carry the resolved window
    specs = storages(CalibrationConfig(budget=0.0625).validate())
    assert {s.recent for s in specs["k"] + specs["v"] if s.quantized} == {8}
    # kernel_storage keeps no window whatever the default, and refuses one asked for that is not a default
    for b, w in ((0.0625, None), (0.0625, 8), (0.5, 16)):
        specs = storages(CalibrationConfig(budget=b, recent=w, kernel_storage=True).validate())
        assert not any(s.recent for s in specs["k"] + specs["v"])
    with pytest.raises(ValueError, match="kernel_storage keeps no exact recent tokens"):
        CalibrationConfig(kernel_storage=True, recent=8).validate()
    with pytest.raises(ValueError, match="recent must be an integer"):
        CalibrationConfig(recent=True).validate()


def test_sequences_too_short_to_quantize_a_storage_leave_it_out(caplog):
    """Found by a user: ``--bits auto --seq-len 40`` chose 2-bit channel codes. A channel group is quantized
    only once 64 tokens older than the ``recent`` exact ones have come (80 by default), so shorter calibration
    sequences measured no error for it and the knapsack took it at its fewest bits, for free. Such storages
    are now left out of the choice, with a warning; a fixed width none of whose storages the sequences
    quantize is refused."""
    from stiefkv.calibrate.pipeline import CalibrationConfig, storages

    def layouts(**kw):
        specs = storages(CalibrationConfig(**kw).validate())
        return {s.layout for s in specs["k"] + specs["v"] if s.quantized}

    assert layouts(seq_len=79) == {"token"} and layouts(seq_len=80) == {"token", "channel"}
    assert layouts(seq_len=71, budget=0.0625) == {"token"} and layouts(seq_len=72, budget=0.0625) == {
        "token", "channel"}  # 8 exact tokens below a 10 % budget
    assert layouts(seq_len=16) == set() and layouts(seq_len=17) == {"token"}
    assert storages(CalibrationConfig(seq_len=16, bits="16").validate()) is None
    seqs = torch.randint(3, 97, (4, 40), generator=torch.Generator().manual_seed(0))
    kw = dict(budget=0.25, method="pca", profile_sequences=2)
    with caplog.at_level("WARNING", logger="stiefkv.calibrate.pipeline"):
        proj = stiefkv.calibrate(tiny_model(), None, sequences=seqs, **kw)
    assert all(s.layout == "token" for pair in proj.specs for s in pair if s.quantized)
    assert "seq_len 40 quantizes no token of the channel storages" in caplog.text
    assert "seq_len 80 or more offers them" in caplog.text
    with pytest.raises(ValueError, match=r"^seq_len 12 quantizes no token of the bits 2 storages .* "
                                         r"use seq_len 17 or more"):
        stiefkv.calibrate(tiny_model(), None, sequences=seqs[:, :12], bits=2, **kw)


def test_save_pretrained_keeps_the_storage(tmp_path):
    from tests.tiny import tiny_tokenizer

    model = tiny_model()
    proj = quantized_projections(model)
    stiefkv.load(model, proj)
    x = torch.randint(0, 97, (1, 70), generator=gen(6))
    compressed = model(x).logits
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    reloaded, _ = stiefkv.load_model(str(tmp_path))
    assert stiefkv.attention.projections_of(reloaded).specs == proj.specs
    torch.testing.assert_close(reloaded(x).logits, compressed, atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton kernels)")
@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
def test_triton_over_dequantized_latents_matches_the_reference(key_mode):
    """On CUDA the quantized cache dequantizes into the bf16/fp32 Triton kernels: the same greedy tokens as
    the PyTorch reference over the same codes (fp32 model: no near-tie flips)."""
    model = tiny_model("llama", head_dim=64, heads=8, kv_heads=2).cuda()
    proj = random_projections(model, 24, 40, key_mode)
    proj = Projections(keys=proj.keys, values=proj.values, key_mode=key_mode, fingerprint=proj.fingerprint,
                       budget=proj.budget, quant=[(QuantSpec(4, "channel"), QuantSpec(3, "token")),
                                                  (QuantSpec(2, "token"), QuantSpec(8, "channel"))])
    x = torch.randint(1, 97, (3, 70), generator=gen(8)).cuda()
    outs = greedy_by_backend(model, proj, x)
    assert torch.equal(outs["triton"], outs["reference"])


def _tiny_windows(monkeypatch, vocab=97, n=3, window=160, seed=11):
    """Patch the test windows to ``n`` random windows (no data files, no tokenizer)."""
    import stiefkv.evaluate as ev

    ws = torch.randint(0, vocab, (n, window), generator=gen(seed))
    monkeypatch.setattr(ev, "load_test_windows", lambda tok, data, window, limit, model=None: ws)
    return ws


def test_through_cache_harness_matches_one_forward_without_compression(monkeypatch):
    from transformers import DynamicCache

    from stiefkv.evaluate import evaluate, evaluate_through_cache

    _tiny_windows(monkeypatch)
    model = tiny_model()
    # a DynamicCache loses nothing: chunked scoring equals one forward, KL 0
    res = evaluate_through_cache(model, None, DynamicCache, name="dynamic", window=160, chunk=37)
    assert res.ppl == pytest.approx(res.ppl_original, rel=1e-5) and abs(res.next_token_kl) < 1e-6
    assert res.kv_bytes_per_token == 2 * 2 * 2 * 24 * 2  # L · G · (K + V) · d · bf16
    # a quantized latent cache fed in chunks holds what the accounting says, and scores exactly as one
    # forward does: each query reads exact what decoding it would have (its recent window, filling groups)
    n_layers, G, d = 2, 2, 24
    model = tiny_model(dtype=torch.bfloat16)  # the exact tokens cost bf16 bytes, as the accounting counts
    for name in ("int2", "kivi2-r0"):
        proj = baseline_projections(model, name)
        chunked = evaluate_through_cache(model, None, stiefkv.LatentCache, name=name, projections=proj,
                                         window=160, chunk=40)
        whole = evaluate(model, None, proj, window=160, layer_errors=False)
        assert whole.key_mode is None  # identity bases: no key mode to show in the table
        assert math.isfinite(chunked.ppl) and chunked.ppl_original == pytest.approx(whole.ppl_original)
        k, v = proj.specs[0]
        assert chunked.kv_bytes_per_token == pytest.approx(
            n_layers * G * (k.bytes_per_token(d, context=160) + v.bytes_per_token(d, context=160)) + 4)
        # the same latents and the same attention, summed in other orders (bf16 model: measured 1e-8 apart)
        assert chunked.ppl == pytest.approx(whole.ppl, rel=1e-4) and whole.next_token_kl > 1e-4
        assert chunked.next_token_kl == pytest.approx(whole.next_token_kl, rel=1e-3)


def test_transformers_quantized_cache_baseline(monkeypatch):
    pytest.importorskip("optimum.quanto")
    from stiefkv.evaluate import evaluate_through_cache, transformers_quantized_cache

    _tiny_windows(monkeypatch, window=320)
    model = tiny_model(head_dim=64, heads=4, kv_heads=2)  # quanto groups 64 channels: a whole head
    for name, bits in (("hf-quanto4", 4), ("hf-quanto2", 2)):
        made = []

        def new_cache():
            made.append(transformers_quantized_cache(model, name))
            return made[-1]

        res = evaluate_through_cache(model, None, new_cache, name=name, window=320, chunk=64)
        assert math.isfinite(res.ppl) and res.next_token_kl > 0
        # when the residual is flushed into codes differs between transformers versions: count from the
        # filled cache what is codes (per layer, K and V, G heads × 64 channels at `bits`, one bf16 scale and
        # shift per token and head) and what is bf16 residual
        layer = made[-1].layers[0]
        coded = layer._quantized_keys.shape[-2]
        residual = layer.keys.shape[-2] if layer.keys is not None and layer.keys.dim() == 4 else 0
        assert coded + residual == 320 and coded > 0
        want = 2 * 2 * 2 * (coded * (64 * bits / 8 + 2 * 2) + residual * 64 * 2) / 320
        assert res.kv_bytes_per_token == pytest.approx(want), name


def test_cli_eval_of_a_transformers_baseline_prints_its_table_and_writes_its_json(tmp_path, monkeypatch):
    pytest.importorskip("optimum.quanto")
    from stiefkv.cli import main

    _tiny_windows(monkeypatch, window=320, n=1)
    model = tiny_model(head_dim=64, heads=4, kv_heads=2)
    monkeypatch.setattr(stiefkv, "load_model", lambda spec, **kw: (model, CharTokenizer()))
    out = tmp_path / "hq.json"
    result = CliRunner().invoke(main, ["eval", "tiny", "--baseline", "hf-quanto4", "--window", "320",
                                       "--windows", "1", "--json", str(out)])
    assert result.exit_code == 0, result.output
    row = next(x for x in result.output.splitlines() if x.startswith("| hf-quanto4 |"))
    written = json.loads(out.read_text())
    assert written["method"] == "hf-quanto4" and written["budget"] is None and math.isfinite(written["ppl"])
    # no budget: the share of the bf16 bytes stands in for it
    share = 100 * written["kv_bytes_per_token"] / written["kv_bytes_per_token_original"]
    assert f"| {share:.1f} % of bytes | – |" in row


def test_transformers_baseline_without_its_backend_says_what_to_install(monkeypatch):
    import builtins

    from stiefkv.evaluate import transformers_quantized_cache

    real = builtins.__import__

    def no_quanto(name, *args, **kwargs):
        if name.startswith("optimum"):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_quanto)
    with pytest.raises(ValueError, match="pip install optimum-quanto"):
        transformers_quantized_cache(tiny_model(), "hf-quanto4")


def test_cli_names_every_baseline_on_a_bad_one(monkeypatch):
    from stiefkv.cli import main

    monkeypatch.setattr(stiefkv, "load_model", lambda spec, **kw: (tiny_model(), CharTokenizer()))
    result = CliRunner().invoke(main, ["eval", "tiny", "--baseline", "hf-quanto8"])
    assert result.exit_code == 2 and "choose one of" in result.output
    assert "kivi2-vmse" in result.output and "hf-quanto4, hf-quanto2" in result.output


def test_learned_rotation_is_orthogonal_and_never_worse_on_held_out_latents():
    pytest.importorskip("geoopt")
    from stiefkv.calibrate.rotation import learn_rotation

    g = gen(21)
    for r in (24, 37):
        # latents whose channels differ in scale and share a heavy-tailed factor: a rotation has room to help
        base = torch.randn(4, 2, 96, r, generator=g) * torch.logspace(0.3, -0.7, r)
        base += torch.randn(4, 2, 96, 1, generator=g) ** 3 * torch.randn(r, generator=g) * 0.3
        R0 = spreading_rotation(r)
        z = base @ R0
        spec = QuantSpec(2, "token")
        res = learn_rotation(z, spec, steps=60)
        eye = torch.eye(r, dtype=torch.float64)
        assert res.R.shape == (2, r, r) and torch.isfinite(res.R).all()
        torch.testing.assert_close(res.R.double().transpose(-1, -2) @ res.R.double(), eye.expand(2, r, r),
                                   atol=1e-5, rtol=0)
        held = z[-1:]
        err = lambda zz: float((fake_quant(zz, spec) - zz).double().pow(2).sum())  # noqa: E731
        assert res.error_start == pytest.approx(err(held), rel=1e-6)
        assert res.error_best == pytest.approx(err(held @ res.R), rel=1e-4)
        assert res.error_best <= res.error_start
    with pytest.raises(ValueError, match="per token"):
        learn_rotation(z, QuantSpec(2, "channel"))


def test_calibrate_with_learned_rotation_keeps_bases_orthonormal_and_the_storage(corpus, monkeypatch):
    pytest.importorskip("geoopt")
    import stiefkv.calibrate.pipeline as pipeline

    per_token = pipeline.storage_candidates
    monkeypatch.setattr(pipeline, "storage_candidates",  # the rotation turns bases stored per token only
                        lambda *a: [s for s in per_token(*a) if s.layout == "token"])
    common = {"data": str(corpus), "num_sequences": 6, "seq_len": 70, "seed": 1, "steps": 4,
              "step_sequences": 2, "profile_sequences": 2, "budget": 0.3}
    plain = stiefkv.calibrate(tiny_model(), CharTokenizer(), **common)
    learned = stiefkv.calibrate(tiny_model(), CharTokenizer(), learn_rotation=True, **common)
    assert learned.specs == plain.specs and learned.ranks == plain.ranks  # the rotation changes bases only
    learned.validate()  # orthonormal to the checkpoint's tolerance
    rotated = [e for e in learned.settings["refine"] if "rotation" in e]
    per_token = sum(s.quantized and s.layout == "token" and s.bits <= 4
                    for pair in learned.specs for s in pair)
    assert len(rotated) == per_token > 0
    assert all(e["quant_error_best"] <= e["quant_error_start"] for e in rotated)


def test_storage_kl_prediction_follows_the_anchors():
    from stiefkv.calibrate.profile import predict_storage_kl

    anchors = [(4.0, 0.02), (64.0, 0.5)]  # int4's and int2's (noise, KL), in either order
    for noise in (9.0, 20.0, 64.0, 100.0):  # on and beyond the power law through both
        slope = math.log(0.5 / 0.02) / math.log(64.0 / 4.0)
        assert predict_storage_kl(noise, anchors) == pytest.approx(0.02 * (noise / 4.0) ** slope, rel=1e-12)
        assert predict_storage_kl(noise, anchors[::-1]) == predict_storage_kl(noise, anchors)
    assert predict_storage_kl(1.0, anchors) == pytest.approx(0.005)  # below int4: proportional to the noise
    assert predict_storage_kl(0.0, anchors) == 0.0
    assert predict_storage_kl(2.0, [(4.0, 0.0), (64.0, 0.5)]) == pytest.approx(0.5 * 2 / 64)
    assert math.isfinite(predict_storage_kl(9.0, [(4.0, 0.3), (64.0, 0.2)]))  # KL not growing: proportional


def test_latent_noises_of_every_rank_at_once_equal_one_call_per_rank():
    from stiefkv.calibrate.profile import latent_noise, latent_noises

    g = gen(11)
    G, d, N = 3, 128, GROUP + 21  # ranks across the 64-channel groups; a channel group still filling
    x = latents((2, G, N, d), seed=11)
    full = torch.linalg.qr(torch.randn(G, d, d, generator=g, dtype=torch.float64))[0].float()
    bases = [full[..., :r] for r in (5, 40, 64, 72, 128)]
    for spec in (QuantSpec(2, "token", recent=7), QuantSpec(3, "token", recent=7, log8=True),
                 QuantSpec(4, "channel", recent=3), QuantSpec(8, "token")):
        got = latent_noises(x, bases, spec)
        want = [latent_noise(x, P, spec) for P in bases]
        assert all(math.isfinite(v) and v > 0 for v in got), spec
        # squares in float32 (each within 6e-8 of the float64 one), summed in float64
        assert got == pytest.approx(want, rel=1e-6), spec
    assert latent_noises(None, bases, QuantSpec(2)) == [0.0] * len(bases)


def test_kl_profile_measures_only_the_anchor_widths_and_predicts_the_rest():
    from stiefkv.calibrate.profile import ANCHOR_BITS, add_quant_profile, storage_candidates
    from stiefkv.layers import LayerBatch

    g, N = gen(4), 3 * GROUP + 9  # the per-channel layout quantizes whole groups
    layer = tiny_model().model.layers[0]
    D = layer.self_attn.q_proj.in_features
    d = layer.self_attn.head_dim
    G = layer.self_attn.k_proj.out_features // d
    x = torch.randn(1, N, D, generator=g)
    cos, sin = torch.ones(1, N, d), torch.zeros(1, N, d)
    batch = LayerBatch(0, x, x, (cos, sin), None, torch.arange(N)[None])
    eye = torch.eye(d).expand(G, d, d)
    calls = []

    def measure(P_k, P_v, quant):
        spec = quant[0] if quant[0].quantized else quant[1]
        calls.append(str(spec))
        return 0.01 * 2.0 ** (8 - spec.bits) * (1.5 if spec.layout == "channel" else 1.0)

    specs = {w: storage_candidates("auto", recent=5) for w in ("k", "v")}
    prof = LayerProfile(ranks=[8, d], k=[0.3, 0.0], v=[0.2, 0.0], metric="kl")
    add_quant_profile(prof, layer, batch, lambda r: eye[..., :r], lambda r: eye[..., :r], specs, measure,
                      key_mode="pre_rope", anchor_bits=ANCHOR_BITS)
    assert sorted(calls) == sorted(str(s) for s in specs["k"] + specs["v"] if s.bits in ANCHOR_BITS)
    for which in ("k", "v"):
        table = prof.quant[which]
        assert set(table) == {str(s) for s in specs[which]}
        assert all(math.isfinite(e) and e >= 0 for errs in table.values() for e in errs)
        for layout in LAYOUTS:  # more bits, less KL, anchors as measured
            full = [table[f"int{b}-{layout}-r5"][-1] for b in (2, 3, 4, 8)]
            assert full[0] > full[1] > full[2] > full[3] >= 0
            assert full[0] == measure(None, None, (QuantSpec(2, layout), QuantSpec()))
    # without anchor widths (profile_storages="all") every storage is measured
    calls.clear()
    add_quant_profile(LayerProfile(ranks=[8, d], k=[0.3, 0.0], v=[0.2, 0.0], metric="kl"), layer, batch,
                      lambda r: eye[..., :r], lambda r: eye[..., :r], specs, measure, key_mode="pre_rope")
    assert len(calls) == 2 * len(specs["k"])
    # log8 storages are never measured with anchors: predicted from the float-scaled per-token anchors
    calls.clear()
    specs = {w: storage_candidates("auto", recent=5, log8=True) for w in ("k", "v")}
    assert sum(s.log8 for s in specs["k"]) == 4 and all(s.layout == "token" for s in specs["k"] if s.log8)
    prof = LayerProfile(ranks=[8, d], k=[0.3, 0.0], v=[0.2, 0.0], metric="kl")
    add_quant_profile(prof, layer, batch, lambda r: eye[..., :r], lambda r: eye[..., :r], specs, measure,
                      key_mode="pre_rope", anchor_bits=ANCHOR_BITS)
    assert not any("log8" in c for c in calls) and len(calls) == 8
    full = [prof.quant["v"][f"int{b}-token-log8-r5"][-1] for b in (2, 3, 4, 8)]
    assert all(math.isfinite(e) for e in full) and full[0] > full[1] > full[2] > full[3] >= 0


def test_kernel_storage_chooses_what_the_kernels_read(corpus, tmp_path, monkeypatch):
    """kernel_storage: every quantized latent per token with no exact window, in budget; the static cache
    then holds no windowed store. An exact window is refused, from Python and from the CLI (exit 2, nothing
    written)."""
    pytest.importorskip("geoopt")
    from stiefkv.cli import main
    from stiefkv.static_cache import StaticLatentCache

    common = {"data": str(corpus), "num_sequences": 6, "seq_len": 70, "seed": 1, "steps": 4,
              "step_sequences": 2, "profile_sequences": 2}
    for bits in ("auto", 4):
        proj = stiefkv.calibrate(tiny_model(), CharTokenizer(), budget=0.2, bits=bits, kernel_storage=True,
                                 **common)
        assert proj.kv_bytes_per_token() <= 0.2 * 2 * 2 * 2 * 24 * 2 + 1e-9
        specs = [s for pair in proj.specs for s in pair if s.quantized]
        assert specs and all(s.layout == "token" and not s.recent and s.bits in KERNEL_BITS for s in specs)
        model = stiefkv.load(tiny_model(), proj)
        assert not StaticLatentCache(model, 1, 16).windowed
    from stiefkv.calibrate.pipeline import CalibrationConfig, storages

    chosen = storages(CalibrationConfig(bits="4", mse="values", kernel_storage=True).validate())
    assert [str(s) for s in chosen["k"]] == ["int4-token"]
    assert [str(s) for s in chosen["v"]] == ["int4-token-mse"]
    with pytest.raises(ValueError, match="no exact recent"):
        stiefkv.calibrate(tiny_model(), CharTokenizer(), budget=0.2, kernel_storage=True, recent=5, **common)
    monkeypatch.setattr(stiefkv, "load_model", lambda spec, **kw: (tiny_model(), CharTokenizer()))
    out = tmp_path / "k.safetensors"
    result = CliRunner().invoke(main, ["calibrate", "tiny", "-o", str(out), "--kernel-storage", "--recent",
                                       "5"])
    assert result.exit_code == 2 and "got recent 5" in result.output and not out.exists(), result.output
