"""Evaluation: perplexity, layer error, next-token KL and KV bytes per token (DESIGN.md protocol).

Perplexity: the test text joined, tokenized once, cut into non-overlapping windows (2048 tokens), mean
token NLL over every scored token. With projections, each window runs twice — uncompressed (with hooks
that also run each compressed layer on the uncompressed layer's input, for the layer errors) and
compressed — and the next-token KL ``KL(p_orig ‖ p_compressed)`` is averaged over the same tokens.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import asdict, dataclass, replace

import torch
from tqdm.auto import tqdm

from stiefkv.attention import Switch, is_compressed
from stiefkv.cache import LatentCache, cache_keyword
from stiefkv.data import check_vocabulary, load_texts, token_stream, windows
from stiefkv.layers import (
    ErrorStats,
    LayerBatch,
    attention_kl,
    attention_queries_keys,
    compressed_layer_output,
    layer_hooks,
)
from stiefkv.models import check_context, decoder_layers, rope_spec
from stiefkv.projections import Projections
from stiefkv.quant import DEFAULT_RECENT, POSITION_BYTES, QuantSpec

# Quantization-only caches a user would otherwise pick, run through the same harness as the checkpoints:
# full-rank (identity) bases with every latent quantized. int{b}: keys and values per token (groups of 64
# channels); kivi{b}: keys per channel over 64-token groups, values per token (KIVI's layout). Keys are
# quantized before RoPE, as StiefKV's pre_rope latents are. Each keeps its DEFAULT_RECENT newest tokens exact,
# as KIVI keeps its residual and StiefKV's calibrated caches do; -r0 keeps none (a channel group still
# filling aside).
BASELINES = {f"{name}{b}{suffix}": (QuantSpec(b, key_layout, recent=w), QuantSpec(b, "token", recent=w))
             for b in (8, 4, 3, 2) for name, key_layout in (("int", "token"), ("kivi", "channel"))
             for suffix, w in (("", DEFAULT_RECENT), ("-r0", 0))}
# the same caches with StiefKV's least-squared-error encoder on the values (-vmse) or on both (-mse): what
# the encoder alone gains (or costs) a quantization-only cache
BASELINES |= {f"{name}{suffix}": (QuantSpec(k.bits, k.layout, mse=suffix == "-mse", recent=k.recent),
                                  QuantSpec(v.bits, "token", mse=True, recent=v.recent))
              for name, (k, v) in list(BASELINES.items())
              if k.bits < 8 and not name.endswith("-r0") for suffix in ("-mse", "-vmse")}
# and with their exact tokens in int8 (-w8), as StiefKV's calibrated caches hold them: what that storage
# choice alone gives a quantization-only cache
BASELINES |= {f"{name}-w8": (replace(k, window8=True), replace(v, window8=True))
              for name, (k, v) in list(BASELINES.items()) if "-" not in name}


def baseline_projections(model, name: str, context: int | None = None) -> Projections:
    """The quantization-only cache ``name`` (a key of :data:`BASELINES`) as :class:`Projections`, its budget
    its bytes at ``context`` tokens (a per-channel group's and the exact window's share depend on it; the
    default context: 2048)."""
    from stiefkv.models import dims_of, fingerprint

    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; choose one of {', '.join(BASELINES)}")
    dims = dims_of(model.config)
    eye = torch.eye(dims.d).expand(dims.G, dims.d, dims.d).contiguous()
    specs = BASELINES[name]
    proj = Projections(keys=[eye] * dims.L, values=[eye] * dims.L, key_mode="pre_rope",
                       fingerprint=fingerprint(model), budget=1.0, method=f"baseline {name}",
                       quant=[specs] * dims.L)
    at = None if context is None else (proj.kv_bytes_per_token(context) - POSITION_BYTES)
    proj.budget = round(proj.achieved_budget if at is None else at / bf16_bytes_per_token(model), 6)
    return proj


@dataclass
class EvalResult:
    model: str
    data: str
    window: int
    windows: int
    tokens_scored: int
    ppl_original: float
    kv_bytes_per_token_original: float
    method: str | None = None
    budget: float | None = None
    key_mode: str | None = None
    ppl: float | None = None
    layer_rel_error: float | None = None
    layer_cosine: float | None = None
    next_token_kl: float | None = None
    kv_bytes_per_token: float | None = None
    layer_errors: list | None = None
    attention_kl_context: int | None = None
    attention_kl: list | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def load_test_windows(tokenizer, *, data: str = "wikitext2", window: int = 2048, limit: int | None = None,
                      advice: str = "lower --window", model=None) -> torch.Tensor:
    """``[W, window]`` token ids of the test split (the first ``limit`` windows when given); ``advice``
    ends the error where there is not one window. With ``model``, ids it has no embedding for are refused
    (:func:`~stiefkv.data.check_vocabulary`)."""
    ws = windows(token_stream(tokenizer, load_texts(data, "test")), window)
    if len(ws) == 0:
        raise ValueError(f"the test data has fewer than {window} tokens: {advice}")
    ws = ws if limit is None else ws[:limit]
    if model is not None:
        check_vocabulary(model, ws, data)
    return ws


def _nll_and_logprobs(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(ids, use_cache=False).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1)
    nll = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    return nll, logp


@torch.no_grad()
def bf16_bytes_per_token(model) -> float:
    """The uncompressed cache's bytes a token in bf16, what every budget is a fraction of (whatever dtype the
    model runs in: a float32 model's cache would count double)."""
    from stiefkv.models import dims_of

    dims = dims_of(model.config)
    return float(dims.L * dims.G * 2 * dims.d * 2)


