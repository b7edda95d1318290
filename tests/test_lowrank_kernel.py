"""The Triton low-rank attention (``stiefkv.kernels.lowrank``) against the PyTorch reference.

Without CUDA the kernels run on the CPU under ``TRITON_INTERPRET=1`` (set by conftest.py before any kernel
module is built) at small shapes; with CUDA the same table runs compiled, plus realistic sizes (d = 128, an
8k and a 32k context).
Every kernel path is covered: decode (one program per KV head), decode split across programs (the last
program of a tile merges the splits), and tiled causal prefill — for both key modes, GQA 1/3/4, ranks
8–56 (padded to powers of two), left padding, per-key bias, ``P_v`` given or ``None``, fp32/fp16/bf16.
"""

import math
import types
import warnings

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from stiefkv.kernels import RopeSpec  # noqa: E402
from stiefkv.kernels import lowrank as lk  # noqa: E402
from stiefkv.kernels.reference import lowrank_attention as reference  # noqa: E402

from .utils import assert_close  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# (atol, rtol): the kernel rounds q', rebuilt keys and probabilities to the latent dtype before each tl.dot
# (fp32 accumulation); the reference computes everything in fp32 and rounds only its output.
TOL = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_inputs(B, H, G, Nq, Nk, d, r_k, r_v, dtype, *, padded=True, bias=True, pv=True, device=DEVICE,
                pos_offset=300):
    """Random queries and latents, orthonormal bases, left-padded lengths with one full row and one odd one,
    key positions counted from each row's first real key (plus a random offset), a llama-like rope spec."""
    q = torch.randn(B, H, Nq, d).to(device, dtype)
    z_k = torch.randn(B, G, Nk, r_k).to(device, dtype)
    z_v = torch.randn(B, G, Nk, r_v).to(device, dtype)
    P_k = torch.linalg.qr(torch.randn(G, d, r_k))[0].to(device)
    P_v = torch.linalg.qr(torch.randn(G, d, r_v))[0].to(device) if pv else None
    lengths = None
    first = torch.zeros(B, dtype=torch.long)
    if padded:
        lengths = torch.randint(1, Nk + 1, (B,))
        lengths[0] = Nk
        first = Nk - lengths
        lengths = lengths.to(device)
    offset = torch.randint(pos_offset // 2, pos_offset + 1, (B, 1))
    positions = (torch.arange(Nk)[None, :] - first[:, None]).clamp(min=0) + offset
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    rope = RopeSpec(inv_freq.to(device), attention_scaling=1.15)
    bias_t = (0.5 * torch.randn(B, G, Nk)).to(device) if bias else None
    kwargs = dict(positions=positions.to(device), rope=rope, bias=bias_t, lengths=lengths)
    return (q, z_k, z_v, P_k, P_v), kwargs


def check(args, kwargs, *, key_mode, causal=True, what="", **tuning):
    kwargs = dict(kwargs, key_mode=key_mode, causal=causal)
    with torch.no_grad():
        out = lk.lowrank_attention(*args, **kwargs, **tuning)
        expected = reference(*args, **kwargs)
    atol, rtol = TOL[args[1].dtype]
    assert_close(out, expected, atol=atol, rtol=rtol, what=what)


# (path, B, H, G, Nq, Nk, d, r_k, r_v, splits, padded, bias, pv): every row differs in what it stresses.
CASES = [
    ("decode", 2, 4, 4, 1, 37, 32, 8, 24, 1, True, True, True),  # GQA 1, rank 8 padded to 16
    ("decode", 3, 12, 4, 1, 77, 64, 40, 56, 1, True, False, False),  # GQA 3, latent output
    ("decode_split", 2, 8, 2, 1, 150, 64, 56, 40, 4, True, True, True),  # GQA 4, empty splits for short rows
    ("decode_split", 1, 3, 1, 1, 97, 32, 24, 8, 3, False, True, False),  # one KV head, no padding
    ("decode_multi", 2, 8, 2, 3, 61, 32, 24, 24, 2, True, True, True),  # 3 new tokens × GQA 4 = 12 rows
    ("prefill", 2, 4, 1, 45, 45, 64, 24, 40, 1, True, True, True),  # one 128-row tile, diagonal masking
    ("prefill", 1, 6, 2, 50, 50, 32, 16, 8, 1, True, False, False),  # 150 rows: two query tiles
    ("prefill_chunk", 2, 12, 3, 19, 70, 64, 56, 24, 1, True, True, True),  # Nq < Nk (chunked prefill)
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t).removeprefix("torch."))
@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-H{c[2]}G{c[3]}-q{c[4]}k{c[5]}-r{c[7]}_{c[8]}")
def test_matches_reference(case, key_mode, dtype):
    path, B, H, G, Nq, Nk, d, r_k, r_v, splits, padded, bias, pv = case
    args, kwargs = make_inputs(B, H, G, Nq, Nk, d, r_k, r_v, dtype, padded=padded, bias=bias, pv=pv)
    check(args, kwargs, key_mode=key_mode, num_splits=splits, what=f"{path} {key_mode} {dtype}")


# every path in bf16 with both logits orders; fp32 and fp16 on a split decode and a causal chunk
AHEAD_CASES = [(c, torch.bfloat16, (True, False)) for c in CASES] + [
    (c, dtype, (False,)) for c in (CASES[2], CASES[7]) for dtype in (torch.float32, torch.float16)]


def _ahead_id(x) -> str:
    if isinstance(x, torch.dtype):
        return str(x).removeprefix("torch.")
    if len(x) < 5:  # the logits orders: keys_left and q kᵀ, or q kᵀ only
        return "both-orders" if len(x) == 2 else "q-kT"
    return f"{x[0]}-H{x[2]}G{x[3]}-q{x[4]}k{x[5]}-r{x[7]}_{x[8]}"


@pytest.mark.parametrize("case,dtype,orders", AHEAD_CASES, ids=_ahead_id)
def test_logits_ahead_matches_reference(case, dtype, orders):
    """``pre_rope`` logits formed one tile ahead (``ahead``) give the same attention in every path: the first
    tile's logits before the loop, the last iteration's past the keys (masked loads, never read), the
    masked tail's own look-ahead, causal rows, padding, bias, both key orders of the logits dot."""
    path, B, H, G, Nq, Nk, d, r_k, r_v, splits, padded, bias, pv = case
    args, kwargs = make_inputs(B, H, G, Nq, Nk, d, r_k, r_v, dtype, padded=padded, bias=bias, pv=pv)
    for left in orders:
        check(args, kwargs, key_mode="pre_rope", num_splits=splits, ahead=True, keys_left=left, block_n=16,
              what=f"ahead keys_left={left} {path} {dtype}")


def test_logits_ahead_is_taken_only_where_it_applies(monkeypatch):
    """``ahead`` asks for the look-ahead loop over float latents without prefetch (``pre_rope``); over codes
    (timed on the H100 and lost), with prefetch or after RoPE the launcher leaves it off, and the result is
    still the reference's."""
    launched = []
    real = lk._lowrank_attn_fwd

    class Spy:  # records what each launch compiles for, then launches it
        def __getitem__(self, grid):
            return lambda *a, **kw: launched.append(kw["AHEAD"]) or real[grid](*a, **kw)

    monkeypatch.setattr(lk, "_lowrank_attn_fwd", Spy())
    args, kwargs = make_inputs(2, 8, 2, 1, 90, 32, 24, 24, torch.bfloat16)
    q, z_k, z_v, P_k, P_v = args
    for key_mode, tuning, expected in (("pre_rope", {}, True), ("post_rope", {}, False),
                                       ("pre_rope", {"prefetch": True}, False)):
        check(args, kwargs, key_mode=key_mode, ahead=True, num_splits=2, what=f"ahead {key_mode} {tuning}",
              **tuning)
        assert launched.pop() is expected, (key_mode, tuning)
    for bits in (4, 8):  # with the codes' default prefetch and without
        codes = (quantize_latents(z_k, bits), quantize_latents(z_v, bits))
        keys, values = (c.dequantize(torch.bfloat16) for c in codes)
        for prefetch in (None, False):
            with torch.no_grad():
                out = lk.lowrank_attention(q, *codes, P_k, P_v, key_mode="pre_rope", **kwargs, num_splits=2,
                                           ahead=True, prefetch=prefetch)
                ref = reference(q, keys, values, P_k, P_v, key_mode="pre_rope", **kwargs)
            assert_close(out, ref, *TOL[torch.bfloat16], what=f"ahead over int{bits} prefetch={prefetch}")
            assert launched.pop() is False, (bits, prefetch)
    assert not launched


@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("case", CASES[::2] + CASES[5:6],
                         ids=lambda c: f"{c[0]}-q{c[4]}k{c[5]}-r{c[7]}_{c[8]}")
def test_prefetch_matches_reference(case, key_mode):
    """The candidate that reads each tile one iteration ahead gives the same attention (bf16)."""
    path, B, H, G, Nq, Nk, d, r_k, r_v, splits, padded, bias, pv = case
    args, kwargs = make_inputs(B, H, G, Nq, Nk, d, r_k, r_v, torch.bfloat16, padded=padded, bias=bias, pv=pv)
    check(args, kwargs, key_mode=key_mode, num_splits=splits, prefetch=True, what=f"prefetch {path}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", CASES[::2] + CASES[5:6],
                         ids=lambda c: f"{c[0]}-q{c[4]}k{c[5]}-r{c[7]}_{c[8]}")
def test_keys_left_matches_reference(case, dtype):
    """``pre_rope`` logits computed as ``(k qᵀ)ᵀ`` (the rotated keys the dot's left operand; the decode
    default) and as ``q kᵀ`` give the same attention, in decode, split decode, several queries and prefill,
    with and without prefetch."""
    path, B, H, G, Nq, Nk, d, r_k, r_v, splits, padded, bias, pv = case
    args, kwargs = make_inputs(B, H, G, Nq, Nk, d, r_k, r_v, dtype, padded=padded, bias=bias, pv=pv)
    for prefetch, left in ((False, True), (True, True), (False, False)):
        check(args, kwargs, key_mode="pre_rope", num_splits=splits, keys_left=left, prefetch=prefetch,
              what=f"keys_left={left} {path} {dtype} prefetch={prefetch}")


@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
def test_not_causal_and_shuffled_positions(key_mode):
    """Non-causal prefill (every query sees every real key) with positions that are not contiguous, as
    after compaction: each key is rotated at its own stored position, not at its index."""
    args, kwargs = make_inputs(2, 6, 2, 21, 40, 32, 24, 16, torch.float32)
    kwargs["positions"] = torch.randint(0, 5000, (2, 40), device=DEVICE)
    check(args, kwargs, key_mode=key_mode, causal=False, what="non-causal")


@pytest.mark.parametrize("path", ["decode", "prefill"])
def test_rows_without_visible_keys_return_zero(path):
    """A batch row of length 0, and prefill queries that sit in the left padding, see no key: output 0."""
    Nq = 1 if path == "decode" else 12
    args, kwargs = make_inputs(3, 4, 2, Nq, 12, 32, 16, 16, torch.float32)
    kwargs["lengths"] = torch.tensor([12, 0, 5], device=DEVICE)
    with torch.no_grad():
        out = lk.lowrank_attention(*args, **kwargs, key_mode="pre_rope")
    assert out[1].abs().max().item() == 0.0
    if path == "prefill":
        assert out[2, :, :7].abs().max().item() == 0.0  # queries 0..6 are padding of row 2
    check(args, kwargs, key_mode="pre_rope", what=f"{path} with empty rows")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_positions_with_gaps(num_splits, dtype):
    """Decode over positions that are consecutive only in places (a jump inside a key tile, a shuffled
    stretch, as compaction leaves them): every key is rotated at its own stored position."""
    args, kwargs = make_inputs(2, 8, 2, 1, 200, 64, 40, 24, dtype)
    positions = torch.arange(200) + 7
    positions[90:] += 1000
    positions[130:150] = positions[130:150][torch.randperm(20)]
    kwargs["positions"] = positions.expand(2, 200).contiguous().to(DEVICE)
    check(args, kwargs, key_mode="pre_rope", num_splits=num_splits, what="gapped positions")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path, Nq, splits", [("decode", 1, 1), ("decode_split", 1, 3), ("chunk", 5, 1)])
def test_positions_per_kv_head(path, Nq, splits, dtype):
    """Positions ``[B, G, Nk]``, each KV head its own (a compacted cache keeps different tokens per head),
    with β through the bias: each head's keys rotate at that head's positions. A shared ``[B, Nk]`` tensor
    broadcast to every head gives the answer of the 2-D form."""
    B, G, Nk = 2, 3, 83
    args, kwargs = make_inputs(B, 9, G, Nq, Nk, 64, 24, 40, dtype, padded=False)
    kwargs["positions"] = torch.stack([torch.randperm(4000)[:Nk].sort().values for _ in range(B * G)]
                                      ).view(B, G, Nk).to(DEVICE)
    check(args, kwargs, key_mode="pre_rope", num_splits=splits, what=f"per-head positions {path}")
    shared = torch.randint(0, 4000, (B, Nk), device=DEVICE)
    with torch.no_grad():
        a = lk.lowrank_attention(*args, **dict(kwargs, positions=shared), key_mode="pre_rope",
                                 num_splits=splits)
        b = lk.lowrank_attention(*args, **dict(kwargs, positions=shared[:, None].expand(B, G, Nk)),
                                 key_mode="pre_rope", num_splits=splits)
    assert torch.equal(a, b)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_far_positions(num_splits):
    """Keys at positions past 120k: the in-kernel rotation must match the reference's fp32 angles there."""
    args, kwargs = make_inputs(2, 8, 2, 1, 70, 64, 40, 24, torch.float32, pos_offset=131000)
    check(args, kwargs, key_mode="pre_rope", num_splits=num_splits, what="far positions")


