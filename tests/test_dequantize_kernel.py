"""The one-pass dequantization (``stiefkv/kernels/dequantize.py``) against ``QuantizedLatents.dequantize``:
every code width, both layouts, log8 scales, odd ranks and token counts, a strided slice of a larger
buffer, under the Triton interpreter on the CPU (and compiled where CUDA is present)."""

import pytest
import torch

from stiefkv.kernels import QuantizedLatents
from stiefkv.quant import QuantSpec, quantize

pytest.importorskip("triton")
from stiefkv.kernels.dequantize import dequantize_latents  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def codes_of(z: torch.Tensor, spec: QuantSpec) -> QuantizedLatents:
    qz = quantize(z, spec)
    low = None if qz.low is None else qz.low.to(DEVICE)
    return QuantizedLatents(qz.codes.to(DEVICE), qz.scale.to(DEVICE), low, spec.bits, qz.rank, spec.layout,
                            spec.log8)


def check(z: QuantizedLatents, dtype: torch.dtype) -> None:
    want = z.dequantize(dtype).cpu()
    got = dequantize_latents(z, dtype).cpu()
    assert got.shape == want.shape and got.dtype == dtype
    assert torch.equal(got.isnan(), want.isnan())
    got, want = got.nan_to_num(), want.nan_to_num()
    if DEVICE == "cpu":  # the interpreter computes as the reference does: bit for bit
        assert torch.equal(got, want), f"differ at {(got != want).nonzero()[:4].tolist()}"
    else:  # within one unit of the output's last place: the device fuses the multiply-add (one rounding less)
        ulp = {torch.float32: 2 ** -23, torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7}[dtype]
        # and near zero the fused float32 result differs by up to 2^-23 of the largest product
        atol = 2 ** -22 * want.abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), rtol=ulp, atol=atol)


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
@pytest.mark.parametrize("layout", ["token", "channel"])
def test_every_width_and_layout(bits, layout):
    g = torch.Generator().manual_seed(bits * 7 + len(layout))
    r = 72 if layout == "token" else 13  # two channel groups, the second partial; an odd rank
    N = 70 if layout == "token" else 192  # channel scales are per 64 tokens
    z = torch.randn(2, 3, N, r, generator=g) * torch.logspace(-2, 1, N)[None, None, :, None]
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        check(codes_of(z, QuantSpec(bits, layout)), dtype)


@pytest.mark.parametrize("bits", [8, 4])
def test_log8_scales(bits):
    z = torch.randn(1, 2, 33, 56, generator=torch.Generator().manual_seed(bits)) * 3
    check(codes_of(z, QuantSpec(bits, "token", log8=True)), torch.bfloat16)


def test_a_strided_slice_of_a_larger_buffer():
    """The prefill's key slices: codes and scales viewed out of a buffer of more tokens."""
    z = torch.randn(2, 5, 100, 40, generator=torch.Generator().manual_seed(3))
    whole = codes_of(z, QuantSpec(4, "token"))
    part = whole._replace(codes=whole.codes[:, :, 17:83], scale=whole.scale[:, :, 17:83],
                          low=whole.low[:, :, 17:83])
    assert not part.codes.is_contiguous()
    check(part, torch.bfloat16)
    # lows laid out apart from the scales (a copy of another stride): read with their own strides
    apart = whole.low.transpose(0, 1).contiguous().transpose(0, 1)[:, :, 17:83]
    check(part._replace(low=apart), torch.float16)
    got = dequantize_latents(part, torch.float32).cpu()
    torch.testing.assert_close(got, dequantize_latents(whole, torch.float32).cpu()[:, :, 17:83],
                               rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["token", "channel"])
def test_a_padded_width_reads_zeros_past_the_rank(layout):
    """``width``: the prefill tiles' padded rank written in the same pass, the channels past the rank 0."""
    z = torch.randn(2, 3, 128, 40, generator=torch.Generator().manual_seed(9))
    q = codes_of(z, QuantSpec(4, layout))
    for dtype in (torch.float32, torch.bfloat16):
        wide = dequantize_latents(q, dtype, width=64).cpu()
        assert wide.shape == (2, 3, 128, 64) and wide.is_contiguous()
        assert torch.equal(wide[..., :40], dequantize_latents(q, dtype).cpu())
        assert torch.equal(wide[..., 40:], torch.zeros(2, 3, 128, 24, dtype=dtype))
    with pytest.raises(ValueError, match="width 32 is narrower than the latents' rank 40"):
        dequantize_latents(q, torch.float32, width=32)


def test_a_nan_group_stays_nan():
    z = torch.randn(2, 2, 9, 70, generator=torch.Generator().manual_seed(4))
    z[1, 0, 3, 66] = float("nan")  # the second channel group of one token
    q = codes_of(z, QuantSpec(4, "token"))
    assert q.dequantize(torch.float32).isnan().sum() == 6  # that group's 6 channels
    check(q, torch.bfloat16)


