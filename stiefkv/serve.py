"""Fast greedy generation: chunked prefill into a static cache, then a CUDA-graph-captured decode step.

:func:`generate` is StiefKV's own serving path. The prompt is written into a preallocated cache chunk by
chunk (``prefill_chunk`` tokens a forward over all the rows, logits for the last token only), so the cache,
not prefill transients, sets the peak memory: no layer's keys and values, no MLP activation and no logit
matrix ever exist for the whole prompt at once, and a forward's activations do not grow with the batch. The
decode step of the whole model — embedding, every decoder layer, the last norm, the head, the argmax and
the bookkeeping of the next step — is captured once as a CUDA graph and replayed for every token, with no
host work or synchronisation between tokens: the kernels read the cache's length from device memory.

On a model prepared by :func:`stiefkv.load` the cache is a :class:`~stiefkv.static_cache.StaticLatentCache`;
a prompt compacted by :func:`stiefkv.compact` continues on it too (``past_key_values=``: its entries,
positions and β per KV head held in the first slots, the question read behind them).
An uncompressed model gets transformers' ``StaticCache`` under the same chunking and the same capture, so
that the two are compared on equal terms (``benchmarks/bench_serve.py``).
"""

from __future__ import annotations

import logging
import numbers
import warnings
from contextlib import contextmanager
from typing import NamedTuple

import torch
from torch import nn

from stiefkv import kernels
from stiefkv.cache import cache_keyword, left_pads
from stiefkv.models import arch_of, check_token_ids, decoder_layers
from stiefkv.static_cache import (
    StaticLatentCache,
    check_fits,
    compacted_slots,
    full_cache_bytes,
    transformers_static_length,
)

log = logging.getLogger(__name__)

CAPTURE = ("auto", True, False)
# Prompt tokens a prefill forward takes over all rows. Bounded over the batch, not a row: at capacity the
# activations of a per-row chunk grew with the rows (0.21 GiB a row at 2048 tokens a row on Llama-3-8B
# shapes), which took the room of a quarter of the rows a 12.5 % cache could hold (docs/notes/serving.md).
PREFILL_TOKENS = 4096


