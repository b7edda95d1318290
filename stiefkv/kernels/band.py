"""The exact band of a prefill forward over quantized latents, in one Triton launch.

A cache that quantizes a token only once newer tokens have arrived shows each query its own recent keys
exact (:class:`~stiefkv.kernels._common.ExactTail`). Below the band every query reads the keys as stored,
and :func:`stiefkv.kernels.lowrank.lowrank_attention` takes them; inside it, which version of key ``j``
query ``i`` reads moves with the query: the exact one where ``j ≥ key_from[i]`` (the values:
``value_from[i]``), the stored one below. This kernel attends each query to the band with both versions at
hand: per key tile it forms the logits from the stored and from the exact latents (``pre_rope``: both keys
rebuilt as ``P_k z`` and rotated at their position; ``post_rope``: against ``P_kᵀ q``), keeps the one the
query reads, and accumulates ``p_stored · v_stored + p_exact · v_exact`` with ``p`` split where the query's
exact values start. The band is a prefill chunk and the exact window (~150 keys at SmolLM2's serving
shapes), so computing both versions costs little; it replaces the reference's ~110 PyTorch operators a
layer (``reference._banded_attention`` and the rebuilt keys it needs) with one launch.

It returns the band's output and log-sum-exp, which the caller merges with the keys below (the decode kernel
continues its softmax from them: ``prior=``). Its PyTorch reference is
:func:`stiefkv.kernels.reference.lowrank_attention` with ``exact=``; floats in, any of bf16, fp16 or fp32,
computed in float32. Inference only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from stiefkv.kernels._common import KEY_MODES, ExactTail, RopeSpec, interpreting, padded_dim
from stiefkv.kernels.lowrank import _LN2, _LOG2E, _TL_DTYPES, _dot, _sincos

# The decode kernel's dot: with F32 as its UPCAST (float32 inputs, and the interpreter, which multiplies bf16
# operands wrongly) IEEE float32 on operands already rounded to their dtype, as the reference computes;
# else the tensor cores in the inputs' 16-bit dtype with float32 accumulation (the precision is unread there)
DOT_PREC = tl.constexpr("tf32")
BLOCK_M = 32  # rows (query, head of the GQA group) a program: small tiles keep both key versions in registers
BLOCK_N = 32  # band keys a step
# 4 warps: faster than 8 at every shape timed (H100, 2026-12-06, seventh session, bench_attention.py
# --tables band, ms, 8 → 4 warps): Llama-3-8B's heads r 64, 32×128 tokens behind 8, post_rope 0.281 → 0.178,
# pre_rope 0.452 → 0.357; 8×512 0.589 → 0.385, 1.099 → 0.862; 1×2048 0.922 → 0.658, 1.899 → 1.552;
# SmolLM2's r 32 0.076 → 0.043 and 0.141 → 0.070 at 32×128. ptxas's log (triton 3.9) had put spills at 4
# warps (d 64, r 64, pre_rope 644 bytes of spill stores against 48 at 8), which the timing outweighs.
NUM_WARPS = 4
MAX_DIM = 128  # head dims and ranks the kernel takes (fits)


@triton.jit
def _latent_tile(Z, offs_n, n_keys, stride_n, stride_r, R: tl.constexpr, R_P2: tl.constexpr,
                 DTYPE: tl.constexpr):
    """``[BLOCK_N, R_P2]`` latents of keys ``offs_n`` in ``DTYPE`` (0 past ``n_keys`` and past rank ``R``)."""
    offs_r = tl.arange(0, R_P2)
    mask = (offs_n < n_keys)[:, None] & (offs_r < R)[None, :]
    ptrs = Z + offs_n[:, None] * stride_n + offs_r[None, :] * stride_r
    return tl.load(ptrs, mask=mask, other=0.0).to(DTYPE)


@triton.jit
def _basis_rows(P, first, stride_pd, stride_pr, ROWS: tl.constexpr, R: tl.constexpr, R_P2: tl.constexpr,
                DTYPE: tl.constexpr):
    """Rows ``first … first + ROWS`` of one KV head's basis ``[d, r]`` in ``DTYPE``, zero past rank ``R``."""
    offs_d = first + tl.arange(0, ROWS)
    offs_r = tl.arange(0, R_P2)
    ptrs = P + offs_d[:, None] * stride_pd + offs_r[None, :] * stride_pr
    return tl.load(ptrs, mask=(offs_r < R)[None, :], other=0.0).to(DTYPE)