def _fenced(t):
    """``t`` inside a NaN-filled buffer: any unmasked read past either end of it returns NaN."""
    buf = torch.full((t.numel() + 4096,), float("nan"), dtype=t.dtype, device=t.device)
    view = buf[2048:2048 + t.numel()].view(t.shape)
    view.copy_(t)
    return view


@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetch"])
@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("Nq,splits", [(1, 3), (19, 1)], ids=["decode_split", "prefill"])
def test_no_reads_outside_the_inputs(key_mode, Nq, splits, prefetch):
    """Every float input sits between NaN fences; a rank-padded tile or a ragged key tile that read past
    its tensor (or a tile read ahead past the last one) would turn the output NaN (assert_close fails on
    NaN)."""
    args, kwargs = make_inputs(2, 12, 3, Nq, 70, 64, 56, 24, torch.bfloat16)
    args = tuple(_fenced(t) if t is not None else None for t in args)
    kwargs = dict(kwargs, bias=_fenced(kwargs["bias"]))
    check(args, kwargs, key_mode=key_mode, num_splits=splits, prefetch=prefetch, what="fenced inputs")


def test_more_queries_than_keys():
    """Causal with Nq > Nk: query i sits at key index Nk − Nq + i, so the first Nq − Nk queries see
    nothing."""
    args, kwargs = make_inputs(1, 4, 2, 20, 9, 32, 8, 8, torch.float32, padded=False)
    check(args, kwargs, key_mode="post_rope", what="Nq > Nk")


@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
def test_strided_cache_views(key_mode):
    """The cache as the first Nk slots of a preallocated buffer and a transposed-layout query: the kernel
    takes every stride explicitly and must not assume contiguity."""
    B, H, G, Nk, d, r = 2, 4, 2, 33, 32, 24
    args, kwargs = make_inputs(B, H, G, 1, Nk, d, r, r, torch.float16)
    q, z_k, z_v, P_k, P_v = args
    buf_k = torch.zeros(B, G, Nk + 31, r, device=DEVICE, dtype=z_k.dtype)
    buf_v = torch.zeros(B, Nk + 31, G, r, device=DEVICE, dtype=z_v.dtype)  # token-major: strides differ
    buf_k[:, :, :Nk] = z_k
    buf_v[:, :Nk] = z_v.transpose(1, 2)
    q_t = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, H, 1, d] with heads not outermost
    args = (q_t, buf_k[:, :, :Nk], buf_v[:, :Nk].transpose(1, 2), P_k, P_v)
    check(args, kwargs, key_mode=key_mode, num_splits=2, what="strided views")


def shared_inputs(B, H, G, Nq, Nk, d, r_k, r_v, dtype, **kw):
    """``make_inputs`` with one latent a token for all ``G`` KV heads, as a shared basis ``[1, G·d, r]``
    serves it: latents ``[B, 1, N, r]`` expanded to ``[B, G, N, r]`` (stride 0 over heads), per-head bases
    ``[G, d, r]`` cut from one orthonormal ``[G·d, r]`` (ranks may exceed ``d``)."""
    (q, z_k, z_v, _, _), kwargs = make_inputs(B, H, G, Nq, Nk, d, r_k, r_v, dtype, **kw)
    z_k = z_k[:, :1].expand(B, G, Nk, r_k)
    z_v = z_v[:, :1].expand(B, G, Nk, r_v)
    P_k = torch.linalg.qr(torch.randn(G * d, r_k))[0].reshape(G, d, r_k).to(z_k.device)
    P_v = torch.linalg.qr(torch.randn(G * d, r_v))[0].reshape(G, d, r_v).to(z_k.device)
    return (q, z_k, z_v, P_k, P_v), kwargs


@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("path, Nq, splits", [("decode", 1, 1), ("decode_split", 1, 3), ("prefill", 23, 1)])
def test_shared_latents_read_through_stride0_views(path, Nq, splits, key_mode):
    """Bases shared by a layer's KV heads: every head reads the same latent through a stride-0 view, at ranks
    above the head dimension (40 and 72 against d = 32) and GQA 3."""
    args, kwargs = shared_inputs(2, 9, 3, Nq, 41, 32, 40, 72, torch.float16)
    check(args, kwargs, key_mode=key_mode, num_splits=splits, what=f"shared {path}")


def _out_of_shared_memory_above(monkeypatch, fits):
    """Make ``lk._launch`` raise Triton's OutOfResources for every config ``fits`` refuses, as a GPU does
    for tiles past its shared memory (the interpreter never does); returns the configs tried."""
    from triton.runtime.errors import OutOfResources

    tried, launch = [], lk._launch

    def launch_or_refuse(*args):
        cfg = args[13]
        tried.append(dict(cfg))
        if not fits(cfg):
            raise OutOfResources(300000, 232448, "shared memory")
        return launch(*args)

    monkeypatch.setattr(lk, "_launch", launch_or_refuse)
    monkeypatch.setattr(lk, "_FITTED", {})
    return tried


@pytest.mark.parametrize("path, Nq", [("decode", 1), ("prefill", 23)])
def test_ranks_above_d_retry_with_smaller_tiles(monkeypatch, path, Nq):
    """Ranks above the head dimension (shared bases) whose default tiles run out of shared memory launch
    again with one stage and smaller key tiles, give the reference's output, and the fitted config is
    remembered: the next call launches it first."""
    tried = _out_of_shared_memory_above(monkeypatch, lambda c: c["num_stages"] == 1 and c["block_n"] <= 16)
    args, kwargs = shared_inputs(2, 9, 3, Nq, 41, 32, 40, 72, torch.float16)
    check(args, kwargs, key_mode="pre_rope", what=f"smaller tiles {path}")
    assert tried[0]["num_stages"] > 1 and tried[-1]["num_stages"] == 1 and tried[-1]["block_n"] == 16
    n = len(tried)
    check(args, kwargs, key_mode="pre_rope", what="again")
    assert len(tried) == n + 1 and tried[-1]["block_n"] == 16


def test_prefill_at_ranks_above_d_falls_to_query_tiles_of_64_rows(monkeypatch):
    """The last step of the fitting: a prefill whose 128-row query tiles fit at no key tile launches with
    64-row ones (after one stage and 16-key tiles), and gives the reference's output."""
    tried = _out_of_shared_memory_above(monkeypatch, lambda c: c["block_m"] <= 64)
    args, kwargs = shared_inputs(1, 9, 3, 50, 50, 32, 40, 72, torch.float32)
    check(args, kwargs, key_mode="post_rope", what="64-row query tiles")
    assert tried[-1]["block_m"] == 64 and tried[-1]["block_n"] == 16 and tried[-1]["num_stages"] == 1


def test_ranks_no_tile_fits_are_refused_by_triton_and_left_to_the_reference_by_auto(monkeypatch, caplog):
    import stiefkv.kernels as kernels

    tried = _out_of_shared_memory_above(monkeypatch, lambda c: False)
    args, kwargs = shared_inputs(1, 6, 2, 1, 19, 32, 48, 40, torch.float32)
    message = (r"ranks \(48, 40\) at head dimension 32 need more shared memory than this GPU has \(300000 "
               r"bytes asked in tiles of 16 queries × 16 keys in 1 stage\(s\), the smallest tried\)")
    with pytest.raises(lk.TilesTooLarge, match=message):
        kernels.lowrank_attention(*args, **kwargs, backend="triton")
    n = len(tried)
    with pytest.raises(lk.TilesTooLarge, match=message):  # remembered: not compiled again, the same words
        kernels.lowrank_attention(*args, **kwargs, backend="triton")
    assert len(tried) == n
    # another kernel (latent output: no P_v) is tried afresh, not refused for the first one's failure
    with pytest.raises(lk.TilesTooLarge):
        kernels.lowrank_attention(*args[:4], None, **kwargs, backend="triton")
    assert len(tried) > n
    # tiles the caller chose are launched as given or refused, never shrunk
    n = len(tried)
    given = r"in tiles of 16 queries × 32 keys in 2 stage\(s\), as given"
    with pytest.raises(lk.TilesTooLarge, match=given):
        lk.lowrank_attention(*args, **kwargs, block_n=32, num_stages=2)
    assert len(tried) == n + 1
    monkeypatch.setattr(kernels, "_use_kernel", lambda *a, **k: True)  # as on a GPU
    before = kernels.reference_fallbacks()
    with caplog.at_level("WARNING", logger="stiefkv.kernels"):
        out = kernels.lowrank_attention(*args, **kwargs, backend="auto")
    assert "PyTorch reference" in caplog.text
    assert kernels.reference_fallbacks() == before + 1  # what stiefkv.generate checks before a capture
    with torch.no_grad():
        assert_close(out, reference(*args, **kwargs), atol=1e-5, rtol=1e-5, what="auto's fallback")
    # ranks ≤ d never take the fitting path: their tiles were measured to fit
    args, kwargs = make_inputs(1, 4, 2, 1, 19, 32, 24, 32, torch.float32)
    with pytest.raises(Exception, match="shared memory"):
        lk.lowrank_attention(*args, **kwargs)


# Shared bases at realistic sizes: SmolLM2 (G 3, d 64) at 50 %, Llama-3-8B heads (G 8, d 128) at 25 and 50 %.
SHARED_GPU_CASES = [
    ("smollm2_decode", 2, 9, 3, 1, 4099, 64, 96, 96),
    ("smollm2_prefill", 1, 9, 3, 1000, 1000, 64, 96, 96),
    ("llama8b_decode_12", 2, 32, 8, 1, 8195, 128, 128, 128),
    ("llama8b_decode_25", 2, 32, 8, 1, 8195, 128, 256, 256),
    ("llama8b_decode_50", 1, 32, 8, 1, 8195, 128, 512, 512),
    ("llama8b_prefill_25", 1, 32, 8, 777, 777, 128, 256, 256),
]


@gpu_only
@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("case", SHARED_GPU_CASES, ids=lambda c: c[0])
def test_shared_latents_realistic_sizes_gpu(case, key_mode):
    """Where no tile fits (``TilesTooLarge``: on the H200 ranks 512 at d 128, 2026-12-04), ``backend="auto"``
    gives the reference's output instead."""
    import stiefkv.kernels as kernels

    name, B, H, G, Nq, Nk, d, r_k, r_v = case
    args, kwargs = shared_inputs(B, H, G, Nq, Nk, d, r_k, r_v, torch.bfloat16, pos_offset=0)
    try:
        check(args, kwargs, key_mode=key_mode, what=f"{name} {key_mode}")
    except lk.TilesTooLarge:
        with torch.no_grad():
            out = kernels.lowrank_attention(*args, **kwargs, key_mode=key_mode, backend="auto")
            expected = reference(*args, **kwargs, key_mode=key_mode)
        assert_close(out, expected, atol=1.6e-2, rtol=1.6e-2, what=f"{name} {key_mode} auto")


@triton.jit
def _sincos_kernel(X, S, C, N: tl.constexpr, FAST: tl.constexpr):
    offs = tl.arange(0, N)
    if FAST:  # 2: the turns rounded by the add and subtract of ROUND_MAGIC (sincos_fadd)
        s, c = lk._sincos_fast(tl.load(X + offs), FAST == 2)
    else:
        s, c = lk._sincos(tl.load(X + offs))
    tl.store(S + offs, s)
    tl.store(C + offs, c)


