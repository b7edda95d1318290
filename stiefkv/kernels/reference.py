"""PyTorch references for the fused kernels; also the CPU path.

Every function here has the same signature as its Triton counterpart in this package and computes in
float32 whatever the input dtype; ``lowrank_attention`` returns the dtype of the queries, ``attention_kl``
float32. They materialise what the kernels never do (rebuilt keys, the N×N logits) and are meant for tests,
CPU inference and short contexts.
"""

from __future__ import annotations

import torch

from ._common import (
    KEY_MODES,
    ExactTail,
    QuantizedLatents,
    RopeSpec,
    as_float_latents,
    check_attention_inputs,
    check_codes,
    check_kl_inputs,
    check_prior,
    merge_prior,
)

__all__ = ["KEY_MODES", "ExactTail", "QuantizedLatents", "RopeSpec", "attention_kl", "key_padding_mask",
           "lowrank_attention", "rebuild_keys", "rope_cos_sin", "rotate"]


def rope_cos_sin(positions: torch.Tensor, rope: RopeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[..., d/2]`` (float32) for integer ``positions`` ``[...]``."""
    freqs = positions.to(torch.float32)[..., None] * rope.inv_freq.to(positions.device, torch.float32)
    return freqs.cos() * rope.attention_scaling, freqs.sin() * rope.attention_scaling


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[..., d]`` by half-dimension ``cos, sin`` ``[..., d/2]`` (broadcast)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_latent(q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                P: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Queries ``[B, N, H, d]`` rotated by transformers' ``cos, sin`` ``[B, N, d]`` and returned as
    ``[B, H, N, d]``; with ``k`` ``[B, N, G, d]`` and ``P`` ``[G, d, r]`` also ``z = Pᵀ rot(k)``
    ``[B, G, N, r]``. float32 inside, each output in its input's dtype."""

    def rot(x):  # [B, N, heads, d] → [B, heads, N, d]
        x1, x2 = x.transpose(1, 2).float().chunk(2, dim=-1)
        c1, c2 = cos.float()[:, None].chunk(2, dim=-1)
        s1, s2 = sin.float()[:, None].chunk(2, dim=-1)
        return torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), dim=-1)

    z = None if k is None else torch.matmul(rot(k), P.float()).to(k.dtype)
    return rot(q).to(q.dtype), z


def rebuild_keys(
    z_k: torch.Tensor, P_k: torch.Tensor, *, key_mode: str, positions: torch.Tensor | None,
    rope: RopeSpec | None,
) -> torch.Tensor:
    """Keys ``[B, G, N, d]`` (float32) from latents ``z_k`` ``[B, G, N, r_k]`` and bases ``P_k``
    ``[G, d, r_k]``.

    ``pre_rope`` rotates the rebuilt key at its position ``positions`` ``[B, N]`` (or per KV head,
    ``[B, G, N]``: a compacted cache keeps different tokens per head); ``post_rope`` latents
    were taken after the rotation, so the rebuilt key is already rotated.
    """
    keys = torch.einsum("bgnr,gdr->bgnd", z_k.float(), P_k.float())
    if key_mode == "post_rope":
        return keys
    if positions is None or rope is None:
        raise ValueError("key_mode='pre_rope' needs the key positions and the rope spec")
    cos, sin = rope_cos_sin(positions, rope)  # [B, N, d/2] or [B, G, N, d/2]
    if positions.dim() == 2:
        cos, sin = cos[:, None], sin[:, None]
    return rotate(keys, cos, sin)


def key_padding_mask(lengths: torch.Tensor | None, batch: int, n_keys: int, device) -> torch.Tensor:
    """Boolean ``[B, Nk]``: True where a key is real; ``lengths[b]`` real keys sit at the end (left
    padding)."""
    if lengths is None:
        return torch.ones(batch, n_keys, dtype=torch.bool, device=device)
    idx = torch.arange(n_keys, device=device)
    return idx[None, :] >= (n_keys - lengths.to(device).long())[:, None]