@triton.jit
def _rotated_key_logits(q1, q2, z, P, stride_pd, stride_pr, cos, sin, HALF: tl.constexpr, R: tl.constexpr,
                        R_P2: tl.constexpr, DTYPE: tl.constexpr, F32: tl.constexpr):
    """``q · rot(P z)`` ``[BLOCK_M, BLOCK_N]`` (float32): the keys rebuilt from latents ``z`` ``[BLOCK_N,
    R_P2]`` in halves and rotated by ``cos, sin`` ``[BLOCK_N, d/2]`` (transformers' ``rotate_half``), in
    float32, then met by the queries' halves ``q1, q2`` in ``DTYPE``."""
    p1 = _basis_rows(P, 0, stride_pd, stride_pr, HALF, R, R_P2, DTYPE)
    p2 = _basis_rows(P, HALF, stride_pd, stride_pr, HALF, R, R_P2, DTYPE)
    zero = tl.zeros([z.shape[0], HALF], dtype=tl.float32)
    a1 = _dot(z, tl.trans(p1), zero, DOT_PREC, F32)  # [BLOCK_N, d/2]
    a2 = _dot(z, tl.trans(p2), zero, DOT_PREC, F32)
    k1 = (a1 * cos - a2 * sin).to(DTYPE)
    k2 = (a2 * cos + a1 * sin).to(DTYPE)
    s = _dot(q1, tl.trans(k1), tl.zeros([q1.shape[0], z.shape[0]], dtype=tl.float32), DOT_PREC, F32)
    return _dot(q2, tl.trans(k2), s, DOT_PREC, F32)


@triton.jit
def _version_logits(Z, offs_n, n_k, stride_n, stride_r, q1, q2, P, stride_pd, stride_pr, cos, sin,
                    HALF: tl.constexpr, R: tl.constexpr, R_P2: tl.constexpr, DTYPE: tl.constexpr,
                    F32: tl.constexpr, PRE_ROPE: tl.constexpr):
    """One version's logits ``[BLOCK_M, BLOCK_N]`` (float32) over the key tile ``offs_n`` of latents ``Z``:
    ``pre_rope`` the keys rebuilt and rotated (:func:`_rotated_key_logits`, queries' halves ``q1, q2``),
    ``post_rope`` against the projected queries ``q1`` (``P_kᵀ q``)."""
    z = _latent_tile(Z, offs_n, n_k, stride_n, stride_r, R, R_P2, DTYPE)
    # if and else, not an early return: the compiler traces what follows a constexpr return (the
    # interpreter does not), and the other mode's dot does not type-check
    if PRE_ROPE:
        s = _rotated_key_logits(q1, q2, z, P, stride_pd, stride_pr, cos, sin, HALF, R, R_P2, DTYPE, F32)
    else:
        s = _dot(q1, tl.trans(z), tl.zeros([q1.shape[0], z.shape[0]], dtype=tl.float32), DOT_PREC, F32)
    return s