@torch.no_grad()
def evaluate(model, tokenizer, projections: Projections | None = None, *, data: str = "wikitext2",
             window: int = 2048, limit: int | None = None, batch_size: int = 1, backend: str = "reference",
             model_name: str = "", layer_errors: bool = True) -> EvalResult:
    """Evaluate ``model`` uncompressed and, with ``projections``, compressed, on the same test windows.

    ``layer_errors=False`` skips the per-layer output errors on the test windows (a third of the time).
    ``backend`` defaults to the reference: every window is one causal prefill, which it runs through SDPA's
    fused causal path and compiles nothing. On the H200 (fourth session, not re-measured since), with the
    Triton prefill kernel (``"auto"``), the 147 SmolLM2 test windows took 152 s, 2 minutes of it before the
    first window was done (most likely one compilation per distinct rank pair of a DP checkpoint); the same
    windows with the reference took about 13 s (without layer errors). The kernels pay off in decode.
    """
    if is_compressed(model):  # its "original" pass would be the compressed model, silently
        raise ValueError("this model is served by stiefkv.load: evaluate compares the original model with "
                         "the checkpoint given. Evaluate the original: stiefkv.unload(model), or load it "
                         "with stiefkv.load_model(..., projections=False)")
    if isinstance(projections, (str, os.PathLike)):
        projections = Projections.load(projections)
    if window < 2:
        raise ValueError(f"window must be ≥ 2 tokens (one to predict from, one to score), got {window}")
    check_context(model.config, window, "window")
    device = next(model.parameters()).device
    ws = load_test_windows(tokenizer, data=data, window=window, limit=limit, model=model)
    layers = decoder_layers(model)
    stats = [ErrorStats() for _ in layers]
    nll_orig = nll_comp = kl_sum = 0.0
    count = 0
    if projections is not None:
        projections.check(model)
        rope = rope_spec(model.config)
        bases = [(k.to(device), v.to(device)) for k, v in zip(projections.keys, projections.values)]
        switch = Switch(model, projections, backend=backend)

    def layer_error(batch: LayerBatch) -> None:
        P_k, P_v = bases[batch.layer_idx]
        y_hat = compressed_layer_output(layers[batch.layer_idx], batch, P_k, P_v,
                                        key_mode=projections.key_modes[batch.layer_idx], rope=rope,
                                        backend=backend, quant=projections.specs[batch.layer_idx])
        stats[batch.layer_idx].add(y_hat, batch.output)

    passes = "original and compressed" if projections is not None else "original"
    desc = f"evaluate {len(ws)} windows of {window} tokens ({passes})"
    for start in tqdm(range(0, len(ws), batch_size), desc=desc, unit="batch"):
        ids = ws[start:start + batch_size].to(device)
        if projections is None:
            nll, _ = _nll_and_logprobs(model, ids)
        else:
            if layer_errors:
                with layer_hooks(model, layer_error):
                    nll, logp = _nll_and_logprobs(model, ids)
            else:
                nll, logp = _nll_and_logprobs(model, ids)
            with switch:
                nll_c, logp_c = _nll_and_logprobs(model, ids)
            nll_comp += float(nll_c.double().sum())
            kl_sum += float((logp.exp() * (logp - logp_c)).sum(-1).double().sum())
            del logp, logp_c
        nll_orig += float(nll.double().sum())
        count += nll.numel()

    result = EvalResult(model=model_name, data=data, window=window, windows=len(ws), tokens_scored=count,
                        ppl_original=math.exp(nll_orig / count),
                        kv_bytes_per_token_original=bf16_bytes_per_token(model))
    if projections is not None:
        # the checkpoint's bytes a token in a cache of one window (the served cache holds exactly these:
        # tests/test_quant.py), not a float32 model's
        kv = projections.kv_bytes_per_token(context=window)
        result.method, result.budget = projections.method, projections.budget
        # a quantization-only baseline's identity bases have no key mode to speak of
        result.key_mode = None if projections.method.startswith("baseline ") else projections.key_mode_summary
        result.ppl = math.exp(nll_comp / count)
        result.next_token_kl = kl_sum / count
        result.kv_bytes_per_token = kv
        if layer_errors:
            errors = [{"layer": i} | s.as_dict() for i, s in enumerate(stats)]
            result.layer_rel_error = sum(e["rel_error"] for e in errors) / len(errors)
            result.layer_cosine = sum(e["cosine"] for e in errors) / len(errors)
            result.layer_errors = errors
    return result