@triton.jit
def _turns_kernel(X, K_FLOOR, K_FADD, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(X + offs)
    tl.store(K_FLOOR + offs, lk._turns(x, False))
    tl.store(K_FADD + offs, lk._turns(x, True))


def test_turns_rounded_by_fadd_equal_floor():
    """``sincos_fadd``'s whole turns (an add and a subtract of 1.5·2²³) are ``floor(x/2π + 0.5)``'s at every
    angle up to a 1M-token context's (position × θ₀ ≈ 1e6) and below zero, except at exact ties, where they
    differ by one turn (and the remainder is ±π either way)."""
    torch.manual_seed(7)
    x = torch.cat([torch.linspace(-10.0, 10.0, 509), (torch.rand(1543) - 0.3) * 1.05e6,
                   torch.tensor([0.0, math.pi, -math.pi, 3 * math.pi])]).to(DEVICE)
    real = x.numel()
    n = triton.next_power_of_2(real)
    x = torch.nn.functional.pad(x, (0, n - real))
    k_floor, k_fadd = torch.empty_like(x), torch.empty_like(x)
    _turns_kernel[(1,)](x, k_floor, k_fadd, N=n)
    x, k_floor, k_fadd = x[:real], k_floor[:real], k_fadd[:real]  # the padding's zeros are not compared
    # ties of the fp32 product (the GPU fuses it with the add, which can only move a value off a tie)
    tie = (x * lk.INV_TWO_PI.value).frac().abs() == 0.5
    assert torch.equal(k_fadd[~tie], k_floor[~tie])
    assert ((k_fadd[tie] - k_floor[tie]).abs() <= 1).all()
    assert (k_fadd != 0).sum() > real // 2  # the angles span many turns, both signs: not a zero output


@pytest.mark.parametrize(("fast", "atol"), [(0, 3e-7), pytest.param(1, 2e-6, marks=gpu_only),
                                            pytest.param(2, 2e-6, marks=gpu_only)],
                         ids=["polynomial", "hardware", "hardware_fadd"])
def test_sincos_large_angles(fast, atol):
    """The in-kernel sin/cos stays accurate at the angles a 128k context produces (position × θ₀ ≈ 1.3e5):
    the polynomial one everywhere, the hardware one (``fast_sincos``, after its 2π reduction, its turns
    rounded by ``FRND`` or by ``sincos_fadd``'s add and subtract) on CUDA."""
    x = torch.cat([torch.linspace(-10.0, 10.0, 512), torch.rand(512) * 131072.0]).to(DEVICE)
    s, c = torch.empty_like(x), torch.empty_like(x)
    _sincos_kernel[(1,)](x, s, c, N=1024, FAST=fast)
    x64 = x.double()
    assert_close(s, x64.sin().float(), atol=atol, rtol=0.0, what="sin")
    assert_close(c, x64.cos().float(), atol=atol, rtol=0.0, what="cos")


@gpu_only
@pytest.mark.parametrize("case", CASES[:5], ids=lambda c: f"{c[0]}-q{c[4]}k{c[5]}-r{c[7]}_{c[8]}")
def test_sincos_fadd_matches_reference(case):
    """``pre_rope`` decode with the turns rounded on the FMA pipe (``sincos_fadd``) gives the reference's
    attention, compiled (the interpreter has no hardware sin/cos), at positions past 100k as well."""
    path, B, H, G, Nq, Nk, d, r_k, r_v, splits, padded, bias, pv = case
    args, kwargs = make_inputs(B, H, G, Nq, Nk, d, r_k, r_v, torch.bfloat16, padded=padded, bias=bias, pv=pv)
    check(args, kwargs, key_mode="pre_rope", num_splits=splits, sincos_fadd=True, what=f"sincos_fadd {path}")
    far = dict(kwargs, positions=kwargs["positions"] + 100_003)
    check(args, far, key_mode="pre_rope", num_splits=splits, sincos_fadd=True, what=f"sincos_fadd far {path}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's refusal")
def test_fast_sincos_is_refused_by_the_interpreter():
    args, kwargs = make_inputs(1, 4, 2, 1, 8, 32, 8, 8, torch.float32)
    with torch.no_grad(), pytest.raises(ValueError, match="fast_sincos=True needs a CUDA device"):
        lk.lowrank_attention(*args, **kwargs, key_mode="pre_rope", fast_sincos=True)
    with torch.no_grad(), pytest.raises(ValueError, match="sincos_fadd=True .* needs fast_sincos"):
        lk.lowrank_attention(*args, **kwargs, key_mode="pre_rope", sincos_fadd=True)


def test_refuses_bad_inputs(monkeypatch):
    args, kwargs = make_inputs(1, 4, 2, 1, 8, 32, 8, 8, torch.float32)
    q, z_k, z_v, P_k, P_v = args
    with pytest.raises(ValueError, match="P_k must be"):
        lk.lowrank_attention(q, z_k, z_v, P_k[:, :, :4], P_v, **kwargs)
    with pytest.raises(ValueError, match="needs the key positions"):
        lk.lowrank_attention(*args, **dict(kwargs, positions=None), key_mode="pre_rope")
    with pytest.raises(ValueError, match="multiple of KV heads"):
        lk.lowrank_attention(q[:, :3], z_k, z_v, P_k, P_v, **kwargs)
    with pytest.raises(RuntimeError, match="inference-only"):
        lk.lowrank_attention(q.requires_grad_(), z_k, z_v, P_k, P_v, **kwargs)
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="runs on CUDA tensors"):
            lk.lowrank_attention(q.detach(), z_k, z_v, P_k, P_v, **kwargs)


# Realistic sizes on the GPU: Llama-3-8B heads (H = 32, G = 8, d = 128), 50 % and 25 % budgets.
GPU_CASES = [
    ("decode_8k", 2, 1, 8195, 64, 64, None),  # default split heuristic, one row padded
    ("decode_32k_latent", 1, 1, 32768, 32, 32, None),
    ("decode_odd_rank", 4, 1, 4099, 40, 56, None),
    ("prefill_4k", 1, 4096, 4096, 64, 64, None),
    ("prefill_chunk", 2, 512, 3000, 32, 48, None),
    ("prefill_odd_rank", 1, 1000, 1000, 56, 40, None),  # key rank padded to 64 for prefill (_pad_rank)
]


@gpu_only
@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c[0])
def test_realistic_sizes_gpu(case, key_mode):
    name, B, Nq, Nk, r_k, r_v, splits = case
    args, kwargs = make_inputs(B, 32, 8, Nq, Nk, 128, r_k, r_v, torch.bfloat16, pv="latent" not in name,
                               pos_offset=0)
    check(args, kwargs, key_mode=key_mode, num_splits=splits, what=f"{name} {key_mode}")
    if key_mode == "pre_rope":
        check(args, kwargs, key_mode=key_mode, num_splits=splits, fast_sincos=False,
              what=f"{name} polynomial sin/cos")


@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("path, Nq, splits, padded", [
    ("decode", 1, 1, True), ("decode_split", 1, 3, True), ("chunk", 19, 1, True),
    ("chunk_unpadded", 7, 1, False)])
def test_valid_count_from_device(path, Nq, splits, padded, key_mode):
    """A static cache's buffers hold ``Nk`` slots of which the first ``n_valid`` (a device int32) are keys:
    the kernel reads the count from memory and gives what the reference gives on those keys alone. The
    unfilled slots hold NaN, which any read of them would spread."""
    B, G, n, slots = 2, 3, 53, 90
    args, kwargs = make_inputs(B, 6, G, Nq, n, 64, 24, 40, torch.float32, padded=padded)
    q, z_k, z_v, P_k, P_v = args
    expected_args = args
    big = [torch.full((B, G, slots, z.shape[3]), float("nan"), device=DEVICE) for z in (z_k, z_v)]
    big[0][:, :, :n], big[1][:, :, :n] = z_k, z_v
    pos = torch.zeros(B, slots, dtype=kwargs["positions"].dtype, device=DEVICE)
    pos[:, :n] = kwargs["positions"]
    bias = torch.full((B, G, slots), float("nan"), device=DEVICE)
    bias[..., :n] = kwargs["bias"]
    n_valid = torch.tensor([n], dtype=torch.int32, device=DEVICE)
    static = dict(kwargs, positions=pos, bias=bias, n_valid=n_valid, key_mode=key_mode)
    with torch.no_grad():
        out = lk.lowrank_attention(q, *big, P_k, P_v, **static, num_splits=splits)
        expected = reference(*expected_args, **kwargs, key_mode=key_mode)
        from_reference = reference(q, *big, P_k, P_v, **static)
    assert_close(out, expected, atol=1e-4, rtol=1e-4, what=f"n_valid {path} {key_mode}")
    assert_close(from_reference, expected, atol=1e-5, rtol=1e-5, what="reference with n_valid")
    n_valid.fill_(n - 4)  # the same launch reads the new count: nothing was baked in on the host
    with torch.no_grad():
        out = lk.lowrank_attention(q, *big, P_k, P_v, **static, num_splits=splits)
        cut = dict(kwargs, positions=kwargs["positions"][:, : n - 4], bias=kwargs["bias"][..., : n - 4],
                   key_mode=key_mode)
        if kwargs["lengths"] is not None:
            cut["lengths"] = (kwargs["lengths"] - 4).clamp(min=0)
            static["lengths"] = cut["lengths"]
            out = lk.lowrank_attention(q, *big, P_k, P_v, **static, num_splits=splits)
        expected = reference(q, z_k[:, :, : n - 4], z_v[:, :, : n - 4], P_k, P_v, **cut)
    assert_close(out, expected, atol=1e-4, rtol=1e-4, what=f"n_valid moved {path} {key_mode}")


def test_valid_count_bad_input():
    args, kwargs = make_inputs(1, 2, 1, 1, 20, 32, 16, 16, torch.float32, padded=False)
    with pytest.raises(ValueError, match="n_valid must be one int32"):
        lk.lowrank_attention(*args, **kwargs, n_valid=torch.tensor([3, 4], dtype=torch.int32))


def quantize_latents(z: torch.Tensor, bits: int):
    """``z`` in ``stiefkv.quant``'s token layout, as the kernels read it."""
    from stiefkv.kernels import QuantizedLatents
    from stiefkv.quant import QuantSpec, quantize

    qz = quantize(z.float().cpu(), QuantSpec(bits, "token"))
    return QuantizedLatents(qz.codes.to(z.device), qz.scale.to(z.device), qz.low.to(z.device), bits, qz.rank)


# (path, B, H, G, Nq, Nk, r_k, r_v, splits): ranks below, at and across a 64-channel scale group, odd ones
QUANT_CASES = [
    ("decode", 2, 8, 2, 1, 77, 24, 40, 1),
    ("decode_split", 1, 6, 3, 1, 150, 64, 72, 3),  # one row: the dearest case under the interpreter
    ("prefill", 1, 4, 2, 37, 37, 40, 24, 1),
    ("prefill_chunk", 2, 6, 2, 19, 61, 72, 32, 1),
    ("decode_odd", 1, 4, 2, 1, 90, 25, 41, 2),  # odd ranks: a last byte with one nibble, split keys
    ("decode_narrow", 1, 4, 2, 1, 40, 13, 16, 1),  # padded ranks below 32: int4 interleaved, not split
    # three queries in the decode tile over 284 keys (full tiles, then the causal one), GQA 3, ranks padded
    # to 16: where the 256-key int4 tile gave wrong logits on the H200
    ("decode_multi", 2, 6, 2, 3, 284, 11, 13, 1),
    # full rank, r = d: the ranks --bits auto keeps at 50 %; two scale groups a token
    ("decode_full", 1, 8, 2, 1, 150, 128, 128, 2),
]


@pytest.mark.parametrize("bits", [8, 4, 3, 2])
@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("case", QUANT_CASES, ids=lambda c: f"{c[0]}-G{c[3]}-q{c[4]}k{c[5]}-r{c[6]}_{c[7]}")
def test_quantized_latents_match_the_reference(case, key_mode, bits):
    """int8 and packed int4 codes (token layout, fp16 scales), dequantized in registers or with the scales
    folded into logits and probabilities (``fold_scales``: ranks within one scale group), against the
    reference on the dequantized latents (bf16 queries; the reference's dequantization checked against
    ``stiefkv.quant``'s)."""
    from stiefkv.quant import QuantSpec, dequantize, quantize

    path, B, H, G, Nq, Nk, r_k, r_v, splits = case
    args, kwargs = make_inputs(B, H, G, Nq, Nk, 128, r_k, r_v, torch.bfloat16)
    q, z_k, z_v, P_k, P_v = args
    qk, qv = quantize_latents(z_k, bits), quantize_latents(z_v, bits)
    expected_zk = dequantize(quantize(z_k.float().cpu(), QuantSpec(bits, "token")), torch.bfloat16)
    assert torch.equal(qk.dequantize(torch.bfloat16).cpu(), expected_zk)
    # (P_v, fold_scales, prefetch, nibbles, nibble_rebuild, nibble_fold, keys_left)
    variants = [(P_v, False, False, False, False, False, False), (None, *[False] * 6),
                (P_v, True, False, False, False, False, False), (None, True, *[False] * 5),
                (P_v, False, True, False, False, False, False), (P_v, False, True, True, False, False, False),
                (None, False, False, True, True, False, False), (P_v, False, True, True, True, True, False),
                (P_v, False, True, True, True, True, True)]
    for pv, fold, ahead, nib, rebuild, nib_fold, left in variants:
        with torch.no_grad():
            out = lk.lowrank_attention(q, qk, qv, P_k, pv, key_mode=key_mode, **kwargs, num_splits=splits,
                                       fold_scales=fold, prefetch=ahead, nibbles=nib, nibble_rebuild=rebuild,
                                       nibble_fold=nib_fold, keys_left=left)
            expected = reference(q, qk.dequantize(torch.bfloat16), qv.dequantize(torch.bfloat16), P_k, pv,
                                 key_mode=key_mode, **kwargs)
        atol, rtol = TOL[torch.bfloat16]
        if fold:  # two bf16 roundings apart: the reference rounds the latents, the fold rounds p·scale
            atol, rtol = 2 * atol, 2 * rtol
        what = (f"int{bits} {path} {key_mode} P_v={pv is not None} fold={fold} prefetch={ahead} "
                f"nibbles={nib} rebuild={rebuild} nibble_fold={nib_fold} keys_left={left}")
        assert_close(out, expected, atol=atol, rtol=rtol, what=what)
    # mixed: quantized keys over float values
    atol, rtol = TOL[torch.bfloat16]
    with torch.no_grad():
        out = lk.lowrank_attention(q, qk, z_v, P_k, P_v, key_mode=key_mode, **kwargs, num_splits=splits)
        expected = reference(q, qk, z_v, P_k, P_v, key_mode=key_mode, **kwargs)
    assert_close(out, expected, atol=atol, rtol=rtol, what=f"int{bits} keys, bf16 values")


