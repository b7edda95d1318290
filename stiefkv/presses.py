"""Token-eviction baselines scored as kvpress defines its presses (NVIDIA/kvpress, ``kvpress/presses``).

kvpress 0.5.5 pins ``transformers<5.3``, so the compressed-context harness reimplements the scores from their
definitions and keeps, per KV head, the ``int(T·keep)`` highest-scoring tokens unchanged (β = 0), as
kvpress's ``ScorerPress`` does. Each scorer takes one layer's cache ``keys``, ``values`` ``[B, G, T, d]``
(keys after RoPE) and what it reads of the prompt's queries, and returns scores ``[B, G, T]``:

- ``knorm``: the negated key norm (KnormPress);
- ``snapkv``: the mean attention of the last ``window`` queries over the older keys, average-pooled along
  the tokens, averaged over the query heads of a KV head; the window itself always kept (SnapKVPress), so
  where fewer than ``window`` tokens are kept it keeps the newest, as ``recent`` does (kvpress likewise);
- ``tova``: the last token's attention averaged over all query heads, the same for every KV head, the last
  token always kept (TOVAPress);
- ``streaming_llm``: the first :data:`SINKS` tokens and the newest (StreamingLLMPress);
- ``expected_attention``: the attention the next ``future`` positions' queries are expected to pay, from the
  mean and covariance of the prompt's queries before RoPE and the RoPE rotation averaged over those
  positions, times the value norm; the first :data:`SINKS` tokens always kept (ExpectedAttentionPress);
- ``recent``: the newest tokens, no sinks; ``random``: a random subset (RandomPress), from ``seed``.

Every method keeps the same count per KV head, the harness's ``round(T·keep)``, so that all are compared on
the same bytes (kvpress itself keeps ``int(T·keep)``, at most one token fewer).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

PRESSES = ("knorm", "snapkv", "tova", "streaming_llm", "expected_attention", "recent", "random")
SINKS = 4  # StreamingLLMPress's and ExpectedAttentionPress's n_sink
SNAPKV_WINDOW, SNAPKV_KERNEL = 64, 5
FUTURE = 512  # ExpectedAttentionPress's n_future_positions


def _grouped_mean(scores: torch.Tensor, G: int) -> torch.Tensor:
    """``[B, H, T]`` → ``[B, G, T]``: the mean over the query heads that share each KV head."""
    B, H, T = scores.shape
    return scores.view(B, G, H // G, T).mean(2)


def _repeat(x: torch.Tensor, H: int) -> torch.Tensor:
    return x.repeat_interleave(H // x.shape[1], 1)


def knorm(keys: torch.Tensor) -> torch.Tensor:
    return -keys.float().norm(dim=-1)


def snapkv(keys: torch.Tensor, queries: torch.Tensor, scale: float, window: int = SNAPKV_WINDOW,
           kernel: int = SNAPKV_KERNEL) -> torch.Tensor:
    """``queries`` ``[B, H, window, d]``: the last ``window`` prompt queries at their own positions."""
    B, G, T, _ = keys.shape
    if T <= window:
        raise ValueError(f"SnapKV needs more than its window of {window} tokens; got {T}")
    H = queries.shape[1]
    logits = (queries.float() @ _repeat(keys, H).float().transpose(-1, -2)) * scale
    causal = torch.full((window, T), -torch.inf, device=keys.device).triu(T - window + 1)
    attn = torch.softmax(logits + causal, -1)[..., :-window]
    scores = F.avg_pool1d(attn.mean(-2), kernel_size=kernel, padding=kernel // 2, stride=1)
    scores = _grouped_mean(scores, G)
    return torch.cat([scores, _kept_first(scores, window, newest=True)], -1)


def _kept_first(scores: torch.Tensor, n: int, *, newest: bool) -> torch.Tensor:
    """Scores ``[B, G, n]`` above all of ``scores`` for ``n`` tokens a press always keeps (the window, the
    sinks), ranked among themselves so that keeping fewer than ``n`` keeps the newest (``newest``) or the
    first, not a tie that ``topk`` breaks anyhow."""
    rank = torch.arange(n, device=scores.device, dtype=torch.float32) / n
    top = float(scores.max()) + 1 if scores.numel() else 1.0
    return (top + (rank if newest else rank.flip(0))).expand(*scores.shape[:2], n)


def tova(keys: torch.Tensor, last_query: torch.Tensor, scale: float) -> torch.Tensor:
    """``last_query`` ``[B, H, 1, d]``: the prompt's last query at its own position. As kvpress does, the
    attention is averaged over all query heads (every KV head keeps the same tokens) and the last token is
    always kept."""
    H = last_query.shape[1]
    B, G, T, _ = keys.shape
    logits = (last_query.float() @ _repeat(keys, H).float().transpose(-1, -2)) * scale
    scores = torch.softmax(logits, -1)[..., 0, :-1].mean(1, keepdim=True).expand(B, G, T - 1)
    return F.pad(scores, (0, 1), value=float(scores.max()) + 1)


def recent(keys: torch.Tensor) -> torch.Tensor:
    B, G, T, _ = keys.shape
    return torch.arange(T, device=keys.device, dtype=torch.float32).expand(B, G, T).clone()


def streaming_llm(keys: torch.Tensor) -> torch.Tensor:
    scores = recent(keys)
    scores[..., :SINKS] = keys.shape[2] + torch.arange(SINKS, 0, -1, dtype=scores.dtype)[:keys.shape[2]]
    return scores


def averaged_rotation(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``[d, d]``: the RoPE rotation ``x ↦ x·cos + rotate_half(x)·sin`` averaged over positions (``cos``,
    ``sin`` ``[n, d]``), as a matrix acting on column vectors."""
    d = cos.shape[-1]
    half = torch.zeros(d, d, dtype=cos.dtype, device=cos.device)  # rotate_half(x) = half @ x
    half[: d // 2, d // 2:] = -torch.eye(d // 2, dtype=cos.dtype, device=cos.device)
    half[d // 2:, : d // 2] = torch.eye(d // 2, dtype=cos.dtype, device=cos.device)
    return (torch.diag_embed(cos) + sin[:, :, None] * half).mean(0)


def expected_attention(keys: torch.Tensor, values: torch.Tensor, pre_rope_queries: torch.Tensor,
                       rotation: torch.Tensor) -> torch.Tensor:
    """``pre_rope_queries`` ``[B, H, n, d]``: the prompt's queries before RoPE after its first
    :data:`SINKS` tokens; ``rotation`` from :func:`averaged_rotation` over the next :data:`FUTURE`
    positions."""
    B, G, T, d = keys.shape
    H = pre_rope_queries.shape[1]
    q = pre_rope_queries.float()
    mu = q.mean(2)  # [B, H, d]
    centred = q - mu[:, :, None]
    cov = centred.transpose(-1, -2) @ centred / q.shape[2]  # [B, H, d, d]
    R = rotation.float()
    mu, cov = mu @ R.T, R @ cov @ R.T
    k = _repeat(keys[:, :, SINKS:], H).float()
    scores = (k @ mu[..., None]).squeeze(-1) / math.sqrt(d)
    scores = scores + torch.einsum("bhnd,bhde,bhne->bhn", k, cov, k) / d / 2
    scores = _grouped_mean(torch.softmax(scores, -1), G) * values[:, :, SINKS:].float().norm(dim=-1)
    return torch.cat([_kept_first(scores, SINKS, newest=False), scores], -1)


def random_scores(keys: torch.Tensor, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(keys.shape[:3], generator=g).to(keys.device)


def evict(keys: torch.Tensor, values: torch.Tensor, scores: torch.Tensor, t: int):
    """The ``t`` highest-scoring tokens of each KV head, in their order: keys, values ``[B, G, t, d]`` and
    their indices ``[B, G, t]``."""
    index = scores.topk(t, dim=-1).indices.sort(-1).values
    pick = index[..., None]
    return (keys.gather(2, pick.expand(-1, -1, -1, keys.shape[-1])),
            values.gather(2, pick.expand(-1, -1, -1, values.shape[-1])), index)
