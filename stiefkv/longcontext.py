"""Compressed-context perplexity: prefill ``C`` tokens, compact their cache, score the next ``S`` tokens in
one forward on top of it (DESIGN.md, Evaluation protocol), against the same chunk uncompressed.

The uncompressed model's own cache is compacted here into a :class:`~stiefkv.compacted.CompactedCache`: its
keys are after RoPE, so a kept key keeps the rotation of its position, and the scored tokens continue at
positions ``C …``; β reaches attention through each layer's mask. The reference queries are the context's own
over its last ``window`` tokens, rotated as if they came after the context; the presses read what kvpress's
read (:func:`_queries_for`).

Scored tokens: the ``S − 1`` tokens the second forward predicts (the first scored position's prediction comes
from the prefill, the same with and without compaction).
"""

from __future__ import annotations

import random
import weakref
from contextlib import nullcontext
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from stiefkv import presses
from stiefkv.cache import cache_keyword
from stiefkv.compacted import (
    DEFAULT_WINDOW,
    build,
    model_probe,
    pin_count,
    prefill_with_queries,
    repeat_queries,
    study_queries,
)
from stiefkv.compaction import METHODS as AM_METHODS
from stiefkv.compaction import effective_options
from stiefkv.data import check_vocabulary
from stiefkv.models import decoder_layers, max_positions

METHODS = AM_METHODS + presses.PRESSES


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
    projections: str | None = None  # the served model's checkpoint (its latent cache compacted), or None
    ppl_ranks: float | None = None  # with projections: the served model with the whole context
    bytes_fraction: float | None = None  # the compacted context's bytes / its bf16 cache's
    pinned_tokens: int = 0  # of the entries kept, the prompt's most surprising tokens held exact (pin)
    shared: bool = False  # latents shared by a layer's KV heads: one entry set a layer, not a head

    def as_dict(self) -> dict:
        return asdict(self)


REFERENCE_OPTIONS = ("pin", "self_study", "study_prompt", "study_greedy", "repeat")  # not the fits' options


def _fit_options(options: dict) -> dict:
    """``options`` less those that choose the reference queries and pins (:func:`_reference`, ``pin``)."""
    return {k: v for k, v in options.items() if k not in REFERENCE_OPTIONS}


def _queries_for(method: str, context: int, window: int) -> dict:
    """What of the prompt's queries ``method`` reads (:func:`prefill_with_queries`' arguments)."""
    if window < 1:
        raise ValueError(f"the reference window must hold at least 1 query; got {window}")
    if method == "tova":
        return dict(window=1, shift=False)
    if method == "snapkv":
        return dict(window=min(presses.SNAPKV_WINDOW, context), shift=False)
    if method == "expected_attention":
        if context <= presses.SINKS:
            raise ValueError(f"expected_attention keeps its first {presses.SINKS} tokens and scores the "
                             f"rest: a context of {context} tokens leaves none to score; use a longer one")
        return dict(window=context - presses.SINKS, shift=False, rotate=False)
    if method in AM_METHODS:
        return dict(window=min(window, context))
    return dict(window=1, shift=False)  # reads none: the smallest capture


def _reference(model, ids: torch.Tensor, method: str, window: int, options: dict):
    """The prompt's cache, the reference queries ``method`` reads, and ``options`` less the two that shape
    them (for AM and its eviction): ``self_study=N`` (the queries of N sampled tokens added; after
    ``study_prompt``, ids of an instruction, if given; argmax tokens with ``study_greedy``) and
    ``repeat=(N, every[, lead[, past]])`` (the queries of the last N prompt tokens read again instead of
    the window's; past the model's positions in segments after ``lead`` tokens of lead-in, or with
    ``past`` in one reading at positions beyond the model's)."""
    options = dict(options)
    study = options.pop("self_study", 0)
    ask = options.pop("study_prompt", None)
    greedy = options.pop("study_greedy", False)
    repeat = options.pop("repeat", None)
    cache, queries = prefill_with_queries(model, ids, **_queries_for(method, ids.shape[1], window))
    if method in AM_METHODS and repeat:
        queries = repeat_queries(model, ids, cache, *repeat)
    if method in AM_METHODS and study:
        studied = study_queries(model, ids, cache, study, seed=0, prompt=ask, greedy=greedy)
        queries = [torch.cat([a, b], 2) for a, b in zip(queries, studied)]
    return cache, queries, options


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return float(torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(),
                                                   reduction="sum"))