# (B, H, G, Nk, r_k, r_v, splits): ranks at and across a scale group, padded ones (28 → 32, 44 → 64: words
# past the rank masked), full rank with two groups, and 25 (stored as 32 codes: the word holding channel 24
# read whole, its padding codes meeting zero basis rows)
PAIR_CASES = [(1, 6, 3, 150, 64, 72, 3), (2, 4, 2, 90, 28, 44, 2), (1, 8, 2, 150, 128, 128, 2),
              (1, 4, 2, 77, 25, 36, 1)]  # the two dear cases at one row, a cheap one at two


@pytest.mark.parametrize("log8", [False, True])
@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("case", PAIR_CASES, ids=lambda c: f"G{c[2]}-k{c[3]}-r{c[4]}_{c[5]}-s{c[6]}")
def test_int8_pairs_match_the_reference(case, key_mode, log8):
    """int8 codes read as 32-bit words and met as two tiles of channel pairs (``pairs``: channels ``4w + j``
    and ``4w + 2 + j``, the query's or basis's matching halves, two value halves joined at the end), with
    prefetch (without it ``pairs`` falls back to the bytes' loop), decoded late, latent or projected output,
    against the reference on the dequantized latents; and the same as the bytes' loop within rounding."""
    B, H, G, Nk, r_k, r_v, splits = case
    args, kwargs = make_inputs(B, H, G, 1, Nk, 128, r_k, r_v, torch.bfloat16)
    q, z_k, z_v, P_k, P_v = args
    z_k = z_k * 3  # scales several octaves apart from the values'
    codes = log8_latents if log8 else quantize_latents
    qk, qv = codes(z_k, 8), codes(z_v, 8)
    atol, rtol = TOL[torch.bfloat16]
    for pv, extra in [(P_v, dict(prefetch=True)), (None, dict(prefetch=True)), (None, dict(prefetch=False)),
                      (P_v, dict(prefetch=True, late_values=True))]:
        with torch.no_grad():
            out = lk.lowrank_attention(q, qk, qv, P_k, pv, key_mode=key_mode, **kwargs, num_splits=splits,
                                       pairs=True, **extra)
            plain = lk.lowrank_attention(q, qk, qv, P_k, pv, key_mode=key_mode, **kwargs, num_splits=splits,
                                         pairs=False, **extra)
            expected = reference(q, qk.dequantize(torch.bfloat16), qv.dequantize(torch.bfloat16), P_k, pv,
                                 key_mode=key_mode, **kwargs)
        what = f"int8 pairs r{r_k}/{r_v} {key_mode} log8={log8} P_v={pv is not None} {extra}"
        assert_close(out, expected, atol=atol, rtol=rtol, what=what)
        assert_close(out, plain, atol=atol, rtol=rtol, what=what + " against the bytes' loop")
        if pv is not None and extra == dict(prefetch=True):  # the default decode over int8 codes is this loop
            with torch.no_grad():
                default = lk.lowrank_attention(q, qk, qv, P_k, pv, key_mode=key_mode, **kwargs,
                                               num_splits=splits)
            assert torch.equal(default, out), what + ": the default configuration is not the pairs loop"


@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
def test_decode_over_codes_defaults(key_mode):
    """Decode over codes turns ``pairs``, ``planes`` and ``channel_rows`` on (the launcher applies each to
    the codes it fits); ``pre_rope`` over int8, int2 or channel-layout keys wider than 64 channels takes
    64-key tiles, and so do int3 keys and wide channel-layout keys of either mode under ``lengths``; bf16
    latents and int4 token-layout keys keep their tiles. ``pre_rope`` int3 channel-layout keys are met as
    planes (``int3_planes``)."""
    for r_k, bits, channel, padded in [(128, 8, False, False), (100, 8, False, True), (64, 8, False, False),
                                       (128, 4, False, True), (40, 8, False, False), (112, 2, False, False),
                                       (112, 2, True, False), (112, 4, True, False), (112, 3, True, True),
                                       (64, 2, True, True), (56, 4, True, False), (128, 3, False, False),
                                       (72, 3, False, True), (128, 3, True, False)]:
        cfg = lk._default_config(2, 4096, key_mode, 16, 132, r_k, True, bits, k_channel=channel,
                                 left_padded=padded)
        assert cfg["pairs"] and cfg["planes"] and cfg["channel_rows"] and cfg["prefetch"]
        assert not cfg["nibble_words"]  # a candidate, not timed to win
        assert cfg["int3_planes"] == (key_mode == "pre_rope" and bits == 3 and channel)
        wide = r_k > 64
        narrow = wide and ((key_mode == "pre_rope" and (bits in (8, 3, 2) or channel))
                           or (channel and padded))
        assert cfg["block_n"] == (64 if narrow else 128), (r_k, bits, channel, padded, cfg)
        assert cfg["sincos_fadd"] == (bits != 3)  # timed slower over int3 keys only (H100, 2026-12-06)
    bf16 = lk._default_config(2, 4096, key_mode, 16, 132, 128, False, 16)
    assert not (bf16["pairs"] or bf16["planes"] or bf16["channel_rows"]) and bf16["sincos_fadd"]


@pytest.mark.parametrize("ranks", [(56, 48), (64, 64), (64, 72), (11, 13), (16, 16), (40, 13)])
def test_wide_int4_tiles_span_several_tiles_and_splits(ranks):
    """``post_rope`` decode over int4 token-layout keys and values takes 256-key tiles (``nibbles_kv``) at
    padded ranks of 32 to 64, and only there: 700 keys in 2 splits (a split of two full tiles, one of a
    partial one), against the reference and against the 128-key tile. Ranks padded to 16 keep the 128-key
    tile: there the wide tile's loop gave wrong logits on the H200 (the default tile of this test then
    failed at r 11/13 and 16/16)."""
    r_k, r_v = ranks
    wide_ranks = all(32 <= lk.padded_dim(r) <= 64 for r in ranks)
    wide = lk._default_config(2, 700, "post_rope", 2, 132, r_k, True, 4, nibbles_kv=wide_ranks)
    assert wide["block_n"] == (lk.WIDE_NIBBLE_TILE if wide_ranks else 128)
    assert wide["prefetch"] == (not wide_ranks)  # the wide tile leaves copies to the pipeliner
    assert lk._default_config(2, 700, "pre_rope", 2, 132, r_k, True, 4, nibbles_kv=True)["block_n"] == 128
    args, kwargs = make_inputs(1, 4, 2, 1, 700, 128, r_k, r_v, torch.bfloat16)
    q, z_k, z_v, P_k, P_v = args
    qk, qv = quantize_latents(z_k, 4), quantize_latents(z_v, 4)
    assert (lk._token_int4(qk) and lk._token_int4(qv)) == wide_ranks  # what the call passes
    with torch.no_grad():
        expected = reference(q, qk.dequantize(torch.bfloat16), qv.dequantize(torch.bfloat16), P_k, P_v,
                             key_mode="post_rope", **kwargs)
        out = lk.lowrank_attention(q, qk, qv, P_k, P_v, key_mode="post_rope", **kwargs, num_splits=2)
        narrow = lk.lowrank_attention(q, qk, qv, P_k, P_v, key_mode="post_rope", **kwargs, num_splits=2,
                                      block_n=128)
        fetched = lk.lowrank_attention(q, qk, qv, P_k, P_v, key_mode="post_rope", **kwargs, num_splits=2,
                                       prefetch=True)
    atol, rtol = TOL[torch.bfloat16]
    assert_close(out, expected, atol=atol, rtol=rtol, what=f"int4 post_rope r{r_k}/{r_v}, default tile")
    assert_close(out, narrow, atol=atol, rtol=rtol, what=f"int4 post_rope r{r_k}/{r_v}, 256 against 128")
    assert_close(fetched, expected, atol=atol, rtol=rtol, what=f"int4 post_rope r{r_k}/{r_v}, prefetch")


def test_logits_ahead_is_the_default_where_it_was_measured_to_win():
    """``pre_rope`` decode over bf16 latents at d 128 and r 64 (64-key tiles) forms its logits one tile
    ahead, with ``q kᵀ`` logits, where each split holds ≥ AHEAD_KEYS keys: 16×16k and 4×128k at Llama-3-8B's
    heads; not 1×32k's ~1000 keys a split, nor codes, ``post_rope``, d 64 or r 32 (not measured, or lost)."""
    def cfg(n_k, programs, key_mode="pre_rope", r=64, codes=False, bits=16, d=128):
        return lk._default_config(4, n_k, key_mode, programs, 132, r, codes, bits, head_dim=d)

    for n_k, programs in ((16384, 16 * 8), (131072, 4 * 8)):
        taken = cfg(n_k, programs)
        assert taken["ahead"] and not taken["keys_left"]
        assert n_k >= lk.AHEAD_KEYS * taken["num_splits"]
    one = cfg(32768, 8)
    assert one["num_splits"] > 8 and not one["ahead"] and one["keys_left"]
    for other in (cfg(131072, 32, "post_rope"), cfg(131072, 32, codes=True, bits=4), cfg(131072, 32, d=64),
                  cfg(131072, 32, r=32)):
        assert not other["ahead"]
    assert cfg(131072, 32, codes=True, bits=4)["keys_left"]  # int4 keys keep their keys_left


def test_int4_keys_at_a_padded_rank_take_q_k_logits():
    """``keys_left`` over int4 keys at r 64 (measured faster) but not at r 56, padded to 64 (measured slower
    at three shapes); bf16 latents keep it at both."""
    def cfg(r, bits, n_k=131072, programs=32):
        return lk._default_config(4, n_k, "pre_rope", programs, 132, r, bits < 16, bits)

    assert cfg(64, 4)["keys_left"] and not cfg(56, 4)["keys_left"] and not cfg(40, 4)["keys_left"]
    assert cfg(56, 16, n_k=32768, programs=8)["keys_left"] and not cfg(64, 8)["keys_left"]


@pytest.mark.parametrize("ranks", [(64, 64), (40, 50), (64, 30)])
def test_int2_post_rope_takes_two_warps_and_twice_the_splits(ranks):
    """``post_rope`` decode over int2 token-layout keys and values at a padded rank of 64 (both) runs 2 warps
    on 128-key tiles with twice the rule's splits; ``pre_rope``, log8 scales, other ranks and int4 keep the
    rule. The default call (700 keys, GQA 4, splits of 2× the rule) against the reference."""
    r_k, r_v = ranks
    rule = lk._default_config(2, 700, "post_rope", 2, 132, r_k, True, 2)
    taken = lk._default_config(2, 700, "post_rope", 2, 132, r_k, True, 2, int2_kv=True)
    assert rule["num_warps"] == 4 and (taken["num_warps"], taken["block_n"]) == (2, 128)
    assert taken["num_splits"] == 2 * rule["num_splits"] and taken["planes"] and taken["prefetch"]
    assert lk._default_config(2, 700, "pre_rope", 2, 132, r_k, True, 2, int2_kv=True)["num_warps"] == 4
    # where the rule gives one split (two programs an SM and more), not measured: the rule stays
    many = lk._default_config(2, 700, "post_rope", 264, 132, r_k, True, 2, int2_kv=True)
    assert many["num_splits"] == 1 and many["num_warps"] == 4
    args, kwargs = make_inputs(1, 8, 2, 1, 700, 128, r_k, r_v, torch.bfloat16)
    q, z_k, z_v, P_k, P_v = args
    qk, qv = quantize_latents(z_k, 2), quantize_latents(z_v, 2)
    both = all(lk.padded_dim(r) == 64 for r in ranks)
    assert (lk._token_int2(qk) and lk._token_int2(qv)) == both  # what the call passes
    from stiefkv.kernels import QuantizedLatents
    from stiefkv.quant import QuantSpec, quantize

    log8 = quantize(z_k.float().cpu(), QuantSpec(2, "token", log8=True))
    assert not lk._token_int2(QuantizedLatents(log8.codes, log8.scale, log8.low, 2, log8.rank, log8=True))
    assert not lk._token_int2(quantize_latents(z_k, 4))
    launched = lk.lowrank_attention(q, qk, qv, P_k, P_v, key_mode="post_rope", **kwargs, return_config=True)
    assert launched["num_warps"] == (2 if both else 4)
    with torch.no_grad():
        expected = reference(q, qk.dequantize(torch.bfloat16), qv.dequantize(torch.bfloat16), P_k, P_v,
                             key_mode="post_rope", **kwargs)
        out = lk.lowrank_attention(q, qk, qv, P_k, P_v, key_mode="post_rope", **kwargs)
    atol, rtol = TOL[torch.bfloat16]
    assert_close(out, expected, atol=atol, rtol=rtol, what=f"int2 post_rope r{r_k}/{r_v}, default")


@pytest.mark.parametrize("bits,ranks,key_mode", [(4, (56, 48), "post_rope"), (4, (40, 72), "pre_rope"),
                                                  (8, (24, 40), "post_rope")])