# transformers' own quantized cache (``QuantizedCache``, KIVI-like: per-token groups of 64 channels, the last
# ``residual_length`` = 128 tokens in full precision), with the optimum-quanto backend at its defaults.
TRANSFORMERS_BASELINES = {"hf-quanto4": 4, "hf-quanto2": 2}
CHUNK = 64  # tokens per forward when a window is scored through a cache


def require_quanto(name: str) -> None:
    """Raise a clear error when baseline ``name``'s backend, optimum-quanto, is not installed."""
    try:
        import optimum.quanto  # noqa: F401
    except ImportError:
        raise ValueError(f"--baseline {name} is transformers' QuantizedCache with the optimum-quanto "
                         "backend, which is not installed: pip install optimum-quanto") from None


def transformers_quantized_cache(model, name: str):
    """A fresh ``transformers.QuantizedCache`` for baseline ``name`` (a key of
    :data:`TRANSFORMERS_BASELINES`)."""
    require_quanto(name)
    from transformers import QuantizedCache

    return QuantizedCache(backend="quanto", config=model.config, nbits=TRANSFORMERS_BASELINES[name])


def _quanto_bytes(q) -> int:
    """Bytes a quanto quantized tensor holds: packed codes, and scale and shift counted at bf16 (what a bf16
    model stores; the evaluation may run in float32)."""
    data = q._data
    codes = getattr(data, "_data", data)  # PackedTensor holds its uint8 words in _data
    return codes.numel() * codes.element_size() + (q._scale.numel() + q._shift.numel()) * 2


def cache_bytes(cache) -> int:
    """Every byte a filled cache holds: a :class:`LatentCache` counts its own; a transformers cache its
    full-precision keys and values at bf16 and, for a ``QuantizedCache``, the quantized ones
    (:func:`_quanto_bytes`)."""
    if isinstance(cache, LatentCache):
        return cache.nbytes
    total = 0
    for layer in cache.layers:
        total += sum(t.numel() * 2 for t in (layer.keys, layer.values) if t is not None)
        total += sum(_quanto_bytes(q) for q in (getattr(layer, "_quantized_keys", None),
                                                 getattr(layer, "_quantized_values", None)) if q is not None)
    return total


def _chunked_logprobs(model, ids: torch.Tensor, cache, chunk: int) -> torch.Tensor:
    """Log-probabilities of ``ids`` scored ``chunk`` tokens per forward on top of ``cache`` (as a served model
    reads a prompt fed in pieces, and as a decode reads its past)."""
    key = cache_keyword(model)
    logits = [model(ids[:, s:s + chunk], use_cache=True, **{key: cache}).logits.float()
              for s in range(0, ids.shape[1], chunk)]
    return torch.log_softmax(torch.cat(logits, 1)[:, :-1], dim=-1)


