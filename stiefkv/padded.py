"""Prompts of different lengths in one batch, prefilled and compacted row by row (DESIGN.md, Compaction).

>>> batch = tokenizer(prompts, padding=True, padding_side="left", return_tensors="pt")     # doctest: +SKIP
>>> cache = stiefkv.prefill(model, batch.input_ids, attention_mask=batch.attention_mask)  # doctest: +SKIP
>>> cache = stiefkv.compact(model, cache, keep=0.1)                                        # doctest: +SKIP
>>> model.generate(ids, attention_mask=mask, past_key_values=cache)                         # doctest: +SKIP

(``ids`` and ``mask``: the padded prompts and the questions behind them, the questions unpadded.)

Each row is prefilled alone over its own tokens, at positions 0 … L−1, as a left-padded batch is read when
its positions come from the attention mask (``generate`` does so); its reference queries and surprise are its
own. :func:`prefill_rows` joins the rows into a :class:`PaddedPromptCache`, the left-padded ``DynamicCache``
of the batch (zeros in the padding) that keeps each row's fitting data beside it. :func:`compact_rows`
compacts each row alone, as :func:`stiefkv.compact` compacts one prompt, and joins the rows into one
:class:`~stiefkv.compacted.CompactedCache`: a layer's rows kept to different counts are padded to the largest
with entries attention never reads (β = :data:`~stiefkv.compaction.PAD_BETA`), as
:func:`~stiefkv.compaction.compact_layer` joins rows. The joined cache reports the
padded length for every row, where the next cache slot is; the next *position* of each row is its own
length, which ``generate`` takes from the attention mask and a plain forward from ``position_ids``. Its
checks (:func:`refuse_wrong_padding`, :func:`refuse_wrong_positions`) refuse a continuation that reads the
rows at other positions or with other padding.

On a model served by :func:`stiefkv.load` the rows' latent caches are kept apart (``rows``: quantized
stores of different lengths are not joined uncompacted), so the :class:`PaddedPromptCache` is for
:func:`stiefkv.compact` only; the compacted rows are joined into one compacted ``LatentCache``
(:func:`_joined_latent`).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from stiefkv.cache import LatentCache, first_token_positions, real_appended
from stiefkv.compaction import PAD_BETA, _rows_padded
from stiefkv.models import decoder_layers
from stiefkv.quant import quantized_length


class PaddedPromptCache(DynamicCache):
    """The left-padded ``DynamicCache`` of prompts of ``row_lengths`` ``[B]`` tokens in ``columns`` (each
    row's keys and values in its last ``L`` columns, zeros before them), keeping beside it what each row
    prefilled alone recorded for :func:`stiefkv.compact`: ``row_queries`` (per row, its reference queries a
    layer ``[1, H, m, d]``) and ``row_surprise`` (per row ``[1, L]``). On a served model it holds no layers:
    ``rows`` are the rows' own prefilled ``LatentCache``s, which only :func:`stiefkv.compact` reads."""

    rows: list | None = None

    def __init__(self, row_lengths: torch.Tensor, columns: int, row_queries: list, row_surprise: list,
                 probe: torch.Tensor):
        super().__init__()
        self.row_lengths = row_lengths
        self.columns = columns
        self.row_queries = row_queries
        self.row_surprise = row_surprise
        self.model_probe = probe

    # not compacted: the checks compact installs on the model read a compacted cache's length, and skip a
    # cache whose length is None (as a CompactedCache once reset)
    length = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The padded prompts' columns, as the layers of an unserved model's hold them (a served model's
        rows are held apart, with no layers)."""
        return self.columns if self.rows is not None else super().get_seq_length(layer_idx)

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache: its layers' keys and values, or a served model's rows' latents."""
        if self.rows is not None:
            return sum(r.nbytes for r in self.rows)
        held = (t for layer in self.layers for t in (layer.keys, layer.values))
        return sum(t.nbytes for t in held if isinstance(t, torch.Tensor))

    # each row's fitting data follows every batch edit of its keys (beams, a selection of rows): otherwise
    # compact would cut a row from another's columns and fit it to another's queries, silently
    def _rows_follow(self, index: torch.Tensor) -> None:
        index = index.detach().cpu()
        self.row_lengths = self.row_lengths[index]
        self.row_queries = [self.row_queries[b] for b in index.tolist()]
        self.row_surprise = [self.row_surprise[b] for b in index.tolist()]
        self.prefilled_ids = self.prefilled_ids[index.to(self.prefilled_ids.device)]
        if self.rows is not None:
            self.rows = [self.rows[b] for b in index.tolist()]

    def reorder_cache(self, beam_idx: torch.LongTensor):
        super().reorder_cache(beam_idx)
        self._rows_follow(beam_idx)

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        self._rows_follow(torch.arange(len(self.row_lengths)).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor):
        super().batch_select_indices(indices)
        self._rows_follow(torch.arange(len(self.row_lengths))[indices.cpu()])


def left_padded_lengths(mask, ids: torch.Tensor) -> torch.Tensor | None:
    """Each row's tokens ``[B]`` (on the host) in the left-padded ``mask`` of ``ids``; None when nothing is
    padded. A clear error for a mask of another shape or other values, right padding and holes, and rows of
    fewer than 2 tokens."""
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(ids.shape):
        shape = list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ValueError(f"attention_mask must be a tensor of the ids' shape {list(ids.shape)} (1 for a "
                         f"token, 0 for padding); got {shape}")
    mask = mask.detach().cpu()
    if mask.dtype.is_complex or not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold only 1 (a token) and 0 (padding)")
    mask = mask.long()
    lengths = mask.sum(1)
    C = mask.shape[1]
    left = torch.arange(C)[None] >= (C - lengths)[:, None]  # each row's ones at its end, as left padding
    wrong = (mask.bool() != left).any(1)
    if bool(wrong.any()):
        row = int(wrong.nonzero()[0])
        raise ValueError(f"prefill takes left-padded prompts (tokenizer padding_side='left'): row {row} of "
                         "the attention_mask has padding after or between its tokens")
    short = (lengths < 2).nonzero().flatten().tolist()
    if short:
        raise ValueError(f"row(s) {', '.join(map(str, short[:8]))} of the attention_mask hold fewer than 2 "
                         "tokens: a prompt to compact needs at least 2")
    return None if bool((lengths == C).all()) else lengths


def prefill_rows(model, ids: torch.Tensor, lengths: torch.Tensor, prefill_one,
                 **options) -> PaddedPromptCache:
    """The :class:`PaddedPromptCache` of the left-padded ``ids`` ``[B, C]`` whose rows hold ``lengths``
    tokens, each row prefilled alone by ``prefill_one(model, row_ids, **options)``
    (:func:`stiefkv.prefill`)."""
    B, C = ids.shape
    rows = [prefill_one(model, ids[b:b + 1, C - int(lengths[b]):], **options) for b in range(B)]
    cache = PaddedPromptCache(lengths, C, [r.reference_queries for r in rows],
                              [r.prompt_surprise for r in rows], rows[0].model_probe)
    cache.prefilled_ids = ids.detach().clone()  # not the caller's tensor, which may be refilled in place
    if isinstance(rows[0], LatentCache):
        cache.rows = rows
        return cache
    for i in range(len(rows[0].layers)):
        keys = _left_padded([r.layers[i].keys for r in rows], C)
        cache.update(keys, _left_padded([r.layers[i].values for r in rows], C), i)
    return cache


def _left_padded(rows: list[torch.Tensor], C: int) -> torch.Tensor:
    """Rows ``[1, G, L_b, d]`` as one ``[B, G, C, d]``, each in its last ``L_b`` columns, zeros before."""
    first = rows[0]
    out = first.new_zeros(len(rows), first.shape[1], C, first.shape[3])
    for b, row in enumerate(rows):
        out[b, :, C - row.shape[2]:] = row[0]
    return out


def check_padded_cache(cache: PaddedPromptCache) -> None:
    """A clear error unless ``cache`` holds its prompts only, as :func:`prefill_rows` left them (its rows may
    have been reordered, repeated or selected since: their lengths follow)."""
    lengths, C = cache.row_lengths.tolist(), cache.columns
    if cache.rows is not None:
        whole = [r.get_seq_length() for r in cache.rows] == lengths
    else:
        whole = bool(cache.layers) and cache.layers[0].keys.shape[0] == len(lengths) and \
            all(layer.keys.shape[2] == C for layer in cache.layers)
    if not whole:
        raise ValueError(f"this padded prompts' cache no longer holds its {len(lengths)} prompts of "
                         f"{_listed(cache.row_lengths)} tokens (left-padded to {C}) alone: something "
                         "extended or cut it since stiefkv.prefill. Compact it as prefill returned it")


def check_row_queries(queries, rows: int) -> None:
    """A clear error unless ``queries`` (None, or one tensor a layer) has the padded batch's ``rows``: each
    row's are its slice, checked in full where that row is compacted."""
    if queries is None:
        return
    if not isinstance(queries, (list, tuple)):
        got = f"a {type(queries).__name__}"
    else:
        bad = [(i, q) for i, q in enumerate(queries)
               if not (isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[0] == rows)]
        if not bad:
            return
        i, q = bad[0]  # the first wrong layer named, with what it holds: the caller's own mistake to find
        got = f"layer {i} " + (f"of shape {list(q.shape)}" if isinstance(q, torch.Tensor) else
                               f"a {type(q).__name__}")
    raise ValueError(f"queries must be a list of one [batch {rows}, query heads, ≥ 1 queries, head dim] "
                     "tensor a layer (rotated, as stiefkv.prefill keeps them), one row a prompt of the "
                     f"padded batch; got {got}")


def row_cache(cache: PaddedPromptCache, b: int) -> DynamicCache:
    """Row ``b`` of ``cache`` alone, unpadded, with its own reference queries and surprise: what
    :func:`stiefkv.prefill` returns for that prompt by itself."""
    if cache.rows is not None:
        return cache.rows[b]
    C, L = cache.columns, int(cache.row_lengths[b])
    one = DynamicCache()
    for i, layer in enumerate(cache.layers):
        one.update(layer.keys[b:b + 1, :, C - L:], layer.values[b:b + 1, :, C - L:], i)
    one.reference_queries = cache.row_queries[b]
    one.prompt_surprise = cache.row_surprise[b]
    one.model_probe = cache.model_probe
    one.prefilled_ids = cache.prefilled_ids[b:b + 1, C - L:]
    return one


def compact_rows(model, cache: PaddedPromptCache, compact_one, queries: list[torch.Tensor] | None, **options):
    """Each row of ``cache`` compacted alone by ``compact_one(model, row, queries=..., **options)``
    (:func:`stiefkv.compact`; ``queries``, when given, ``[B, H, m, d]`` a layer, split by row), joined into
    one :class:`~stiefkv.compacted.CompactedCache` of the padded length (on a served model one compacted
    ``LatentCache``: :func:`_joined_latent`)."""
    from stiefkv.compacted import CompactedCache

    rows = []
    for b in range(len(cache.row_lengths)):
        mine = None if queries is None else [q[b:b + 1] for q in queries]
        rows.append(compact_one(model, row_cache(cache, b), queries=mine, **options))
    if isinstance(rows[0], LatentCache):
        joined = _joined_latent(model, rows, cache.columns)
    else:
        joined = CompactedCache(cache.columns, cache.model_probe)
        for i in range(len(rows[0].prefix)):
            # each row's entries as compact_layer returns a row's, joined as it joins rows of other counts
            keys, beta, values, _ = _rows_padded([(r.layers[i].keys, r.beta[i], r.layers[i].values,
                                                   torch.zeros_like(r.beta[i], dtype=torch.long))
                                                  for r in rows])
            joined.add_layer(keys, values, beta)
    joined.row_lengths = cache.row_lengths.clone()
    joined.prompt_ids = cache.prefilled_ids
    return joined


def _joined_latent(model, rows: list[LatentCache], C: int) -> LatentCache:
    """Compacted latent caches of one row each joined into one of the padded length ``C``: each layer's
    entries as stored, padded to the largest row's count by a row's first entry again at β =
    :data:`PAD_BETA` (never attended; where the pads go: :func:`_slots`), stored as the model stores latents,
    with each row's own codes carried over (log8 codes quantized again from their values could take another
    scale). Per-token codes and, where every quantized store of a layer holds channel groups of one
    ``recent``, channel groups are then the row's own; of other mixes (per-token keys beside channel values,
    channel stores of different ``recent``) channel groups fall elsewhere.

    The padding is held as any entry is (``nbytes`` counts it): a layer holds the largest row's count for
    every row (channel groups: up to a group more), so rows of very different lengths hold up to ``B``
    times their own entries (rows of 5 and 300 tokens at keep 0.1, int3/int2 per-token stores: 1.9× the
    rows' bytes alone)."""
    from stiefkv.compacted import _carry_codes

    joined = LatentCache()
    joined.length = C
    joined.basis_tags = dict(rows[0].basis_tags)
    dtype = next(model.parameters()).dtype
    for i, layer in enumerate(decoder_layers(model)):
        counts = [r.prefix[i] for r in rows]
        coded = _coded_alone(counts, layer.self_attn.quant)
        parts, indices = [], []
        for b, r in enumerate(rows):
            z_k, z_v = r.read_layer(i, dtype)
            take, pad = _slots(b, counts, coded, z_k.device)
            beta = r.beta[i].index_select(2, take)
            beta[..., pad] = PAD_BETA
            parts.append((z_k.index_select(2, take), z_v.index_select(2, take),
                          r.head_positions[i].index_select(2, take), beta))
            indices.append(take.expand(*z_k.shape[:2], len(take)))
        joined.add_compacted_layer(*(torch.cat(x) for x in zip(*parts)), quant=layer.self_attn.quant)
        _carry_codes([r.layers[i] for r in rows], joined.layers[i], indices, stores=(0, 1))
    return joined


def _coded_alone(counts: list[int], quant) -> list[int] | None:
    """Each row's entries held as codes alone, where every quantized store of the layer (``quant``: its key
    and value specs) holds ``channel`` groups of one ``recent``: the rows are then joined group-aligned
    (:func:`_slots`). None otherwise (float or per-token stores, or several kinds: padding in front)."""
    specs = [s for s in (quant or ()) if s.quantized]
    if not specs or any(s.layout != "channel" or s.recent != specs[0].recent for s in specs):
        return None
    return [quantized_length(c, specs[0]) for c in counts]


def _slots(b: int, counts: list[int], coded: list[int] | None, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ``b``'s slots in a joined layer of rows kept to ``counts``: each slot's entry of the row (``take``)
    and whether it is padding (``pad``).

    Padding goes in front, so that the row's last entries stay in the slots its store holds exact (the
    residual, the int8 window), as alone. Channel groups (``coded``: each row's entries held as codes alone,
    :func:`_coded_alone`) need more: the row's coded entries end where the longest coded run ends, the pads
    before them whole groups, so that its groups are its own; and its exact entries end the layer, the pads
    between, so that the group still filling holds them all (behind the largest count, a short row's tail,
    exact alone, fell in a full group, and a longer row's groups shifted: int2-channel, 0.17 on the logits
    from the row alone, against 0.06 for the row alone from its uncompacted cache)."""
    if coded is None:
        slot = torch.arange(max(counts), device=device) - (max(counts) - counts[b])
        return slot.clamp(min=0), slot < 0
    codes, tail = max(coded), max(c - h for c, h in zip(counts, coded))
    h, n = coded[b], codes + tail
    exact = counts[b] - h  # the row's entries behind its codes, which end the layer in every row
    slot = torch.arange(n, device=device)
    front = slot < codes
    entry = torch.where(front, slot - (codes - h), slot - (n - exact) + h)
    pad = torch.where(front, slot < codes - h, slot < n - exact)
    return torch.where(pad, 0, entry), pad


# ------------------------------------------------------------------------------------ continuing the batch
def next_positions(cache, held: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's next position ``[B]`` (host): its prompt's length and the tokens appended since, not their
    padding (``held``: the forward's mask over them, else as recorded)."""
    appended = held.sum(1) if held is not None else real_appended(cache)
    return (cache.row_lengths.cpu() + torch.as_tensor(appended).cpu()).long()


def refuse_wrong_padding(cache, mask, required: bool = False) -> None:
    """A clear error unless the 2-D ``mask`` of a forward or ``generate`` over a compacted cache of padded
    prompts pads each row's prompt as it was prefilled: ``generate`` takes the rows' positions from it, and
    other padding would read them at other positions (the tokens after the prompts may be padded: their β
    follows the mask). ``required``: no mask is an error too (``generate``; a forward takes the positions
    from ``position_ids``)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        if required:
            raise ValueError(WRONG_MASK.format(lengths=_listed(cache.row_lengths), C=cache.length))
        return
    C, lengths = cache.length, cache.row_lengths.cpu()
    want = torch.arange(C)[None] >= (C - lengths)[:, None]
    have = mask.detach().cpu()
    if have.shape[0] != want.shape[0] or have.shape[1] < C or not torch.equal(have[:, :C].bool(), want):
        raise ValueError(WRONG_MASK.format(lengths=_listed(lengths), C=C))


WRONG_MASK = ("this compacted cache holds prompts of {lengths} tokens left-padded to {C}: pass the "
              "attention_mask they were prefilled with, then the mask of the tokens after them")


def _listed(values: torch.Tensor) -> str:
    return ", ".join(map(str, values.tolist()[:8])) + (" …" if len(values) > 8 else "")


def refuse_wrong_positions(cache, kwargs: dict, tokens: int, incoming: torch.Tensor | None = None,
                           held: torch.Tensor | None = None) -> None:
    """A clear error where a forward over a compacted cache of padded prompts would read a row at another
    position than its own next one (:func:`next_positions`): without ``position_ids`` the model places every
    row after the padded length. The values are read back for forwards of several tokens only, as the
    other checks do (a decode step should not wait for the device); each row's position is its first new
    token's (``incoming``: the new tokens' mask), against the tokens held behind its prompt, not their
    padding (``held``: the forward's mask over them)."""
    positions = kwargs.get("position_ids")
    if positions is None:  # never so in generate: the read back below costs a decode step nothing there
        lengths = cache.row_lengths.cpu()
        # the model places every row at the padded length onward: each row's own only where none is padded
        # (rows of one length padded alike, as pad_to_multiple_of does, are not)
        if bool((lengths == cache.length).all()):
            return
        raise ValueError(f"this compacted cache holds prompts of {_listed(lengths)} tokens left-padded to "
                         f"{cache.length}: pass position_ids (each row's prompt length onward) to the "
                         "forward, or to generate the attention_mask the prompts were prefilled with")
    if tokens < 2 or not isinstance(positions, torch.Tensor):
        return
    first = first_token_positions(positions, incoming)
    want = next_positions(cache, held)
    if first.shape[0] == 1:
        first = first.expand_as(want)
    if first.shape != want.shape or not bool(((first == want) | (first < 0)).all()):
        raise ValueError(f"position_ids start at {first.tolist()[:8]}, and the rows of this compacted cache "
                         f"continue at {want.tolist()[:8]} (each prompt's length and the tokens since): feed "
                         "only the new tokens, at those positions (to generate, pass the attention_mask the "
                         "prompts were prefilled with)")