def test_late_values_decode_the_same_tile(bits, ranks, key_mode):
    """``late_values`` (value codes decoded just before the value dot) against the reference and against the
    default loop: int4 nibbles (wide and 128-key tiles) and int8 codes, 600 keys over 3 splits, GQA 5."""
    r_k, r_v = ranks
    args, kwargs = make_inputs(2, 10, 2, 1, 600, 128, r_k, r_v, torch.bfloat16)
    q, z_k, z_v, P_k, P_v = args
    qk, qv = quantize_latents(z_k, bits), quantize_latents(z_v, bits)
    with torch.no_grad():
        expected = reference(q, qk.dequantize(torch.bfloat16), qv.dequantize(torch.bfloat16), P_k, P_v,
                             key_mode=key_mode, **kwargs)
        # late_values needs the prefetch, which the wide int4 tile no longer takes by default
        late = lk.lowrank_attention(q, qk, qv, P_k, P_v, key_mode=key_mode, **kwargs, num_splits=3,
                                    late_values=True, prefetch=True)
        default = lk.lowrank_attention(q, qk, qv, P_k, P_v, key_mode=key_mode, **kwargs, num_splits=3,
                                       prefetch=True)
    atol, rtol = TOL[torch.bfloat16]
    assert_close(late, expected, atol=atol, rtol=rtol, what=f"int{bits} {key_mode}, late values")
    assert_close(late, default, atol=atol, rtol=rtol, what=f"int{bits} {key_mode}, late against default")


@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("bits,ranks,nq", [(4, (40, 24), 37), (8, (56, 48), 19), (4, (64, 33), 70)])
def test_prefill_over_codes_in_key_slices(key_mode, bits, ranks, nq):
    """``code_slice``: prefill over codes with keys dequantized a slice at a time (64 keys: several slices,
    the last holding the queries' own keys after an aligned start) against the reference and the whole
    call: GQA 3, left padding that ends inside a slice, per-key bias, the value basis applied and not."""
    r_k, r_v = ranks
    args, kwargs = make_inputs(2, 6, 2, nq, 300, 64, r_k, r_v, torch.bfloat16)
    q, z_k, z_v, P_k, P_v = args
    qk, qv = quantize_latents(z_k, bits), quantize_latents(z_v, bits)
    atol, rtol = TOL[torch.bfloat16]
    with torch.no_grad():
        for pv in (P_v, None):
            expected = reference(q, qk.dequantize(torch.bfloat16), qv.dequantize(torch.bfloat16), P_k, pv,
                                 key_mode=key_mode, **kwargs)
            sliced, lse = lk.lowrank_attention(q, qk, qv, P_k, pv, key_mode=key_mode, **kwargs, code_slice=64,
                                               return_lse=True)
            whole, lse_whole = lk.lowrank_attention(q, qk, qv, P_k, pv, key_mode=key_mode, **kwargs,
                                                    return_lse=True)
            what = f"int{bits} {key_mode} r{r_k}/{r_v} Nq {nq}, P_v {'given' if pv is not None else 'None'}"
            assert_close(sliced, expected, atol=atol, rtol=rtol, what=what + ", sliced")
            assert_close(sliced, whole, atol=atol, rtol=rtol, what=what + ", sliced against whole")
            # the slices meet bf16 latents, the whole call fp16 ones (codes in registers): logits differ by
            # bf16's rounding of a latent, ~4e-3 of a logit
            seen = torch.isfinite(lse_whole)  # −inf: a padded query that sees no key, in both
            assert torch.equal(torch.isfinite(lse), seen), what
            assert_close(lse[seen], lse_whole[seen], atol=2e-2, rtol=4e-3, what=what + ", log-sum-exp")


def test_prefill_over_codes_in_key_slices_reads_n_valid_and_continues_a_prior():
    """Sliced prefill over a static cache's buffer (``n_valid`` of 250 in 320 slots: the rest never read)
    and after a ``prior`` attention over other keys, against the whole call."""
    args, kwargs = make_inputs(2, 8, 2, 23, 320, 64, 40, 24, torch.bfloat16, padded=False)
    q, z_k, z_v, P_k, _ = args
    qk, qv = quantize_latents(z_k, 4), quantize_latents(z_v, 4)
    n_valid = torch.tensor([250], dtype=torch.int32, device=q.device)
    junk = dict(qk._asdict())
    junk["codes"] = qk.codes.clone()
    junk["codes"][:, :, 250:] = 255  # slots past n_valid: never read
    qk_junk = type(qk)(**junk)
    cut = {k: (v[..., :250] if k in ("positions", "bias") and v is not None else v)
           for k, v in kwargs.items()}
    other, _ = make_inputs(2, 8, 2, 23, 40, 64, 40, 24, torch.bfloat16, padded=False)
    with torch.no_grad():
        prior = lk.lowrank_attention(q, other[1], other[2], P_k, None, key_mode="post_rope", causal=False,
                                     return_lse=True)
        kw = {k: v for k, v in kwargs.items() if k != "lengths"}
        sliced = lk.lowrank_attention(q, qk_junk, qv, P_k, None, key_mode="post_rope", **kw, n_valid=n_valid,
                                      code_slice=64, prior=prior)
        cut.pop("lengths")
        whole = lk.lowrank_attention(q, lk._slice_keys(qk, 0, 250), lk._slice_keys(qv, 0, 250), P_k, None,
                                     key_mode="post_rope", **cut, prior=prior)
    atol, rtol = TOL[torch.bfloat16]
    assert_close(sliced, whole, atol=atol, rtol=rtol, what="sliced over n_valid after a prior")


def log8_latents(z: torch.Tensor, bits: int):
    """``z`` ``[B, G, N, r]`` quantized by ``stiefkv.quant`` with log8 scales (one uint8 code a group)."""
    from stiefkv.kernels import QuantizedLatents
    from stiefkv.quant import QuantSpec, quantize

    qz = quantize(z.float().cpu(), QuantSpec(bits, "token", log8=True))
    return QuantizedLatents(qz.codes.to(z.device), qz.scale.to(z.device), None, bits, qz.rank, log8=True)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("case", QUANT_CASES, ids=lambda c: f"{c[0]}-G{c[3]}-q{c[4]}k{c[5]}-r{c[6]}_{c[7]}")
def test_log8_codes_match_the_reference(case, key_mode, bits):
    """Codes with log8 scales (a uint8 code a group, decoded in registers: a mantissa of eight constants
    times a power of two, the symmetric low) read in place, against the reference on the latents
    ``stiefkv.quant`` dequantizes; every loop the codes take (plain, prefetched, folded, nibbles)."""
    from stiefkv.quant import QuantSpec, dequantize, quantize

    path, B, H, G, Nq, Nk, r_k, r_v, splits = case
    args, kwargs = make_inputs(B, H, G, Nq, Nk, 128, r_k, r_v, torch.bfloat16)
    q, z_k, z_v, P_k, P_v = args
    z_k, z_v = z_k * 3, z_v * 0.3  # scales several octaves apart
    qk, qv = log8_latents(z_k, bits), log8_latents(z_v, bits)
    expected_zk = dequantize(quantize(z_k.float().cpu(), QuantSpec(bits, "token", log8=True)), torch.float32)
    assert torch.equal(qk.dequantize(torch.float32).cpu(), expected_zk)
    atol, rtol = TOL[torch.bfloat16]
    variants = [dict(prefetch=False, nibbles=False), dict(prefetch=True, nibbles=False),
                dict(fold_scales=True), dict(prefetch=False, nibbles=True),
                dict(prefetch=True, nibbles=True, nibble_rebuild=True, nibble_fold=True)]
    for pv, extra in [(P_v, v) for v in variants] + [(None, variants[1])]:
        with torch.no_grad():
            out = lk.lowrank_attention(q, qk, qv, P_k, pv, key_mode=key_mode, **kwargs, num_splits=splits,
                                       **extra)
            expected = reference(q, qk.dequantize(torch.bfloat16), qv.dequantize(torch.bfloat16), P_k, pv,
                                 key_mode=key_mode, **kwargs)
        scale = 2 if extra.get("fold_scales") else 1  # p·scale rounded to bf16 (see the test above)
        assert_close(out, expected, atol=scale * atol, rtol=scale * rtol,
                     what=f"log8 int{bits} {path} {key_mode} P_v={pv is not None} {extra}")


def test_quantized_latents_bad_input():
    args, kwargs = make_inputs(1, 2, 1, 1, 20, 32, 16, 16, torch.bfloat16, padded=False)
    q, z_k, z_v, P_k, P_v = args
    qk = quantize_latents(z_k, 4)
    with pytest.raises(ValueError, match="reads 8 or 4 or 3 or 2-bit codes, got 5"):
        lk.lowrank_attention(q, qk._replace(bits=5), z_v, P_k, P_v, **kwargs)
    q3 = quantize_latents(z_k, 3)  # rank 16: two words of three bytes; one byte short is refused
    with pytest.raises(ValueError, match=r"≥ 6\] for rank 16 at 3 bits"):
        lk.lowrank_attention(q, q3._replace(codes=q3.codes[..., :5]), z_v, P_k, P_v, **kwargs)
    with pytest.raises(ValueError, match="scale must be float16"):
        lk.lowrank_attention(q, qk._replace(scale=qk.scale.float()), z_v, P_k, P_v, **kwargs)
    q8 = log8_latents(z_k, 4)
    with pytest.raises(ValueError, match="scale must be uint8 .*log8 codes"):
        lk.lowrank_attention(q, q8._replace(scale=q8.scale.half()), z_v, P_k, P_v, **kwargs)
    with pytest.raises(ValueError, match="log8 scale codes are per token"):
        lk.lowrank_attention(q, q8._replace(layout="channel"), z_v, P_k, P_v, **kwargs)


@pytest.mark.parametrize("attend", ["kernel", "reference"])
def test_malformed_codes_are_refused_by_the_kernel_and_the_reference(attend):
    """The PyTorch reference ran none of the kernel's checks of the codes: a scale of the wrong shape or
    dtype, a row of codes too narrow, a channel layout with log8 scales went into the dequantization
    (broadcast, or an error inside torch), so code tested on a CPU broke on a GPU. Both refuse them now,
    naming the tensor."""
    args, kwargs = make_inputs(1, 4, 2, 1, 70, 64, 40, 24, torch.float32, padded=False)
    q, z_k, z_v, P_k, P_v = args
    attention = lk.lowrank_attention if attend == "kernel" else reference
    qk, qv = quantize_latents(z_k, 4), quantize_latents(z_v, 4)
    q3, q8 = quantize_latents(z_k, 3), log8_latents(z_k, 4)
    bad = {
        r"z_k\.codes must be uint8 \[B, G, N, ≥ 15\] for rank 40 at 3 bits":
            q3._replace(codes=q3.codes[..., :14]),
        r"z_k\.codes must be uint8": qk._replace(codes=qk.codes.to(torch.int16)),
        r"z_k\.scale must be float16 \[1, 2, 70, 1\]": qk._replace(scale=qk.scale.float()),
        r"z_k\.low must be float16 \[1, 2, 70, 1\]": qk._replace(low=qk.low[:, :, :69]),
        r"z_k\.scale must be float16 \[1, 2, 70, 1\] \(token layout\)": qk._replace(scale=qk.scale[:, :1]),
        r"z_k\.scale must be uint8 .*log8 codes": q8._replace(scale=q8.scale.half()),
        "z_k: log8 scale codes are per token": q8._replace(layout="channel"),
        "z_k.layout must be 'token' or 'channel'": qk._replace(layout="tokens"),
    }
    for message, z in bad.items():
        with pytest.raises(ValueError, match=message):
            attention(q, z, z_v, P_k, P_v, **kwargs)
    with pytest.raises(ValueError, match=r"z_v\.scale must be float16"):
        attention(q, z_k, qv._replace(scale=qv.scale.bfloat16()), P_k, P_v, **kwargs)
    wide = q3._replace(codes=torch.cat([q3.codes, torch.zeros_like(q3.codes[..., :2])], -1))  # 17 ≥ 15 bytes
    assert_close(attention(q, wide, z_v, P_k, P_v, **kwargs), reference(q, q3, z_v, P_k, P_v, **kwargs),
                 atol=2e-5, rtol=2e-5, what="3-bit codes in rows wider than they need")
    for bits in (5, 9):
        with pytest.raises(ValueError, match=f"z_k.* 8 or 4 or 3 or 2.*, got {bits}"):
            attention(q, qk._replace(bits=bits), z_v, P_k, P_v, **kwargs)


