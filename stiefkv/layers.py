"""One decoder layer with low-rank keys and values, as calibration and evaluation see it.

This module is neutral ground: calibration (``stiefkv.calibrate``) and evaluation (``stiefkv.evaluate``)
both import it, and it imports neither, nor the optimizer stack. Serving (``stiefkv.attention``) reuses
its projections but keeps its own path: folded bases, a cast key basis and the latent cache.

Everything here is differentiable in the bases ``P_k`` ``[G, d, r_k]`` and ``P_v`` ``[G, d, r_v]`` and
runs on unpadded batches (causal attention, no key mask). Errors are on the decoder-layer output ``y``
``[B, N, D]``: relative error ``‖ŷ − y‖_F / ‖y‖_F`` and the mean per-token cosine similarity.

A basis of shape ``[1, G·d, r]`` is shared by the layer's KV heads (Palu's grouped heads): one latent a
token, ``z = Σ_g P_gᵀ x_g`` with ``P_g`` its ``g``-th block of ``d`` rows, rebuilt as ``P_g z`` for head
``g`` (:func:`to_latent`, :func:`head_latents`, :func:`head_bases`; ``docs/notes/grouped-heads.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from stiefkv import kernels
from stiefkv.kernels import ExactTail, RopeSpec
from stiefkv.models import decoder_layers
from stiefkv.quant import FLOAT, QuantSpec, exact_from, fake_quant, held_exact

NO_QUANT = (FLOAT, FLOAT)


@dataclass
class LayerBatch:
    """What one decoder layer saw and produced for one batch.

    ``hidden`` ``[B, N, D]`` input, ``output`` ``[B, N, D]`` the uncompressed layer's output,
    ``position_embeddings`` the rotary ``(cos, sin)`` ``[B, N, d]``, ``attention_mask`` the 4-D mask (or
    None) and ``position_ids`` ``[1 or B, N]``.
    """

    layer_idx: int
    hidden: torch.Tensor
    output: torch.Tensor
    position_embeddings: tuple[torch.Tensor, torch.Tensor]
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor

    @property
    def positions(self) -> torch.Tensor:
        return self.position_ids.expand(self.hidden.shape[0], self.hidden.shape[1])


@contextmanager
def layer_hooks(model: nn.Module, consumer: Callable[[LayerBatch], None]) -> Iterator[None]:
    """Call ``consumer`` with every decoder layer's :class:`LayerBatch` during forwards; the hooks are
    removed after."""

    def hook(layer_idx):
        def fn(module, args, kwargs, output):
            hidden = args[0] if args else kwargs["hidden_states"]
            out = output[0] if isinstance(output, tuple) else output
            pos_ids = kwargs.get("position_ids")
            if pos_ids is None:
                pos_ids = torch.arange(hidden.shape[1], device=hidden.device)[None]
            consumer(LayerBatch(layer_idx, hidden, out, kwargs["position_embeddings"],
                                kwargs.get("attention_mask"), pos_ids))
        return fn

    handles = [layer.register_forward_hook(hook(i), with_kwargs=True)
               for i, layer in enumerate(decoder_layers(model))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def rotate_with(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' RoPE: ``x·cos + rotate_half(x)·sin`` with full-width ``cos, sin`` ``[B, N, d]``."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


def project_qkv(attn: nn.Module, hidden_states: torch.Tensor, *, keys: bool = True, values: bool = True):
    """q ``[B, H, N, d]``, k ``[B, G, N, d]`` (before RoPE, after any QK-norm), v ``[B, G, N, d]``; k or v is
    None when not asked for."""
    shape = (*hidden_states.shape[:-1], -1, attn.head_dim)
    q = attn.q_proj(hidden_states).view(shape)
    if getattr(attn, "q_norm", None) is not None:
        q = attn.q_norm(q)
    k = v = None
    if keys:
        k = attn.k_proj(hidden_states).view(shape)
        if getattr(attn, "k_norm", None) is not None:
            k = attn.k_norm(k)
        k = k.transpose(1, 2)
    if values:
        v = attn.v_proj(hidden_states).view(shape).transpose(1, 2)
    return q.transpose(1, 2), k, v


def is_shared(P: torch.Tensor, d: int) -> bool:
    """Whether the basis ``P`` is one ``[1, G·d, r]`` for all of a layer's KV heads of dim ``d``."""
    return P.shape[-2] != d


