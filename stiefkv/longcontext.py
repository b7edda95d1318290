"""Compressed-context perplexity: prefill ``C`` tokens, compact their cache, score the next ``S`` tokens in
one forward on top of it (DESIGN.md, Evaluation protocol), against the same chunk uncompressed.

The uncompressed model's own cache is compacted here (:func:`stiefkv.compaction.compact_layer`): its keys are
after RoPE, so a kept key keeps the rotation of its position, and the scored tokens continue at positions
``C …``. β reaches attention as a 4-D additive mask ``[B, H, S, t + S]`` (transformers passes a 4-D mask to
attention as it is): β on the compacted entries of each KV head's query heads, the causal mask on the new
tokens. The reference queries are the context's own over its last ``window`` tokens, rotated as if they
came after the context (:func:`prefill_with_queries`).

Scored tokens: the ``S − 1`` tokens the second forward predicts (the first scored position's prediction comes
from the prefill, the same with and without compaction).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from stiefkv import presses
from stiefkv.cache import cache_keyword
from stiefkv.compaction import METHODS as AM_METHODS
from stiefkv.compaction import compact_layer, effective_options, global_budgets
from stiefkv.layers import project_qkv, rotate_with
from stiefkv.models import check_context, decoder_layers

DEFAULT_WINDOW = 1024  # reference queries: the context's last tokens (all of a shorter one), shifted after it
METHODS = AM_METHODS + presses.PRESSES
HEADS = {"global": "each", "layers": "mean", "layers-max": "max"}  # global_budgets' heads= per allocation


@dataclass
class CompactedResult:
    """Mean NLL of the scored tokens with the compacted and the full context, over ``chunks`` chunks."""

    method: str
    keep: float
    context: int
    score: int
    chunks: int
    tokens: int
    ppl: float
    ppl_full: float
    kept_tokens: int  # entries kept per KV head, on average over layers and heads
    held_tokens: float  # entries stored per KV head, with the padding of heads kept to fewer than others

    def as_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def prefill_with_queries(model, ids: torch.Tensor, window: int, shift: bool = True, rotate: bool = True):
    """The model's cache after ``ids`` ``[B, C]``, and per layer the rotated queries ``[B, H, w, d]`` of the
    last ``window`` positions. With ``shift`` they are rotated ``window`` positions later, after the whole
    context, as the queries that will read the compacted block are: every context key is then in their
    past (a query inside the window would see keys after its own position, at negative distances).
    ``rotate=False`` gives them before RoPE."""
    queries: dict[int, torch.Tensor] = {}
    hooks = []
    C = ids.shape[1]
    where = torch.arange(C - window, C, device=ids.device)[None] + (window if shift else 0)
    probe = torch.zeros(1, 1, device=ids.device, dtype=next(model.parameters()).dtype)
    cos, sin = getattr(model, "model", model).rotary_emb(probe, where)
    for i, layer in enumerate(decoder_layers(model)):
        def grab(module, args, kwargs, i=i):
            x = kwargs["hidden_states"][:, -window:]
            q, _, _ = project_qkv(module, x, keys=False, values=False)
            queries[i] = rotate_with(q, cos, sin) if rotate else q
        hooks.append(layer.self_attn.register_forward_pre_hook(grab, with_kwargs=True))
    try:
        cache = DynamicCache()
        model(ids, use_cache=True, **{cache_keyword(model): cache})
    finally:
        for h in hooks:
            h.remove()
    return cache, [queries[i] for i in range(len(queries))]


def compacted(model, cache, queries: list[torch.Tensor], t: int, method: str, **options):
    """A new cache holding each layer's block compacted to ``t`` entries per KV head on average, and the
    layers' β ``[B, G, t_layer]``. ``options`` over :data:`~stiefkv.compaction.AM_DEFAULTS` for ``am``;
    ``allocation``: ``uniform`` (``t`` for every head), ``global`` (the keys
    of highest attention across all layers and heads: heads differ, padded to their layer's largest),
    ``layers`` (the same counts pooled per layer, equal for its heads: no padding), ``layers-max`` (each
    layer's largest head count for all its heads, at the cut that stores ``t`` per head on average)."""
    layers = decoder_layers(model)
    if method in presses.PRESSES:
        return _pressed(model, cache, queries, t, method)
    options = effective_options(method, options)
    allocation = options.pop("allocation")
    budgets = [t] * len(layers)
    if allocation != "uniform":
        budgets = global_budgets([cache.layers[i].keys for i in range(len(layers))], queries, t,
                                 scales=[la.self_attn.scaling for la in layers],
                                 pooling=options.get("pooling", "mean"), heads=HEADS[allocation])
    new, betas = DynamicCache(), []
    for i, (layer, q) in enumerate(zip(layers, queries)):
        k, v = cache.layers[i].keys, cache.layers[i].values
        kept, beta, fitted, _ = compact_layer(k, v, q, budgets[i], scale=layer.self_attn.scaling,
                                              method=method, **options)
        new.update(kept.to(k.dtype), fitted.to(v.dtype), i)
        betas.append(beta)
    return new, betas


def _pressed(model, cache, queries: list[torch.Tensor], t: int, method: str):
    """Every layer evicted to ``t`` tokens per KV head by kvpress's ``method`` (:mod:`stiefkv.presses`)."""
    new, betas = DynamicCache(), []
    rotation = None
    if method == "expected_attention":
        C = cache.layers[0].keys.shape[2]
        probe = torch.zeros(1, 1, dtype=torch.float32, device=cache.layers[0].keys.device)
        where = torch.arange(C, C + presses.FUTURE, device=probe.device)[None]
        cos, sin = getattr(model, "model", model).rotary_emb(probe, where)
        rotation = presses.averaged_rotation(cos[0].double(), sin[0].double())
    for i, (layer, q) in enumerate(zip(decoder_layers(model), queries)):
        k, v = cache.layers[i].keys, cache.layers[i].values
        scale = layer.self_attn.scaling
        scores = {"knorm": lambda: presses.knorm(k), "snapkv": lambda: presses.snapkv(k, q, scale),
                  "tova": lambda: presses.tova(k, q, scale),
                  "streaming_llm": lambda: presses.streaming_llm(k),
                  "expected_attention": lambda: presses.expected_attention(k, v, q, rotation),
                  "recent": lambda: presses.recent(k), "random": lambda: presses.random_scores(k, seed=i),
                  }[method]()
        kept, vals, _ = presses.evict(k, v, scores, t)
        new.update(kept, vals, i)
        betas.append(torch.zeros(kept.shape[:3], dtype=k.dtype, device=k.device))
    return new, betas


def _queries_for(method: str, context: int, window: int) -> dict:
    """What of the prompt's queries ``method`` reads (:func:`prefill_with_queries`' arguments)."""
    if method == "tova":
        return dict(window=1, shift=False)
    if method == "snapkv":
        return dict(window=presses.SNAPKV_WINDOW, shift=False)
    if method == "expected_attention":
        return dict(window=context - presses.SINKS, shift=False, rotate=False)
    if method in AM_METHODS:
        return dict(window=min(window, context))
    return dict(window=1, shift=False)  # reads none: the smallest capture


def bias_mask(beta: torch.Tensor, heads: int, n_new: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, H, n_new, t + n_new]``: β of each KV head's entries for its query heads, then the causal mask."""
    B, G, t = beta.shape
    low = torch.finfo(dtype).min
    front = beta.repeat_interleave(heads // G, 1)[:, :, None, :].expand(B, heads, n_new, t)
    causal = torch.full((n_new, n_new), low, dtype=dtype, device=beta.device).triu(1)
    return torch.cat([front.to(dtype), causal.expand(B, heads, n_new, n_new)], -1)


@torch.no_grad()
def chunk_nll(model, ids: torch.Tensor, context: int, keep: float, method: str, *,
              window: int = DEFAULT_WINDOW, **options) -> tuple[float, float, int, int, float]:
    """Summed NLL of the scored tokens of ``ids`` ``[1, C + S]`` with the context compacted by ``method`` and
    uncompressed; their count; the entries kept per head, and those stored with padding."""
    n = ids.shape[1]
    full = model(ids).logits[:, context:-1].float()
    targets = ids[:, context + 1:]
    nll_full = torch.nn.functional.cross_entropy(full.flatten(0, 1), targets.flatten(), reduction="sum")
    cache, queries = prefill_with_queries(model, ids[:, :context], **_queries_for(method, context, window))
    t = max(1, round(keep * context))
    cache, betas = compacted(model, cache, queries, t, method, **options)
    heads = model.config.num_attention_heads
    dtype = next(model.parameters()).dtype
    positions = torch.arange(context, n, device=ids.device)[None]
    masks = [bias_mask(b, heads, n - context, dtype) for b in betas]
    logits = _forward_with_layer_masks(model, ids[:, context:], cache, positions, masks)[:, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
    held = sum(b.shape[-1] for b in betas) / len(betas)
    return float(nll), float(nll_full), targets.numel(), t, held


def _forward_with_layer_masks(model, ids, cache, positions, masks):
    """The model's forward where each layer's attention adds its own mask (β differs by layer; the model
    is handed the first, so that it builds none of its own)."""
    hooks = []
    for layer, mask in zip(decoder_layers(model), masks):
        def swap(module, args, kwargs, mask=mask):
            kwargs["attention_mask"] = mask
            return args, kwargs
        hooks.append(layer.self_attn.register_forward_pre_hook(swap, with_kwargs=True))
    try:
        return model(ids, position_ids=positions, attention_mask=masks[0],
                     **{cache_keyword(model): cache}).logits
    finally:
        for h in hooks:
            h.remove()


def evaluate_compacted(model, tokenizer, *, context: int = 4096, score: int = 512, keep: float = 0.1,
                       method: str = "am", chunks: int | None = None, data: str = "wikitext2",
                       window: int = DEFAULT_WINDOW, **options) -> CompactedResult:
    """Compressed-context perplexity over non-overlapping chunks of ``context + score`` test tokens."""
    from stiefkv.evaluate import load_test_windows

    if not 0 < keep <= 1:
        raise ValueError(f"keep must be in (0, 1], got {keep}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
    if method in AM_METHODS:
        effective_options(method, options)
    if context <= presses.SNAPKV_WINDOW and method == "snapkv":
        raise ValueError(f"snapkv needs a context longer than its window of {presses.SNAPKV_WINDOW} tokens")
    if context < 2 or score < 2:
        raise ValueError(f"need a context and a scored span of ≥ 2 tokens each, got {context} and {score}")
    check_context(model.config, context + score, "context + score")
    device = next(model.parameters()).device
    windows = load_test_windows(tokenizer, data=data, window=context + score, limit=chunks)
    nll = nll_full = 0.0
    tokens = kept = 0
    held = 0.0
    for w in tqdm(windows, desc=f"compacted context {method} keep {keep:g}", unit="chunk"):
        a, b, n, kept, h = chunk_nll(model, w[None].to(device), context, keep, method, window=window,
                                     **options)
        nll, nll_full, tokens, held = nll + a, nll_full + b, tokens + n, held + h / len(windows)
    ppl = float(torch.exp(torch.tensor(nll / tokens)))
    ppl_full = float(torch.exp(torch.tensor(nll_full / tokens)))
    return CompactedResult(method, keep, context, score, len(windows), tokens, ppl, ppl_full, kept, held)


def format_compacted(r: CompactedResult) -> str:
    """A markdown table of one compressed-context result."""
    delta = 100 * (r.ppl / r.ppl_full - 1)
    return "\n".join([
        "| method | context | kept per head | chunks | scored tokens | PPL | uncompressed | ΔPPL |",
        "|---|---|---|---|---|---|---|---|",
        f"| {r.method} | {r.context} | {r.kept_tokens} ({r.keep:g}) | {r.chunks} | {r.tokens} "
        f"| {r.ppl:.3f} | {r.ppl_full:.3f} | {delta:+.1f} % |",
    ])