def test_decode_splits():
    """Split counts: the four benchmark shapes keep their measured counts, rounds between one and two
    programs per SM are filled, enough programs take none, and a short cache is not split past 256 keys."""
    from stiefkv.kernels.lowrank import _decode_splits

    sms = 132
    assert [_decode_splits(p, n, sms) for p, n in [(8, 32768), (64, 8192), (128, 16384), (32, 131072)]] == \
        [33, 4, 2, 8]
    assert _decode_splits(176, 32768, sms) == 3  # 528 programs: four full rounds
    assert _decode_splits(300, 32768, sms) == 1
    # two programs an SM at once (decode over codes): the last round of 264 filled best
    assert _decode_splits(304, 32768, sms, per_sm=2) == 6  # 1824 of 1848 slots, against 304 of 528
    assert _decode_splits(360, 32768, sms, per_sm=2) == 5  # 1800 of 1848; 2, 4 and 6 fill 91 %
    assert _decode_splits(376, 32768, sms, per_sm=2) == 2  # 752 of 792; 4 fills as well: the fewer
    assert _decode_splits(304, 600, sms, per_sm=2) == 3  # ceil(600 / 256)
    assert _decode_splits(528, 32768, sms, per_sm=2) == 1  # two full rounds
    assert _decode_splits(232, 32768, sms, per_sm=2) == _decode_splits(232, 32768, sms)  # below 2 an SM
    from stiefkv.kernels.lowrank import _default_config

    def splits(mode, wide, codes=True, rows=38, r=56, bits=4):  # rows x 8 heads at 32k, GQA 4
        return _default_config(4, 32768, mode, rows * 8, sms, r, codes, bits, nibbles_kv=wide)["num_splits"]

    assert (splits("post_rope", True), splits("post_rope", False), splits("pre_rope", True)) == (6, 6, 6)
    assert splits("pre_rope", True, rows=45) == 5  # measured: 1.584 ms; 2 splits 1.677, 1 split 2.039
    assert splits("pre_rope", False, rows=43, r=112, bits=2) == 3  # a125's int2 channel keys
    assert splits("pre_rope", False, codes=False, bits=16) == 1  # bf16 latents: not measured there
    assert _decode_splits(8, 600, sms) == 3  # ceil(600 / 256)
    assert _decode_splits(176, 300, sms) == 2


def test_decode_splits_with_more_resident_programs():
    """Below one program an SM, a kernel counted to fit three or four programs an SM fills those slots in
    one round (SmolLM2's 32 rows × 3 KV heads: 4 splits, as measured), two keeps the measured rule, and the
    256-key floor still holds."""
    from stiefkv.kernels.lowrank import _decode_splits

    sms = 132
    assert _decode_splits(96, 8192, sms) == _decode_splits(96, 8192, sms, resident=2) == 2
    assert _decode_splits(96, 8192, sms, resident=3) == 4  # 384 programs of 396 slots
    assert _decode_splits(96, 8192, sms, per_sm=2, resident=4) == 5
    assert _decode_splits(32, 131072, sms, resident=3) == 12
    assert _decode_splits(96, 700, sms, resident=4) == 3  # ceil(700 / 256)
    assert _decode_splits(200, 8192, sms, resident=4) == _decode_splits(200, 8192, sms)  # past one an SM


class _FakeKernel:  # what _resident_programs reads of a compiled Triton kernel
    def __init__(self, regs, warps, shared):
        self.n_regs, self.run = regs, object()
        self.metadata = types.SimpleNamespace(num_warps=warps, shared=shared)


@pytest.mark.parametrize("regs,warps,shared,expected", [
    (167, 4, 53248, 3),  # SmolLM2's pre_rope bf16 tile (triton 3.6, sm_90): 168 a thread as allocated
    (175, 4, 64512, 2),  # Llama-3-8B's: 176 × 128 × 3 > 64 K registers
    (96, 4, 37888, 5),  # post_rope bf16 at r 32: registers allow 5 (12288 each), shared memory 6
    (24, 4, 8192, 16),  # threads: 2048 a SM
    (255, 4, 200000, 1),  # shared memory
])
def test_resident_programs(monkeypatch, regs, warps, shared, expected):
    props = types.SimpleNamespace(regs_per_multiprocessor=65536, shared_memory_per_multiprocessor=233472,
                                  max_threads_per_multi_processor=2048)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    assert lk._resident_programs(_FakeKernel(regs, warps, shared), torch.device("cuda")) == expected
    assert lk._resident_programs(types.SimpleNamespace(run=None), torch.device("cuda")) is None


def test_occupancy_splits_counts_each_kernel_once(monkeypatch):
    """The split count follows the compiled kernel's count (capped at MAX_RESIDENT), compiles once a kernel
    (not once a shape), and keeps the rule's count where two or fewer fit."""
    args, kwargs = make_inputs(32, 9, 3, 1, 8192, 64, 32, 32, torch.bfloat16, padded=False, bias=False)
    q, z_k, z_v, P_k, P_v = args
    full = (*args, "pre_rope", kwargs["positions"], kwargs["rope"], None, True, None, None, 0.125)
    cfg = lk._default_config(3, 8192, "pre_rope", 96, 132, 32)
    assert cfg["num_splits"] == 2
    compiled = []

    def fake_launch(*a, compile_only=False):
        assert compile_only and a[13]["num_splits"] >= 2  # the split variant of the kernel
        compiled.append(a[13])
        return "kernel"

    for resident, expected in ((3, 4), (2, 2), (9, 5)):  # 9: capped at 4 → 528 // 96
        monkeypatch.setattr(lk, "_RESIDENT", {})
        monkeypatch.setattr(lk, "_launch", fake_launch)
        monkeypatch.setattr(lk, "_resident_programs", lambda kernel, device, r=resident: r)
        assert lk._occupancy_splits(full, cfg, False, None, 132) == expected
        shorter = (q, z_k[:, :, :3000], *full[2:])  # at most 2 splits of ≥ 1024 keys: the rule's 2
        assert lk._occupancy_splits(shorter, cfg, False, None, 132) == 2
    assert len(compiled) == 3  # one a kernel: the shorter cache reused the count
    # 8 programs (Llama-3-8B's 1×32k): the rule's 33 stays, not 49 splits of 668 keys (slower, measured)
    few = (q[:1, :8], torch.zeros(1, 1, 1, 32).expand(1, 8, 32768, 32), *full[2:])
    rule = lk._default_config(4, 32768, "pre_rope", 8, 132, 32)
    monkeypatch.setattr(lk, "_resident_programs", lambda kernel, device: 3)
    assert rule["num_splits"] == 33 and lk._occupancy_splits(few, rule, False, None, 132) == 33


@gpu_only
@pytest.mark.parametrize("bits", [16, 4, 2])
@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
def test_occupancy_splits_at_smollm2_shapes_gpu(key_mode, bits):
    """SmolLM2's decode (32 rows, 9 heads over 3 KV heads, d 64, r 32, 8192 keys, left padding): launched at
    the split count its compiled kernel's occupancy gives on this GPU, against the reference."""
    args, kwargs = make_inputs(32, 9, 3, 1, 8192, 64, 32, 32, torch.bfloat16, bias=False)
    q, z_k, z_v, P_k, P_v = args
    if bits < 16:
        z_k, z_v = quantize_latents(z_k, bits), quantize_latents(z_v, bits)
    with torch.no_grad():
        cfg = lk.lowrank_attention(q, z_k, z_v, P_k, P_v, key_mode=key_mode, **kwargs, return_config=True)
        out = lk.lowrank_attention(q, z_k, z_v, P_k, P_v, key_mode=key_mode, **kwargs)
        floats = [z.dequantize(torch.bfloat16) if bits < 16 else z for z in (z_k, z_v)]
        expected = reference(q, *floats, P_k, P_v, key_mode=key_mode, **kwargs)
    assert cfg["num_splits"] >= lk._default_config(3, 8192, key_mode, 96, lk._num_sms(q.device), 32,
                                                   bits < 16, bits)["num_splits"]
    if key_mode == "pre_rope" or bits < 16:  # counted: this Triton reports the compiled kernel's registers
        assert lk._RESIDENT and None not in lk._RESIDENT.values()
    atol, rtol = TOL[torch.bfloat16]
    what = f"{key_mode} bits {bits} splits {cfg['num_splits']}"
    assert_close(out, expected, atol=atol, rtol=rtol, what=what)