@torch.no_grad()
def evaluate_through_cache(model, tokenizer, new_cache, *, name: str, projections: Projections | None = None,
                           data: str = "wikitext2", window: int = 2048, limit: int | None = None,
                           chunk: int = CHUNK, model_name: str = "") -> EvalResult:
    """Perplexity and next-token KL with each window scored ``chunk`` tokens at a time through a cache made
    by ``new_cache()`` (transformers' ``QuantizedCache`` or ``DynamicCache``, or a :class:`LatentCache` with
    ``projections`` applied), against the uncompressed model on the same windows. Bytes per token: what the
    cache holds after one whole window, divided by the window."""
    check_context(model.config, window, "window")
    device = next(model.parameters()).device
    ws = load_test_windows(tokenizer, data=data, window=window, limit=limit, model=model)
    switch = Switch(model, projections) if projections is not None else contextlib.nullcontext()
    nll_orig = nll_comp = kl_sum = 0.0
    count = 0
    for start in tqdm(range(len(ws)), desc=f"evaluate {len(ws)} windows through {name}", unit="window"):
        ids = ws[start:start + 1].to(device)
        nll, logp = _nll_and_logprobs(model, ids)
        cache = new_cache()
        with switch:
            logp_c = _chunked_logprobs(model, ids, cache, chunk)
        nll_comp += float(-logp_c.gather(-1, ids[:, 1:, None]).double().sum())
        kl_sum += float((logp.exp() * (logp - logp_c)).sum(-1).double().sum())
        nll_orig += float(nll.double().sum())
        count += nll.numel()
    nbytes = cache_bytes(cache)  # the last window's, filled
    return EvalResult(model=model_name, data=data, window=window, windows=len(ws), tokens_scored=count,
                      ppl_original=math.exp(nll_orig / count),
                      kv_bytes_per_token_original=bf16_bytes_per_token(model),
                      method=name, ppl=math.exp(nll_comp / count), next_token_kl=kl_sum / count,
                      kv_bytes_per_token=nbytes / window,
                      key_mode=projections.key_mode_summary if projections is not None else None,
                      budget=projections.budget if projections is not None else None)


def chunked_attention_kl(q, k_t, k_s, *, scale: float, chunk: int | None) -> float:
    """Summed causal ``KL(P_t ‖ P_s)`` over every row. On CUDA StreamKL streams it in ``O(N)`` memory; the
    CPU reference materialises logits, so there the query rows go ``chunk`` at a time (rows are independent:
    a block ``[s, e)`` of queries needs only keys ``[0, e)``)."""
    N = q.shape[2]
    if q.is_cuda or chunk is None:
        return float(attention_kl(q, k_t, q, k_s, causal=True, scale_t=scale, scale_s=scale, reduction="sum"))
    total = 0.0
    for s in range(0, N, chunk):
        e = min(N, s + chunk)
        total += float(attention_kl(q[:, :, s:e], k_t[:, :, :e], q[:, :, s:e], k_s[:, :, :e], causal=True,
                                    scale_t=scale, scale_s=scale, reduction="sum"))
    return total


def kl_tokens(tokenizer, data: str, context: int) -> torch.Tensor:
    """The test tokens :func:`attention_kl_per_layer` reads, refused up front where there are fewer than
    ``context`` (before an evaluation that would otherwise run first)."""
    stream = token_stream(tokenizer, load_texts(data, "test"))
    if stream.numel() < context:
        raise ValueError(f"the test data of '{data}' has {stream.numel()} tokens, fewer than --kl-context "
                         f"{context}: lower --kl-context or give longer test text")
    return stream


