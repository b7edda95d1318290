"""The quantize-on-write kernel (``stiefkv/kernels/quantize.py``) against ``stiefkv.quant.quantize`` then
``index_copy_``: every byte of the codes, scales and lows equal, under the Triton interpreter on the CPU (and
compiled where CUDA is present)."""

import pytest
import torch

from stiefkv.quant import LOG8_LARGEST, QuantSpec, packed_bytes, quantize

pytest.importorskip("triton")
from stiefkv.kernels.quantize import quantize_into  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def buffers(B, G, L, r, bits, log8):
    groups = -(-r // 64)
    codes = torch.randint(0, 256, (B, G, L, packed_bytes(r, bits)), dtype=torch.uint8, device=DEVICE)
    if log8:
        return codes, torch.randint(0, 256, (B, G, L, groups), dtype=torch.uint8, device=DEVICE), None
    return codes, torch.randn(B, G, L, groups, device=DEVICE).half(), torch.randn(B, G, L, groups,
                                                                                    device=DEVICE).half()


def hard_latents(B, G, n, r, dtype, log8=False):
    """Random latents of several octaves, with rows that stress the encoder: constant, zero, tiny (below
    the smallest log8 scale), large (for log8: past the largest code, which clips), and values on exact grid
    midpoints."""
    z = torch.randn(B, G, n, r) * torch.logspace(-3, 2, n)[None, None, :, None]
    z[0, 0, 0] = 0.75  # constant group: scale 0, code 0, back as its low
    z[0, -1, 1 % n] = 0.0
    z[-1, 0, 2 % n] = 1e-6 * torch.randn(r)
    z[-1, -1, 3 % n] = (1e6 if log8 else 1e4) * torch.randn(r)  # float16 scales and lows stay finite
    z[0, 0, -1] = torch.arange(r) * 0.5 - 3.0  # ties for the round-half-even rule at several widths
    return z.to(dtype).to(DEVICE)


def expected(z, slots, bufs, spec):
    codes, scale, low = (None if t is None else t.clone().cpu() for t in bufs)
    q = quantize(z.float().cpu() if z.dtype != torch.float32 else z.cpu(), spec)
    codes.index_copy_(2, slots.cpu(), q.codes)
    scale.index_copy_(2, slots.cpu(), q.scale)
    if low is not None:
        low.index_copy_(2, slots.cpu(), q.low)
    return codes, scale, low


def assert_same(got, want, what):
    """Every byte equal; float16 scales and lows bit for bit, but for the payload of a NaN (both NaN)."""
    for name, g, w in zip(("codes", "scale", "low"), got, want):
        if w is None:
            continue
        g = g.cpu()
        if g.dtype == torch.float16:
            assert torch.equal(g.isnan(), w.isnan()), f"{what}: {name} NaN at different places"
            g, w = g.nan_to_num(0.0).view(torch.int16), w.nan_to_num(0.0).view(torch.int16)
        assert torch.equal(g, w), f"{what}: {name} differ at {(g != w).nonzero()[:4].tolist()}"


@pytest.mark.parametrize("log8", [False, True], ids=["fp16", "log8"])
@pytest.mark.parametrize("bits", [8, 4, 3, 2])
@pytest.mark.parametrize("r, dtype", [(13, torch.bfloat16), (64, torch.float32), (72, torch.bfloat16),
                                      (41, torch.float16), (128, torch.bfloat16)])
def test_tokens_quantized_into_their_slots(r, dtype, bits, log8):
    B, G, n, L = 2, 3, 6, 11
    z = hard_latents(B, G, n, r, dtype, log8)
    slots = torch.randperm(L)[:n].to(DEVICE)
    bufs = buffers(B, G, L, r, bits, log8)
    want = expected(z, slots, bufs, QuantSpec(bits, "token", log8=log8))
    quantize_into(z, slots, *bufs, bits=bits, log8=log8, largest=LOG8_LARGEST[bits])
    assert_same(bufs, want, f"int{bits} log8={log8} r={r} {dtype}")


@pytest.mark.parametrize("bits, log8", [(4, True), (3, False)])
def test_a_chunk_over_several_token_blocks(bits, log8):
    """A prefill chunk longer than a program's block of tokens (``CHUNK_TOKENS``), not a multiple of it:
    every token's codes, scales and lows at its slot, and through the round trip its entry; nothing past
    the chunk written."""
    from stiefkv.kernels.quantize import CHUNK_TOKENS, round_trip_into
    from stiefkv.quant import WINDOW8, held_exact

    B, G, r = 2, 3, 72
    n, L = 2 * CHUNK_TOKENS + 5, 2 * CHUNK_TOKENS + 11
    z = hard_latents(B, G, n, r, torch.bfloat16, log8)
    slots = torch.randperm(L)[:n].to(DEVICE)
    bufs = buffers(B, G, L, r, bits, log8)
    want = expected(z, slots, bufs, QuantSpec(bits, "token", log8=log8))
    quantize_into(z, slots, *bufs, bits=bits, log8=log8, largest=LOG8_LARGEST[bits])
    assert_same(bufs, want, f"{n} tokens int{bits} log8={log8}")
    out = torch.full((B, G, L, r), 7.0, dtype=torch.bfloat16, device=DEVICE)
    round_trip_into(z, slots, out, bits=WINDOW8.bits, largest=LOG8_LARGEST[WINDOW8.bits], wrap=False)
    want = torch.full_like(out, 7.0).cpu().index_copy_(2, slots.cpu(), held_exact(
        z.cpu(), QuantSpec(4, "token", recent=16, window8=True)).to(torch.bfloat16))
    assert torch.equal(out.cpu().isnan(), want.isnan())
    assert torch.equal(out.cpu().nan_to_num(0.0), want.nan_to_num(0.0))


@pytest.mark.parametrize("bits, log8", [(8, False), (4, True), (2, True), (3, False)])
@pytest.mark.parametrize("slot", [0, 5, 16, 17, 40, 79, 100, 183], ids=lambda s: f"slot{s}")
def test_ring_entry_pushed_out_of_the_window(slot, bits, log8):
    """A windowed store's decode write: the token ``slot − recent`` (slot 0 before any is due) quantized from
    its ring entry, as ``WindowedCodes.write_one`` does with PyTorch operators; past the first lap of the
    ring too."""
    B, G, r, recent, L = 2, 2, 40, 16, 200
    window = recent + 64
    ring = hard_latents(B, G, window, r, torch.bfloat16, log8)
    bufs = buffers(B, G, L, r, bits, log8)
    token = torch.tensor([slot - recent])
    entry = ring.index_select(2, (token % window).to(DEVICE))
    want = expected(entry, token.clamp(min=0), bufs, QuantSpec(bits, "token", log8=log8))
    quantize_into(ring, torch.tensor([slot], device=DEVICE), *bufs, bits=bits, log8=log8,
                  largest=LOG8_LARGEST[bits], ring=(recent, window))
    assert_same(bufs, want, f"ring slot {slot} int{bits} log8={log8}")


@pytest.mark.parametrize("log8", [False, True], ids=["fp16", "log8"])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_a_nan_in_a_group_as_pytorch(bits, log8):
    """A NaN in a group: the scale NaN (log8: its NaN code) and every code 0, as ``quantize`` gives; the
    token's other group is unaffected."""
    z = torch.randn(1, 2, 3, 100)
    z[0, 0, 1, 7] = float("nan")
    z[0, 1, 2, 70] = float("nan")
    z = z.to(DEVICE)
    bufs = buffers(1, 2, 5, 100, bits, log8)
    slots = torch.tensor([4, 0, 2], device=DEVICE)
    want = expected(z, slots, bufs, QuantSpec(bits, "token", log8=log8))
    quantize_into(z, slots, *bufs, bits=bits, log8=log8, largest=LOG8_LARGEST[bits])
    assert_same(bufs, want, f"NaN int{bits} log8={log8}")
    assert (want[1][0, 0, 0, 0] == 255) if log8 else want[1][0, 0, 0, 0].isnan()


def test_float16_scale_is_the_same_quotient_on_every_device():
    """``quantize``'s ``(hi − low) / levels`` on a float16 tie (the exact quotient is a halfway point): CUDA
    divides by a Python number as a product with its reciprocal, one bit off; dividing by a tensor gives the
    CPU's (and the kernel's) quotient on every device."""
    z = torch.tensor([-7.00390625, -0.0953369140625]).repeat(32)[None, None, None]  # [1, 1, 1, 64]
    here = quantize(z.to(DEVICE), QuantSpec(4, "token")).scale.cpu()
    assert here.item() == 0.46044921875 == quantize(z, QuantSpec(4, "token")).scale.item()


def test_bad_input():
    z = torch.randn(1, 2, 3, 40, device=DEVICE)
    codes, scale, low = buffers(1, 2, 8, 40, 4, False)
    slots = torch.arange(3, device=DEVICE)
    with pytest.raises(ValueError, match="bits must be one of"):
        quantize_into(z, slots, codes, scale, low, bits=5)
    with pytest.raises(ValueError, match="do not hold 40-channel latents of 8 bits"):
        quantize_into(z, slots, codes, scale, low, bits=8)
    with pytest.raises(ValueError, match="log8 scales take no low"):
        quantize_into(z, slots, codes, scale, low, bits=4, log8=True)
    with pytest.raises(ValueError, match="3 tokens but 2 slots"):
        quantize_into(z, slots[:2], codes, scale, low, bits=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("r", [24, 64, 100])  # a short group, one whole, one and a short one
def test_round_trip_kernel_holds_a_token_as_the_int8_window_does(dtype, r):
    """``round_trip_into`` (a ``window8`` store's decoded token through int8 log8 codes and back, into
    its ring entry) against ``held_exact`` then ``index_copy_``: bit for bit in float32 and bfloat16, the
    stressed rows included (a NaN group reads back NaN, the rest of the row unchanged); other ring entries
    untouched."""
    from stiefkv.kernels.quantize import round_trip_into
    from stiefkv.quant import WINDOW8, held_exact

    B, G, window = 2, 3, 21
    z = hard_latents(B, G, 5, r, dtype, log8=True)
    z[1, 2, 4, r // 2] = float("nan")  # one NaN: its group only
    spec = QuantSpec(4, "token", recent=16, window8=True)
    ring = torch.randn(B, G, window, r, dtype=dtype, device=DEVICE)
    for t, slot in enumerate((0, 7, 20, 21, 45)):  # wraps around the ring
        token = z[:, :, t:t + 1]
        s = torch.tensor([slot], device=DEVICE)
        want = ring.clone().cpu()
        want.index_copy_(2, s.cpu() % window, held_exact(token.cpu(), spec).to(dtype))
        round_trip_into(token, s, ring, bits=WINDOW8.bits, largest=LOG8_LARGEST[WINDOW8.bits])
        got = ring.cpu()
        assert torch.equal(got.isnan(), want.isnan()), f"slot {slot}: NaN at different places"
        assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0)), \
            f"slot {slot}: {(got.nan_to_num(0.0) != want.nan_to_num(0.0)).nonzero()[:4].tolist()}"
    # a prefill chunk: every token into its own entry of a buffer, in one launch
    chunk = torch.full_like(z, 7.0)
    round_trip_into(z, torch.arange(5, device=DEVICE), chunk, bits=WINDOW8.bits,
                    largest=LOG8_LARGEST[WINDOW8.bits], wrap=False)
    want = held_exact(z.cpu(), spec).to(dtype)
    assert torch.equal(chunk.cpu().isnan(), want.isnan())
    assert torch.equal(chunk.cpu().nan_to_num(0.0), want.nan_to_num(0.0))
    with pytest.raises(ValueError, match="2 tokens but 1 slots"):
        round_trip_into(z[:, :, :2], torch.tensor([0], device=DEVICE), ring)


def channel_buffers(B, G, L, r, bits):
    codes = torch.randint(0, 256, (B, G, L, packed_bytes(r, bits)), dtype=torch.uint8, device=DEVICE)
    return codes, torch.randn(B, G, L // 64, r, device=DEVICE).half(), torch.randn(B, G, L // 64, r,
                                                                                   device=DEVICE).half()


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
@pytest.mark.parametrize("r, dtype, recent", [(13, torch.bfloat16, 16), (64, torch.float32, 0),
                                              (72, torch.bfloat16, 16), (41, torch.float16, 5),
                                              (130, torch.bfloat16, 16)])
def test_channel_group_quantized_when_due(r, dtype, recent, bits):
    """``quantize_group_into`` (the channel layout's decode write) against ``WindowedCodes.write_one``'s
    PyTorch: at the slots that complete a group past the window, the 64 tokens from their ring entries
    quantized per channel, every byte of the codes and the group's scales and lows equal (stressed columns:
    constant, tiny, large, ties); at every other slot nothing written. Past the first lap of the ring too."""
    from stiefkv.kernels.quantize import quantize_group_into

    B, G, L = 2, 3, 256
    window = recent + 64
    ring = (torch.randn(B, G, window, r) * torch.logspace(-3, 2, r)).to(dtype)
    ring[0, 0, :, 0] = 0.75  # a constant channel: scale 0, code 0, back as its low
    ring[1, 2, :, r // 2] = 1e-6 * torch.randn(window)
    ring[1, 0, :, -1] = torch.arange(window) * 0.5 - 3.0  # grid midpoints: half to even
    ring = ring.to(DEVICE)
    spec = QuantSpec(bits, "channel", recent=recent)
    for slot in (recent + 62, recent + 63, recent + 64, 2 * 64 + recent - 1, 3 * 64 + recent - 1, 100):
        bufs = channel_buffers(B, G, L, r, bits)
        want = [t.clone().cpu() for t in bufs]
        end = slot + 1 - recent
        if end > 0 and end % 64 == 0:
            slots = torch.arange(end - 64, end)
            q = quantize(ring.cpu().index_select(2, slots % window), spec)
            want[0].index_copy_(2, slots, q.codes)
            want[1].index_copy_(2, slots[:1] // 64, q.scale)
            want[2].index_copy_(2, slots[:1] // 64, q.low)
        quantize_group_into(ring, torch.tensor([slot], device=DEVICE), *bufs, bits=bits, recent=recent)
        assert_same(bufs, want, f"channel int{bits} r={r} slot {slot}")


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
@pytest.mark.parametrize("r, dtype, n, first", [(13, torch.bfloat16, 64, 128), (72, torch.float32, 192, 0),
                                                (41, torch.float16, 128, 64)])
def test_channel_chunk_groups_quantized(r, dtype, n, first, bits):
    """``quantize_groups_into`` (a prefill chunk's channel groups, one launch) against ``quantize`` of the
    chunk then ``WindowedCodes._store``: every byte of the codes at slots ``first …`` and of the groups'
    scales and lows equal, every other byte untouched (stressed channels: constant, tiny, grid midpoints)."""
    from stiefkv.kernels.quantize import quantize_groups_into

    B, G, L = 2, 3, 320
    z = (torch.randn(B, G, n, r) * torch.logspace(-3, 2, r)).to(dtype)
    z[0, 0, :, 0] = 0.75
    z[1, 2, :, r // 2] = 1e-6 * torch.randn(n)
    z[1, 0, :, -1] = torch.arange(n) * 0.5 - 3.0
    z = z.to(DEVICE)
    bufs = channel_buffers(B, G, L, r, bits)
    want = [t.clone().cpu() for t in bufs]
    q = quantize(z.cpu(), QuantSpec(bits, "channel"))
    slots = torch.arange(first, first + n)
    want[0].index_copy_(2, slots, q.codes)
    want[1].index_copy_(2, slots[::64] // 64, q.scale)
    want[2].index_copy_(2, slots[::64] // 64, q.low)
    quantize_groups_into(z, first, *bufs, bits=bits)
    assert_same(bufs, want, f"channel chunk int{bits} r={r} {n} tokens at {first}")


def test_channel_chunk_bad_input():
    from stiefkv.kernels.quantize import quantize_groups_into

    bufs = channel_buffers(1, 2, 128, 24, 4)
    with pytest.raises(ValueError, match="whole groups of 64 tokens at a group's first slot: got 40 tokens"):
        quantize_groups_into(torch.randn(1, 2, 40, 24, device=DEVICE), 0, *bufs, bits=4)
    with pytest.raises(ValueError, match="got 64 tokens at slot 10"):
        quantize_groups_into(torch.randn(1, 2, 64, 24, device=DEVICE), 10, *bufs, bits=4)
    with pytest.raises(ValueError, match="do not hold 24-channel latents of 8 bits"):
        quantize_groups_into(torch.randn(1, 2, 64, 24, device=DEVICE), 0, *bufs, bits=8)


def test_channel_group_nan_and_bad_input():
    """A NaN in a channel of the group: that channel's scale and low NaN, its codes 0, as ``quantize``; the
    other channels unaffected. Buffers of another width and a ring too short for the window are refused."""
    from stiefkv.kernels.quantize import quantize_group_into

    ring = torch.randn(1, 2, 80, 24)
    ring[0, 1, 30, 5] = float("nan")
    ring = ring.to(DEVICE)
    bufs = channel_buffers(1, 2, 128, 24, 4)
    want = [t.clone().cpu() for t in bufs]
    q = quantize(ring.cpu()[:, :, :64], QuantSpec(4, "channel"))
    for t, part in zip(want, (q.codes, q.scale, q.low)):
        t.index_copy_(2, torch.arange(t.shape[2])[: part.shape[2]], part)
    quantize_group_into(ring, torch.tensor([79], device=DEVICE), *bufs, bits=4, recent=16)
    assert_same(bufs, want, "NaN channel")
    assert want[1][0, 1, 0, 5].isnan() and not want[1][0, 1, 0, 4].isnan()
    with pytest.raises(ValueError, match="do not hold 24-channel latents of 8 bits"):
        quantize_group_into(ring, torch.tensor([79], device=DEVICE), *bufs, bits=8, recent=16)
    with pytest.raises(ValueError, match="cannot hold 17 recent tokens"):
        quantize_group_into(ring, torch.tensor([79], device=DEVICE), *bufs, bits=4, recent=17)
