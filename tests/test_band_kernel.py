"""The band kernel (``stiefkv/kernels/band.py``): attention over a prefill chunk's exact band, each key held
stored and exact, against the reference's banded attention (``reference.lowrank_attention(..., exact=)``),
under the Triton interpreter on the CPU and compiled where CUDA is present.

Tolerances: float32 1e-4 (the kernel's dots are IEEE float32, as the reference's einsums), bfloat16 1.6e-2
and float16 4e-3 on the output; the log-sum-exp is float32 on both sides, but in 16 bits the kernel rounds
its rebuilt keys and probabilities to the dtype for the tensor cores, as the decode kernel does, where the
reference computes in float32: 2e-2 (bf16) and 2e-3 (fp16) there, 1e-4 in float32.
"""

import pytest
import torch

from stiefkv.kernels import ExactTail, RopeSpec, lowrank_attention_reference

from .utils import assert_close, compiles_for_the_gpu

pytest.importorskip("triton")
from stiefkv.kernels.band import band_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.bfloat16: 1.6e-2, torch.float16: 4e-3}
LSE_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-3}  # 16-bit: rebuilt keys rounded

# (B, H, G, Nq, Ne, d, r_k, r_v): odd sizes, GQA 1, 3 and 4, ranks that are not powers of two, a band as long
# as the queries (the first chunk: the band holds every key) and one much longer (SmolLM2's chunk and window)
SHAPES = [(2, 6, 2, 37, 45, 64, 23, 19), (1, 9, 3, 5, 150, 64, 64, 64), (3, 8, 8, 40, 40, 32, 13, 31),
          (2, 8, 2, 19, 70, 128, 56, 40)]


def band_inputs(B, H, G, Nq, Ne, d, r_k, r_v, dtype, *, per_head_positions=False, lengths=None, bias=False,
                causal=True, window=7):
    """Queries, the band's stored latents (the exact ones plus a quantization-sized error), the exact ones,
    orthonormal bases, and each query's start of exact keys and values: the last ``window`` (keys) and
    ``window // 2`` (values) before it where causal, random starts anywhere in the band otherwise."""
    gen = torch.Generator().manual_seed(B * 1000 + Nq * 10 + Ne)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    exact_k, exact_v = randn(B, G, Ne, r_k), randn(B, G, Ne, r_v)
    z_k, z_v = exact_k + 0.2 * randn(B, G, Ne, r_k), exact_v + 0.2 * randn(B, G, Ne, r_v)
    if causal:
        at = torch.arange(Nq) + (Ne - Nq)
        key_from, value_from = (at + 1 - window).clamp(min=0), (at + 1 - window // 2).clamp(min=0)
    else:
        key_from = torch.randint(0, Ne + 1, (Nq,), generator=gen)
        value_from = torch.randint(0, Ne + 1, (Nq,), generator=gen)
    if per_head_positions:
        positions = torch.stack([torch.randperm(5 * Ne, generator=gen)[:Ne].sort().values
                                 for _ in range(B * G)]).view(B, G, Ne)
    else:
        positions = (torch.arange(Ne) + 3000)[None].expand(B, Ne)
    P_k = torch.linalg.qr(randn(G, d, r_k))[0]
    P_v = torch.linalg.qr(randn(G, d, r_v))[0]

    def dev(t):
        return t.to(DEVICE, dtype if t.is_floating_point() else t.dtype)

    exact = ExactTail(dev(exact_k), dev(exact_v), key_from.to(DEVICE), value_from.to(DEVICE))
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    kwargs = dict(positions=positions.to(DEVICE), rope=RopeSpec(inv_freq.to(DEVICE), 1.2), causal=causal,
                  bias=None if not bias else dev(0.5 * randn(B, G, Ne)),
                  lengths=None if lengths is None else torch.tensor(lengths, device=DEVICE))
    return dev(randn(B, H, Nq, d)), dev(z_k), dev(z_v), exact, dev(P_k), dev(P_v), kwargs


def check(q, z_k, z_v, exact, P_k, P_v, key_mode, kwargs, what):
    with torch.no_grad():
        out, lse = band_attention(q, z_k, z_v, exact, P_k, P_v, key_mode=key_mode, **kwargs)
        ref, ref_lse = lowrank_attention_reference(q, z_k, z_v, P_k, P_v, key_mode=key_mode, exact=exact,
                                                   return_lse=True, **kwargs)
    tol = TOL[q.dtype]
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    assert_close(out, ref, atol=tol, rtol=tol, what=f"{what}: output")
    unseen = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), unseen), f"{what}: rows with no key"
    assert bool((lse[unseen] < 0).all()), f"{what}: +inf log-sum-exp"
    lse_tol = LSE_TOL[q.dtype]
    assert_close(lse[~unseen], ref_lse[~unseen], atol=lse_tol, rtol=lse_tol, what=f"{what}: log-sum-exp")
    assert torch.equal(out[unseen], torch.zeros_like(out[unseen])), f"{what}: a row with no key is not 0"
    return out, lse