@torch.no_grad()
def chunk_nll(model, ids: torch.Tensor, context: int, keep: float, method: str, *,
              window: int = DEFAULT_WINDOW, served=None, **options) -> tuple:
    """Summed NLL of the scored tokens of ``ids`` ``[1, C + S]`` with the context compacted by ``method`` and
    uncompressed; their count; the entries kept per head, and those stored with padding; with ``served``
    (a :class:`~stiefkv.attention.Switch`) the served model's latent cache is compacted, and the summed NLL
    of the served model with the whole context comes last (else None)."""
    n = ids.shape[1]
    targets = ids[:, context + 1:]
    nll_full = _nll(model(ids).logits[:, context:-1], targets)
    nll_ranks = None
    with served if served is not None else nullcontext():
        if served is not None:
            nll_ranks = _nll(model(ids).logits[:, context:-1], targets)
        cache, queries, options = _reference(model, ids[:, :context], method, window, options)
        t = max(1, round(keep * context))
        cache = build(model, cache, queries, t, method, **options)
        positions = torch.arange(context, n, device=ids.device)[None]
        logits = model(ids[:, context:], position_ids=positions, **{cache_keyword(model): cache}).logits
    nll = _nll(logits[:, :-1], targets)
    held = sum(cache.prefix) / len(cache.prefix)
    return nll, nll_full, targets.numel(), t, held, nll_ranks


def entry_bytes(model, proj=None, entries: int = 2048) -> tuple[float, float]:
    """Bytes of one compacted entry (a kept token, every layer and KV head: its latents or bf16 keys and
    values, its int32 position and bf16 β per head) in a cache of ``entries`` of them (quantized latents
    keep their newest few exact), and of one token of the bf16 cache."""
    from stiefkv.models import dims_of
    from stiefkv.projections import POSITION_BYTES

    dims = dims_of(model.config)
    full = dims.L * dims.G * 2 * dims.d * 2
    stored = full if proj is None else proj.kv_bytes_per_token(entries) - POSITION_BYTES
    return stored + dims.L * dims.G * (4 + 2), full


def _check_positions(config, context: int, extra: int, what: str) -> None:
    """A clear error naming the largest context that fits the model's positions beside ``extra`` more."""
    limit = max_positions(config)
    if limit is not None and context + extra > limit:
        fits = (f"use --context (context=) at most {limit - extra}" if limit - extra >= 2 else
                f"the {what} alone leave no room for a context of 2 tokens: this model is too short for it")
        raise ValueError(f"a context of {context} and {extra} {what} need {context + extra} positions; the "
                         f"model has {limit} (max_position_embeddings): {fits}")