@torch.no_grad()
def attention_kl_per_layer(model, tokenizer, projections: Projections, *, data: str = "wikitext2",
                           context: int = 8192, chunk: int | None = 1024,
                           stream: torch.Tensor | None = None) -> list[float]:
    """Per layer, the mean ``KL(P_orig ‖ P_compressed)`` of attention rows over the first ``context`` test
    tokens.

    Queries and original keys are the uncompressed model's at that layer; compressed keys go through the
    layer's ``P_k`` and its key storage (codes, the exact recent band) as the served cache holds them once
    it holds all ``context`` tokens. Memory grows linearly with ``context``. A KL is ≥ 0: rounding below
    it (identical rows) reads 0.
    """
    if context < 1:
        raise ValueError(f"context must be ≥ 1 token, got {context}")
    check_context(model.config, context, "context")
    projections.check(model)
    device = next(model.parameters()).device
    stream = kl_tokens(tokenizer, data, context) if stream is None else stream
    check_vocabulary(model, stream[None, :context], data)
    layers = decoder_layers(model)
    kl = [float("nan")] * len(layers)

    def consume(batch: LayerBatch) -> None:
        i = batch.layer_idx
        attn = layers[i].self_attn
        q, k_t, k_s = attention_queries_keys(attn, layers[i].input_layernorm(batch.hidden),
                                             projections.keys[i].to(device),
                                             key_mode=projections.key_modes[i],
                                             position_embeddings=batch.position_embeddings,
                                             key_spec=projections.specs[i][0])
        rows = q.shape[1] * q.shape[2]
        value = chunked_attention_kl(q, k_t, k_s, scale=attn.scaling, chunk=chunk) / rows
        kl[i] = 0.0 if -1e-6 < value < 0 else value  # rounding below 0 reads 0; a NaN stays one

    with layer_hooks(model, consume):
        # the decoder stack alone: no LM head needed
        getattr(model, "model", model)(stream[:context][None].to(device), use_cache=False)
    return kl


LEGEND = """\
Lower is better for every column but "layer cos" (1 is perfect).
- PPL: perplexity, exp(mean next-token negative log-likelihood) over every scored token; ΔPPL against the
  uncompressed row, which is the same model on the same windows with its full KV cache.
- layer rel. err: per decoder layer ‖ŷ − y‖ / ‖y‖ of its output with only that layer compressed, on the
  uncompressed model's inputs to it; mean over layers. layer cos: the per-token cosine of ŷ and y, likewise.
- next-token KL: KL(p_uncompressed ‖ p_compressed) of the next-token distributions, nats per token.
- KV B/token: bytes the cache holds per token, measured from a real cache (latents, positions)."""


def format_table(result: EvalResult, *, legend: bool = True) -> str:
    """A markdown table of one evaluation (uncompressed row, then the compressed row), with its legend."""
    head = (f"model {result.model or '?'} · data {result.data} test · window {result.window} · "
            f"{result.windows} windows · {result.tokens_scored} tokens scored")
    rows = ["| setting | budget | key mode | PPL | ΔPPL | layer rel. err | layer cos | next-token KL "
            "| KV B/token |",
            "|---|---|---|---|---|---|---|---|---|",
            f"| uncompressed | 100 % | – | {result.ppl_original:.4f} | – | – | – | – | "
            f"{result.kv_bytes_per_token_original:.0f} |"]
    if result.ppl is not None:
        delta = 100 * (result.ppl / result.ppl_original - 1)
        err = "–" if result.layer_rel_error is None else f"{result.layer_rel_error:.4f}"
        cos = "–" if result.layer_cosine is None else f"{result.layer_cosine:.4f}"
        # a quantized cache of transformers' has no budget: its share of the bytes stands in
        budget = (f"{100 * result.budget:g} %" if result.budget is not None else
                  f"{100 * result.kv_bytes_per_token / result.kv_bytes_per_token_original:.1f} % of bytes")
        rows.append(f"| {result.method} | {budget} | {result.key_mode or '–'} | {result.ppl:.4f} | "
                    f"{delta:+.1f} % | {err} | {cos} | {result.next_token_kl:.4f} | "
                    f"{result.kv_bytes_per_token:.0f} |")
    text = head + "\n\n" + "\n".join(rows)
    if result.attention_kl is not None:
        per_layer = " ".join(f"{v:.3g}" for v in result.attention_kl)
        text += (f"\n\nattention KL(original ‖ compressed) per row at {result.attention_kl_context} tokens: "
                 f"mean {sum(result.attention_kl) / len(result.attention_kl):.4g} nats; "
                 f"per layer: {per_layer}")
    return text + ("\n\n" + LEGEND if legend else "")