@triton.jit
def _band_fwd(
    Q, ZK, ZV, EK, EV, KEY_FROM, VALUE_FROM, PK, PV, POS, INV_FREQ, BIAS, LENGTHS, OUT, LSE,
    n_q, n_k, group, sm_scale, rope_scaling,
    stride_qb, stride_qh, stride_qn, stride_qd,
    stride_zkb, stride_zkg, stride_zkn, stride_zkr, stride_zvb, stride_zvg, stride_zvn, stride_zvr,
    stride_ekb, stride_ekg, stride_ekn, stride_ekr, stride_evb, stride_evg, stride_evn, stride_evr,
    stride_pkg, stride_pkd, stride_pkr, stride_pvg, stride_pvd, stride_pvr,
    stride_posb, stride_posg, stride_posn, stride_bb, stride_bg, stride_bn,
    stride_ob, stride_oh, stride_on, stride_od, stride_lb, stride_lh,
    kv_heads, HEAD_DIM: tl.constexpr, R_K: tl.constexpr, R_V: tl.constexpr, R_K_P2: tl.constexpr,
    R_V_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRE_ROPE: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LENGTHS: tl.constexpr, HAS_PV: tl.constexpr,
    DTYPE: tl.constexpr, UPCAST: tl.constexpr,
):
    """One program: ``BLOCK_M`` rows of one (batch row, KV head) over the whole band; row ``m`` is query
    ``m // group`` of the group's head ``m % group``, so each key tile is rebuilt once for the GQA group. A
    key tile computes the stored version's logits only where some row still reads stored keys in it, the
    exact version's only where some row reads exact ones (most tiles below the diagonal need one)."""
    F32: tl.constexpr = DTYPE == tl.float32 or UPCAST
    pid_m = tl.program_id(0)
    pid_bg = tl.program_id(1)
    b = pid_bg // kv_heads
    g = pid_bg % kv_heads
    b64, g64 = b.to(tl.int64), g.to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < n_q * group
    q_idx = offs_m // group
    head = (g * group + offs_m % group).to(tl.int64)
    HALF: tl.constexpr = HEAD_DIM // 2
    q_rows = Q + b64 * stride_qb + head * stride_qh + q_idx * stride_qn
    key_from = tl.load(KEY_FROM + q_idx, mask=row_ok, other=0)
    value_from = tl.load(VALUE_FROM + q_idx, mask=row_ok, other=0)
    # the tile's range of starts: a key tile at n reads stored keys for some row iff n < max(from), exact
    # ones iff n + BLOCK_N > min(from)
    k_lo = tl.min(tl.where(row_ok, key_from, n_k), 0)
    k_hi = tl.max(tl.where(row_ok, key_from, 0), 0)
    v_lo = tl.min(tl.where(row_ok, value_from, n_k), 0)
    v_hi = tl.max(tl.where(row_ok, value_from, 0), 0)
    ZK += b64 * stride_zkb + g64 * stride_zkg
    ZV += b64 * stride_zvb + g64 * stride_zvg
    EK += b64 * stride_ekb + g64 * stride_ekg
    EV += b64 * stride_evb + g64 * stride_evg
    PK += g64 * stride_pkg
    if PRE_ROPE:
        offs_h = tl.arange(0, HALF)
        q1 = tl.load(q_rows[:, None] + offs_h[None, :] * stride_qd, mask=row_ok[:, None], other=0.0).to(DTYPE)
        q2 = tl.load(q_rows[:, None] + (HALF + offs_h)[None, :] * stride_qd, mask=row_ok[:, None],
                     other=0.0).to(DTYPE)
        inv_freq = tl.load(INV_FREQ + offs_h).to(tl.float32)
        POS += b64 * stride_posb + g64 * stride_posg
    else:  # post_rope: logits in r_k dimensions against P_kᵀ q (q1)
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_rows[:, None] + offs_d[None, :] * stride_qd, mask=row_ok[:, None], other=0.0).to(DTYPE)
        q1 = _dot(q, _basis_rows(PK, 0, stride_pkd, stride_pkr, HEAD_DIM, R_K, R_K_P2, DTYPE),
                  tl.zeros([BLOCK_M, R_K_P2], dtype=tl.float32), DOT_PREC, F32).to(DTYPE)  # [BLOCK_M, R_K_P2]
        q2 = q1
        cos = 0.0  # no rotation: unread
        sin = 0.0
    first_real = 0
    if HAS_LENGTHS:  # left padding: a row's real keys are its last lengths[b]
        first_real = n_k - tl.load(LENGTHS + b)
    end = n_k
    if CAUSAL:  # query i sits at key n_k − n_q + i
        last_query = tl.minimum(n_q - 1, (pid_m * BLOCK_M + BLOCK_M - 1) // group)
        end = tl.minimum(n_k, n_k - n_q + last_query + 1)
    acc = tl.zeros([BLOCK_M, R_V_P2], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    qk_scale = sm_scale * _LOG2E
    for start in range(0, end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        if PRE_ROPE:
            pos = tl.load(POS + offs_n * stride_posn, mask=offs_n < n_k, other=0).to(tl.float32)
            sin, cos = _sincos(pos[:, None] * inv_freq[None, :])  # the decode kernel's polynomial: ~1e-7
            cos, sin = cos * rope_scaling, sin * rope_scaling
        s_stored = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        s_exact = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if start < k_hi:
            s_stored = _version_logits(ZK, offs_n, n_k, stride_zkn, stride_zkr, q1, q2, PK, stride_pkd,
                                       stride_pkr, cos, sin, HALF, R_K, R_K_P2, DTYPE, F32, PRE_ROPE)
        if start + BLOCK_N > k_lo:
            s_exact = _version_logits(EK, offs_n, n_k, stride_ekn, stride_ekr, q1, q2, PK, stride_pkd,
                                      stride_pkr, cos, sin, HALF, R_K, R_K_P2, DTYPE, F32, PRE_ROPE)
        s = tl.where(offs_n[None, :] >= key_from[:, None], s_exact, s_stored) * qk_scale
        if HAS_BIAS:
            bias = tl.load(BIAS + b64 * stride_bb + g64 * stride_bg + offs_n * stride_bn, mask=offs_n < n_k,
                           other=0.0)
            s += bias.to(tl.float32)[None, :] * _LOG2E
        visible = ((offs_n < n_k) & (offs_n >= first_real))[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= (n_k - n_q + q_idx)[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        p_exact = tl.where(offs_n[None, :] >= value_from[:, None], p, 0.0)
        if start < v_hi:
            zv = _latent_tile(ZV, offs_n, n_k, stride_zvn, stride_zvr, R_V, R_V_P2, DTYPE)
            acc = _dot((p - p_exact).to(DTYPE), zv, acc, DOT_PREC, F32)
        if start + BLOCK_N > v_lo:
            ev = _latent_tile(EV, offs_n, n_k, stride_evn, stride_evr, R_V, R_V_P2, DTYPE)
            acc = _dot(p_exact.to(DTYPE), ev, acc, DOT_PREC, F32)
        m_i = m_new
    seen = l_i > 0.0
    o = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * _LN2, float("-inf"))
    tl.store(LSE + b64 * stride_lb + head * stride_lh + q_idx, lse, mask=row_ok)
    o_rows = OUT + b64 * stride_ob + head * stride_oh + q_idx * stride_on
    if HAS_PV:  # in float32: one small dot a program, and the output keeps the reference's precision
        pv = _basis_rows(PV + g64 * stride_pvg, 0, stride_pvd, stride_pvr, HEAD_DIM, R_V, R_V_P2, tl.float32)
        out = tl.dot(o, tl.trans(pv), input_precision="ieee")  # [BLOCK_M, d]
        offs_d = tl.arange(0, HEAD_DIM)
        tl.store(o_rows[:, None] + offs_d[None, :] * stride_od, out.to(OUT.dtype.element_ty),
                 mask=row_ok[:, None])
    else:
        offs_r = tl.arange(0, R_V_P2)
        tl.store(o_rows[:, None] + offs_r[None, :] * stride_od, o.to(OUT.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_r < R_V)[None, :])


def band_attention(
    q: torch.Tensor,
    z_k: torch.Tensor,
    z_v: torch.Tensor,
    exact: ExactTail,
    P_k: torch.Tensor,
    P_v: torch.Tensor | None,
    *,
    key_mode: str,
    positions: torch.Tensor | None = None,
    rope: RopeSpec | None = None,
    bias: torch.Tensor | None = None,
    causal: bool = True,
    lengths: torch.Tensor | None = None,
    scale: float | None = None,
    num_warps: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` ``[B, H, Nq, d]`` over a band of ``Ne`` keys held twice: stored (``z_k``, ``z_v``
    ``[B, G, Ne, r]``, the codes dequantized) and exact (``exact.z_k``, ``exact.z_v``, the same shapes);
    query ``i`` reads key ``j`` exact where ``j ≥ exact.key_from[i]`` (values: ``value_from[i]``), indices
    within the band. ``positions`` ``[B, Ne]`` or ``[B, G, Ne]`` (``pre_rope``), ``bias`` ``[B, G, Ne]``,
    ``lengths`` ``[B]`` (real keys at the end of each row) and ``causal`` (query ``i`` at key
    ``Ne − Nq + i``) as :func:`stiefkv.kernels.lowrank_attention` has them.

    Returns the output ``[B, H, Nq, d]`` (``[B, H, Nq, r_v]`` with ``P_v=None``) in ``q.dtype`` and each
    row's log-sum-exp of the logits it read ``[B, H, Nq]`` (float32, −inf where it sees no key; its output
    is then 0), as the reference's ``return_lse=True`` gives them. ``num_warps`` overrides
    :data:`NUM_WARPS` (for benchmarks' sweeps).
    """
    if not q.is_cuda and not interpreting():
        raise RuntimeError("the Triton band attention runs on CUDA tensors (or on the CPU under "
                           "TRITON_INTERPRET=1); the reference takes the band elsewhere")
    _check_band(q, z_k, z_v, exact, P_k, P_v, key_mode, positions, rope, bias, lengths)
    B, H, Nq, d = q.shape
    G, Ne, r_k = z_k.shape[1], z_k.shape[2], z_k.shape[3]
    r_v = z_v.shape[3]
    out = torch.empty(B, H, Nq, d if P_v is not None else r_v, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, H, Nq, device=q.device, dtype=torch.float32)
    if B * H * Nq == 0:
        return out, lse
    pre = key_mode == "pre_rope"
    # contiguous: the kernel reads them by index (an int32 view would come through .to unchanged)
    key_from = exact.key_from.to(device=q.device, dtype=torch.int32).contiguous()
    value_from = exact.value_from.to(device=q.device, dtype=torch.int32).contiguous()
    pos = positions if pre else None
    pos_strides = (0, 0, 0) if pos is None else (
        (pos.stride(0), 0, pos.stride(1)) if pos.dim() == 2 else pos.stride())
    inv_freq = rope.inv_freq.to(device=q.device, dtype=torch.float32).contiguous() if pre else None
    bias_strides = (0, 0, 0) if bias is None else bias.stride()
    pv_strides = (0, 0, 0) if P_v is None else P_v.stride()
    ek, ev = exact.z_k, exact.z_v
    grid = (triton.cdiv(Nq * (H // G), BLOCK_M), B * G)
    _band_fwd[grid](
        q, z_k, z_v, ek, ev, key_from, value_from, P_k, P_v, pos, inv_freq, bias,
        None if lengths is None else lengths.to(device=q.device, dtype=torch.int32).contiguous(), out, lse,
        Nq, Ne, H // G, float(d**-0.5 if scale is None else scale),
        float(rope.attention_scaling) if pre else 1.0,
        *q.stride(), *z_k.stride(), *z_v.stride(), *ek.stride(), *ev.stride(), *P_k.stride(), *pv_strides,
        *pos_strides, *bias_strides, *out.stride(), lse.stride(0), lse.stride(1), G,
        HEAD_DIM=d, R_K=r_k, R_V=r_v, R_K_P2=padded_dim(r_k), R_V_P2=padded_dim(r_v),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, PRE_ROPE=pre, CAUSAL=causal, HAS_BIAS=bias is not None,
        HAS_LENGTHS=lengths is not None, HAS_PV=P_v is not None, DTYPE=_TL_DTYPES[q.dtype],
        UPCAST=interpreting(), num_warps=NUM_WARPS if num_warps is None else num_warps,
    )
    return out, lse


def fits(d: int, r_k: int, r_v: int) -> bool:
    """Whether the kernel takes these shapes: a power-of-two head dim of 32 to :data:`MAX_DIM`, ranks up to
    it (at d 256 and full rank the ``P_kᵀ q`` and ``P_v`` tiles need ~280 KB of shared memory on sm_90,
    past the H100's 227 KB; d 128 at r 128 compiles to 82-98 KB)."""
    return d % 32 == 0 and d & (d - 1) == 0 and d <= MAX_DIM and max(r_k, r_v) <= MAX_DIM


def _check_band(q, z_k, z_v, exact, P_k, P_v, key_mode, positions, rope, bias, lengths) -> None:
    """Refuse inputs the band kernel cannot read, naming the bad one."""
    if key_mode not in KEY_MODES:
        raise ValueError(f"key_mode must be one of {KEY_MODES}, got {key_mode!r}")
    if q.dim() != 4 or not all(isinstance(t, torch.Tensor) and t.dim() == 4
                               for t in (z_k, z_v, exact.z_k, exact.z_v)):
        raise ValueError("band_attention takes 4-D float queries, stored latents and exact latents; got "
                         f"{[tuple(getattr(t, 'shape', ())) for t in (q, z_k, z_v, exact.z_k, exact.z_v)]}")
    B, H, Nq, d = q.shape
    G, Ne = z_k.shape[1], z_k.shape[2]
    if not fits(d, z_k.shape[3], z_v.shape[3]):
        raise ValueError(f"the band kernel needs a power-of-two head dim of 32 to {MAX_DIM} and ranks up to "
                         f"{MAX_DIM}, got d {d}, ranks {z_k.shape[3]} and {z_v.shape[3]}; use the reference")
    if q.dtype not in _TL_DTYPES or any(t.dtype not in _TL_DTYPES for t in (z_k, z_v, exact.z_k, exact.z_v)):
        raise ValueError(f"the band kernel takes bf16, fp16 or fp32 queries and latents, got {q.dtype}, "
                         f"{z_k.dtype}, {z_v.dtype}, {exact.z_k.dtype} and {exact.z_v.dtype}")
    if H % G:
        raise ValueError(f"query heads ({H}) must be a multiple of KV heads ({G})")
    if exact.z_k.shape != z_k.shape or exact.z_v.shape != z_v.shape or tuple(z_v.shape[:3]) != (B, G, Ne):
        raise ValueError(f"the band's stored latents {tuple(z_k.shape)}, {tuple(z_v.shape)} and exact ones "
                         f"{tuple(exact.z_k.shape)}, {tuple(exact.z_v.shape)} must be [B={B}, G, Ne, r] "
                         "alike")
    if tuple(P_k.shape) != (G, d, z_k.shape[3]) or (P_v is not None and
                                                   tuple(P_v.shape) != (G, d, z_v.shape[3])):
        raise ValueError(f"P_k {tuple(P_k.shape)} and P_v {tuple(getattr(P_v, 'shape', ()))} must be "
                         f"[G={G}, d={d}, r]")
    for name in ("key_from", "value_from"):
        if tuple(getattr(exact, name).shape) != (Nq,):
            raise ValueError(f"exact.{name} must be [Nq={Nq}], got {tuple(getattr(exact, name).shape)}")
    if key_mode == "pre_rope" and (positions is None or rope is None or tuple(positions.shape) not in (
            (B, Ne), (B, G, Ne)) or rope.inv_freq.numel() != d // 2):
        raise ValueError(f"pre_rope needs positions [B={B}, Ne={Ne}] (or [B, G, Ne]) and a rope spec of "
                         f"d/2={d // 2} frequencies; got {tuple(getattr(positions, 'shape', ()))}")
    if bias is not None and tuple(bias.shape) != (B, G, Ne):
        raise ValueError(f"bias must be [B={B}, G={G}, Ne={Ne}], got {tuple(bias.shape)}")
    if lengths is not None and tuple(lengths.shape) != (B,):
        raise ValueError(f"lengths must be [B={B}], got {tuple(lengths.shape)}")