def generate(model: nn.Module, input_ids: torch.Tensor, *, max_new_tokens: int,
             attention_mask: torch.Tensor | None = None, past_key_values=None, cache=None,
             max_length: int | None = None,
             prefill_chunk: int = PREFILL_TOKENS, capture: bool | str = "auto", eos_token_id="model",
             pad_token_id: int | None = None) -> torch.Tensor:
    """Greedy generation of ``max_new_tokens`` tokens per row; returns ``[B, N + max_new_tokens]`` ids.

    Parameters
    ----------
    model : a causal LM of an architecture StiefKV supports (:func:`stiefkv.models.arch_of`), served by
        :func:`stiefkv.load` (latent cache) or not (transformers' static cache).
    input_ids : ``[B, N]`` prompt, left-padded where ``attention_mask`` says so.
    max_new_tokens : tokens to generate per row (≥ 1).
    attention_mask : ``[B, N]`` 0/1, left padding only; None for none. Over a compacted cache, the mask of
        the whole sequence, as ``generate`` takes it: the prompt's columns as it was prefilled, then any
        padding among the tokens after it (every row's last token real).
    past_key_values : the cache :func:`stiefkv.compact` returned for this served model (or None). The first
        ``past_key_values.get_seq_length()`` columns of ``input_ids`` are the tokens it stands for (its
        prompt and any tokens appended since); the rest are read into a static cache after its entries
        (positions and β per KV head). The cache is copied, not extended: each call can ask another
        question of it. Float latents and per-token codes (behind an exact window too); not channel-layout
        codes. ``cache=`` is the same (transformers ≥ 5.24's name); give one of the two.
    max_length : slots the cache is allocated for; ``N + max_new_tokens`` by default (over a compacted
        cache: its entries, the new tokens and ``max_new_tokens``).
    prefill_chunk : prompt tokens a prefill forward takes, summed over the rows: each row's share is
        ``prefill_chunk // batch`` tokens (at least 1), so the forward's activations stay the same at any
        batch.
    capture : ``"auto"`` captures the decode step as a CUDA graph on CUDA (a model on one device) and runs it
        eagerly elsewhere; True demands the capture, False runs eagerly. Both give the same tokens.
    eos_token_id, pad_token_id : tokens after a row's first end token (one id or a list of them) become
        ``pad_token_id`` (the steps still run: a captured loop does not stop early). ``"model"`` takes the
        model's generation config (its end tokens, and its pad token or else the first end token), as
        ``generate`` does; None keeps every token.
    """
    if cache is not None and past_key_values is not None:
        raise ValueError("give the compacted cache as cache= or as past_key_values=, not both")
    past_key_values = cache if cache is not None else past_key_values
    B, N = _check_call(model, input_ids, max_new_tokens, attention_mask, prefill_chunk, capture,
                       compacted=past_key_values is not None)
    # int16 or uint8 ids pass as integer ids, and the embedding takes only int32 and int64
    input_ids = input_ids.long()
    turn = _compacted_turn(model, past_key_values, input_ids, attention_mask)
    max_new_tokens, prefill_chunk = int(max_new_tokens), int(prefill_chunk)
    if not (isinstance(eos_token_id, str) and eos_token_id == "model"):
        eos_token_id = _end_ids(eos_token_id)  # a bad end token is refused before any work
    pad_token_id = _pad_id(pad_token_id)
    device = input_ids.device
    if max_length is not None and not _whole(max_length):
        raise ValueError(f"max_length must be a whole number of tokens a row, got {max_length!r}")
    needed = N + max_new_tokens if turn is None else turn.slots + N - turn.held + max_new_tokens
    max_length = needed if max_length is None else int(max_length)
    positions_max = getattr(model.config, "max_position_embeddings", None)
    if isinstance(positions_max, int) and N + max_new_tokens > positions_max:
        warnings.warn(f"the prompt ({N}) and {max_new_tokens} new tokens run past the model's "
                      f"{positions_max} positions (max_position_embeddings); what it generates there is "
                      "outside what it was trained on", stacklevel=2)
    if max_length < needed:
        what = f"the prompt ({N})" if turn is None else (f"the compacted cache's {turn.slots} entries, the "
                                                         f"{N - turn.held} input ids after them")
        raise ValueError(f"max_length={max_length} cannot hold {what} and {max_new_tokens} new "
                         f"tokens; raise it to at least {needed}")
    positions = _positions(attention_mask, B, N, device)
    with torch.inference_mode(), _out_of_memory_named(B, max_length):
        # transformers' StaticCache allocates its buffers at the prefill's first write
        if turn is None:
            runner = Runner(model, make_cache(model, B, max_length), attention_mask)
            logits = runner.prefill(input_ids, positions, prefill_chunk)
        else:
            runner, logits = _prefill_after(model, turn, input_ids, positions, max_length, prefill_chunk)
        first_slot = N if turn is None else turn.slots + N - turn.held
    with torch.inference_mode():
        tokens = torch.empty(B, max_new_tokens, dtype=torch.long, device=device)
        tokens[:, 0] = logits.argmax(-1)
        if max_new_tokens > 1:
            state = DecodeState(tokens, positions[:, -1:] + 1, first_slot)
            graph = capture is True or (capture == "auto" and device.type == "cuda" and _one_device(model))
            if graph:
                runner.decode_captured(state, max_new_tokens - 1, demanded=capture is True)
            else:
                runner.decode_eager(state, max_new_tokens - 1)
    if isinstance(eos_token_id, str) and eos_token_id == "model":
        eos_token_id, pad_token_id = _model_end_tokens(model, pad_token_id)
    ends = _end_ids(eos_token_id)
    if ends:
        tokens = _pad_after_eos(tokens, ends, ends[0] if pad_token_id is None else pad_token_id)
    return torch.cat([input_ids, tokens], 1)


