"""Operators one decode step runs per layer inside the static cache's update (the write and what attention
is handed to read), by store: a count on the CPU of the operators that compute (views left out); on CUDA
each is a kernel of the captured graph. What an exact window adds, before a GPU profile says its cost.

    python benchmarks/experiments/decode_ops.py [--fused-writes] [--layer]

``--fused-writes``: codes written as on CUDA, by the quantize-on-write kernels (per token, and a channel
group when due; an int8 window's tokens by the round-trip kernel), and a split decode's ring side read by
``dequantize_at``: here stand-ins that compute nothing (the count does not depend on the values); their one
launch a latent is not counted.

``--layer``: instead, the operators of one decoder layer's whole attention forward (layer 1: the split
step's bookkeeping is layer 0's), with the attention kernel stubbed and its calls counted beside them.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
FUSED = "--fused-writes" in sys.argv
LAYER = "--layer" in sys.argv
import stiefkv  # noqa: E402
from stiefkv import static_cache  # noqa: E402
from stiefkv.quant import QuantSpec  # noqa: E402
from stiefkv.static_cache import StaticLatentCache  # noqa: E402
from tests.tiny import random_projections, tiny_model  # noqa: E402

STORES = {"bf16": ("bf16", "bf16"), "int8 codes": ("int8-token", "int8-token"),
          "int8 r16 (ring)": ("int8-token-r16", "int8-token-r16"),
          "int8 r16 keys, int8 values": ("int8-token-r16", "int8-token"),
          "int2 channel r16, int3 r16": ("int2-channel-r16", "int3-token-r16"),
          # what --bits auto keeps at 50 % on SmolLM2 (int8 exact windows, log8 scales), and its odd pair
          "auto 50 %: int8 log8 r16 w8": ("int8-token-log8-r16-w8", "int8-token-log8-r16-w8"),
          "auto 50 %, odd: + int4 channel w8": ("int8-token-log8-r16-w8", "int4-channel-r16-w8")}


VIEWS = {f"aten::{n}" for n in ("unsqueeze", "slice", "alias", "view", "select", "expand", "as_strided",
                                 "reshape", "transpose", "t", "permute", "squeeze", "detach", "lift_fresh",
                                 "_unsafe_view", "empty", "empty_strided", "resolve_conj", "resolve_neg")}


def step_ops(key_spec: str, value_spec: str) -> tuple[int, Counter]:
    torch.manual_seed(0)
    model = tiny_model("llama", heads=6, kv_heads=2, head_dim=24)
    proj = random_projections(model, 11, 13, "pre_rope")
    if key_spec != "bf16":
        proj.quant = [(QuantSpec.parse(key_spec), QuantSpec.parse(value_spec))] * len(proj.keys)
    model = stiefkv.load(model, proj)
    cache = StaticLatentCache(model, 2, 400)
    owner, name = (model.model.layers[1].self_attn, "forward") if LAYER else (cache, "update_layer")
    inner = getattr(owner, name)

    def traced(*args, **kwargs):
        with torch.profiler.record_function("counted"):
            return inner(*args, **kwargs)

    setattr(owner, name, traced)
    ids = torch.randint(0, model.config.vocab_size, (2, 300))
    with torch.inference_mode():
        model(ids, past_key_values=cache, use_cache=True)
        token = ids[:, -1:]
        model(token, past_key_values=cache, use_cache=True)
        ATTENTION_CALLS.clear()
        ATTENTION_CALLS["layers"] = model.config.num_hidden_layers
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            model(token, past_key_values=cache, use_cache=True)
    ops = Counter()
    for e in prof.events():
        if e.name in VIEWS or not e.name.startswith("aten::") or e.cpu_parent is None:
            continue
        parent, inside = e.cpu_parent, False
        while parent is not None:  # counted once: the outermost operator inside the update
            if parent.name.startswith("aten::") and parent.name not in VIEWS:
                break
            inside = inside or parent.name == "counted"
            parent = parent.cpu_parent
        else:
            if inside:
                ops[e.name] += 1
    return (1 if LAYER else model.config.num_hidden_layers), ops


ATTENTION_CALLS = Counter()


def _attention_stub(q, z_k, z_v, P_k, P_v, **kwargs):
    """One attention kernel launch: counted, its output empty (a view here: not an operator)."""
    ATTENTION_CALLS["calls"] += 1
    out = torch.empty(*q.shape[:3], z_v.shape[3] if P_v is None else q.shape[3], dtype=q.dtype)
    return (out, torch.empty(q.shape[:3])) if kwargs.get("return_lse") else out


def main() -> None:
    if FUSED:
        static_cache.FUSED_WRITES = True
        static_cache._quantize_into = lambda *args, **kwargs: None
        static_cache._round_trip_into = lambda *args, **kwargs: None  # an int8 window's one launch
        from stiefkv.kernels import dequantize

        # a split decode's ring side of a latent, one launch: its output, uncounted (empty is a view here)
        dequantize.dequantize_at = lambda z, slots, dtype, **kw: torch.empty(
            *z.shape[:2], slots.numel(), z.rank, dtype=dtype, device=slots.device)
    if LAYER:
        from stiefkv import kernels

        kernels.lowrank_attention = _attention_stub
    base = None
    for label, (k, v) in STORES.items():
        layers, ops = step_ops(k, v)
        total = sum(ops.values()) / layers
        base = base or total
        where = "in layer 1's attention forward" if LAYER else "per layer in the cache's update"
        per_layer = ATTENTION_CALLS["calls"] / max(ATTENTION_CALLS["layers"], 1)
        calls = f", {per_layer:.0f} attention calls a layer" if LAYER else ""
        print(f"{label:32s} {total:5.0f} operators {where} ({total - base:+.0f} against bf16){calls}")
        if "ring" in label:
            print("   ", ", ".join(f"{n[6:]} {c // layers}" for n, c in ops.most_common(12)))


if __name__ == "__main__":
    main()