def lowrank_attention(
    q: torch.Tensor,
    z_k: torch.Tensor,
    z_v: torch.Tensor,
    P_k: torch.Tensor,
    P_v: torch.Tensor | None,
    *,
    key_mode: str = "pre_rope",
    positions: torch.Tensor | None = None,
    rope: RopeSpec | None = None,
    bias: torch.Tensor | None = None,
    causal: bool = True,
    lengths: torch.Tensor | None = None,
    n_valid: torch.Tensor | None = None,
    scale: float | None = None,
    exact: ExactTail | None = None,
    return_lse: bool = False,
    prior: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over a latent KV cache.

    Parameters
    ----------
    q : ``[B, H, Nq, d]`` queries, already rotated at their positions (as the model computes them).
    z_k : ``[B, G, Nk, r_k]`` key latents, ``z_k = P_kᵀ k`` (``k`` before or after RoPE per ``key_mode``).
    z_v : ``[B, G, Nk, r_v]`` value latents, ``z_v = P_vᵀ v``. Either may be :class:`QuantizedLatents`
        (dequantized here to the queries' dtype, as the kernel does in registers).
    P_k : ``[G, d, r_k]`` and P_v : ``[G, d, r_v]`` orthonormal bases. ``P_v=None`` returns the attention
        output in latent space ``[B, H, Nq, r_v]`` (for a ``P_v`` folded into ``o_proj``).
    positions : ``[B, Nk]`` integer key positions, or ``[B, G, Nk]`` per KV head (``pre_rope`` only).
    rope : :class:`RopeSpec` (``pre_rope`` only).
    bias : ``[B, G, Nk]`` additive logit bias per key (compacted tokens); zero when ``None``.
    causal : query ``i`` sits at key index ``Nk − Nq + i`` and sees keys up to it.
    lengths : ``[B]`` real keys per row, right-aligned (left padding); all real when ``None``.
    n_valid : one integer tensor: only the first ``n_valid`` key slots hold keys (a static cache); read
        back to the host here, and everything above then counts those keys.
    scale : softmax scale, ``d**-0.5`` by default.
    exact : :class:`ExactTail`: query ``i`` reads keys (values) from ``key_from[i]`` (``value_from[i]``) on
        from its exact latents instead of the quantized ones.
    return_lse : also return each row's log-sum-exp of its scaled, biased, masked logits ``[B, H, Nq]``
        (float32; −inf for a row with no visible key); with ``exact``, of the logits it reads.
    prior : ``(o, lse)`` of an attention over other keys (its output, in the same space as this one's, and
        log-sum-exp ``[B, H, Nq]``): the result is the attention over both key sets, merged by
        :func:`~stiefkv.kernels._common.merge_by_lse` (and the log-sum-exp of both).

    Returns
    -------
    ``[B, H, Nq, d]`` (or ``[B, H, Nq, r_v]``) in ``q.dtype``. A query row with no visible key returns 0.
    """
    if key_mode not in KEY_MODES:
        raise ValueError(f"key_mode must be one of {KEY_MODES}, got {key_mode!r}")
    if prior is not None:
        check_prior(prior, q, q.shape[3] if P_v is not None else z_v.shape[3])
        out, lse = lowrank_attention(q, z_k, z_v, P_k, P_v, key_mode=key_mode, positions=positions, rope=rope,
                                     bias=bias, causal=causal, lengths=lengths, n_valid=n_valid, scale=scale,
                                     exact=exact, return_lse=True)
        return merge_prior(prior, out, lse, q.dtype, return_lse)
    for name, z in (("z_k", z_k), ("z_v", z_v)):
        if isinstance(z, QuantizedLatents):
            check_codes(z, name)
    z_k, z_v = as_float_latents(z_k, q.dtype), as_float_latents(z_v, q.dtype)
    check_attention_inputs(q, z_k, z_v, P_k, P_v, key_mode, positions, rope, bias, lengths, n_valid)
    if n_valid is not None:
        n = int(n_valid.reshape(-1)[0])
        if not 0 <= n <= z_k.shape[2]:
            raise ValueError(f"n_valid must lie in 0..Nk={z_k.shape[2]} (the key slots filled), got {n}")
        z_k, z_v = z_k[:, :, :n], z_v[:, :, :n]
        positions = positions[..., :n] if positions is not None else None
        bias = bias[..., :n] if bias is not None else None
    B, H, Nq, d = q.shape
    G, Nk = z_k.shape[1], z_k.shape[2]
    if H % G:
        raise ValueError(f"query heads ({H}) must be a multiple of KV heads ({G})")
    scale = d**-0.5 if scale is None else scale
    if key_mode == "post_rope":
        # q·(P_k z) = (P_kᵀ q)·z: attention runs in r_k dimensions.
        qf = torch.einsum("bgsqd,gdr->bgsqr", q.float().view(B, G, H // G, Nq, d), P_k.float())
        qf = qf.reshape(B, H, Nq, -1)
        keys = z_k.float()
    else:
        qf = q.float()
        keys = rebuild_keys(z_k, P_k, key_mode=key_mode, positions=positions, rope=rope)
    if exact is not None:
        tail_keys = exact.z_k.float() if key_mode == "post_rope" else rebuild_keys(
            exact.z_k, P_k, key_mode=key_mode, positions=positions[..., Nk - exact.z_k.shape[2]:], rope=rope)
        out, lse = _banded_attention(qf, keys, z_v.float(), tail_keys, exact, lengths=lengths, bias=bias,
                                     causal=causal, scale=scale, with_lse=return_lse)
    elif causal and Nq == Nk and bias is None and lengths is None:
        # The plain causal square (prefill, evaluation): no dense mask, so SDPA may take a fused kernel;
        # heads expanded here because not every fused kernel takes enable_gqa.
        out = torch.nn.functional.scaled_dot_product_attention(
            qf, keys.repeat_interleave(H // G, dim=1), z_v.float().repeat_interleave(H // G, dim=1),
            is_causal=True, scale=scale)
    else:
        out = _masked_attention(qf, keys, z_v.float(), lengths=lengths, bias=bias, causal=causal, scale=scale)
    if not (causal and Nq <= Nk and lengths is None and bias is None):  # else every row sees a key
        # a row with no visible key is 0 (SDPA gives NaN there); a NaN from the inputs stays NaN
        out = torch.where(_no_key(B, H, Nq, Nk, lengths, bias, causal, q.device)[..., None], 0.0, out)
    if P_v is not None:
        out = torch.einsum("bgsqr,gdr->bgsqd", out.reshape(B, G, H // G, Nq, out.shape[-1]), P_v.float())
    out = out.reshape(B, H, Nq, out.shape[-1]).to(q.dtype)  # sizes named: an empty batch has no -1
    if return_lse:
        if exact is None:
            lse = _logsumexp(qf, keys, lengths=lengths, bias=bias, causal=causal, scale=scale)
        return out, lse
    return out


def _no_key(B: int, H: int, Nq: int, Nk: int, lengths, bias, causal: bool, device) -> torch.Tensor:
    """``[B, H, Nq]``: the query rows that see no key (padding, causality, or a bias of −inf on all)."""
    visible = key_padding_mask(lengths, B, Nk, device)[:, None, None, :]
    if causal:
        q_idx = torch.arange(Nq, device=device) + (Nk - Nq)
        visible = visible & (torch.arange(Nk, device=device)[None, :] <= q_idx[:, None])
    if bias is not None:
        finite = (bias != float("-inf")).repeat_interleave(H // bias.shape[1], dim=1)
        visible = visible & finite[:, :, None, :]
    return ~visible.expand(B, H, Nq, Nk).any(-1)


def _logsumexp(qf, keys, *, lengths, bias, causal: bool, scale: float) -> torch.Tensor:
    """``log Σ_j exp(scale·q·k_j + bias_j)`` over each row's visible keys ``[B, H, Nq]`` (−inf: none)."""
    B, H, Nq, _ = qf.shape
    G, Nk = keys.shape[1], keys.shape[2]
    logits = torch.einsum("bhqr,bhkr->bhqk", qf, keys.float().repeat_interleave(H // G, dim=1)) * scale
    visible = key_padding_mask(lengths, B, Nk, qf.device)[:, None, None, :]
    if causal:
        q_idx = torch.arange(Nq, device=qf.device) + (Nk - Nq)
        visible = visible & (torch.arange(Nk, device=qf.device)[None, :] <= q_idx[:, None])
    if bias is not None:
        logits = logits + bias.float().repeat_interleave(H // G, dim=1)[:, :, None, :]
    return torch.logsumexp(logits.masked_fill(~visible, float("-inf")), -1)


def _masked_attention(qf, keys, values, *, lengths, bias, causal: bool, scale: float) -> torch.Tensor:
    B, H, Nq, _ = qf.shape
    G, Nk = keys.shape[1], keys.shape[2]
    visible = key_padding_mask(lengths, B, Nk, qf.device)[:, None, None, :]
    if causal:
        q_idx = torch.arange(Nq, device=qf.device) + (Nk - Nq)
        visible = visible & (torch.arange(Nk, device=qf.device)[None, :] <= q_idx[:, None])
    mask = torch.zeros(visible.shape, dtype=torch.float32, device=qf.device)
    mask = mask.masked_fill(~visible, float("-inf"))
    if bias is not None:
        mask = mask + bias.float().repeat_interleave(H // G, dim=1)[:, :, None, :]
    # SDPA's math is the softmax(q kᵀ·scale + mask) v of the docstring; values are the latents.
    return torch.nn.functional.scaled_dot_product_attention(
        qf, keys, values, attn_mask=mask.expand(B, H, Nq, Nk) if mask.shape[1] == 1 else mask,
        scale=scale, enable_gqa=True,
    )


BAND_ELEMENTS = 1 << 26  # logits per step of the banded reference (256 MiB in float32): bounds its memory


def _banded_attention(qf, keys, values, tail_keys, exact: ExactTail, *, lengths, bias, causal: bool,
                      scale: float, with_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention where query ``i`` reads the last keys and values from ``exact`` from ``key_from[i]``
    (``value_from[i]``) on: logits and the value sum swap in the exact tail where the band says so. Returns
    the output ``[B, H, Nq, r_v]`` and, ``with_lse``, each row's log-sum-exp of the logits it read
    ``[B, H, Nq]`` (else None)."""
    B, H, Nq, _ = qf.shape
    G, Nk, Ne = keys.shape[1], keys.shape[2], tail_keys.shape[2]
    check_exact_tail(exact, values, Nq, Nk)
    S = H // G
    q5 = qf.view(B, G, S, Nq, -1)
    tail_values = exact.z_v.float()
    tail_delta = tail_values - values[:, :, Nk - Ne:]
    tail_idx = torch.arange(Nk - Ne, Nk, device=qf.device)
    visible = key_padding_mask(lengths, B, Nk, qf.device)[:, None, None, None, :]
    key_bias = None if bias is None else bias.float()[:, :, None, None, :]
    key_from, value_from = exact.key_from.to(qf.device), exact.value_from.to(qf.device)
    outs, lses = [], []
    step = max(1, BAND_ELEMENTS // (B * H * Nk))
    for lo in range(0, Nq, step):
        hi = min(Nq, lo + step)
        q = q5[:, :, :, lo:hi]
        logits = torch.einsum("bgsqd,bgkd->bgsqk", q, keys) * scale
        # only the band these queries read exact: from the first key any of them does, to the last it sees
        a = max(Nk - Ne, int(torch.minimum(key_from[lo:hi].min(), value_from[lo:hi].min())))
        b = max(a, min(Nk, Nk - Nq + hi) if causal else Nk)
        band = slice(a - (Nk - Ne), b - (Nk - Ne))
        tail = torch.einsum("bgsqd,bgkd->bgsqk", q, tail_keys[:, :, band]) * scale
        use_k = tail_idx[None, band] >= key_from[lo:hi, None]
        logits[..., a:b] = torch.where(use_k, tail, logits[..., a:b])
        if key_bias is not None:
            logits = logits + key_bias
        seen = visible
        if causal:
            q_idx = torch.arange(lo, hi, device=qf.device) + (Nk - Nq)
            seen = seen & (torch.arange(Nk, device=qf.device)[None, :] <= q_idx[:, None])
        logits = logits.masked_fill(~seen, float("-inf"))
        if with_lse:
            lses.append(torch.logsumexp(logits, -1))
        p = torch.softmax(logits, dim=-1)
        use_v = (tail_idx[None, band] >= value_from[lo:hi, None]).float()
        out = torch.einsum("bgsqk,bgkr->bgsqr", p, values)
        out = out + torch.einsum("bgsqk,bgkr->bgsqr", p[..., a:b] * use_v, tail_delta[:, :, band])
        outs.append(out)
    lse = torch.cat(lses, 3).reshape(B, H, Nq) if with_lse else None
    return torch.cat(outs, 3).reshape(B, H, Nq, -1), lse


def check_exact_tail(exact: ExactTail, z_v: torch.Tensor, n_queries: int, n_keys: int) -> None:
    """Refuse an :class:`ExactTail` that does not fit the latents it stands beside, naming what it got."""
    zk, zv = exact.z_k, exact.z_v
    ne = zk.shape[2] if zk.dim() == 4 else -1
    if (zk.dim() != 4 or zv.dim() != 4 or zv.shape[2] != ne or ne > n_keys or zk.shape[:2] != zv.shape[:2]
            or zv.shape[:2] != z_v.shape[:2] or zv.shape[3] != z_v.shape[3]):
        raise ValueError(f"exact.z_k and exact.z_v must be [B, G, Ne, r] latents of the same last Ne ≤ "
                         f"{n_keys} keys; got {tuple(zk.shape)} and {tuple(zv.shape)} beside z_v "
                         f"{tuple(z_v.shape)}")
    for name in ("key_from", "value_from"):
        t = getattr(exact, name)
        if t.shape != (n_queries,):
            raise ValueError(f"exact.{name} must be [Nq] = [{n_queries}]; got {tuple(t.shape)}")
        if n_queries and int(t.min()) < n_keys - ne:
            raise ValueError(f"exact.{name} must be at least Nk − Ne = {n_keys - ne} (keys before the tail "
                             f"have no exact latents); got {int(t.min())}")


def _attention_logits(q: torch.Tensor, k: torch.Tensor, scale: float | None) -> torch.Tensor:
    """Logits ``[B, H, Nq, Nk]`` (float32) with GQA: ``k`` ``[B, Hkv, Nk, d]`` serves ``H // Hkv`` heads
    each."""
    H, Hkv, d = q.shape[1], k.shape[1], q.shape[-1]
    if H % Hkv:
        raise ValueError(f"query heads ({H}) must be a multiple of key heads ({Hkv})")
    k = k.float().repeat_interleave(H // Hkv, dim=1)
    return torch.einsum("bhqd,bhkd->bhqk", q.float(), k) * (d**-0.5 if scale is None else scale)


def attention_kl(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    q_s: torch.Tensor,
    k_s: torch.Tensor,
    *,
    causal: bool = True,
    scale_t: float | None = None,
    scale_s: float | None = None,
    reduction: str = "mean",
    direction: str = "forward",
) -> torch.Tensor:
    """KL divergence between a teacher's and a student's attention distributions, materialised.

    ``P_t = softmax(q_t k_tᵀ · scale_t)``, ``P_s`` likewise; per query row ``KL(P_t ‖ P_s)``
    (``direction="forward"``) or ``KL(P_s ‖ P_t)`` (``"reverse"``).

    Parameters
    ----------
    q_t : ``[B, H, Nq, d_t]``, k_t : ``[B, H_t, Nk, d_t]`` teacher queries and keys.
    q_s : ``[B, H, Nq, d_s]``, k_s : ``[B, H_s, Nk, d_s]`` student queries and keys; GQA independently.
    causal : query ``i`` sees keys up to index ``Nk − Nq + i``.
    scale_t, scale_s : logit scales, ``d**-0.5`` by default.
    reduction : ``"none"`` ``[B, H, Nq]``, ``"sum"`` or ``"mean"`` over all rows.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if direction not in ("forward", "reverse"):
        raise ValueError(f"direction must be 'forward' or 'reverse', got {direction!r}")
    check_kl_inputs(q_t, k_t, q_s, k_s)
    a = _attention_logits(q_t, k_t, scale_t)
    b = _attention_logits(q_s, k_s, scale_s)
    if causal:
        Nq, Nk = a.shape[-2], a.shape[-1]
        q_idx = torch.arange(Nq, device=a.device) + (Nk - Nq)
        hidden = torch.arange(Nk, device=a.device)[None, :] > q_idx[:, None]
        # A large finite fill, not -inf: p = 0 there exactly, and no inf − inf reaches the gradient.
        a = a.masked_fill(hidden, -1e30)
        b = b.masked_fill(hidden, -1e30)
    log_p, log_s = torch.log_softmax(a, dim=-1), torch.log_softmax(b, dim=-1)
    if direction == "reverse":
        log_p, log_s = log_s, log_p
    kl = (log_p.exp() * (log_p - log_s)).sum(dim=-1)
    if reduction == "none":
        return kl
    return kl.sum() if reduction == "sum" else kl.mean()