def test_return_config_is_what_launches():
    """``return_config`` gives the configuration the call launches: launched explicitly, it gives the same
    output as the default call; a sliced prefill over codes is refused."""
    args, kwargs = make_inputs(2, 6, 2, 1, 300, 32, 24, 16, torch.float32, padded=True)
    kwargs = dict(kwargs, key_mode="pre_rope")
    with torch.no_grad():
        cfg = lk.lowrank_attention(*args, **kwargs, return_config=True)
        rule = lk._default_config(3, 300, "pre_rope", 4, lk._num_sms(args[0].device), 24) | {
            "fast_sincos": not lk.interpreting(), "fold_scales": False}
        assert dict(cfg, num_splits=0) == dict(rule, num_splits=0)
        assert cfg["num_splits"] >= rule["num_splits"]  # more where more programs fit an SM (CUDA)
        out = lk.lowrank_attention(*args, **kwargs)
        again = lk.lowrank_attention(*args, **kwargs, num_splits=cfg["num_splits"], block_n=cfg["block_n"],
                                     num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    assert torch.equal(out, again)
    pre, pk = make_inputs(1, 2, 1, 200, 5000, 32, 16, 16, torch.float32, padded=False)
    z_k = quantize_latents(pre[1], 4)
    with pytest.raises(ValueError, match="code_slice=0"):
        lk.lowrank_attention(pre[0], z_k, *pre[2:], **pk, key_mode="pre_rope", return_config=True)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_dequantize_in_slices_matches_stiefkv_quant(bits):
    """QuantizedLatents.dequantize, a few tokens at a time (a slice that does not divide N), gives
    stiefkv.quant's dequantization exactly, on a rank across two scale groups."""
    from stiefkv.kernels import QuantizedLatents
    from stiefkv.quant import QuantSpec, dequantize, quantize

    z = torch.randn(2, 3, 23, 70) * 4
    qz = quantize(z, QuantSpec(bits, "token"))
    latents = QuantizedLatents(qz.codes, qz.scale, qz.low, bits, qz.rank)
    expected = dequantize(qz, torch.float32)
    got = latents.dequantize(torch.float32, tokens=5)
    assert torch.isfinite(got).all() and torch.equal(got, expected)
    assert torch.equal(latents.dequantize(torch.bfloat16), expected.to(torch.bfloat16))


@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("path,Nq,splits,codes", [("decode", 1, 1, False), ("decode_split", 1, 3, False),
                                                  ("decode_codes", 1, 2, True), ("prefill", 19, 1, False)])
def test_log_sum_exp_matches_the_reference(path, Nq, splits, codes, key_mode):
    """return_lse: each row's log-sum-exp of its logits (bias, padding and n_valid applied) equals the
    reference's, and two attentions over the two halves of the keys merged by it give the whole."""
    args, kwargs = make_inputs(2, 12, 3, Nq, 70, 64, 24, 40, torch.bfloat16)
    q, z_k, z_v, P_k, P_v = args
    if codes:
        z_k, z_v = quantize_latents(z_k, 8), quantize_latents(z_v, 4)
    n_valid = torch.tensor([66], dtype=torch.int32, device=DEVICE)
    kwargs = dict(kwargs, key_mode=key_mode, n_valid=n_valid, lengths=None)
    with torch.no_grad():
        out, lse = lk.lowrank_attention(q, z_k, z_v, P_k, P_v, **kwargs, num_splits=splits, return_lse=True)
        ref_out, ref_lse = reference(q, z_k, z_v, P_k, P_v, **kwargs, return_lse=True)
    atol, rtol = TOL[torch.bfloat16]
    assert_close(out, ref_out, atol=atol, rtol=rtol, what=f"{path} output")
    assert_close(lse, ref_lse, atol=2e-2, rtol=1e-3, what=f"{path} lse")
    if Nq == 1:  # keys 0..39 and 40..65 (the second half through a zero bias, the first hidden by -inf)
        head = dict(kwargs, n_valid=torch.tensor([40], dtype=torch.int32, device=DEVICE), bias=None)
        tail_bias = torch.where(torch.arange(70, device=DEVICE) >= 40, 0.0, float("-inf")).expand(2, 3, 70)
        tail = dict(kwargs, bias=tail_bias.contiguous())
        with torch.no_grad():
            o1, l1 = lk.lowrank_attention(q, z_k, z_v, P_k, P_v, **head, return_lse=True)
            o2, l2 = lk.lowrank_attention(q, z_k, z_v, P_k, P_v, **tail, return_lse=True)
        w1, w2 = (l1 - torch.maximum(l1, l2)).exp(), (l2 - torch.maximum(l1, l2)).exp()
        merged = (o1.float() * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2)[..., None]
        whole = reference(q, z_k, z_v, P_k, P_v, **dict(kwargs, bias=None))
        assert_close(merged.to(whole.dtype), whole, atol=atol, rtol=rtol, what=f"{path} merged halves")


@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("path,Nq,splits,codes,dtype", [
    ("decode", 1, 1, True, torch.bfloat16), ("decode_split", 1, 3, False, torch.bfloat16),
    ("decode_int4_split", 1, 2, 4, torch.bfloat16), ("decode_fp32", 1, 1, False, torch.float32),
    ("prefill", 19, 1, False, torch.bfloat16)], ids=lambda v: str(v).removeprefix("torch."))
def test_prior_continues_the_softmax(path, Nq, splits, codes, dtype, key_mode):
    """``prior=(o, lse)`` of an attention over the first keys, then a call over the rest: the whole
    attention (and its log-sum-exp), as the reference gives it; rows the prior saw nothing of (left padding
    past the first keys) and rows the second call sees nothing of both come out right. Odd value rank 40 (a
    prefill pads it to 64, and the prior with it)."""
    B, H, G, Nk, r_k, r_v = 3, 12, 3, 70, 24, 40
    args, kwargs = make_inputs(B, H, G, Nq, Nk, 64, r_k, r_v, dtype)
    q, z_k, z_v, P_k, P_v = args
    if codes:
        bits = 4 if codes == 4 else 8
        z_k, z_v = quantize_latents(z_k, bits), quantize_latents(z_v, 4)
    lengths = torch.tensor([Nk, 20, 45], device=DEVICE)  # row 1: all its keys in the second part
    cut = 40
    first = dict(kwargs, key_mode=key_mode, causal=False, bias=None,
                 lengths=(lengths - (Nk - cut)).clamp(min=0),
                 n_valid=torch.tensor([cut], dtype=torch.int32, device=DEVICE))
    # the second part: keys cut..Nk through a bias that hides the first part (the ring view's way)
    hide = torch.where(torch.arange(Nk, device=DEVICE) >= cut, 0.0, float("-inf"))
    second = dict(kwargs, key_mode=key_mode, causal=Nq > 1, lengths=lengths,
                  bias=(kwargs["bias"] + hide).contiguous())
    if Nq > 1:  # a causal prefill over both parts: the first part is older than every query
        first["n_valid"] = None
        first["lengths"] = None
        z_k1, z_v1 = z_k[:, :, :cut], z_v[:, :, :cut]
    with torch.no_grad():
        if Nq > 1:
            head = dict(first, positions=first["positions"][:, :cut])
            o1, l1 = lk.lowrank_attention(q, z_k1, z_v1, P_k, None, **head, return_lse=True)
        else:
            o1, l1 = lk.lowrank_attention(q, z_k, z_v, P_k, None, **first, num_splits=splits, return_lse=True)
        out, lse = lk.lowrank_attention(q, z_k, z_v, P_k, None, **second, num_splits=splits, return_lse=True,
                                        prior=(o1, l1))
        ref_out, ref_lse = reference(q, z_k, z_v, P_k, None, **second, return_lse=True, prior=(o1, l1))
    assert torch.isinf(l1[1]).all() if Nq == 1 else True  # row 1 saw nothing in the first part
    atol, rtol = TOL[dtype]
    assert_close(out, ref_out, atol=atol, rtol=rtol, what=f"{path} prior")
    assert_close(lse, ref_lse, atol=max(atol, 1e-3), rtol=1e-3, what=f"{path} prior lse")
    if Nq == 1:  # the two parts are the whole cache (first part's bias aside: none there)
        whole = reference(q, z_k, z_v, P_k, None, **dict(second, bias=kwargs["bias"] * (hide == 0)))
        assert_close(out, whole, atol=2 * atol, rtol=2 * rtol, what=f"{path} prior = whole")
    with pytest.raises(ValueError, match="latent"):
        lk.lowrank_attention(q, z_k, z_v, P_k, P_v, **second, prior=(o1, l1))


def test_prior_bad_input_and_gradients():
    """A prior of the wrong shape, not a pair or on another device is refused by both backends with a
    message naming it; a prior that needs a gradient keeps ``auto`` on the reference (which carries the
    gradient) and is refused by the kernel, which has no backward."""
    from stiefkv import kernels

    args, kwargs = make_inputs(2, 8, 2, 3, 30, 32, 8, 16, torch.float32)
    q, z_k, z_v, P_k, P_v = args
    kwargs = dict(kwargs, key_mode="pre_rope")
    o = torch.randn(2, 8, 3, 16, device=DEVICE)
    lse = torch.randn(2, 8, 3, device=DEVICE)
    for backend in ("triton", "reference"):
        with torch.no_grad():
            with pytest.raises(ValueError, match=r"prior= must be an output \[B, H, Nq, 16\]"):
                kernels.lowrank_attention(q, z_k, z_v, P_k, None, **kwargs, backend=backend,
                                          prior=(o, lse[:, :, :1]))
            with pytest.raises(ValueError, match="pair"):
                kernels.lowrank_attention(q, z_k, z_v, P_k, None, **kwargs, backend=backend, prior=o)
            with pytest.raises(ValueError, match=r"\[B, H, Nq, 32\]"):  # with P_v: an output in d dims
                kernels.lowrank_attention(q, z_k, z_v, P_k, P_v, **kwargs, backend=backend, prior=(o, lse))
    o.requires_grad_()
    out = kernels.lowrank_attention(q, z_k, z_v, P_k, None, **kwargs, backend="auto", prior=(o, lse))
    assert out.requires_grad
    out.sum().backward()
    assert o.grad is not None and torch.isfinite(o.grad).all() and o.grad.abs().sum() > 0
    with pytest.raises(RuntimeError, match="inference-only"):
        kernels.lowrank_attention(q, z_k, z_v, P_k, None, **kwargs, backend="triton", prior=(o, lse))


@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("case", QUANT_CASES[::3], ids=lambda c: c[0])
def test_codes_under_fp32_queries_stay_fp32(case, key_mode):
    """fp32 queries over int8 or int4 keys and int4 values (and over those keys beside fp32 values): the codes
    dequantize in fp32 and every dot runs at fp32 precision, within the fp32 tolerance of the reference."""
    path, B, H, G, Nq, Nk, r_k, r_v, splits = case
    args, kwargs = make_inputs(B, H, G, Nq, Nk, 128, r_k, r_v, torch.float32)
    q, z_k, z_v, P_k, P_v = args
    q = q * 30  # large logits: fp16 or tf32 anywhere on the way shows
    qv = quantize_latents(z_v, 4)
    atol, rtol = TOL[torch.float32]
    for qk, values, exact_values in [(quantize_latents(z_k, bits), values, exact) for bits in (8, 4)
                                     for values, exact in ((qv, qv.dequantize(torch.float32)), (z_v, z_v))]:
        with torch.no_grad():
            out = lk.lowrank_attention(q, qk, values, P_k, P_v, key_mode=key_mode, **kwargs,
                                       num_splits=splits)
            expected = reference(q, qk.dequantize(torch.float32), exact_values, P_k, P_v, key_mode=key_mode,
                                 **kwargs)
        assert_close(out, expected, atol=atol, rtol=rtol, what=f"fp32 {path} {key_mode}")


def channel_codes(z: torch.Tensor, bits: int, n_keys: int):
    """``z``'s first ``n_keys`` tokens in ``stiefkv.quant``'s channel layout (a scale and low per channel and
    group of 64 tokens), the rest of the buffer's tokens quantized too (a static cache's slots past the
    filled count hold whatever they held)."""
    from stiefkv.kernels import QuantizedLatents
    from stiefkv.quant import QuantSpec, quantize

    N = z.shape[2]
    padded = torch.cat([z.float().cpu(), torch.zeros(*z.shape[:2], -N % 64, z.shape[3])], 2)
    qz = quantize(padded, QuantSpec(bits, "channel"))
    return QuantizedLatents(qz.codes[:, :, :N].to(z.device), qz.scale.to(z.device), qz.low.to(z.device),
                            bits, qz.rank, "channel")


@pytest.mark.parametrize("bits", [8, 4, 3])
@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("case", QUANT_CASES, ids=lambda c: f"{c[0]}-q{c[4]}k{c[5]}-r{c[6]}_{c[7]}")
def test_channel_layout_codes_match_the_reference(case, key_mode, bits):
    """Codes with a scale and low per channel and group of 64 tokens (the keys' layout of --bits auto): read
    in place against the reference on the dequantized latents; with n_valid inside a token group, and
    beside per-token value codes."""
    path, B, H, G, Nq, Nk, r_k, r_v, splits = case
    args, kwargs = make_inputs(B, H, G, Nq, Nk, 128, r_k, r_v, torch.bfloat16)
    q, z_k, z_v, P_k, P_v = args
    ck, cv = channel_codes(z_k, bits, Nk), channel_codes(z_v, bits, Nk)
    assert torch.equal(ck.dequantize(torch.float32).cpu(), ck.dequantize(torch.float32, tokens=64).cpu())
    atol, rtol = TOL[torch.bfloat16]
    for values in (cv, quantize_latents(z_v, 4)):
        with torch.no_grad():
            out = lk.lowrank_attention(q, ck, values, P_k, P_v, key_mode=key_mode, **kwargs,
                                       num_splits=splits)
            expected = reference(q, ck.dequantize(torch.bfloat16), values.dequantize(torch.bfloat16), P_k,
                                 P_v, key_mode=key_mode, **kwargs)
        assert_close(out, expected, atol=atol, rtol=rtol, what=f"channel int{bits} {path} {key_mode}")


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
def test_channel_rows_match_the_per_element_scales(key_mode, bits):
    """``channel_rows``: channel-layout scales read as a row a token group the tile spans and broadcast over
    its keys, at tiles smaller and larger than the 64-token group (a 128-key tile spans two), split keys
    whose last tile is partial (150 and 203 keys) and five queries in one decode tile: the reference's
    output and the per-element loop's within rounding. With ``lengths`` (left padding shifts the tiles off
    the groups) the launcher keeps the per-element loads, and gives the reference's output too."""
    atol, rtol = TOL[torch.bfloat16]
    for B, H, G, Nq, Nk, r_k, r_v, splits, block_n in [(2, 6, 3, 1, 150, 64, 72, 3, 128),
                                                       (1, 4, 2, 1, 203, 100, 28, 2, 32),
                                                       (1, 4, 2, 5, 70, 40, 24, 1, None)]:
        args, kwargs = make_inputs(B, H, G, Nq, Nk, 128, r_k, r_v, torch.bfloat16, padded=False)
        q, z_k, z_v, P_k, P_v = args
        ck, cv = channel_codes(z_k, bits, Nk), channel_codes(z_v, bits, Nk)
        with torch.no_grad():
            expected = reference(q, ck.dequantize(torch.bfloat16), cv.dequantize(torch.bfloat16), P_k, P_v,
                                 key_mode=key_mode, **kwargs)
            what = f"channel rows int{bits} {key_mode} k{Nk} r{r_k}/{r_v} block_n={block_n}"
            out, plain = (lk.lowrank_attention(q, ck, cv, P_k, P_v, key_mode=key_mode, **kwargs,
                                               num_splits=splits, block_n=block_n, channel_rows=rows,
                                               planes=False)  # planes would read int2 scales by rows
                          for rows in (True, False))
            assert_close(out, expected, atol=atol, rtol=rtol, what=what)
            assert_close(out, plain, atol=atol, rtol=rtol, what=what + " against per-element scales")
            if bits == 4:  # int2 takes planes by default
                default = lk.lowrank_attention(q, ck, cv, P_k, P_v, key_mode=key_mode, **kwargs,
                                               num_splits=splits, block_n=block_n)
                assert torch.equal(default, out), what + ": the default configuration is not the rows"
        if Nq == 1:  # left-padded rows
            _, padded = make_inputs(B, H, G, Nq, Nk, 128, r_k, r_v, torch.bfloat16)
            with torch.no_grad():
                out = lk.lowrank_attention(q, ck, cv, P_k, P_v, key_mode=key_mode, **padded,
                                           num_splits=splits, channel_rows=True)
                expected = reference(q, ck.dequantize(torch.bfloat16), cv.dequantize(torch.bfloat16), P_k,
                                     P_v, key_mode=key_mode, **padded)
            assert_close(out, expected, atol=atol, rtol=rtol, what=f"channel rows, lengths, k{Nk}")


def planes_under_lengths(args, ck, cv, key_mode, splits, what, **option):
    """The planes tests' left-padded decode: ``args`` of :func:`make_inputs` (one query), codes ``ck``, ``cv``
    and the planes ``option``, against the reference with the same rows' lengths."""
    atol, rtol = TOL[torch.bfloat16]
    q, z_k, z_v, P_k, P_v = args
    B, H, Nq, _ = q.shape
    (G, Nk, r_k), r_v = z_k.shape[1:], z_v.shape[3]
    _, padded = make_inputs(B, H, G, Nq, Nk, 128, r_k, r_v, torch.bfloat16)
    with torch.no_grad():
        out = lk.lowrank_attention(q, ck, cv, P_k, P_v, key_mode=key_mode, **padded, num_splits=splits,
                                   prefetch=True, **option)
        expected = reference(q, ck.dequantize(torch.bfloat16), cv.dequantize(torch.bfloat16), P_k, P_v,
                             key_mode=key_mode, **padded)
    assert_close(out, expected, atol=atol, rtol=rtol, what=f"{what}, lengths")


# (B, H, G, Nq, Nk, r_k, r_v, splits): one and two scale groups (112 keys, 96 values), padded ranks (112 →
# 128: words past the rank masked), rows not a multiple of 4 bytes (40 and 72 channels: the byte-wise loop),
# and five queries in one causal decode tile
PLANE_CASES = [(2, 6, 3, 1, 150, 64, 72, 3), (1, 4, 2, 1, 203, 112, 32, 2), (1, 4, 2, 1, 90, 40, 48, 1),
               (1, 4, 2, 5, 70, 48, 96, 1)]


@pytest.mark.parametrize("layout", ["token", "channel"])
@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
def test_int2_planes_match_the_reference(key_mode, layout):
    """``planes``: int2 codes read as 32-bit words and decoded into bit-plane column order (column ``k·W + w``
    holds channel ``8w + k``), the basis or query rows and the output columns at the matching channels:
    against the reference on the dequantized latents and the byte-wise loop, keys in the token or the
    channel layout (whose scales ``planes`` reads as rows), values per token on min–max or log8 scales,
    latent or projected output, split keys, padded ranks; with left padding too (channel keys byte-wise)."""
    atol, rtol = TOL[torch.bfloat16]
    for B, H, G, Nq, Nk, r_k, r_v, splits in PLANE_CASES:
        args, kwargs = make_inputs(B, H, G, Nq, Nk, 128, r_k, r_v, torch.bfloat16, padded=False)
        q, z_k, z_v, P_k, P_v = args
        ck = channel_codes(z_k, 2, Nk) if layout == "channel" else quantize_latents(z_k, 2)
        cv = log8_latents(z_v, 2) if layout == "channel" else quantize_latents(z_v, 2)
        assert lk._word_rows(ck.codes) == (r_k % 16 == 0)  # 40 and 100 channels: rows of 10, 26 bytes
        with torch.no_grad():
            for pv, extra in [(P_v, {}), (None, dict(channel_rows=True, late_values=True))]:
                what = f"int2 planes {layout} {key_mode} k{Nk} r{r_k}/{r_v} P_v={pv is not None} {extra}"
                out, plain = (lk.lowrank_attention(q, ck, cv, P_k, pv, key_mode=key_mode, **kwargs,
                                                   num_splits=splits, prefetch=True, planes=on, **extra)
                              for on in (True, False))
                expected = reference(q, ck.dequantize(torch.bfloat16), cv.dequantize(torch.bfloat16), P_k, pv,
                                     key_mode=key_mode, **kwargs)
                assert_close(out, expected, atol=atol, rtol=rtol, what=what)
                assert_close(out, plain, atol=atol, rtol=rtol, what=what + " against the byte-wise loop")
                default = lk.lowrank_attention(q, ck, cv, P_k, pv, key_mode=key_mode, **kwargs,
                                               num_splits=splits, **extra)
                assert torch.equal(default, out), what + ": the default configuration is not the planes"
        if Nq == 1 and r_k == 112:  # left padding: channel keys fall back to their per-element scales
            planes_under_lengths(args, ck, cv, key_mode, splits, f"int2 planes {layout}", planes=True)


# (B, H, G, Nq, Nk, r_k, r_v, splits): two scale groups and padded ranks (72 → 128, 40 → 64), one group (r 24
# → 32), split keys, and five queries in one causal decode tile
PLANE3_CASES = [(2, 6, 3, 1, 150, 72, 40, 3), (1, 4, 2, 1, 203, 112, 24, 2), (1, 4, 2, 5, 70, 48, 96, 1)]


@pytest.mark.parametrize("layout", ["token", "channel"])
@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
def test_int3_planes_match_the_reference(key_mode, layout):
    """``int3_planes``: int3 codes decoded field by field into bit-plane column order, the basis or query rows
    and the output columns at the matching channels: against the reference on the dequantized latents and
    the byte-wise loop, keys in the token or the channel layout (scales by rows), values per token, latent
    or projected output, split keys, padded ranks; with left padding too."""
    atol, rtol = TOL[torch.bfloat16]
    for B, H, G, Nq, Nk, r_k, r_v, splits in PLANE3_CASES:
        args, kwargs = make_inputs(B, H, G, Nq, Nk, 128, r_k, r_v, torch.bfloat16, padded=False)
        q, z_k, z_v, P_k, P_v = args
        ck = channel_codes(z_k, 3, Nk) if layout == "channel" else quantize_latents(z_k, 3)
        cv = quantize_latents(z_v, 3)
        with torch.no_grad():
            for pv in (P_v, None):
                what = f"int3 planes {layout} {key_mode} k{Nk} r{r_k}/{r_v} P_v={pv is not None}"
                out, plain = (lk.lowrank_attention(q, ck, cv, P_k, pv, key_mode=key_mode, **kwargs,
                                                   num_splits=splits, prefetch=True, int3_planes=on)
                              for on in (True, False))
                expected = reference(q, ck.dequantize(torch.bfloat16), cv.dequantize(torch.bfloat16), P_k, pv,
                                     key_mode=key_mode, **kwargs)
                assert_close(out, expected, atol=atol, rtol=rtol, what=what)
                assert_close(out, plain, atol=atol, rtol=rtol, what=what + " against the byte-wise loop")
        if Nq == 1 and r_k == 112:  # left padding: token keys keep their planes, channel keys their bytes
            planes_under_lengths(args, ck, cv, key_mode, splits, f"int3 planes {layout}", int3_planes=True)


@triton.jit
def _nibbles_probe(RAW, EVEN_ASM, ODD_ASM, EVEN, ODD, N: tl.constexpr, W: tl.constexpr):
    offs = tl.arange(0, N)[:, None] * W + tl.arange(0, W)[None, :]
    raw = tl.load(RAW + offs)
    even, odd = lk._nibbles_to_half(raw, True)
    tl.store(EVEN_ASM + offs, even)
    tl.store(ODD_ASM + offs, odd)
    even, odd = lk._nibbles_to_half(raw, False)
    tl.store(EVEN + offs, even)
    tl.store(ODD + offs, odd)


@triton.jit
def _log8_probe(CODES, SCALE, LOW, BITS: tl.constexpr):
    offs = tl.arange(0, 256)
    scale, low = lk._log8(tl.load(CODES + offs), BITS)
    tl.store(SCALE + offs, scale)
    tl.store(LOW + offs, low)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_log8_codes_decode_in_the_kernel_as_in_torch(bits):
    """Every uint8 log8 code decodes in registers (``_log8``) to the bits of ``log8_scale`` and ``log8_low``:
    the power of two, the mantissa, the float16 rounding of the low and NaN for code 255."""
    from stiefkv.kernels._common import LOG8_NAN, log8_low, log8_scale

    codes = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    scale, low = (torch.full((256,), 7.0, device=DEVICE) for _ in range(2))
    with warnings.catch_warnings():  # numpy (the interpreter) warns where the low overflows to −inf
        warnings.simplefilter("ignore", RuntimeWarning)
        _log8_probe[(1,)](codes, scale, low, BITS=bits)
    want_scale = log8_scale(codes.cpu())
    want_low = log8_low(want_scale, bits)
    for got, want in ((scale.cpu(), want_scale), (low.cpu(), want_low)):
        same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
        assert same.all(), f"codes {same.logical_not().nonzero().flatten().tolist()[:8]}"
    assert scale[LOG8_NAN].isnan() and not scale[:LOG8_NAN].isnan().any()


@triton.jit
def _pairs_probe(RAW, A_ASM, B_ASM, A, B, N: tl.constexpr, W: tl.constexpr):
    offs = tl.arange(0, N)[:, None] * W + tl.arange(0, W)[None, :]
    half = tl.arange(0, N)[:, None] * (2 * W) + tl.arange(0, 2 * W)[None, :]
    raw = tl.load(RAW + offs)
    a, b = lk._word_pairs(raw, N, W, True)
    tl.store(A_ASM + half, a)
    tl.store(B_ASM + half, b)
    a, b = lk._word_pairs(raw, N, W, False)
    tl.store(A + half, a)
    tl.store(B + half, b)


@pytest.mark.parametrize("log8", [False, True])
@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
def test_int4_words_match_the_reference(key_mode, log8):
    """``nibble_words``: int4 token-layout codes read as 32-bit words (eight codes a register) and met as
    even and odd channels: against the reference and the byte-wise nibbles, at one and two scale groups,
    a padded rank (25 → 32: the word holding channel 24 read whole), latent and projected output, the
    logits' scale fold (``post_rope``, one group), ``late_values`` and 256-key tiles."""
    atol, rtol = TOL[torch.bfloat16]
    codes = log8_latents if log8 else quantize_latents
    for B, H, G, Nq, Nk, r_k, r_v, splits, variants in [
            (2, 6, 3, 1, 150, 64, 128, 3, [(True, dict(nibble_fold=True)), (True, dict(block_n=256))]),
            (1, 4, 2, 1, 90, 25, 40, 2, [(False, dict(late_values=True))])]:
        args, kwargs = make_inputs(B, H, G, Nq, Nk, 128, r_k, r_v, torch.bfloat16)
        q, z_k, z_v, P_k, P_v = args
        qk, qv = codes(z_k, 4), codes(z_v, 4)
        with torch.no_grad():
            expected = {pv is None: reference(q, qk.dequantize(torch.bfloat16), qv.dequantize(torch.bfloat16),
                                              P_k, pv, key_mode=key_mode, **kwargs) for pv in (P_v, None)}
            for projected, extra in variants:
                pv = P_v if projected else None
                what = f"int4 words {key_mode} log8={log8} k{Nk} r{r_k}/{r_v} P_v={pv is not None} {extra}"
                out, plain = (lk.lowrank_attention(q, qk, qv, P_k, pv, key_mode=key_mode, **kwargs,
                                                   num_splits=splits, prefetch=True, nibble_words=on, **extra)
                              for on in (True, False))
                assert_close(out, expected[pv is None], atol=atol, rtol=rtol, what=what)
                assert_close(out, plain, atol=atol, rtol=rtol, what=what + " against the byte-wise nibbles")


@triton.jit
def _planes_probe(RAW, OUT, N: tl.constexpr, R: tl.constexpr, ASM: tl.constexpr):
    W: tl.constexpr = R // 16
    raw = tl.load(RAW + tl.arange(0, N)[:, None] * W + tl.arange(0, W)[None, :])
    tile = lk._plane_codes(raw, R, N, ASM)
    tl.store(OUT + tl.arange(0, N)[:, None] * R + tl.arange(0, R)[None, :], tile)


@pytest.mark.parametrize("rank", [32, 64, 128])
def test_int2_planes_decode_in_plane_order(rank):
    """The int2 words of ``planes`` (sixteen codes a 32-bit word, ``stiefkv.quant.pack``'s words of eight at
    2 bits) become ``1024 + code`` with column ``k·W + w`` holding channel ``8w + k`` (``_channels``): every
    code value in every position; on CUDA the PTX block gives the element-wise form's values."""
    from stiefkv.kernels._common import unpack

    device = "cuda" if torch.cuda.is_available() else "cpu"
    packed = torch.randint(0, 256, (16, rank // 4), dtype=torch.uint8)
    packed[0] = torch.arange(rank // 4, dtype=torch.uint8) * 7  # varied bytes
    codes = unpack(packed, 2, rank).float()  # [16, rank], channel order
    channels = 8 * (torch.arange(rank) % (rank // 8)) + torch.arange(rank) // (rank // 8)
    expected = codes[:, channels] + 1024
    raw = packed.to(device).contiguous().view(torch.int32)
    for asm in (False, True) if device == "cuda" else (False,):
        out = torch.full((16, rank), float("nan"), dtype=torch.float16, device=device)
        _planes_probe[(1,)](raw, out, N=16, R=rank, ASM=asm)
        assert torch.equal(out.float().cpu(), expected), f"int2 planes, rank {rank}, asm={asm}"


@gpu_only
def test_pairs_in_ptx_match_the_elementwise_conversion():
    """The PTX block that turns a 32-bit word of four int8 codes into two fp16 pairs ``1024 + code``
    (``pairs``, compiled only on CUDA) gives the element-wise form's values, every byte value in every
    position of a word, and the pairs land at ``2w + j`` (channels ``4w + j`` and ``4w + 2 + j``)."""
    raw = torch.randint(0, 256, (64, 128), dtype=torch.uint8, device="cuda")
    raw[:2] = torch.arange(256, device="cuda").view(2, 128).to(torch.uint8)
    outs = [torch.full((64, 64), float("nan"), dtype=torch.float16, device="cuda") for _ in range(4)]
    _pairs_probe[(1,)](raw.view(torch.int32), *outs, N=64, W=32)
    a_asm, b_asm, a, b = (o.float() for o in outs)
    quads = raw.view(64, 32, 2, 2).float() + 1024  # [n, w, pair, j]
    assert torch.equal(a, quads[:, :, 0].reshape(64, 64)) and torch.equal(b, quads[:, :, 1].reshape(64, 64))
    assert torch.equal(a_asm, a) and torch.equal(b_asm, b)


@gpu_only
def test_nibbles_in_ptx_match_the_elementwise_conversion():
    """The PTX block that turns four packed int4 bytes into eight fp16 ``1024 + code`` (``nibbles``, compiled
    only on CUDA: the interpreter runs the element-wise form) gives the element-wise form's values, every
    byte value in every position of a 32-bit register."""
    raw = torch.randint(0, 256, (64, 32), dtype=torch.uint8, device="cuda")
    raw[:8] = torch.arange(256, device="cuda").view(8, 32).to(torch.uint8)
    outs = [torch.full((64, 32), float("nan"), dtype=torch.float16, device="cuda") for _ in range(4)]
    _nibbles_probe[(1,)](raw, *outs, N=64, W=32)
    even_asm, odd_asm, even, odd = (o.float() for o in outs)
    codes = raw.to(torch.int32)
    assert torch.equal(even, (codes & 15).float() + 1024) and torch.equal(odd, (codes >> 4).float() + 1024)
    assert torch.equal(even_asm, even) and torch.equal(odd_asm, odd)
