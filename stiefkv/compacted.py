"""A prompt's cache compacted along the token axis, served by the uncompressed model (DESIGN.md, Compaction).

>>> cache = stiefkv.prefill(model, prompt_ids)                          # doctest: +SKIP
>>> cache = stiefkv.compact(model, cache, keep=0.1)                      # doctest: +SKIP
>>> model.generate(torch.cat([prompt_ids, question_ids], 1), past_key_values=cache)   # doctest: +SKIP

:func:`prefill` runs the prompt and keeps, beside its ``DynamicCache``, the reference queries compaction
fits to (the prompt's last ``window`` queries, rotated as if they came after it). :func:`compact` returns a
:class:`CompactedCache`: per layer, the compacted entries form a prefix (keys at their original positions,
their β, fitted values); later tokens append behind it. The cache reports the prompt's original length, so
``generate`` and a plain forward continue at the right positions. β reaches attention through each layer's
attention mask, set by a pre-hook that :func:`compact` installs once on the model's attention modules; it
acts only when the cache passed is a :class:`CompactedCache`.

On a model served by :func:`stiefkv.load` the same calls compact its :class:`~stiefkv.cache.LatentCache`
(:func:`_build_latent`): positions and β per layer and KV head, β through the kernels' ``bias``.

Prompts of different lengths go in left-padded, with their ``attention_mask``: each row is prefilled and
compacted alone and the rows joined (:mod:`stiefkv.padded`).
"""

from __future__ import annotations

import numbers
import types
import weakref
from contextlib import contextmanager

import torch
from transformers import DynamicCache

from stiefkv import padded, presses
from stiefkv.cache import (
    LatentCache,
    QuantizedLatentLayer,
    appended_bias,
    cache_keyword,
    first_token_positions,
    mask_appended,
    real_appended,
    record_appended,
    record_appended_mask,
    refuse_another_prompt,
    refuse_another_question,
    refuse_no_tokens,
    tokens_to_crop,
)
from stiefkv.compaction import METHODS, compact_layers, effective_options
from stiefkv.kernels import reference
from stiefkv.layers import head_bases, head_latents, project_qkv, rotate_with
from stiefkv.models import arch_of, check_token_ids, decoder_layers, dims_of, max_positions
from stiefkv.quant import Quantized
from stiefkv.static_cache import StaticLatentCache

HOOKS = "_stiefkv_compacted_hooks"
DEFAULT_WINDOW = 1024  # reference queries: the prompt's last tokens (all of a shorter one), shifted after it


