"""Serve a `--share-heads` checkpoint of the real model on the GPU: the static cache over its codes with the
decode step graph-captured (`stiefkv.generate`) against `model.generate` over the dynamic cache, on a
WikiText-2 prompt; the tokens must be equal. Prints both times (one run each after a warm-up: a check, not a
benchmark).

    python benchmarks/experiments/shared_serving_check.py MODEL CKPT [--prompt 1024] [--new 64] [--batch 4]
"""

from __future__ import annotations

import argparse
import time

import torch


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("ckpt")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()

    import stiefkv
    from stiefkv.data import load_texts, token_stream

    model, tok = stiefkv.load_model(args.model, device="cuda", dtype=torch.bfloat16)
    proj = stiefkv.Projections.load(args.ckpt)
    stiefkv.load(model, proj)
    print(f"checkpoint: shared {proj.shared}, quantized {proj.quantized}, ranks {proj.ranks[:3]} …, "
          f"storages {[str(s) for s in proj.specs[0]]}", flush=True)
    ids = token_stream(tok, load_texts("wikitext2", "test"))
    rows = torch.stack([ids[i * 5000: i * 5000 + args.prompt] for i in range(args.batch)]).cuda()
    with torch.no_grad():
        stiefkv.generate(model, rows[:, :64], max_new_tokens=4, eos_token_id=None)  # warm-up (compiles)
        model.generate(rows[:, :64], max_new_tokens=4, do_sample=False, pad_token_id=0)
        ours, t_ours = timed(lambda: stiefkv.generate(model, rows, max_new_tokens=args.new,
                                                      eos_token_id=None))
        theirs, t_theirs = timed(lambda: model.generate(rows, max_new_tokens=args.new, do_sample=False,
                                                        pad_token_id=0))
    same = torch.equal(ours, theirs)
    agree = (ours[:, -args.new:] == theirs[:, -args.new:]).float().mean().item()
    print(f"stiefkv.generate (static cache, captured) {t_ours:.2f} s; model.generate (dynamic) "
          f"{t_theirs:.2f} s; tokens equal: {same} (new tokens agreeing: {agree:.3f})", flush=True)


if __name__ == "__main__":
    main()