def to_latent(x: torch.Tensor, P: torch.Tensor) -> torch.Tensor:
    """``z = Pᵀ x``: ``[B, G, N, d]`` through ``[G, d, r]`` (float32) → ``[B, G, N, r]`` in ``x``'s dtype;
    through a shared ``[1, G·d, r]`` → ``[B, 1, N, r]``, the heads' channels side by side."""
    if is_shared(P, x.shape[-1]):
        B, G, N, d = x.shape
        if P.shape[-2] != G * d:
            raise ValueError(f"a shared basis needs G·d = {G * d} rows for {G} KV heads of dim {d}; got "
                             f"{tuple(P.shape)}")
        x = x.transpose(1, 2).reshape(B, 1, N, G * d)
    # matmul broadcasts over B; einsum's host time per call measured ~2.6× larger. P.float(): a served
    # model cast after load (model.half()) holds its bases in that dtype
    return torch.matmul(x.float(), P.float()).to(x.dtype)


def head_latents(z: torch.Tensor, G: int) -> torch.Tensor:
    """Latents ``[B, G, N, r]`` as attention reads them: a shared basis's one latent ``[B, 1, N, r]`` is
    every head's (a view, no copy)."""
    return z if z.shape[1] == G else z.expand(z.shape[0], G, *z.shape[2:])