@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_band_matches_the_banded_reference(shape, key_mode):
    """float32, causal, the output through ``P_v`` and in latent space."""
    q, z_k, z_v, exact, P_k, P_v, kwargs = band_inputs(*shape, torch.float32)
    for pv in (P_v, None):
        check(q, z_k, z_v, exact, P_k, pv, key_mode, kwargs, f"{shape} {key_mode} P_v={pv is not None}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
def test_band_in_half_precision(key_mode, dtype):
    q, z_k, z_v, exact, P_k, P_v, kwargs = band_inputs(2, 6, 2, 37, 45, 64, 23, 19, dtype)
    check(q, z_k, z_v, exact, P_k, P_v, key_mode, kwargs, f"{key_mode} {dtype}")


@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
def test_band_with_padding_bias_and_per_head_positions(key_mode):
    """Left padding (a row whose real keys start after some queries: those see none, output 0 and
    log-sum-exp −inf), a logit bias per key and positions per KV head."""
    q, z_k, z_v, exact, P_k, P_v, kwargs = band_inputs(3, 6, 3, 21, 50, 64, 29, 17, torch.float32,
                                                       per_head_positions=True, lengths=[50, 33, 9],
                                                       bias=True)
    out, lse = check(q, z_k, z_v, exact, P_k, None, key_mode, kwargs, f"{key_mode} padded")
    assert torch.isinf(lse[2, :, :12]).all() and torch.isfinite(lse[2, :, 12:]).all()


@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
def test_band_not_causal_with_starts_anywhere(key_mode):
    """Non-causal queries whose exact keys and values start anywhere in the band, the end (none exact)
    included, independently of one another."""
    q, z_k, z_v, exact, P_k, P_v, kwargs = band_inputs(2, 4, 2, 23, 61, 32, 16, 19, torch.float32,
                                                       causal=False, bias=True, lengths=[61, 40])
    check(q, z_k, z_v, exact, P_k, P_v, key_mode, kwargs, f"{key_mode} not causal")


@pytest.mark.parametrize("key_mode", ["pre_rope", "post_rope"])
def test_band_reads_views_as_the_prefill_hands_them(key_mode):
    """Every input a view, as ``_below_and_band`` slices them from the cache: latents cut from wider buffers
    along the keys and the rank, positions and bias sliced per KV head, and int32 starts read at a stride
    of 2 (``.to(torch.int32)`` hands such a view through unchanged)."""
    B, H, G, Nq, Ne, d, r = 2, 6, 3, 13, 40, 64, 21
    q, z_k, z_v, exact, P_k, P_v, kwargs = band_inputs(B, H, G, Nq, Ne, d, r, r, torch.float32,
                                                       per_head_positions=True, lengths=[40, 25], bias=True)

    def widened(t):  # the same values inside a buffer with more keys and channels: a strided view
        wide = torch.randn(B, G, Ne + 9, r + 5, device=DEVICE)
        wide[:, :, 9:, 2: r + 2] = t
        return wide[:, :, 9:, 2: r + 2]

    def strided(t):
        wide = torch.zeros(2 * t.numel(), dtype=torch.int32, device=DEVICE)
        wide[::2] = t.to(torch.int32)
        return wide[::2]

    views = ExactTail(widened(exact.z_k), widened(exact.z_v), strided(exact.key_from),
                      strided(exact.value_from))
    pos = torch.zeros(B, G, Ne + 7, dtype=torch.long, device=DEVICE)
    pos[..., 7:] = kwargs["positions"]
    bias = torch.zeros(B, G, Ne + 7, device=DEVICE)
    bias[..., 7:] = kwargs["bias"]
    sliced = dict(kwargs, positions=pos[..., 7:], bias=bias[..., 7:])
    assert not any(t.is_contiguous() for t in (*views, sliced["positions"], sliced["bias"]))
    check(q, widened(z_k), widened(z_v), views, P_k, None, key_mode, sliced, f"{key_mode} views")


def test_the_exact_latents_are_read_where_the_band_says():
    """Stored and exact latents far apart (a sign flip): a kernel that read the wrong version at any key
    moves the output far beyond the tolerance, so the comparison above cannot pass by the two being close."""
    q, z_k, z_v, exact, P_k, P_v, kwargs = band_inputs(1, 4, 2, 17, 30, 32, 20, 20, torch.float32)
    flipped = ExactTail(-z_k, -z_v, exact.key_from, exact.value_from)
    out, _ = check(q, z_k, z_v, flipped, P_k, P_v, "pre_rope", kwargs, "flipped")
    none = torch.full_like(exact.key_from, 30)
    stored_only = ExactTail(-z_k, -z_v, none, none)
    plain, _ = check(q, z_k, z_v, stored_only, P_k, P_v, "pre_rope", kwargs, "none exact")
    assert (out - plain).abs().max() > 0.1


def test_a_nan_in_an_exact_latent_is_not_hidden():
    """A NaN in one channel of the band's last exact value: the last query, which reads it, returns NaN in
    that channel (the reference's ``nan_to_num`` for rows with no key turns it into 0 there); a product of
    0 and NaN in the value dot spreads it down that channel only, and every other element matches the
    reference."""
    q, z_k, z_v, exact, P_k, P_v, kwargs = band_inputs(1, 2, 1, 9, 20, 32, 16, 16, torch.float32)
    exact.z_v[0, 0, -1, 3] = float("nan")
    with torch.no_grad():
        out, _ = band_attention(q, z_k, z_v, exact, P_k, None, key_mode="post_rope", **kwargs)
        ref = lowrank_attention_reference(q, z_k, z_v, P_k, None, key_mode="post_rope", exact=exact, **kwargs)
    nan = torch.isnan(out)
    assert nan[0, :, -1, 3].all() and not nan[..., torch.arange(16) != 3].any()
    assert_close(out[~nan], ref[~nan], atol=1e-4, rtol=1e-4, what="beside the NaN")


def test_bad_band_inputs_are_named():
    q, z_k, z_v, exact, P_k, P_v, kwargs = band_inputs(1, 4, 2, 9, 20, 32, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="exact ones"):
        band_attention(q, z_k, z_v, ExactTail(exact.z_k[:, :, 1:], exact.z_v, exact.key_from,
                                              exact.value_from), P_k, P_v, key_mode="pre_rope", **kwargs)
    with pytest.raises(ValueError, match="key_from must be"):
        band_attention(q, z_k, z_v, exact._replace(key_from=exact.key_from[1:]), P_k, P_v,
                       key_mode="pre_rope", **kwargs)
    with pytest.raises(ValueError, match="power-of-two head dim of 32 to 128"):
        band_attention(q[..., :24], z_k, z_v, exact, P_k[:, :24], P_v[:, :24], key_mode="post_rope",
                       **dict(kwargs, rope=None))
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        band_attention(q.double(), z_k, z_v, exact, P_k, P_v, key_mode="post_rope", **kwargs)
    with pytest.raises(ValueError, match="pre_rope needs positions"):
        band_attention(q, z_k, z_v, exact, P_k, P_v, key_mode="pre_rope", **dict(kwargs, positions=None))


COMPILE = """
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from stiefkv.kernels import band

def case(dtype, pre, pv, bias, lengths, causal, d, r_k, r_v):
    t = {torch.bfloat16: "*bf16", torch.float32: "*fp32"}[dtype]
    types = dict(Q=t, ZK=t, ZV=t, EK=t, EV=t, OUT=t, KEY_FROM="*i32", VALUE_FROM="*i32", PK="*fp32",
                 PV="*fp32", POS="*i64", INV_FREQ="*fp32", BIAS="*fp32", LENGTHS="*i32", LSE="*fp32",
                 sm_scale="fp32", rope_scaling="fp32")
    consts = dict(HEAD_DIM=d, R_K=r_k, R_V=r_v, R_K_P2=triton.next_power_of_2(r_k),
                  R_V_P2=triton.next_power_of_2(r_v), BLOCK_M=band.BLOCK_M, BLOCK_N=band.BLOCK_N,
                  PRE_ROPE=pre, CAUSAL=causal, HAS_BIAS=bias, HAS_LENGTHS=lengths, HAS_PV=pv,
                  DTYPE=band._TL_DTYPES[dtype], UPCAST=False)
    for name, kept in (("PV", pv), ("POS", pre), ("INV_FREQ", pre), ("BIAS", bias), ("LENGTHS", lengths)):
        if not kept:
            consts[name] = None
    names = band._band_fwd.arg_names
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    constexprs = {(names.index(k),): v for k, v in consts.items()}
    src = ASTSource(fn=band._band_fwd, signature=sig, constexprs=constexprs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": band.NUM_WARPS})
    assert kernel.asm["cubin"], "no cubin"

case(torch.bfloat16, True, False, False, False, True, 64, 64, 64)
case(torch.bfloat16, False, False, False, False, True, 64, 23, 19)
case(torch.bfloat16, True, True, True, True, True, 128, 56, 40)
case(torch.float32, False, True, False, True, False, 32, 16, 16)
print("compiled")
"""


@pytest.mark.skipif(DEVICE == "cuda", reason="CUDA compiles and runs the kernel in the tests above")
def test_band_kernel_compiles_for_the_gpu():
    """Without a GPU, the kernel compiled to an sm_90 cubin by Triton's own compiler and ptxas (both key
    modes, both outputs, bias, padding, not causal, bf16 and fp32): the interpreter runs neither the
    compiler's type checks nor its tracing of code after a constexpr-if return, which let a post_rope dot
    reach the pre_rope kernel (found this way, 2026-12-06). A fresh cache directory, so it really compiles."""
    compiles_for_the_gpu(COMPILE)