def _check_call(model, input_ids, max_new_tokens, attention_mask, prefill_chunk, capture,
                compacted: bool = False) -> tuple[int, int]:
    # The Runner re-runs a Llama-style decoder stack (embedding, rotary tables, layers, norm, head) with a
    # full-attention mask, served or not: other architectures and binding windows fail deep inside or differ.
    arch_of(model.config)
    check_token_ids(model, input_ids, "input_ids")
    for name, value in (("max_new_tokens", max_new_tokens), ("prefill_chunk", prefill_chunk)):
        if not _whole(value) or value < 1:
            raise ValueError(f"{name} must be a whole number ≥ 1, got {value!r}")
    if not any(capture is c for c in CAPTURE[1:]) and not (isinstance(capture, str) and capture == "auto"):
        raise ValueError(f"capture must be one of {CAPTURE}, got {capture!r}")  # not 1 for True
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise ValueError(f"attention_mask must be a [batch, tokens] tensor of 0 and 1 (or None), got "
                         f"{type(attention_mask).__name__}")
    if capture is True and input_ids.device.type != "cuda":
        raise ValueError(f"capture=True records a CUDA graph and needs the model and ids on a CUDA device; "
                         f"they are on {input_ids.device}. Use capture='auto' (eager here) or False")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids "
                         f"{tuple(input_ids.shape)}")
    if attention_mask is not None and not compacted:  # over a compacted cache: check_continuation
        left_pads(attention_mask)  # the uncompressed model's static cache is read the same way
    elif attention_mask is not None and not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        # positions are the mask's running sum: a 2 or a -1 would read the new tokens at other positions
        raise ValueError("attention_mask must hold 0 (padding) and 1 (a token) only, as a tokenizer gives it")
    if capture is True and not _one_device(model):
        devices = sorted({str(p.device) for p in model.parameters()})
        raise ValueError(f"capture=True needs the whole model on one device; it spans {devices}")
    return input_ids.shape


class CompactedTurn(NamedTuple):
    """A compacted cache continued by :func:`generate`: the cache, the tokens it stands for (``held``: the
    first columns of ``input_ids``), the slots its entries take in a static cache (``slots``: the most any
    layer holds), and the mask's columns (True for a token; None: no mask) of the tokens it holds behind
    its prompt and of the new ones."""

    cache: object
    held: int
    slots: int
    held_mask: torch.Tensor | None
    new_mask: torch.Tensor | None


def _compacted_turn(model, cache, input_ids: torch.Tensor, mask: torch.Tensor | None) -> CompactedTurn | None:
    """The compacted cache :func:`generate` continues, checked against the ids (None without one)."""
    if cache is None:
        return None
    from stiefkv.compacted import check_continuation

    held_mask = check_continuation(model, cache, input_ids, mask)
    held = cache.get_seq_length()
    new_mask = None if mask is None else mask[:, held:].bool()
    return CompactedTurn(cache, held, compacted_slots(cache), held_mask, new_mask)


def _prefill_after(model, turn: CompactedTurn, input_ids: torch.Tensor, positions: torch.Tensor,
                   max_length: int, prefill_chunk: int):
    """A static cache holding ``turn``'s compacted entries, then the new tokens read behind them (padding
    among them at β = ``PAD_BETA``, as the held tokens the mask hides): the runner and the last logits."""
    cache = StaticLatentCache(model, input_ids.shape[0], max_length)
    start = cache.hold_compacted(turn.cache, turn.held_mask, turn.new_mask)
    runner = Runner(model, cache, None)
    new = slice(turn.held, input_ids.shape[1])
    return runner, runner.prefill(input_ids[:, new], positions[:, new], prefill_chunk, start=start)


def _one_device(model: nn.Module) -> bool:
    return len({p.device for p in model.parameters()}) == 1


def _positions(mask: torch.Tensor | None, B: int, N: int, device) -> torch.Tensor:
    """Token positions ``[B, N]``: counted from each row's first real token (transformers' convention for
    left padding: padding sits at 0)."""
    if mask is None:
        return torch.arange(N, device=device)[None].expand(B, N).contiguous()
    return (mask.long().cumsum(1) - 1).clamp(min=0).to(device)


def _model_end_tokens(model: nn.Module, pad: int | None):
    config = getattr(model, "generation_config", None)
    if pad is None:
        pad = getattr(config, "pad_token_id", None)
    return getattr(config, "eos_token_id", None), pad


