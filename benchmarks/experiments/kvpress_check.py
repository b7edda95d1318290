"""Check stiefkv.presses against kvpress itself: the tokens each press keeps, per layer and KV head.

kvpress 0.5.5 pins ``transformers<5.3``, so it runs in its own environment (transformers 5.2, the same torch):

    python3 -m venv /tmp/kvenv && /tmp/kvenv/bin/pip install torch==2.13.0 transformers==5.2.0 gguf \\
        accelerate "datasets>=2.21" "fire>=0.6,<0.7" "pandas>=2.2.2,<3" "peft>=0.20" "cachetools>=5.5.2,<6"
    /tmp/kvenv/bin/pip install --no-deps kvpress==0.5.5
    /tmp/kvenv/bin/python benchmarks/experiments/kvpress_check.py kvpress GGUF /tmp/kv.pt --chunks 3
    .venv/bin/python benchmarks/experiments/kvpress_check.py stiefkv GGUF /tmp/kv.pt

The first step (kvpress's environment, no stiefkv import) prefills each chunk of WikiText-2 test with and
without each press and stores the indices of the keys kvpress kept; the second recomputes the selection with
``stiefkv.presses`` on this environment's prefill and prints, per press, the share of kept tokens both agree
on (1.0: the same tokens in every layer and head).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

PRESSES = {"knorm": "KnormPress", "snapkv": "SnapKVPress", "tova": "TOVAPress",
           "streaming_llm": "StreamingLLMPress", "expected_attention": "ExpectedAttentionPress"}
KEEP = 0.1


def chunks(tokenizer, context: int, n: int) -> list[torch.Tensor]:
    folder = Path(os.environ.get("STIEFKV_DATA_DIR", "../shared/data")) / "wikitext-2"
    text = (folder / "wiki.test.raw").read_text()
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
    return [ids[i * context:(i + 1) * context] for i in range(n)]


def load(gguf: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(gguf)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@torch.no_grad()
def run_kvpress(args) -> None:
    import kvpress
    from transformers import DynamicCache

    model, tok = load(args.gguf)
    out = {"context": args.context, "chunks": [], "kept": {}}
    for ids in chunks(tok, args.context, args.chunks):
        out["chunks"].append(ids)
        full = DynamicCache()
        model(ids[None], past_key_values=full)
        for name, cls in PRESSES.items():
            press = getattr(kvpress, cls)(compression_ratio=1 - KEEP)
            cache = DynamicCache()
            with press(model):
                model(ids[None], past_key_values=cache)
            per_layer = []
            for la_full, la in zip(full.layers, cache.layers):
                # each kept key is one of the prefill's, gathered as it was: find its row
                match = (la.keys[0][:, :, None, :] == la_full.keys[0][:, None, :, :]).all(-1)  # [G, t, T]
                per_layer.append(match.float().argmax(-1))
            out["kept"].setdefault(name, []).append(torch.stack(per_layer))  # [L, G, t]
        print(f"chunk {len(out['chunks'])}: done", flush=True)
    torch.save(out, args.out)


@torch.no_grad()
def run_stiefkv(args) -> None:
    import stiefkv
    from stiefkv.compacted import build, prefill_with_queries
    from stiefkv.longcontext import _queries_for

    model, _ = stiefkv.load_model(args.gguf)
    ref = torch.load(args.out)
    C = ref["context"]
    for name in PRESSES:
        agree = total = 0
        for ids, theirs in zip(ref["chunks"], ref["kept"][name]):
            cache, queries = prefill_with_queries(model, ids[None], **_queries_for(name, C, 1024))
            t = theirs.shape[-1]
            new = build(model, cache, queries, t, name)
            for i, layer in enumerate(new.layers):
                full = cache.layers[i].keys[0]
                mine = (layer.keys[0][:, :, None, :] == full[:, None, :, :]).all(-1).float().argmax(-1)
                for g in range(mine.shape[0]):
                    agree += len(set(mine[g].tolist()) & set(theirs[i, g].tolist()))
                    total += t
        print(f"{name}: {agree / total:.4f} of kvpress's kept tokens also kept by stiefkv.presses "
              f"({len(ref['chunks'])} chunks of {C}, keep {KEEP})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("side", choices=["kvpress", "stiefkv"])
    ap.add_argument("gguf")
    ap.add_argument("out")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--chunks", type=int, default=3)
    args = ap.parse_args()
    (run_kvpress if args.side == "kvpress" else run_stiefkv)(args)


if __name__ == "__main__":
    main()