def head_bases(P: torch.Tensor, G: int) -> torch.Tensor:
    """Bases ``[G, d, r]`` as attention reads them: a shared ``[1, G·d, r]``'s ``g``-th block of rows is
    head ``g``'s."""
    return P if P.shape[0] == G else P.reshape(G, P.shape[-2] // G, P.shape[-1])


def rebuild(x: torch.Tensor, P: torch.Tensor, spec: QuantSpec = FLOAT) -> torch.Tensor:
    """``[B, G, N, d]`` projected onto the bases' span and back (what the latents of ``x`` reproduce), the
    latents stored as ``spec`` between (:func:`~stiefkv.quant.fake_quant`: as a cache holding all ``N``)."""
    z = fake_quant(to_latent(x, P).float(), spec)
    P = P.float()
    if not is_shared(P, x.shape[-1]):
        return torch.matmul(z, P.transpose(-1, -2)).to(x.dtype)
    B, G, N, d = x.shape
    return torch.matmul(z, P.transpose(-1, -2)).reshape(B, N, G, d).transpose(1, 2).to(x.dtype)


def exact_band(quant: tuple[QuantSpec, QuantSpec], n_queries: int, read: tuple[torch.Tensor, torch.Tensor],
               tails: tuple[tuple[torch.Tensor, int], tuple[torch.Tensor, int]]) -> ExactTail | None:
    """The band of exact keys a forward of ``n_queries`` (the last of the keys) needs over latents stored as
    ``quant``: query ``i`` reads exact what the cache held exact when ``i`` was decoded
    (:func:`~stiefkv.quant.exact_from`). ``read`` are the key and value latents as stored (quantized ones
    dequantized), ``tails`` each latent's exact latents ``(z, first index)`` up to the last key. None where
    no band is needed: nothing quantized, or one query (decode reads the cache as it is)."""
    if n_queries == 1 or not any(spec.quantized for spec in quant):
        return None
    n_keys = read[0].shape[2]
    first = min(start for spec, (_, start) in zip(quant, tails) if spec.quantized)
    parts, froms = [], []
    query_index = torch.arange(n_keys - n_queries, n_keys, device=read[0].device)
    for spec, stored, (tail, start) in zip(quant, read, tails):
        if not spec.quantized:  # read exact already: no query needs its tail
            parts.append(stored[:, :, first:])
            froms.append(torch.full_like(query_index, n_keys))
            continue
        # a shorter tail is padded with the stored latents: no query reads them exact
        parts.append(torch.cat([stored[:, :, first:start], tail.to(stored.dtype)], 2) if start > first
                     else tail.to(stored.dtype))
        froms.append(exact_from(query_index, spec).clamp(min=start))
    return ExactTail(parts[0], parts[1], froms[0], froms[1])


def attention_block(attn: nn.Module, hidden_states: torch.Tensor, P_k: torch.Tensor, P_v: torch.Tensor, *,
                    key_mode: str, rope: RopeSpec, position_embeddings, positions: torch.Tensor,
                    backend: str = "reference", quant: tuple[QuantSpec, QuantSpec] = NO_QUANT,
                    straight_through: bool = False) -> torch.Tensor:
    """The attention block of one layer with low-rank keys and values, ``o_proj`` included: ``[B, N, D]``.

    ``hidden_states`` ``[B, N, D]`` is the normed layer input of an unpadded batch; ``positions`` ``[B, N]``.
    ``quant`` stores the key and value latents as the cache would (quantized, then read back);
    ``straight_through`` passes gradients through the quantizer as through the identity.
    Differentiable in ``P_k, P_v`` (float32): calibration optimises them through this function.
    """
    B, N, _ = hidden_states.shape
    cos, sin = position_embeddings
    q, k, v = project_qkv(attn, hidden_states)
    q = rotate_with(q, cos, sin)
    if key_mode == "post_rope":
        k = rotate_with(k, cos, sin)
    z_k, z_v = to_latent(k, P_k), to_latent(v, P_v)
    held = tuple(held_exact(z, spec, straight_through=straight_through) for z, spec in zip((z_k, z_v), quant))
    stored = tuple(fake_quant(z, spec, straight_through=straight_through, held=h)
                   for z, spec, h in zip((z_k, z_v), quant, held))
    exact = exact_band(quant, N, stored, tuple((h, 0) for h in held))
    G = k.shape[1]
    z_k, z_v = head_latents(stored[0], G), head_latents(stored[1], G)
    P_k, P_v = head_bases(P_k, G), head_bases(P_v, G)
    if exact is not None:
        exact = exact._replace(z_k=head_latents(exact.z_k, G), z_v=head_latents(exact.z_v, G))
    out = kernels.lowrank_attention(q, z_k, z_v, P_k.to(z_k.dtype), P_v.to(z_v.dtype), key_mode=key_mode,
                                    positions=positions, rope=rope, causal=True, lengths=None,
                                    scale=attn.scaling, exact=exact, backend=backend)
    return attn.o_proj(out.transpose(1, 2).reshape(B, N, -1).to(hidden_states.dtype))


def compressed_layer_output(layer: nn.Module, batch: LayerBatch, P_k: torch.Tensor, P_v: torch.Tensor, *,
                            key_mode: str, rope: RopeSpec, backend: str = "reference",
                            quant: tuple[QuantSpec, QuantSpec] = NO_QUANT,
                            straight_through: bool = False) -> torch.Tensor:
    """The decoder layer's output ``[B, N, D]`` with keys and values through ``P_k``, ``P_v`` (unpadded
    ``batch``), their latents stored as ``quant`` says."""
    x = batch.hidden
    a = attention_block(layer.self_attn, layer.input_layernorm(x), P_k, P_v, key_mode=key_mode, rope=rope,
                        position_embeddings=batch.position_embeddings, positions=batch.positions,
                        backend=backend, quant=quant, straight_through=straight_through)
    h = x + a
    return h + layer.mlp(layer.post_attention_layernorm(h))


def attention_queries_keys(attn: nn.Module, normed: torch.Tensor, P_k: torch.Tensor | None, *, key_mode: str,
                           position_embeddings, key_spec: QuantSpec = FLOAT
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotated queries ``[B, H, N, d]``, the original rotated keys and the keys rebuilt through ``P_k``
    (``[B, G, N, d]`` each): what the original and the compressed attention compare their logits on.

    ``pre_rope`` rebuilds ``P_k P_kᵀ k`` and then rotates it; ``post_rope`` projects the rotated key. The
    key latents are stored as ``key_spec`` on the way (bf16: as they are).
    """
    cos, sin = position_embeddings
    q, k, _ = project_qkv(attn, normed, values=False)
    q, k_rot = rotate_with(q, cos, sin), rotate_with(k, cos, sin)
    if P_k is None:
        return q, k_rot, k_rot
    k_low = (rotate_with(rebuild(k, P_k, key_spec), cos, sin) if key_mode == "pre_rope"
             else rebuild(k_rot, P_k, key_spec))
    return q, k_rot, k_low


def attention_kl(q_t, k_t, q_s, k_s, **kwargs) -> torch.Tensor:
    """StreamKL on CUDA tensors, the PyTorch reference elsewhere (:func:`stiefkv.kernels.attention_kl`)."""
    return kernels.attention_kl(q_t, k_t, q_s, k_s, **kwargs)


@dataclass
class ErrorStats:
    """Running sums for a layer's relative error and mean token cosine."""

    sq_err: float = 0.0
    sq_ref: float = 0.0
    cos_sum: float = 0.0
    tokens: int = 0

    def add(self, y_hat: torch.Tensor, y: torch.Tensor) -> None:
        y_hat, y = y_hat.double(), y.double()
        self.sq_err += float((y_hat - y).pow(2).sum())
        self.sq_ref += float(y.pow(2).sum())
        self.cos_sum += float(torch.nn.functional.cosine_similarity(y_hat, y, dim=-1).sum())
        self.tokens += y.shape[0] * y.shape[1]

    @property
    def rel_error(self) -> float:
        return (self.sq_err / self.sq_ref) ** 0.5 if self.sq_ref else float("nan")

    @property
    def cosine(self) -> float:
        return self.cos_sum / self.tokens if self.tokens else float("nan")

    def as_dict(self) -> dict:
        return {"rel_error": round(self.rel_error, 6), "cosine": round(self.cosine, 6)}