def _whole(value) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _end_ids(eos) -> list[int]:
    """End token ids from one id, a list or tensor of them, or None (none)."""
    if eos is None:
        return []
    ids = eos.flatten().tolist() if isinstance(eos, torch.Tensor) else eos
    ids = list(ids) if isinstance(ids, (list, tuple)) else [ids]
    if not all(_whole(i) for i in ids):
        raise ValueError(f"eos_token_id must be a token id, a list of them, None or 'model'; got {eos!r}")
    return [int(i) for i in ids]


def _pad_id(pad) -> int | None:
    """``pad_token_id`` checked before any work: None, or a token id ≥ 0. It is only written into the output
    (never read by the model), so a tokenizer's added pad token beyond the embeddings is taken."""
    if pad is None:
        return None
    if not _whole(pad) or pad < 0:
        raise ValueError(f"pad_token_id must be a token id (≥ 0) or None, got {pad!r}")
    return int(pad)


def _pad_after_eos(tokens: torch.Tensor, ends: list[int], pad: int) -> torch.Tensor:
    is_end = torch.isin(tokens, torch.tensor(ends, device=tokens.device, dtype=tokens.dtype)).long()
    after = (is_end.cumsum(1) - is_end) > 0  # strictly after the first end token
    return tokens.masked_fill(after, pad)


@contextmanager
def _out_of_memory_named(rows: int, max_length: int):
    """An allocation that fails while the cache is made and the prompt read is a ``MemoryError`` that says
    what to lower, not torch's allocator message."""
    try:
        yield
    except RuntimeError as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        if not (isinstance(exc, torch.cuda.OutOfMemoryError) or "allocate" in text):
            raise
        raise MemoryError(f"out of memory for a cache of {rows} rows × {max_length} tokens and the prompt's "
                          f"forward ({text[:160]}): lower max_length (by default the prompt plus "
                          "max_new_tokens), the batch, or prefill_chunk") from None


def make_cache(model: nn.Module, batch: int, max_length: int):
    """A :class:`StaticLatentCache` for a served model, transformers' ``StaticCache`` for any other."""
    if any(hasattr(layer.self_attn, "P_k") for layer in decoder_layers(model)):
        return StaticLatentCache(model, batch, max_length)
    from transformers import StaticCache

    # transformers' cache allocates at its first write, inside the prefill: refuse one that cannot fit first
    check_fits(full_cache_bytes(model, batch, max_length), batch, max_length)
    cache = StaticCache(config=model.config, max_cache_len=max_length)
    cache.stiefkv_batch = batch
    return cache


class DecodeState:
    """What a decode step reads and writes, at fixed addresses: the tokens so far, the next token's input
    id and position, its slot, and the index of the next output column."""

    def __init__(self, tokens: torch.Tensor, positions: torch.Tensor, slot: int):
        self.tokens = tokens
        self.ids = tokens[:, :1].clone()
        self.positions = positions.clone()
        self.slot = torch.full((1,), slot, dtype=torch.long, device=tokens.device)
        self.column = torch.ones(1, dtype=torch.long, device=tokens.device)