def test_a_channel_layout_slice():
    """The prefill's slices of channel-layout codes: tokens from a multiple of 64, their scale rows with
    them (``_slice_keys``)."""
    from stiefkv.kernels.lowrank import _slice_keys

    z = torch.randn(1, 2, 250, 27, generator=torch.Generator().manual_seed(6))
    whole = codes_of(torch.cat([z, torch.zeros(1, 2, 6, 27)], 2), QuantSpec(3, "channel"))
    part = _slice_keys(whole, 128, 250)
    check(part, torch.bfloat16)
    torch.testing.assert_close(dequantize_latents(part, torch.float32).cpu(),
                               dequantize_latents(whole, torch.float32).cpu()[:, :, 128:250], rtol=0, atol=0)


def test_no_tokens():
    z = codes_of(torch.randn(1, 2, 64, 24), QuantSpec(8, "token"))
    empty = z._replace(codes=z.codes[:, :, :0], scale=z.scale[:, :, :0], low=z.low[:, :, :0])
    assert dequantize_latents(empty, torch.bfloat16).shape == (1, 2, 0, 24)


@pytest.mark.parametrize("layout", ["token", "channel"])
def test_token_slices_and_codes_beside_a_band(layout):
    """``QuantizedLatents.tokens`` (the prefill's key slices) and :class:`CodesAndBand` (a static cache's
    prefill read: codes below the exact band, floats from it): each slice the kernels take is what slicing
    the whole dequantized latents gives; any other read gets the whole."""
    from stiefkv.kernels import CodesAndBand

    z = torch.randn(2, 3, 192, 13, generator=torch.Generator().manual_seed(len(layout)))
    codes = codes_of(z, QuantSpec(3, layout))  # 192: the channel layout quantizes whole groups of tokens
    codes = codes._replace(codes=codes.codes[:, :, :150], scale=codes.scale[:, :, :150] if layout == "token"
                           else codes.scale, low=codes.low[:, :, :150] if layout == "token" else codes.low)
    whole = codes.dequantize(torch.float32)
    for a, c in ((0, 150), (64, 129), (0, 71), (128, 150)):
        assert torch.equal(codes.tokens(a, c).dequantize(torch.float32), whole[:, :, a:c])
    if layout == "channel":
        with pytest.raises(ValueError, match="multiple of 64"):
            codes.tokens(70, 90)
    split = 71
    mixed = CodesAndBand(codes.tokens(0, split), whole[:, :, split:])
    assert mixed.shape == whole.shape and mixed.split == split and mixed.dtype == torch.float32
    assert mixed[:, :, :split] is mixed.below
    for a, c in ((71, 150), (80, 120), (100, None)):
        assert torch.equal(mixed[:, :, a:c], whole[:, :, a:c])
    for index in ((slice(None), slice(None), slice(0, 90)), (slice(None), slice(None), slice(5, 80)), 1):
        assert torch.equal(mixed[index], whole[index])
    assert torch.equal(mixed.materialize(), whole)


@pytest.mark.parametrize("spec", ["int8-token-log8", "int3-token", "int2-channel", "int4-channel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_at_slots_with_a_ring_overlay(spec, dtype):
    """``dequantize_at``, a split decode's ring side (``static_cache._ring_side``): the codes of scattered
    slots dequantized, and where a slot's ``newest`` is at or past ``first_exact`` its ring entry instead,
    bit for bit as the PyTorch gathers and ``where`` (and as ``dequantize`` at those slots without a ring),
    on every device: the multiply and add are rounded apart, as PyTorch's."""
    from stiefkv.kernels.dequantize import dequantize_at

    spec = QuantSpec.parse(spec)
    B, G, N, r, window = 2, 3, 192, 29, 21
    z = torch.randn(B, G, N, r, generator=torch.Generator().manual_seed(len(str(spec)))) * 3
    codes = codes_of(z, spec)
    ring = torch.randn(B, G, window, r, dtype=dtype, device=DEVICE)
    newest = torch.tensor([5, 190, 64, 63, -1, 127, 128, 0, 150, 151, 149, 100, 101, 30, 191, 2, 66, 80, 7,
                           170, 129], device=DEVICE)
    slots, first = newest.clamp(min=0), torch.tensor([129], device=DEVICE, dtype=torch.int32)
    coded = codes.dequantize(torch.float32).index_select(2, slots).to(dtype)
    assert torch.equal(dequantize_at(codes, slots, dtype).cpu(), coded.cpu())
    want = torch.where((newest >= first)[None, None, :, None], ring.index_select(2, slots % window), coded)
    got = dequantize_at(codes, slots, dtype, ring=ring, newest=newest, first_exact=first)
    assert got.dtype == dtype and torch.equal(got.cpu(), want.cpu())
    with pytest.raises(ValueError, match="together"):
        dequantize_at(codes, slots, dtype, ring=ring)