def evaluate_compacted(model, tokenizer, *, context: int = 4096, score: int = 512, keep: float = 0.1,
                       method: str = "am", chunks: int | None = None, data: str = "wikitext2",
                       window: int = DEFAULT_WINDOW, projections=None, **options) -> CompactedResult:
    """Compressed-context perplexity over non-overlapping chunks of ``context + score`` test tokens. With
    ``projections`` (:class:`~stiefkv.Projections` or a checkpoint path) the served model's latent cache is
    compacted (ranks, bits and tokens composed), against the same uncompressed reference."""
    from stiefkv.evaluate import load_test_windows

    if not 0 < keep <= 1:
        raise ValueError(f"keep must be in (0, 1], got {keep}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
    if method in AM_METHODS:
        effective_options(method, _fit_options(options))
        pin_count(options.get("pin"), 1, method)  # a bad pin is refused before any forward
    if context <= presses.SNAPKV_WINDOW and method == "snapkv":
        raise ValueError(f"snapkv needs a context longer than its window of {presses.SNAPKV_WINDOW} tokens")
    if context < 2 or score < 2:
        raise ValueError(f"need a context and a scored span of ≥ 2 tokens each, got {context} and {score}")
    _check_positions(model.config, context, score, "scored tokens")
    device = next(model.parameters()).device
    windows = load_test_windows(tokenizer, data=data, window=context + score, limit=chunks,
                                advice=f"a chunk is a context of {context} and {score} scored tokens; lower "
                                       "--context (context=) or give longer test text", model=model)
    proj, served, name = _served(model, projections, method)
    nll = nll_full = nll_ranks = 0.0
    tokens = kept = 0
    held = 0.0
    for w in tqdm(windows, desc=f"compacted context {method} keep {keep:g}", unit="chunk"):
        a, b, n, kept, h, r = chunk_nll(model, w[None].to(device), context, keep, method, window=window,
                                        served=served, **options)
        nll, nll_full, tokens, held = nll + a, nll_full + b, tokens + n, held + h / len(windows)
        nll_ranks += r or 0.0
    ppl = float(torch.exp(torch.tensor(nll / tokens)))
    ppl_full = float(torch.exp(torch.tensor(nll_full / tokens)))
    ppl_ranks = float(torch.exp(torch.tensor(nll_ranks / tokens))) if served is not None else None
    entry, full = entry_bytes(model, proj, max(1, round(held)))
    return CompactedResult(method, keep, context, score, len(windows), tokens, ppl, ppl_full, kept, held,
                           name, ppl_ranks, held * entry / (context * full),
                           _pinned(kept, method, options, context), shared=proj is not None and proj.shared)


def _pinned(kept: int, method: str, options: dict, context: int) -> int:
    """The exact tokens among ``kept`` entries a head that ``options``' ``pin`` gives (prefill records the
    surprise they need)."""
    if method not in AM_METHODS or kept >= context:  # every token kept: nothing pinned
        return 0
    return pin_count(options.get("pin"), kept, method)


def _served(model, projections, method: str):
    """``(Projections, Switch, name)`` for ``projections`` (None: the uncompressed model's own cache)."""
    if projections is None:
        return None, None, None
    from stiefkv.attention import Switch
    from stiefkv.projections import Projections

    if method not in AM_METHODS:
        raise ValueError(f"kvpress's {method!r} compacts the uncompressed model's cache; with projections "
                         f"use {' or '.join(AM_METHODS)}")
    proj = projections if isinstance(projections, Projections) else Projections.load(projections)
    name = None if isinstance(projections, Projections) else str(projections)
    return proj, Switch(model, proj), name or proj.method


def _kept(r) -> str:
    return f"{r.kept_tokens} ({r.keep:g}" + (f"; {r.pinned_tokens} exact)" if r.pinned_tokens else ")")


def format_compacted(r: CompactedResult) -> str:
    """A markdown table of one compressed-context result."""
    delta = 100 * (r.ppl / r.ppl_full - 1)
    ranks = r.ppl_ranks is not None  # served: the ranks alone, over the whole context, beside the rest
    kept = "kept a layer" if r.shared else "kept per head"
    return "\n".join([
        f"| method | context | {kept} | chunks | scored tokens | PPL |" + (" ranks only |" if ranks else "")
        + " uncompressed | ΔPPL |",
        "|---|---|---|---|---|---|" + ("---|" if ranks else "") + "---|---|",
        f"| {r.method} | {r.context} | {_kept(r)} | {r.chunks} | {r.tokens} | {r.ppl:.3f} |"
        + (f" {r.ppl_ranks:.3f} |" if ranks else "") + f" {r.ppl_full:.3f} | {delta:+.1f} % |",
    ])


# --------------------------------------------------------------------------------------- synthetic retrieval
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = "There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
QUESTION = " What is the pass key? The pass key is"
ANSWER_TOKENS = 7
# model → {(context, seed, sample): the uncompressed model answered}; weak, so that a new model never meets
# an old one's answers under a reused id
_FULL_ANSWERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def served_state(model) -> tuple:
    """What the model's attention is now: each layer's bases, key mode and storage (their tags; None for an
    uncompressed layer), and a few of its key weights (other weights loaded into the same object)."""
    return (tuple(getattr(layer.self_attn, "basis_tag", None) for layer in decoder_layers(model)),
            tuple(model_probe(model).tolist()))


@dataclass
class RetrievalResult:
    """Pass-key accuracy after a compacted context and after the full one, on the same ``samples``."""

    method: str
    keep: float
    context: int
    samples: int
    seed: int
    accuracy: float
    accuracy_full: float
    kept_tokens: int
    held_tokens: float
    pinned_tokens: int = 0  # of the entries kept, the prompt's most surprising tokens held exact (pin)

    def as_dict(self) -> dict:
        return asdict(self)


def passkey_sample(tokenizer, context: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor, str]:
    """A ``context``-token prompt of filler with a five-digit pass key at a random depth (from ``rng``), the
    question that follows it, and the key: ``(context ids [C], question ids [q], key)``."""
    key = str(rng.randint(10000, 99999))
    encode = lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    intro, needle = encode(INTRO), encode(f"The pass key is {key}. Remember it. {key} is the pass key. ")
    fill = encode(FILLER)
    n = context - len(intro) - len(needle)
    if n < len(fill):
        least = len(intro) + len(needle) + len(fill)
        raise ValueError(f"a pass-key prompt needs at least {least} tokens of context (its introduction, the "
                         f"key's sentences and one filler passage), got {context}: raise --context")
    body = (fill * (n // len(fill) + 1))[:n]
    depth = rng.randrange(0, n // len(fill) + 1) * len(fill)  # between two filler passages
    ids = intro + body[:depth] + needle + body[depth:]
    return torch.tensor(ids[:context]), torch.tensor(encode(QUESTION)), key


@torch.no_grad()
def retrieve(model, tokenizer, ctx: torch.Tensor, question: torch.Tensor, keep: float | None, method: str, *,
             window: int = DEFAULT_WINDOW, **options) -> tuple[str, int, float]:
    """The greedy answer after ``ctx`` compacted by ``method`` (or whole when ``keep`` is None), with the
    entries kept and held per head."""
    device = next(model.parameters()).device
    ids = torch.cat([ctx, question])[None].to(device)
    C = ctx.numel()
    kwargs, kept, held = {}, C, float(C)
    if keep is not None:
        cache, queries, options = _reference(model, ids[:, :C], method, window, options)
        kept = max(1, round(keep * C))
        cache = build(model, cache, queries, kept, method, **options)
        held = sum(cache.prefix) / len(cache.prefix)
        kwargs[cache_keyword(model)] = cache
    out = model.generate(ids, max_new_tokens=ANSWER_TOKENS, do_sample=False, **kwargs)
    return tokenizer.decode(out[0, ids.shape[1]:]), kept, held


def evaluate_retrieval(model, tokenizer, *, context: int = 4096, keep: float = 0.1, method: str = "am",
                       samples: int = 20, seed: int = 0, window: int = DEFAULT_WINDOW,
                       **options) -> RetrievalResult:
    """Pass-key retrieval accuracy over ``samples`` prompts drawn from ``seed``: compacted and whole."""
    if not 0 < keep <= 1:
        raise ValueError(f"keep must be in (0, 1], got {keep}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
    if method in AM_METHODS:
        effective_options(method, _fit_options(options))
        pin_count(options.get("pin"), 1, method)
    _check_positions(model.config, context, 32, "tokens of the question and answer")
    rng = random.Random(seed)
    right = right_full = 0
    kept, held = 0, 0.0
    for i in tqdm(range(samples), desc=f"pass key {method} keep {keep:g}", unit="prompt"):
        ctx, question, key = passkey_sample(tokenizer, context, rng)
        if i == 0:  # one prompt's ids tell a tokenizer that is not the model's, before the work
            check_vocabulary(model, torch.cat([ctx, question])[None], "the pass-key prompts")
        answer, kept, h = retrieve(model, tokenizer, ctx, question, keep, method, window=window, **options)
        # the whole context's answer is the same for every method, not for every checkpoint the model has
        # been served with since (stiefkv.load and unload change it in place)
        memo = _FULL_ANSWERS.setdefault(model, {})
        at = (served_state(model), context, seed, i)
        if at not in memo:
            memo[at] = key in retrieve(model, tokenizer, ctx, question, None, method)[0]
        right, right_full = right + (key in answer), right_full + memo[at]
        held += h / samples
    return RetrievalResult(method, keep, context, samples, seed, right / samples, right_full / samples, kept,
                           held, _pinned(kept, method, options, context))


def format_retrieval(r: RetrievalResult) -> str:
    """A markdown table of one pass-key result."""
    return "\n".join([
        "| method | context | kept per head | prompts (seed) | accuracy | uncompressed |",
        "|---|---|---|---|---|---|",
        f"| {r.method} | {r.context} | {_kept(r)} | {r.samples} ({r.seed}) "
        f"| {r.accuracy:.2f} | {r.accuracy_full:.2f} |",
    ])