class Runner:
    """The model's decoder stack run directly (embedding, rotary tables, layers, norm, head), as transformers'
    forward does but without its host-side mask and cache logic, which a captured graph cannot replay."""

    def __init__(self, model: nn.Module, cache, attention_mask: torch.Tensor | None):
        self.model, self.cache = model, cache
        self.base = getattr(model, "model", model)
        self.layers = decoder_layers(model)
        self.keyword = cache_keyword(self.layers[0])
        self.latent = isinstance(cache, StaticLatentCache)
        device = input_device(model)
        self.starts = None
        if self.latent:
            cache.set_padding(attention_mask)
        elif attention_mask is not None and not bool(attention_mask.bool().all()):
            self.starts = (~attention_mask.bool()).sum(1).to(device)
        self.max_length = cache.max_length if self.latent else transformers_static_length(cache)
        self.graph: torch.cuda.CUDAGraph | None = None

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, V]`` of the last of ``ids`` ``[B, n]`` (at ``positions``, written at ``slots``)."""
        h = self.base.embed_tokens(ids)
        embeddings = self.base.rotary_emb(h, positions)
        mask = None if self.latent else self._mask(slots, h.dtype)
        for layer in self.layers:
            out = layer(h, attention_mask=mask, position_embeddings=embeddings, position_ids=positions,
                        use_cache=True, cache_position=slots, **{self.keyword: self.cache})
            h = out[0] if isinstance(out, tuple) else out
        return self.model.lm_head(self.base.norm(h[:, -1:]))[:, -1]

    def _mask(self, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The additive ``[B, 1, n, max_length]`` mask of transformers' static cache: query ``i`` (slot
        ``slots[i]``) sees the slots up to its own, from its row's first real one."""
        j = torch.arange(self.max_length, device=slots.device)
        visible = j[None, None, None, :] <= slots[None, None, :, None]
        if self.starts is not None:
            visible = visible & (j[None, None, None, :] >= self.starts[:, None, None, None])
        zero = torch.zeros((), dtype=dtype, device=slots.device)
        return torch.where(visible, zero, torch.finfo(dtype).min)

    def prefill(self, ids: torch.Tensor, positions: torch.Tensor, tokens: int,
                start: int = 0) -> torch.Tensor:
        """Write the prompt ``ids`` ``[B, N]`` into the cache from slot ``start`` (the slots before it already
        written), ``tokens`` a forward over all rows (a row's share at least 1); the logits of the last
        prompt token."""
        B, N = ids.shape
        chunk = chunk_per_row(tokens, B)
        logits = None
        for lo in range(0, N, chunk):
            hi = min(N, lo + chunk)
            slots = torch.arange(start + lo, start + hi, device=ids.device)
            logits = self.forward(ids[:, lo:hi], positions[:, lo:hi], slots)
        return logits

    def step(self, state: DecodeState) -> None:
        """One decode step, all on the device: the next token from the current one, written to its column;
        then the inputs of the following step."""
        logits = self.forward(state.ids, state.positions, state.slot)
        nxt = logits.argmax(-1, keepdim=True)
        state.tokens.index_copy_(1, state.column, nxt)
        state.ids.copy_(nxt)
        state.positions.add_(1)
        state.slot.add_(1)
        state.column.add_(1)

    def decode_eager(self, state: DecodeState, steps: int) -> None:
        for _ in range(steps):
            self.step(state)

    def decode_captured(self, state: DecodeState, steps: int, demanded: bool = False) -> None:
        """The first step runs eagerly (see :meth:`capture`); every later step replays the captured one. Where
        the eager step ran a layer on the PyTorch reference (``kernels.reference_fallbacks``: ranks whose
        kernel tiles fit no GPU config), which a graph cannot capture, the rest runs eagerly, or with
        ``demanded`` (``capture=True``) a clear error."""
        if not self.capture(state):
            if demanded:
                raise ValueError("capture=True: a layer of this model attends through the PyTorch reference "
                                 "(its latent ranks fit no tile of the Triton kernels on this GPU, see the "
                                 "warning above), which a CUDA graph cannot capture; use capture='auto' (it "
                                 "decodes eagerly then) or a checkpoint of lower ranks")
            log.warning("stiefkv.generate: a layer attends through the PyTorch reference, which a CUDA graph "
                        "cannot capture; decoding eagerly")
            self.decode_eager(state, steps - 1)
            return
        self.replay(steps - 1)

    def capture(self, state: DecodeState) -> bool:
        """Run one step eagerly on a side stream (it compiles the kernels and sets up the libraries, as
        capture requires), then record the next step as :attr:`graph` without running it. False, with no
        graph recorded, where the eager step ran a layer on the reference (which reads to the host)."""
        before = kernels.reference_fallbacks()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.step(state)
        torch.cuda.current_stream().wait_stream(stream)
        if kernels.reference_fallbacks() > before:
            return False
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step(state)
        return True

    def replay(self, steps: int) -> None:
        """``steps`` decode steps by replaying the captured one, with no host work in between."""
        if steps <= 0:
            return
        if self.latent:
            self.cache.check_room(steps)
        for _ in range(steps):
            self.graph.replay()
        if self.latent:
            self.cache.advance(steps)


def chunk_per_row(tokens: int, batch: int) -> int:
    """The prompt tokens each of ``batch`` rows gives a prefill forward of ``tokens`` tokens."""
    return max(1, int(tokens) // max(1, int(batch)))


def input_device(model: nn.Module) -> torch.device:
    return model.get_input_embeddings().weight.device