class CompactedCache(DynamicCache):
    """A ``DynamicCache`` whose first ``prefix[i]`` entries of layer ``i`` are a compacted block with
    additive logit biases ``beta[i]`` ``[B, G, prefix[i]]``, standing for ``length`` original tokens."""

    def __init__(self, length: int, probe: torch.Tensor | None = None):
        super().__init__()
        self.length: int | None = length  # None once reset
        self.model_probe = probe  # the compacting model's (model_probe): another model continuing is refused
        self.probed_by: tuple | None = None  # the key weight last found to match it, and its version
        self.prefix: list[int] = []
        self.beta: list[torch.Tensor] = []
        self.appended_ids: torch.Tensor | str | None = None  # cache.record_appended
        self.row_lengths: torch.Tensor | None = None  # [B] of prompts of different lengths: stiefkv.padded
        self.prompt_ids: torch.Tensor | None = None  # the compacted prompt's: see refuse_another_prompt
        self.appended_mask: torch.Tensor | None = None  # which appended tokens were padding: appended_bias
        # the mask columns of the forward under way's new tokens (set by its check, _check_forward)
        self.incoming: torch.Tensor | None = None

    def __getstate__(self):
        # a weak reference does not pickle: the copy (torch.save, multiprocessing) checks its model again
        return {**super().__getstate__(), "probed_by": None}

    # β and the appended ids follow every batch edit transformers makes to the layers (beams, contrastive
    # search), as LatentCache's per-row fields do
    def _rows_follow(self, fn) -> None:
        self.beta = [fn(b) for b in self.beta]
        if self.row_lengths is not None:  # on the rows' device from then on: beams reorder every step
            self.row_lengths = fn(self.row_lengths.to(self.beta[0].device))
        for name in ("appended_ids", "prompt_ids", "appended_mask"):
            if isinstance(getattr(self, name), torch.Tensor):
                setattr(self, name, fn(getattr(self, name)))

    def reorder_cache(self, beam_idx: torch.LongTensor):
        super().reorder_cache(beam_idx)
        self._rows_follow(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        self._rows_follow(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor):
        super().batch_select_indices(indices)
        self._rows_follow(lambda t: t[indices])

    def crop(self, size: int):
        """Remove ``-size`` tokens (transformers ≥ 5.2x), or keep ``size`` (older ones, in the reported
        length: the original prompt's plus the tokens appended since). Only appended tokens can go: the
        compacted entries stand for the whole prompt."""
        if self.length is None:  # reset: an ordinary cache
            return super().crop(size)
        # size 0 removes nothing (transformers ≥ 5: generate's stop checks crop(0) every step)
        remove = tokens_to_crop(self.get_seq_length(), self.length, size)
        if remove > 0:
            super().crop(-remove)  # in held entries, which the appended tokens are one each
        after = max(0, self.get_seq_length() - self.length)
        for name in ("appended_ids", "appended_mask"):
            if isinstance(getattr(self, name), torch.Tensor):
                setattr(self, name, getattr(self, name)[:, :after])

    def reset(self) -> None:
        """An empty cache, continued as an ordinary ``DynamicCache`` (as ``LatentCache.reset``): the layers
        dropped (transformers 5.0's ``DynamicLayer.reset`` zeroes them and keeps their length), and the
        compacted prefix's lengths, β and recorded ids with them, which otherwise stood for a prompt no longer
        held (the next forward failed inside torch, or was refused as another question)."""
        self.layers.clear()
        self.prefix, self.beta = [], []
        self.length = self.appended_ids = self.masked_for = self.row_lengths = self.prompt_ids = None
        self.appended_mask = self.incoming = None

    masked_for: int | None = None  # the layer whose mask the hook of install_hooks set last

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """``DynamicCache.update``, once this layer's hook has set its mask: without it (a model that
        ``compact`` was not called on: a copy, a reload) attention would read the compacted prefix without
        β, or fail inside torch on a mask of the wrong length."""
        if layer_idx < len(self.prefix):
            if self.masked_for != layer_idx:
                raise ValueError(
                    f"layer {layer_idx} reads this compacted cache without its β: the model continuing it "
                    "has not the hooks stiefkv.compact installs on the model it is given. Continue the cache "
                    "with that model, or call stiefkv.compacted.install_hooks(model) on this one first")
            self.masked_for = None
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def add_layer(self, keys: torch.Tensor, values: torch.Tensor, beta: torch.Tensor) -> None:
        i = len(self.prefix)
        self.update(keys, values, i)
        self.prefix.append(keys.shape[2])
        self.beta.append(beta)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The original length plus the tokens appended since: where the next position starts."""
        held = super().get_seq_length(layer_idx)
        if layer_idx >= len(self.prefix):
            return held
        return self.length + held - self.prefix[layer_idx]

    def mask(self, layer_idx: int, new: int, heads: int, dtype: torch.dtype) -> torch.Tensor:
        """The additive mask ``[B, heads, new, held + new]`` of ``new`` tokens about to enter layer
        ``layer_idx``: β on the compacted prefix (each KV head's for its query heads), on the tokens appended
        since and the new ones 0, or :data:`~stiefkv.compaction.PAD_BETA` where they are padding
        (:func:`~stiefkv.cache.appended_bias`), causal among the new."""
        beta = self.beta[layer_idx]
        B, G, t = beta.shape
        held = self.layers[layer_idx].get_seq_length()
        low = torch.finfo(dtype).min
        beta = beta.to(dtype)
        front = beta.repeat_interleave(heads // G, 1)[:, :, None, :].expand(B, heads, new, t)
        # the tokens appended since and the new ones: 0, or PAD_BETA where the mask said padding
        since = appended_bias(self.appended_mask, held - t, beta)[:, None, None]
        since = since.expand(B, heads, new, held - t)
        causal = torch.full((new, new), low, dtype=dtype, device=beta.device).triu(1)
        fresh = (causal + appended_bias(self.incoming, new, beta)[:, None, None]).expand(B, heads, new, new)
        return torch.cat([front, since, fresh], -1)


def _refuse_another_model(cache: CompactedCache, attn) -> None:
    """A clear error where a model whose key weights differ from those of the model the cache was compacted
    on continues it (``install_hooks`` on another checkpoint of the same shapes): its keys would meet
    entries fitted to another model's, silently. Layer 0's attention ``attn`` is read once per model (one
    small copy to the host), not at every step."""
    probe = cache.model_probe
    if probe is None:
        return
    # the weight itself and its version: new weights loaded into the same modules (load_state_dict) are
    # checked again; deepcopy keeps a weak reference as it is, so a copy is checked once more at most
    weight = _probe_weight(attn)
    seen = cache.probed_by
    if seen is not None and seen[0]() is weight and seen[1] == weight._version:
        return
    if not torch.equal(probe, _probe_of(attn)):
        raise ValueError("this compacted cache was compacted on a model with other key weights (another "
                         "checkpoint of the same shapes): continue it with the model stiefkv.compact was "
                         "given, or prefill and compact the prompt on this one")
    cache.probed_by = (weakref.ref(weight), weight._version)


def _cache_argument(kwargs: dict):
    for name in ("cache", "past_key_values", "past_key_value"):  # renamed across transformers versions
        if kwargs.get(name) is not None:
            return kwargs[name]
    return None


def install_hooks(model) -> None:
    """Once per model: a pre-hook on each attention module that, when the cache is a
    :class:`CompactedCache`, replaces the attention mask by the cache's own for that layer."""
    install_question_guard(model)
    if getattr(model, HOOKS, None):
        return
    heads = model.config.num_attention_heads
    handles = []
    for i, layer in enumerate(decoder_layers(model)):
        def use_beta(module, args, kwargs, i=i):
            cache = _cache_argument(kwargs)
            if not isinstance(cache, CompactedCache) or i >= len(cache.prefix):
                return None
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            refuse_no_tokens(hidden, cache)
            # the cache's own mask replaces the model's, which is sized by the entries held, not the tokens
            # the 2-D mask spans: _check_forward read that one, and the padding it marks is in the cache's
            if i == 0:
                _refuse_another_model(cache, module)
            kwargs["attention_mask"] = cache.mask(i, hidden.shape[1], heads, hidden.dtype)
            cache.masked_for = i
            return args, kwargs
        handles.append(layer.self_attn.register_forward_pre_hook(use_beta, with_kwargs=True))
    setattr(model, HOOKS, handles)


QUESTION_GUARD = "_stiefkv_question_guard"


def _check_forward(module, args, kwargs):
    """Before a forward over a compacted cache: its rows, its 2-D mask's width, the prompt's padding in it
    and its positions; then the cache takes the mask's padding of the tokens behind the prompt, held and new
    (:func:`_take_padding`), which their β follows. The mask and positions are read back for forwards of
    several tokens only (a turn's first): a decode step should not wait for the device."""
    cache = _cache_argument(kwargs)
    if cache is None:
        return
    _refuse_other_rows(cache, kwargs, args)
    if getattr(cache, "length", None) is None:
        return
    tokens = _tokens_of(kwargs, args)
    mask = _mask_2d(cache, kwargs, tokens)
    incoming = None if mask is None or not tokens else mask[:, -tokens:].bool()
    # the held tokens' columns are read on a turn's first forward only (a decode step's are as recorded)
    held = None if mask is None or tokens < 2 else mask[:, cache.length:mask.shape[1] - tokens].bool()
    if tokens >= 2:
        if getattr(cache, "row_lengths", None) is not None:
            padded.refuse_wrong_padding(cache, mask)
        else:
            _refuse_padded_prompt(cache, mask)
    if getattr(cache, "row_lengths", None) is not None:
        padded.refuse_wrong_positions(cache, kwargs, tokens, incoming, held)
    else:
        _refuse_positions_held(cache, kwargs, incoming, held)
    _take_padding(cache, incoming, held, tokens)


def _mask_2d(cache, kwargs: dict, tokens: int) -> torch.Tensor | None:
    """The forward's 2-D attention mask (None for none), as wide as the tokens the cache reports and the new
    ones: its columns are the prompt's, those of the tokens appended since, then the new ones'. A 4-D mask
    is refused over a compacted cache, whose own mask replaces it."""
    mask = kwargs.get("attention_mask")
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        shape = list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"a compacted cache takes a 2-D attention_mask (1 for a token, 0 for padding) or "
                         f"none, its own mask with its β replacing the model's; got {shape}")
    want = cache.get_seq_length() + tokens
    if mask.shape[1] == tokens > cache.get_seq_length():  # the whole sequence again, as assisted generate
        raise ValueError(REREAD.format(first=0, held=cache.get_seq_length()))
    if mask.shape[1] != want:
        raise ValueError(f"the attention_mask is {mask.shape[1]} columns wide; this compacted cache reports "
                         f"{cache.get_seq_length()} tokens (its prompt of {cache.length} and the tokens "
                         f"since) and the forward brings {tokens}: pass a mask of {want} columns, the "
                         "prompt's first")
    return mask


def _take_padding(cache, incoming: torch.Tensor | None, held: torch.Tensor | None, tokens: int) -> None:
    """Set on the cache which new tokens are padding (``incoming``, read by the layers as their β is made)
    and, on a turn's first forward (several tokens; ``generate``'s first step of any length is taken by
    :func:`_checked_inputs`), which of the tokens it holds behind the prompt are (:func:`_take_held`).
    Device tensors only: nothing is read back."""
    cache.incoming = incoming
    if tokens >= 2:
        _take_held(cache, held)


def _take_held(cache, held: torch.Tensor | None) -> None:
    """Which of the tokens ``cache`` holds behind its prompt are padding, as a turn's mask says (``held``:
    its columns of them; None, no mask: none): a row that ended early in the last turn holds the padding
    ``generate`` fed it as tokens, which the next turn's mask hides; as with any cache, the mask of the turn
    decides (:func:`~stiefkv.cache.mask_appended`)."""
    appended = cache.get_seq_length() - cache.length
    if not appended or not cache.beta:
        return
    if held is None:  # every held token shown again, where an earlier turn hid some
        if getattr(cache, "appended_mask", None) is not None:
            mask_appended(cache, torch.ones(cache.beta[0].shape[0], appended, dtype=torch.bool,
                                            device=cache.beta[0].device))
            cache.appended_mask = None  # none is padding: nothing to grow a step
    elif held.shape[1] == appended:
        mask_appended(cache, held)


def _held_columns(cache, mask) -> torch.Tensor | None:
    """A 2-D mask's columns of the tokens ``cache`` holds behind its compacted prompt (True for a token), or
    None: no mask, or one too narrow to hold them."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[1] < cache.get_seq_length():
        return None
    return mask[:, cache.length:cache.get_seq_length()].bool()


def _tokens_of(kwargs: dict, args: tuple) -> int:
    ids = kwargs.get("input_ids", args[0] if args else None)
    ids = kwargs.get("inputs_embeds") if ids is None else ids
    return ids.shape[1] if isinstance(ids, torch.Tensor) and ids.dim() >= 2 else 0


def _record_ids(module, args, kwargs, output):
    """After a forward that went through: a forward refused or failed part way (padding seen by a layer, an
    interrupt) appends nothing to the cache, and recording its ids before it ran left the record one forward
    ahead of the cache, so the correct continuation was then refused as another question."""
    cache = _cache_argument(kwargs)
    if cache is not None:
        record_appended(cache, kwargs.get("input_ids", args[0] if args else None))
        record_appended_mask(cache, _tokens_of(kwargs, args))


def _refuse_other_rows(cache, kwargs: dict, args: tuple) -> None:
    """A forward of another number of rows than a compacted cache holds: refused, before torch fails to
    join them inside the attention (``generate`` repeats the cache's rows for beams itself:
    :func:`repeats_of`)."""
    held = _compacted_rows(cache)
    ids = kwargs.get("input_ids", args[0] if args else None)
    ids = kwargs.get("inputs_embeds") if ids is None else ids
    if held is None or not isinstance(ids, torch.Tensor) or ids.dim() < 2 or ids.shape[0] == held:
        return
    raise ValueError(f"this compacted cache holds {held} row(s) and the forward brings {ids.shape[0]}: "
                     "continue it with as many rows as it holds (for one of them alone, prefill and compact "
                     "that prompt alone)")


def _refuse_padded_prompt(cache, mask: torch.Tensor | None) -> None:
    """Padding in the columns of a prompt compacted unpadded: refused (its entries stand for every token of
    it; prompts of different lengths are prefilled with their mask, :mod:`stiefkv.padded`). The tokens
    appended behind it may be padded: their β follows the mask."""
    if mask is None:
        return
    hidden = mask[:, :cache.length] == 0
    if bool(hidden.any()):
        rows = hidden.any(-1).nonzero().flatten().tolist()
        raise ValueError(f"the attention_mask pads row(s) {', '.join(map(str, rows[:8]))} inside the prompt "
                         f"of {cache.length} tokens this cache was compacted from unpadded: pass ones over "
                         "its columns (tokens after it may be padded). Prompts of different lengths: prefill "
                         "them with their mask, stiefkv.prefill(model, ids, attention_mask=mask)")


def _refuse_positions_held(cache, kwargs: dict, incoming: torch.Tensor | None,
                           held: torch.Tensor | None) -> None:
    """A forward over positions a compacted cache already holds would attend to the prompt twice (assisted
    and prompt-lookup decoding feed the prompt again on their first step): refused. By the cache slots where
    the forward says them (``cache_position``), else by each row's first position of a token (``incoming``:
    the new tokens' mask), against the prompt and the tokens appended since, not their padding (``held``:
    the mask's columns of those, else as recorded: :func:`~stiefkv.cache.real_appended`)."""
    slots, positions = kwargs.get("cache_position"), kwargs.get("position_ids")
    at = slots if isinstance(slots, torch.Tensor) else positions
    # a forward of several tokens only: reading positions back waits for the device, which a decode step of
    # one token (the path this hook sits on) should not; re-reading the prompt is always several
    if not isinstance(at, torch.Tensor) or at.shape[-1] < 2:
        return
    if at is slots:
        first, limit = int(at.min()), cache.get_seq_length()
        if first >= limit:
            return
    else:
        appended = held.sum(1) if held is not None else real_appended(cache)
        starts, limits = torch.broadcast_tensors(first_token_positions(at, incoming),
                                                 torch.as_tensor(cache.length + appended).cpu())
        below = ((starts >= 0) & (starts < limits)).nonzero().flatten()
        if not len(below):
            return
        first, limit = int(starts[below[0]]), int(limits[below[0]])
    raise ValueError(REREAD.format(first=first, held=limit))


REREAD = ("this forward starts at position {first} and the compacted cache already holds {held} (its "
          "compacted prompt and the tokens since, not their padding): feed only the new tokens. Assisted and "
          "prompt-lookup generate re-read the prompt, which a compacted cache no longer has: generate "
          "without them")


def _checked_inputs(self, input_ids, *args, **kwargs):
    """``prepare_inputs_for_generation`` with a compacted cache's ids checked on ``generate``'s first step
    (every step where this transformers does not say which is first)."""
    if kwargs.get("is_first_iteration", True):
        cache = _cache_argument(kwargs)
        if cache is not None:  # before transformers 5.0's own slicing fails on ids the cache already holds
            refuse_no_tokens(input_ids[:, cache.get_seq_length():], cache)
            k = repeats_of(cache, input_ids)
            # one row of each repeated group checked, before the cache is repeated: a refused generate leaves
            # the cache as it was, for the corrected call
            own, mask = input_ids[::k], kwargs.get("attention_mask")
            refuse_another_prompt(cache, own)
            if getattr(cache, "row_lengths", None) is not None and cache.length is not None:
                rows = mask[::k] if isinstance(mask, torch.Tensor) and mask.dim() == 2 else mask
                padded.refuse_wrong_padding(cache, rows, required=True)
            refuse_another_question(cache, own)
            if k > 1:
                cache.batch_repeat_interleave(k)
            if getattr(cache, "length", None) is not None:  # a turn's first step, however many tokens
                _take_held(cache, _held_columns(cache, mask))
    return type(self).prepare_inputs_for_generation(self, input_ids, *args, **kwargs)


def check_continuation(model, cache, input_ids: torch.Tensor,
                       mask: torch.Tensor | None) -> torch.Tensor | None:
    """:func:`stiefkv.generate`'s checks of ``input_ids`` ``[B, N]`` (and their 2-D ``mask``) continuing a
    served model's compacted :class:`~stiefkv.cache.LatentCache`, as ``generate``'s first step makes them,
    without changing the cache: its rows, new tokens after what it holds, the prompt it was compacted from
    and its padding, the tokens appended since, and a real last token in every row (its logits start the
    answer). Returns the mask's columns of the tokens held behind the prompt (True for a token; None: no
    mask, every one a token)."""
    if isinstance(cache, CompactedCache):
        raise ValueError("stiefkv.generate continues a served model's compacted LatentCache; this "
                         "CompactedCache is an uncompressed model's: continue it with model.generate(ids, "
                         "past_key_values=cache)")
    if not isinstance(cache, LatentCache) or not cache.compacted:
        kind = type(cache).__name__ if not isinstance(cache, LatentCache) else "an uncompacted LatentCache"
        raise ValueError(f"stiefkv.generate's past_key_values takes the cache stiefkv.compact returned for a "
                         f"served model, got {kind}: generate a whole prompt without past_key_values, or "
                         "compact the cache first")
    for i, layer in enumerate(decoder_layers(model)):
        if i >= len(cache.prefix) or not hasattr(layer.self_attn, "basis_tag"):
            raise ValueError("this compacted cache was not made by this served model (another model or "
                             "layer count, or the model is not served by stiefkv.load)")
        if cache.basis_tags.get(i, layer.self_attn.basis_tag) != layer.self_attn.basis_tag:
            raise ValueError(f"layer {i} of this compacted cache holds latents of other bases than the model "
                             "is served with now (another model or checkpoint, or stiefkv.load given another "
                             "since): compact the prompt again with this model")
    rows = _compacted_rows(cache)
    if input_ids.shape[0] != rows:
        raise ValueError(f"this compacted cache holds {rows} row(s) and input_ids bring "
                         f"{input_ids.shape[0]}: continue it with the rows it was compacted from")
    refuse_no_tokens(input_ids[:, cache.get_seq_length():], cache)
    refuse_another_prompt(cache, input_ids)
    if cache.row_lengths is not None:
        padded.refuse_wrong_padding(cache, mask, required=True)
    else:
        _refuse_padded_prompt(cache, mask)
    refuse_another_question(cache, input_ids)
    if mask is not None and not bool(mask[:, -1].bool().all()):
        rows = (~mask[:, -1].bool()).nonzero().flatten().tolist()
        raise ValueError(f"the attention_mask ends row(s) {', '.join(map(str, rows[:8]))} in padding: the "
                         "last token of every row must be real (its logits start the answer); pad questions "
                         "on the left")
    return _held_columns(cache, mask)


def repeats_of(cache, input_ids: torch.Tensor) -> int:
    """How many times ``generate`` repeats each row of a compacted cache of ``B`` rows: it runs ``k·B`` rows
    with beams or several sequences a prompt, repeating each row of the ids ``k`` times, and not the cache
    it is given (1 for any other cache). Ids whose rows are not each row repeated ``k`` times are other
    prompts: refused."""
    held, rows = _compacted_rows(cache), input_ids.shape[0]
    if held is None or rows == held:
        return 1
    groups = input_ids.reshape(held, rows // held, -1) if rows % held == 0 else None
    if groups is None or not bool((groups == groups[:, :1]).all()):
        raise ValueError(f"this compacted cache holds {held} rows and generate runs {rows}: give generate "
                         "the ids of the rows the cache was compacted from (beams and num_return_sequences "
                         "repeat them)")
    return rows // held


def _compacted_rows(cache) -> int | None:
    if isinstance(cache, CompactedCache) and cache.beta:
        return cache.beta[0].shape[0]
    if isinstance(cache, LatentCache) and cache.compacted and cache.head_positions:
        return cache.head_positions[0].shape[0]
    return None


def install_question_guard(model) -> None:
    """Once per model: the ids each forward appends behind a compacted prefix are recorded, and a
    ``generate`` whose ids do not continue them is refused
    (:func:`~stiefkv.cache.refuse_another_question`)."""
    if getattr(model, QUESTION_GUARD, None):
        return
    inner = getattr(model, "model", model)
    handle = (inner.register_forward_pre_hook(_check_forward, with_kwargs=True),
              inner.register_forward_hook(_record_ids, with_kwargs=True))
    if hasattr(type(model), "prepare_inputs_for_generation"):
        # a bound method, not a closure over this instance: a deep copy of the model rebinds it to itself
        model.prepare_inputs_for_generation = types.MethodType(_checked_inputs, model)
    setattr(model, QUESTION_GUARD, handle)


# ---------------------------------------------------------------------------------------------- the prompt
@contextmanager
def _queries_seen(model, take):
    """While inside, every attention module hands ``take(layer, q)`` its queries before RoPE
    ``[B, H, n, d]`` (computed from the layer's input, as the module itself will)."""
    hooks = []
    for i, layer in enumerate(decoder_layers(model)):
        def grab(module, args, kwargs, i=i):
            q, _, _ = project_qkv(module, kwargs["hidden_states"], keys=False, values=False)
            take(i, q)
        hooks.append(layer.self_attn.register_forward_pre_hook(grab, with_kwargs=True))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def _rope(model, positions: torch.Tensor):
    """``cos, sin`` ``[1, n, d]`` of the model's rotary embedding at ``positions`` ``[1, n]``."""
    probe = torch.zeros(1, 1, device=positions.device, dtype=next(model.parameters()).dtype)
    return getattr(model, "model", model).rotary_emb(probe, positions)


@torch.no_grad()
def prefill_with_queries(model, ids: torch.Tensor, window: int, shift: bool = True, rotate: bool = True):
    """The model's cache after ``ids`` ``[B, C]``, and per layer the rotated queries ``[B, H, w, d]`` of the
    last ``window`` positions. With ``shift`` they are rotated ``window`` positions later, after the whole
    context, as the queries that will read the compacted block are: every context key is then in their
    past (a query inside the window would see keys after its own position, at negative distances).
    ``rotate=False`` gives them before RoPE."""
    queries: dict[int, torch.Tensor] = {}
    C = ids.shape[1]
    cos, sin = _rope(model, torch.arange(C - window, C, device=ids.device)[None] + (window if shift else 0))

    def take(i, q):
        q = q[:, :, -window:]
        queries[i] = rotate_with(q, cos, sin) if rotate else q

    cache = _new_cache(model)
    with _queries_seen(model, take):
        out = model(ids, use_cache=True, **{cache_keyword(model): cache})
    cache.prompt_surprise = surprise(out.logits, ids)
    return cache, [queries[i] for i in range(len(queries))]


def surprise(logits: torch.Tensor, ids: torch.Tensor, rows: int = 1024) -> torch.Tensor:
    """Each prompt token's surprise ``[B, C]`` (float32): the model's loss on it, −log p(x_t | x_<t), from
    the prompt's own forward; the first token, which nothing predicts, +inf. In slices of ``rows``
    positions, so that no float32 copy of all the logits is made."""
    B, C = ids.shape
    out = torch.full((B, C), float("inf"), device=ids.device)
    for a in range(0, C - 1, rows):
        b = min(a + rows, C - 1)
        out[:, a + 1:b + 1] = torch.nn.functional.cross_entropy(
            logits[:, a:b].float().flatten(0, 1), ids[:, a + 1:b + 1].flatten(), reduction="none").view(B, -1)
    return out


def _new_cache(model):
    """The cache the model's own forward would make: a :class:`~stiefkv.cache.LatentCache` on a model
    served by :func:`stiefkv.load`, a ``DynamicCache`` otherwise."""
    from stiefkv.attention import is_compressed

    return LatentCache() if is_compressed(model) else DynamicCache()


def _refuse_latent(cache, what: str) -> None:
    if isinstance(cache, LatentCache):
        raise ValueError(f"{what} on a stiefkv.LatentCache is not built (its quantized layers cannot be "
                         "rewound exactly): use the prompt's own queries (window=) on a served model")


def prefill(model, ids: torch.Tensor, *, window: int = DEFAULT_WINDOW, self_study: int = 0,
            seed: int = 0, study_prompt: torch.Tensor | None = None, study_greedy: bool = False,
            repeat: int = 0, attention_mask: torch.Tensor | None = None, **unexpected) -> DynamicCache:
    """Run the prompt ``ids`` ``[B, C]`` and return its ``DynamicCache``, holding as
    ``reference_queries`` the queries :func:`compact` fits to: the prompt's last ``window`` (all of a
    shorter one; 0 for none), rotated as if they came after it, and with ``self_study`` > 0 the queries of
    that many tokens the model then samples itself (from ``seed``; argmax with ``study_greedy``), at their
    own positions, after reading ``study_prompt`` (ids ``[p]`` of a generic instruction about the text, such
    as "Repeat the text above", whose queries are added too) when given. ``repeat`` > 0 takes instead of the
    window's the queries of the prompt's last ``repeat`` tokens read a second time right after it (positions
    ``C …``; in segments where the model's positions end first, :func:`repeat_queries`): every key then
    meets queries that look back for it. For retrieval this keeps a hidden fact (a pass key at C 4096, keep
    0.1, ``pin=0``: 10 of 10 on the CPU, against 0.30 for the window; docs/notes/compaction.md), at the price
    of a second prefill and more reference queries; :func:`compact`'s default ``pin`` keeps it too (0.95 on
    the H200) at neither price.

    Prompts of different lengths go in left-padded with their ``attention_mask`` (tokenizer
    ``padding_side="left"``): each row is prefilled alone over its own tokens and the rows kept in a
    :class:`~stiefkv.padded.PaddedPromptCache` (:mod:`stiefkv.padded`), which :func:`compact` compacts row by
    row; continue the compacted cache with the same mask (``generate`` takes each row's positions from
    it)."""
    if unexpected:
        raise TypeError(f"prefill() got unexpected arguments {', '.join(sorted(unexpected))}")
    arch_of(model.config)  # Llama-style attention over every token (no window), as compaction assumes
    check_token_ids(model, ids, "prefill's ids", least=2)
    ids = ids.long()  # int32 ids (numpy's default on some systems) reached the loss as targets torch refuses
    if attention_mask is not None:
        lengths = padded.left_padded_lengths(attention_mask, ids)
        if lengths is not None:
            return padded.prefill_rows(model, ids, lengths, prefill, window=window, self_study=self_study,
                                       seed=seed, study_prompt=study_prompt, study_greedy=study_greedy,
                                       repeat=repeat)
    counts = {"window": window, "self_study": self_study, "repeat": repeat}
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be a whole number of tokens, got {value!r}")
    if window < 0 or self_study < 0 or repeat < 0 or window + self_study + repeat == 0:
        raise ValueError(f"window, self_study and repeat count reference queries: ≥ 0, not all 0; got "
                         f"{window}, {self_study} and {repeat}")
    if study_prompt is not None:
        if not self_study:
            raise ValueError("study_prompt is read before the self-study tokens: give self_study > 0 too")
        study_prompt = _study_prompt(model, study_prompt)
    if repeat:
        repeat_room(model, ids.shape[1])
    limit = max_positions(model.config)
    read = 0 if study_prompt is None else len(study_prompt)
    if self_study and limit is not None and ids.shape[1] + read + self_study > limit:
        raise ValueError(f"self_study {self_study} tokens after the prompt's {ids.shape[1]}"
                         + (f" and the study prompt's {read}" if read else "")
                         + f" run past the model's {limit} positions: lower self_study or the prompt")
    cache, queries = prefill_with_queries(model, ids, max(1, min(window, ids.shape[1])))
    if repeat:
        queries = repeat_queries(model, ids, cache, repeat)
    if self_study:
        _refuse_latent(cache, "self-study")
        studied = study_queries(model, ids, cache, self_study, seed, prompt=study_prompt, greedy=study_greedy)
        # the window's (or the repeat's) queries beside the studied ones; none from a window of 0 alone
        queries = studied if window == 0 and not repeat else [torch.cat([a, b], 2)
                                                               for a, b in zip(queries, studied)]
    cache.reference_queries = queries
    cache.model_probe = model_probe(model)
    cache.prefilled_ids = ids.detach().clone()  # not the caller's tensor, which may be refilled in place
    return cache


def _study_prompt(model, prompt) -> torch.Tensor:
    """``study_prompt`` as ids ``[p]``: a 1-D tensor, the ``[1, p]`` a tokenizer returns, or a list of ids."""
    if isinstance(prompt, (list, tuple)):
        prompt = torch.tensor(prompt) if prompt and all(isinstance(t, int) for t in prompt) else prompt
    if isinstance(prompt, torch.Tensor) and prompt.dim() == 2 and prompt.shape[0] == 1:
        prompt = prompt[0]
    if not isinstance(prompt, torch.Tensor) or prompt.dim() != 1:
        raise ValueError(f"study_prompt must be token ids [p] (or the [1, p] a tokenizer returns), got "
                         f"{getattr(prompt, 'shape', type(prompt).__name__)}")
    check_token_ids(model, prompt[None], "study_prompt")
    return prompt


def model_probe(model) -> torch.Tensor:
    """A few of layer 0's key-projection weights: enough to tell a cache prefilled by another checkpoint of
    the same shapes (a base and an instruct model) from one of ``model``; eight values copied once a prefill,
    where hashing every K/V weight would cost a second at 8B."""
    return _probe_of(decoder_layers(model)[0].self_attn)


def _probe_weight(attn) -> torch.Tensor:
    return getattr(attn, "inner", attn).k_proj.weight


def _probe_of(attn) -> torch.Tensor:
    return _probe_weight(attn).detach()[0, :8].float().cpu()


@torch.no_grad()
def study_queries(model, ids: torch.Tensor, cache, tokens: int, seed: int, prompt: torch.Tensor | None = None,
                  greedy: bool = False) -> list[torch.Tensor]:
    """Per layer the rotated queries ``[B, H, n, d]`` of a continuation of ``ids`` the model writes itself on
    top of ``cache`` (which holds the prompt's keys and values as they were afterwards): ``prompt`` ``[p]``
    (a generic instruction about the text, read first; its queries are kept too) and ``tokens`` tokens
    sampled from ``seed`` (argmax with ``greedy``). ``n`` is ``p + tokens``."""
    _refuse_latent(cache, "self-study")
    C = ids.shape[1]
    B = ids.shape[0]
    grabbed: dict[int, list[torch.Tensor]] = {}
    state = {}
    g = torch.Generator(device=ids.device).manual_seed(seed)
    key = cache_keyword(model)
    last = [(la.keys[:, :, C - 1:], la.values[:, :, C - 1:]) for la in cache.layers]  # restored exactly
    def take(i, q):
        grabbed.setdefault(i, []).append(rotate_with(q, *state["rope"])[:, :, state["skip"]:])

    # step 0 re-reads the prompt's last token (its query is dropped) and the instruction
    head = ids[:, -1:]
    if prompt is not None:
        head = torch.cat([head, prompt.to(ids.device)[None].expand(B, -1)], 1)
    try:
        with _queries_seen(model, take):
            token, at = head, C - 1
            _truncate(cache, C - 1)
            for j in range(tokens + 1):
                where = torch.arange(at, at + token.shape[1], device=ids.device)[None]
                state["rope"], state["skip"] = _rope(model, where), int(j == 0)
                out = model(token, position_ids=where.expand(B, -1), **{key: cache})
                at += token.shape[1]
                logits = out.logits[:, -1].float()
                token = (logits.argmax(-1, keepdim=True) if greedy else
                         torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
    finally:
        _truncate(cache, C - 1)
        for layer, (k, v) in zip(cache.layers, last):
            layer.keys, layer.values = torch.cat([layer.keys, k], 2), torch.cat([layer.values, v], 2)
    return [torch.cat(grabbed[i], 2) for i in range(len(grabbed))]


REPEAT_LEAD = 64  # tokens a segment of a second reading re-reads first, their queries dropped


def repeat_room(model, context: int) -> int | None:
    """Positions left after a prompt of ``context`` tokens for reading it again (None: no limit), refused
    with a clear error where fewer than 2 are left."""
    limit = max_positions(model.config)
    if limit is None:
        return None
    room = limit - context
    if room < 2:
        raise ValueError(f"reading the prompt again needs positions after it, and a prompt of "
                         f"{context} tokens leaves {max(room, 0)} of the model's {limit}: shorten the "
                         "prompt or use the window's queries (repeat=0)")
    return room


@torch.no_grad()
def repeat_queries(model, ids: torch.Tensor, cache, tokens: int, every: int = 1,
                   lead: int = REPEAT_LEAD, past: bool = False) -> list[torch.Tensor]:
    """Per layer the rotated queries ``[B, H, ⌈n/every⌉, d]`` of the prompt's last ``n = min(tokens, C)``
    tokens read again right after it, at positions ``C …`` on top of ``cache`` (restored exactly
    afterwards): a second reading looks back at every token of the first, so the block's keys all meet
    queries that want them. Every ``every``-th query is kept.

    Where ``C + n`` would pass the model's positions, the second reading goes in segments that each fill
    the positions left (``C …`` again for every segment, the cache cut back to ``C`` between them), each
    after a lead-in of up to ``lead`` tokens (at most half the positions left) before it, their queries
    dropped, so that its first queries read on from their own text as a whole second reading's do.
    ``past=True`` reads it in one go instead, at positions past the model's last (RoPE extrapolated; the
    distance from a token to its first reading, ``C``, stays within them)."""
    _refuse_latent(cache, "reading the prompt again")
    if tokens < 1 or every < 1 or lead < 0:
        raise ValueError(f"reading the prompt again takes tokens ≥ 1, every ≥ 1 and lead ≥ 0; got {tokens}, "
                         f"{every} and {lead}")
    C = ids.shape[1]
    n = min(tokens, C)
    room = None if past else repeat_room(model, C)
    lead_most = 0 if room is None or n <= room else min(lead, room // 2)
    span = n if room is None or n <= room else room - lead_most
    grabbed: dict[int, list[torch.Tensor]] = {}
    try:
        for start in range(C - n, C, span):
            end = min(start + span, C)
            lead = min(lead_most, start)
            where = torch.arange(C, C + lead + end - start, device=ids.device)[None]
            cos, sin = _rope(model, where)
            # the queries of tokens start, start + every, … of the re-read region (its index 0 is C − n)
            keep = slice(lead + (-(start - (C - n)) % every), None, every)

            def take(i, q, cos=cos, sin=sin, keep=keep):
                grabbed.setdefault(i, []).append(rotate_with(q, cos, sin)[:, :, keep])

            with _queries_seen(model, take):
                model(ids[:, start - lead:end], position_ids=where.expand(ids.shape[0], -1),
                      **{cache_keyword(model): cache})
            _truncate(cache, C)
    finally:
        _truncate(cache, C)
    return [torch.cat(grabbed[i], 2) for i in range(len(grabbed))]


def _truncate(cache, n: int) -> None:
    """Keep the first ``n`` tokens of every layer (``DynamicCache.crop``'s argument changed meaning in
    transformers 5.24)."""
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]


# --------------------------------------------------------------------------------------------- compaction
def build(model, cache, queries: list[torch.Tensor], t: int, method: str, **options) -> CompactedCache:
    """A :class:`CompactedCache` of ``cache``'s layers compacted to ``t`` entries per KV head on average by
    ``method``: AM or the eviction ``attention`` (``options`` over
    :data:`~stiefkv.compaction.AM_DEFAULTS` for ``am``), or a kvpress press. ``allocation``: ``uniform``
    (``t`` for every head), ``global`` (the keys of highest attention across all layers and heads: heads
    differ, padded to their layer's largest), ``layers`` (those counts pooled per layer, equal for its heads:
    no padding), ``layers-max`` (each layer's largest head count for all its heads, at the cut that stores
    ``t`` per head on average)."""
    pins = pinned_tokens(cache, t, options.pop("pin", None), method)
    if isinstance(cache, LatentCache):
        return _build_latent(model, cache, queries, t, method, pins, **options)
    if method in presses.PRESSES:
        return _pressed(model, cache, queries, t, method)
    layers = decoder_layers(model)
    new = CompactedCache(cache.layers[0].keys.shape[2], model_probe(model))
    keys = [cache.layers[i].keys for i in range(len(layers))]
    values = [cache.layers[i].values for i in range(len(layers))]
    scales = [la.self_attn.scaling for la in layers]
    for kept, beta, fitted in compact_pinned(keys, values, queries, t, pins, scales=scales, method=method,
                                             **options):
        new.add_layer(kept, fitted, beta)
    install_hooks(model)
    return new


def compact_pinned(keys: list[torch.Tensor], values: list[torch.Tensor], queries: list[torch.Tensor], t: int,
                   pins: torch.Tensor | None, *, scales: list[float], method: str = "am", **options):
    """Per layer ``(keys, β, values)`` of :func:`~stiefkv.compaction.compact_layers` over the tokens not in
    ``pins`` ``[B, p]`` to ``t − p`` entries, then the pinned tokens as they are, β = 0, behind them (what
    :func:`build` stores for a ``DynamicCache``; timed by ``bench_compaction_speed.py``)."""
    fits = compact_layers(*_unpinned(keys, values, pins), queries, t - _count(pins), scales=scales,
                          method=method, **options)
    for i, (kept, beta, fitted, _) in enumerate(fits):
        kept, fitted = kept.to(keys[i].dtype), fitted.to(values[i].dtype)
        if pins is not None:
            kept = torch.cat([kept, _take(keys[i], pins)], 2)
            fitted = torch.cat([fitted, _take(values[i], pins)], 2)
            beta = torch.cat([beta, beta.new_zeros(*beta.shape[:2], pins.shape[1])], 2)
        yield kept, beta, fitted


# pin's default (pin=None) for AM: a tenth of the kept entries, at least PIN_FLOOR tokens but at most a
# quarter of them, and none where fewer than PIN_FROM entries are kept. A pass key's digits rank ~20-62 in the
# prompt's surprise whatever its length, so a share alone loses them in short prompts (C 2048, a tenth: 0.55
# of the pass keys) and a large share costs the perplexity of long ones (C 4096, a quarter: ΔPPL +1.75 against
# +1.40 for a tenth). At 102 kept entries (C 1024) AM keeps the pass key without pins (1.00 of 20, CPU) and
# pins cost ΔPPL +2.41 against +1.44 (H200, whole set); at 154 (C 1536: 0.95 against 0.85) and 205 (C 2048:
# 1.00 against 0.55) they are needed. PIN_FROM lies between 102 and 154, a choice, not a measurement
# (docs/notes/compaction.md).
PIN_SHARE, PIN_FLOOR, PIN_CAP, PIN_FROM = 0.1, 64, 0.25, 128
# as result rows record it
DEFAULT_PIN = {"share": PIN_SHARE, "floor": PIN_FLOOR, "cap": PIN_CAP, "from": PIN_FROM}


def rule_count(rule: dict, t: int) -> int:
    """The pins of a default rule (:data:`DEFAULT_PIN`'s form) at ``t`` kept entries; a rule recorded without
    ``from`` (the default of 2026-12-04's fifteenth session) pinned at every ``t``."""
    if t < rule.get("from", 0):
        return 0
    return max(int(rule["share"] * t), min(rule["floor"], int(rule["cap"] * t)))


def pin_count(pin: float | None, t: int, method: str) -> int:
    """How many of the ``t`` kept entries hold exact tokens: ``int(pin · t)`` for a share ``pin`` in
    [0, 1); for ``pin=None`` AM's default (:data:`DEFAULT_PIN`: :func:`rule_count`) and none for the other
    methods."""
    if pin is None:
        return rule_count(DEFAULT_PIN, t) if method == "am" else 0
    if isinstance(pin, bool) or not isinstance(pin, numbers.Real) or not 0 <= pin < 1:
        raise ValueError(f"pin is the share of the kept entries held exact, in [0, 1) (None for the "
                         f"default); got {pin!r}")
    return int(float(pin) * t)  # < t: pin < 1


def pinned_tokens(cache, t: int, pin: float | None, method: str) -> torch.Tensor | None:
    """The tokens ``[B, p]`` (ascending) that :func:`pin_count` of the ``t`` kept entries hold exact: each
    row's most surprising prompt tokens (:func:`surprise`, recorded by :func:`prefill`), the first token
    among them. A token the model could not predict carries what the rest of the prompt does not (a pass
    key's digits in repeated filler), and queries of the prompt's window rarely read it, so attention
    matching alone lets it go (docs/notes/compaction.md). None when no token is pinned, and for the
    default on a cache that :func:`prefill` did not make (no surprise recorded)."""
    p = pin_count(pin, t, method)
    if not p or (t >= cache.get_seq_length() and method not in presses.PRESSES):
        return None  # every token is kept: pins would only move some behind the rest (codes group by order)
    if method in presses.PRESSES:
        raise ValueError(f"pin is an option of attention matching and its eviction, not of kvpress's "
                         f"{method!r}")
    score = getattr(cache, "prompt_surprise", None)
    if score is None and pin is None:
        return None
    if score is None:
        raise ValueError("pin needs each prompt token's surprise, which stiefkv.prefill(model, ids) records "
                         "on the cache: prefill with it (or pass pin=0)")
    # a cache cropped after prefill holds the first tokens it scored; one extended since holds tokens it did
    # not score, which are never pinned
    return most_surprising(score[:, :cache.get_seq_length()], p)


def most_surprising(score: torch.Tensor, p: int) -> torch.Tensor:
    """Each row's ``p`` (at most its length) tokens of highest ``score`` ``[B, T]``, ascending."""
    return score.topk(min(p, score.shape[1]), dim=1).indices.sort(dim=1).values


def _count(pins: torch.Tensor | None) -> int:
    return 0 if pins is None else pins.shape[1]


def _take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Tokens ``index`` ``[B, n]`` (the same for every head) of ``x`` ``[B, G, T, d]``."""
    return torch.gather(x, 2, index[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))


def _others(pins: torch.Tensor, T: int) -> torch.Tensor:
    """The tokens ``[B, T − p]`` (ascending) that are not in ``pins`` ``[B, p]``."""
    free = torch.ones(pins.shape[0], T, dtype=torch.bool, device=pins.device).scatter_(1, pins, False)
    return free.nonzero()[:, 1].view(pins.shape[0], -1)


def _unpinned(keys: list, values: list, pins: torch.Tensor | None) -> tuple:
    """Per layer the keys and values of the tokens left to compact (all of them without pins)."""
    if pins is None:
        return keys, values
    rest = _others(pins, keys[0].shape[2])
    return _Lazy(keys, lambda x: _take(x, rest)), _Lazy(values, lambda x: _take(x, rest))


class _Lazy:
    """Per layer ``read(layers[i])``, made when the compaction reads layer ``i``, so that it holds one layer's
    at a time: the unpinned tokens of every layer at once held a second copy of the cache (peak +7.6 GiB
    against +4.0 without pins at 32k tokens of Llama-3-8B shapes, H200), and shared latents' widened queries
    are ``G×`` the queries. A layer set to None (:func:`~stiefkv.compaction.compact_layers` lets each go once
    done) is dropped."""

    def __init__(self, layers: list, read):
        self._layers, self._read = list(layers), read

    def __len__(self) -> int:
        return len(self._layers)

    def __getitem__(self, i: int):
        if not isinstance(i, int):
            raise TypeError(f"lazy layers are read one at a time, by an int index; got {i!r}")
        x = self._layers[i]
        return None if x is None else self._read(x)

    def __setitem__(self, i: int, value) -> None:
        if value is not None:
            raise TypeError("a lazy layer is read-only; it can only be let go (None)")
        self._layers[i] = None

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def _build_latent(model, cache: LatentCache, queries: list[torch.Tensor], t: int, method: str,
                  pins: torch.Tensor | None = None, **options) -> LatentCache:
    """:func:`build` for a served model's :class:`~stiefkv.cache.LatentCache`: the keys are scored and chosen
    as attention sees them (rebuilt from the latents, rotated at their positions), and each kept entry keeps
    its latent and position; the values are fitted in the latent space (``P_v`` is orthonormal, so a fit
    there is the fit of the full values restricted to the subspace; for a basis shared by the KV heads, whose
    heads each read their block of it, a least-squares proxy over every query head's latent outputs). The
    prefix is stored as the model stores latents (quantized layers quantize it again from the latents as
    read: the same codes for min–max storages; per-token keys and int8-window keys carry their own codes
    over, since dequantized log8 codes can ask for a finer scale)."""
    if method in presses.PRESSES:
        raise ValueError(f"kvpress's {method!r} is a baseline for the uncompressed model's cache; a "
                         f"stiefkv.LatentCache is compacted by {' or '.join(repr(m) for m in METHODS)}")
    layers = decoder_layers(model)
    T = cache.get_seq_length()
    dtype = next(model.parameters()).dtype
    latents = [cache.read_layer(i, dtype) for i in range(len(layers))]
    B, G = latents[0][0].shape[:2]  # G is 1 for bases shared by the KV heads: one latent a token
    positions = cache.positions[:, None].expand(B, G, T)
    keys = [_rebuilt_keys(z_k, la.self_attn, cache.positions) for (z_k, _), la in zip(latents, layers)]
    kv_heads = layers[0].self_attn.kv_heads
    if G == 1 and kv_heads > 1:  # widened a layer at a time, as the fit reads it
        queries = _Lazy(queries, lambda q: _queries_of_shared(q, kv_heads))
    new = LatentCache()
    new.length = T
    new.basis_tags = dict(cache.basis_tags)  # the bases that wrote the latents (check_cache matched them)
    rest_keys, rest_values = _unpinned(keys, [z_v for _, z_v in latents], pins)
    del keys  # the compaction lets each layer's rebuilt keys go once it is done
    fits = compact_layers(rest_keys, rest_values, queries, t - _count(pins),
                          method=method, scales=[la.self_attn.scaling for la in layers], **options)
    others = None if pins is None else _others(pins, T)[:, None].expand(-1, G, -1)
    for i, (layer, (_, beta, fitted, index)) in enumerate(zip(layers, fits)):
        z_k, z_v = latents[i]
        if pins is not None:  # index into the tokens left, then the pinned ones exact (β = 0) behind them
            index = torch.cat([torch.gather(others, 2, index), pins[:, None].expand(-1, G, -1)], 2)
            fitted = torch.cat([fitted.to(z_v.dtype), _take(z_v, pins)], 2)
            beta = torch.cat([beta, beta.new_zeros(B, G, pins.shape[1])], 2)
        kept = torch.gather(z_k, 2, index[..., None].expand(-1, -1, -1, z_k.shape[-1]))
        new.add_compacted_layer(kept, fitted.to(z_v.dtype), torch.gather(positions, 2, index), beta,
                                quant=layer.self_attn.quant)
        _carry_codes(cache.layers[i], new.layers[i], index)
    return new


def _rebuilt_keys(z_k: torch.Tensor, attn, positions: torch.Tensor) -> torch.Tensor:
    """A served layer's keys as attention sees them, ``[B, G, T, d]``; for bases shared by its ``G`` KV heads
    (latents ``[B, 1, T, r]``) the heads' keys side by side, ``[B, 1, T, G·d]``: one entry a token, chosen
    and fitted once for all heads (:func:`_queries_of_shared`)."""
    G = attn.kv_heads
    keys = reference.rebuild_keys(head_latents(z_k, G), head_bases(attn.P_k, G), key_mode=attn.key_mode,
                                  positions=positions, rope=attn.rope)
    if z_k.shape[1] == G:
        return keys
    B, _, T, d = keys.shape
    return keys.permute(0, 2, 1, 3).reshape(B, 1, T, G * d)


def _queries_of_shared(q: torch.Tensor, G: int) -> torch.Tensor:
    """Queries ``[B, H, n, d]`` of ``G`` KV heads against keys side by side (:func:`_rebuilt_keys`): each
    query head's in its KV head's block of ``G·d`` channels, zeros elsewhere, so that its logits are its own
    head's and every query head of the layer scores and fits the one shared entry."""
    B, H, n, d = q.shape
    wide = q.new_zeros(B, H, n, G, d)
    heads = torch.arange(H, device=q.device)
    wide[:, heads, :, heads // (H // G)] = q.transpose(0, 1)
    return wide.reshape(B, H, n, G * d)


def _carry_codes(before, after, index: torch.Tensor | list[torch.Tensor], stores: tuple = (0,)) -> None:
    """Give the compacted layer ``after`` the kept keys' own codes where ``before`` held them so and ``after``
    holds them the same way: per-token codes (quantizing dequantized log8 codes again can pick a finer scale,
    a second rounding; min–max codes come back the same either way), and the int8 codes of a ``window8``
    window (int8 on log8 scales is not idempotent either). ``index`` ``[B, G, t]``: the kept entries' tokens
    in ``before``. ``before`` and ``index`` may be lists, each layer the source of the next rows of ``after``,
    as many as its index has (padded prompts, each row compacted alone: :mod:`stiefkv.padded`). ``stores``:
    the keys' (0) by default; (0, 1) with the values' too, where ``before`` holds the very values kept."""
    befores, indices = (before, index) if isinstance(before, list) else ([before], [index])
    if not isinstance(after, QuantizedLatentLayer) or \
            not all(isinstance(b, QuantizedLatentLayer) for b in befores):
        return
    for s in stores:
        new, olds = after.stores[s], [b.stores[s] for b in befores]
        if not new.spec.quantized or any(old.spec != new.spec for old in olds):
            continue
        if new.codes is not None and new.spec.layout == "token":
            new.codes = _carried_rows(olds, "codes", new.codes, [i[..., : new.held] for i in indices])
        if isinstance(new.window, Quantized):
            new.window = _carried_rows(olds, "window", new.window, [i[..., new.held:] for i in indices])


def _carried_rows(olds: list, name: str, new: Quantized, takes: list[torch.Tensor]) -> Quantized:
    """``new`` with its rows, in order, carried from each store of ``olds`` (:func:`_carried`: as many rows as
    its ``take``) where that store holds its ``name`` (``codes``, or the ``window``'s int8 codes behind its
    ``held`` tokens) as codes."""
    parts, start = [], 0
    for old, take in zip(olds, takes):
        rows = slice(start, start + take.shape[0])
        start = rows.stop
        mine = new.apply(lambda t, rows=rows: t[rows])
        held = getattr(old, name)
        first = 0 if name == "codes" else old.held
        parts.append(_carried(held, mine, take, first) if isinstance(held, Quantized) else mine)
    if len(parts) == 1:
        return parts[0]
    low = None if parts[0].low is None else torch.cat([p.low for p in parts])
    return Quantized(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]), low,
                     new.bits, new.layout, new.rank)


def _carried(old: Quantized, new: Quantized, take: torch.Tensor, first: int) -> Quantized:
    """``new`` (per-token codes) with each row replaced by ``old``'s row ``take − first`` where ``old`` holds
    that token (``first ≤ take < first + old.length``)."""
    take = take - first
    had = (take >= 0) & (take < old.length)  # [B, G, n]
    take = take.clamp(0, old.length - 1)

    def pick(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
        if a is None:
            return None
        got = torch.gather(a, 2, take[..., None].expand(-1, -1, -1, a.shape[-1]))
        return torch.where(had[..., None], got, b)

    return Quantized(pick(old.codes, new.codes), pick(old.scale, new.scale), pick(old.low, new.low), new.bits,
                     new.layout, new.rank)


def _pressed(model, cache, queries: list[torch.Tensor], t: int, method: str) -> CompactedCache:
    """Every layer evicted to ``t`` tokens per KV head by kvpress's ``method`` (:mod:`stiefkv.presses`)."""
    new = CompactedCache(cache.layers[0].keys.shape[2], model_probe(model))
    rotation = None
    if method == "expected_attention":
        C = cache.layers[0].keys.shape[2]
        cos, sin = _rope(model, torch.arange(C, C + presses.FUTURE, device=cache.layers[0].keys.device)[None])
        rotation = presses.averaged_rotation(cos[0].double(), sin[0].double())
    for i, (layer, q) in enumerate(zip(decoder_layers(model), queries)):
        k, v = cache.layers[i].keys, cache.layers[i].values
        scale = layer.self_attn.scaling
        scores = {"knorm": lambda: presses.knorm(k), "snapkv": lambda: presses.snapkv(k, q, scale),
                  "tova": lambda: presses.tova(k, q, scale),
                  "streaming_llm": lambda: presses.streaming_llm(k),
                  "expected_attention": lambda: presses.expected_attention(k, v, q, rotation),
                  "recent": lambda: presses.recent(k),
                  # the run's seed (--seed) and the layer: another seed draws another subset
                  "random": lambda: presses.random_scores(k, seed=(torch.initial_seed() + i) % 2 ** 63),
                  }[method]()
        kept, vals, _ = presses.evict(k, v, scores, t)
        new.add_layer(kept, vals, torch.zeros(kept.shape[:3], dtype=k.dtype, device=k.device))
    install_hooks(model)
    return new


def check_cache(model, cache) -> int:
    """The prompt length of ``cache``, a prefilled ``DynamicCache`` of ``model`` (or the
    :class:`~stiefkv.cache.LatentCache` of a model served by :func:`stiefkv.load`); a clear error
    otherwise."""
    from stiefkv.attention import is_compressed

    arch_of(model.config)
    latent = isinstance(cache, LatentCache)
    if isinstance(cache, StaticLatentCache):
        raise ValueError("compaction rewrites the cache's layers and a StaticLatentCache keeps its buffers "
                         "fixed: prefill with stiefkv.prefill(model, ids) (a dynamic LatentCache) to compact")
    if isinstance(cache, CompactedCache) or (latent and cache.compacted):
        raise ValueError("this cache is compacted already: compact the prompt's cache once")
    if not isinstance(cache, DynamicCache):
        raise ValueError(f"compact takes the DynamicCache of a prefilled prompt; got {type(cache).__name__}")
    if latent != is_compressed(model):
        raise ValueError("the cache does not belong to this model: a model served by stiefkv.load keeps a "
                         "stiefkv.LatentCache, any other model a DynamicCache; prefill with "
                         "stiefkv.prefill(model, ids) on the model you compact for")
    layers = decoder_layers(model)
    held = [la for la in cache.layers if la.get_seq_length()]
    if not held:
        raise ValueError("the cache is empty: prefill the prompt first (stiefkv.prefill(model, ids))")
    if latent:
        if cache.lengths is not None:
            raise ValueError("compaction has no notion of padding: prefill unpadded rows")
        shape = tuple(cache.read_layer(0, torch.float32)[0].shape)
    else:
        shape = tuple(held[0].keys.shape)
    cfg = model.config
    G = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    heads = f"{G} KV heads × {d}"
    if latent and getattr(layers[0].self_attn, "shared", False):
        G, heads = 1, f"one latent a token (bases shared by its {G} KV heads)"
    ok = len(held) == len(layers) and shape[1] == G and (latent or shape[3] == d)
    if not ok:
        raise ValueError(f"the cache does not belong to this model: it holds {len(held)} layers of keys "
                         f"{list(shape)}, the model has {len(layers)} layers of {heads}")
    # the shapes first: a model of other shapes is named so, not as another checkpoint of the same ones
    probe = getattr(cache, "model_probe", None)
    if probe is not None and not torch.equal(probe, model_probe(model)):
        raise ValueError("the cache does not belong to this model: it was prefilled by a model with other "
                         "key weights (another checkpoint of the same shapes); prefill with "
                         "stiefkv.prefill(model, ids) on the model you compact for")
    if latent:
        for i, (layer, held_layer) in enumerate(zip(layers, cache.layers)):
            ranks = (tuple(s.rank for s in held_layer.stores) if isinstance(held_layer, QuantizedLatentLayer)
                     else (held_layer.keys.shape[-1], held_layer.values.shape[-1]))
            served = (layer.self_attn.P_k.shape[-1], layer.self_attn.P_v.shape[-1])
            if ranks != served:
                raise ValueError(f"the cache does not belong to this model as served: layer {i} holds "
                                 f"latents of ranks {ranks}, the model's checkpoint has {served} (another "
                                 "checkpoint filled it); prefill again with the model you compact for")
            tag = cache.basis_tags.get(i)
            if tag is not None and tag != layer.self_attn.basis_tag:
                raise ValueError(f"the cache does not belong to this model as served: layer {i} holds "
                                 "latents of other bases of the same ranks (another checkpoint filled it); "
                                 "prefill again with the model you compact for")
    return cache.get_seq_length() if latent else shape[2]


def compact(model, cache, keep: float = 0.1, *, method: str = "am", queries: list[torch.Tensor] | None = None,
            **options) -> CompactedCache | LatentCache:
    """Compact a prefilled prompt's cache to ``keep`` of its tokens per KV head (on average over layers and
    heads) by attention matching (``method="am"``) or eviction by the same queries (``"attention"``).
    ``keep`` is the share kept: kvpress's ``compression_ratio`` is the share removed (``keep = 1 −
    compression_ratio``). Counts that differ between heads or rows are stored padded to the largest in a
    layer (padding entries have β = −1e4 and are never attended): ``allocation="global"``, and a batch of
    several rows under ``layers-max``, hold somewhat more entries than they attend (2-17 % more in tests on
    a tiny model); ``uniform`` holds exactly ``keep``. Padded prompts of very different lengths hold each
    layer's largest row count for every row (rows of 5 and 300 tokens at keep 0.1: 1.9× the rows' entries;
    :mod:`stiefkv.padded`).

    The uncompressed model's ``DynamicCache`` becomes a :class:`CompactedCache`; the
    :class:`~stiefkv.cache.LatentCache` of a model served by :func:`stiefkv.load` (bf16 or quantized
    latents, either key mode) a compacted ``LatentCache``, whose β reaches the kernels as their ``bias``.
    Latents of bases shared by a layer's KV heads (``--share-heads``: one latent a token) keep one entry set
    a layer for all its heads, chosen and fitted by all its query heads (``keep`` of the tokens a layer).

    ``queries``: per layer ``[B, H, m, d]`` rotated reference queries; by default those :func:`prefill`
    kept on the cache. ``options``: ``selection`` (``attention`` | ``omp``), ``fit_beta``,
    ``refit_values``, ``allocation``, ``pooling``, ``solver``, ``ridge``, ``block`` (longer layers are
    compacted in blocks of that many tokens; None for whole layers) (defaults:
    :data:`~stiefkv.compaction.AM_DEFAULTS`), and ``pin``: the share of the kept entries that hold the
    prompt's most surprising tokens exact, β = 0, beside the rest compacted (:func:`pinned_tokens`; a pass key
    kept where the window's queries lose it); by default (None) for AM a tenth, at least 64 tokens, at most a
    quarter, none below 128 kept entries (:func:`pin_count`), none for ``attention``; ``pin=0`` for none.
    The result continues with ``model(ids, past_key_values=...)`` or ``model.generate(...)`` at the prompt's
    original positions. Padded prompts (:func:`prefill` with an ``attention_mask``) are compacted row by row,
    each as it would be alone, and continue with that mask (:mod:`stiefkv.padded`)."""
    try:
        if isinstance(keep, (str, bytes, bool)):  # float() would take "0.5", and True as keep everything
            raise TypeError
        keep = float(keep)
    except (TypeError, ValueError):
        raise ValueError(f"keep must be a number in (0, 1] (the fraction of the prompt's tokens kept), got "
                         f"{keep!r}") from None
    if not 0 < keep <= 1:
        raise ValueError(f"keep must be in (0, 1] (the fraction of the prompt's tokens kept), got {keep}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)} (kvpress's presses are baselines of "
                         f"stiefkv eval --compact); got {method!r}")
    if isinstance(cache, padded.PaddedPromptCache):  # each row compacted alone, by this function
        padded.check_padded_cache(cache)
        padded.check_row_queries(queries, len(cache.row_lengths))
        return padded.compact_rows(model, cache, compact, queries, keep=keep, method=method, **options)
    T = check_cache(model, cache)
    if T < 2:
        raise ValueError(f"the cache holds {T} token: too few to compact (at least 2)")
    queries = queries if queries is not None else getattr(cache, "reference_queries", None)
    if queries is None:
        raise ValueError("compact needs the prompt's reference queries: prefill with "
                         "stiefkv.prefill(model, ids), or pass queries=")
    check_queries(model, cache, queries)
    effective_options(method, {k: v for k, v in options.items() if k != "pin"})
    new = build(model, cache, queries, max(1, round(keep * T)), method, **options)
    new.prompt_ids = prompt_ids_held(cache, T)
    install_question_guard(model)
    return new


def prompt_ids_held(cache, T: int) -> torch.Tensor | None:
    """The ids of the ``T`` tokens ``cache`` holds, as :func:`prefill` recorded them (a cache cropped since
    holds the first of them); None where unknown: not prefilled by it, or extended since."""
    ids = getattr(cache, "prefilled_ids", None)
    return ids[:, :T] if isinstance(ids, torch.Tensor) and ids.shape[1] >= T else None


def check_queries(model, cache, queries) -> None:
    """A clear error unless ``queries`` are one ``[B, H, m ≥ 1, d]`` tensor a layer for ``cache``'s rows and
    ``model``'s query heads."""
    layers = decoder_layers(model)
    dims = dims_of(model.config)
    H, d = dims.H, dims.d
    B = cache.positions.shape[0] if isinstance(cache, LatentCache) else cache.layers[0].keys.shape[0]
    if not isinstance(queries, (list, tuple)) or len(queries) != len(layers):
        n = len(queries) if isinstance(queries, (list, tuple)) else type(queries).__name__
        raise ValueError(f"queries must be a list of one tensor a layer ({len(layers)}); got {n}")
    for i, q in enumerate(queries):
        if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[0] != B or q.shape[1] != H \
                or q.shape[2] < 1 or q.shape[3] != d:
            shape = list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
            raise ValueError(f"queries of layer {i} must be [batch {B}, {H} query heads, ≥ 1 queries, {d}] "
                             f"(rotated, as stiefkv.prefill keeps them); got {shape}")
        if not q.dtype.is_floating_point or not bool(torch.isfinite(q).all()):
            what = q.dtype if not q.dtype.is_floating_point else "NaN or infinite values"
            raise ValueError(f"queries of layer {i} hold {what}: the fits need finite float queries")

