"""The real SmolLM2 served through the compiled decode kernel with int4 ``post_rope`` latents at small ranks,
against the PyTorch reference backend on the same tokens (issue 14, docs/notes/serving.md item 11).

The wide int4 tile computed wrong logits on the H200 at ranks padded to 16 (r 11/13 and 16/16), bf16,
one to three queries: decode. Random-input kernel tests found it; this checks the model end to end.
Per case: PCA bases cut to the ranks (bf16 model on CUDA, int4 per-token codes for keys and values), a
prefill of a WikiText-2 test prompt for each of ``--batch`` rows, then ``--steps`` decode steps fed the
text's next tokens (teacher forcing: both backends see the same inputs). Reported: the largest logit
difference over the largest logit, and how often the two backends' next tokens agree. The control cases
(ranks 24/40, and int8 at 16/16) take the loops the fix did not touch.

    usage: python benchmarks/experiments/smollm2_int4_decode_check.py MODEL [--steps 32] [--batch 3]
Exits 1 when a case's agreement falls below ``--min-agree`` or its error above ``--max-rel``.
"""

import argparse
import json
import sys

import torch

import stiefkv
from stiefkv.data import load_texts, token_stream
from stiefkv.projections import Projections
from stiefkv.quant import QuantSpec

CASES = [  # (r_k, r_v, bits)
    (11, 13, 4), (16, 16, 4), (7, 16, 4), (24, 40, 4), (16, 16, 8),
]


def cut(proj: Projections, r_k: int, r_v: int, bits: int) -> Projections:
    """``proj``'s bases cut to their first ``r_k`` / ``r_v`` columns, stored as ``bits``-bit token codes."""
    spec = QuantSpec(bits, "token")
    return Projections(keys=[k[..., :r_k].contiguous() for k in proj.keys],
                       values=[v[..., :r_v].contiguous() for v in proj.values], key_mode=proj.key_mode,
                       fingerprint=proj.fingerprint, budget=proj.budget, method=proj.method,
                       quant=[(spec, spec)] * len(proj.keys))


@torch.no_grad()
def forced_logits(model, proj, backend: str, prompt: torch.Tensor, follow: torch.Tensor) -> torch.Tensor:
    """Next-token logits ``[B, steps, V]`` (float32) of the decode steps after a prefill of ``prompt``."""
    stiefkv.load(model, proj, backend=backend)
    out = model(prompt, use_cache=True)
    past, logits = out.past_key_values, []
    for t in range(follow.shape[1]):
        out = model(follow[:, t:t + 1], past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits.append(out.logits[:, -1].float())
    stiefkv.unload(model)
    return torch.stack(logits, 1)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt", type=int, default=300)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batch", type=int, default=3)
    ap.add_argument("--min-agree", type=float, default=0.9)
    ap.add_argument("--max-rel", type=float, default=0.05)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("this check compiles the kernels: it needs a CUDA device", file=sys.stderr)
        return 2
    model, tok = stiefkv.load_model(args.model, device="cuda")
    proj = stiefkv.calibrate(model, tok, budget=1.0, bits="16", method="pca", allocation="uniform",
                             key_mode="post_rope", num_sequences=8, seq_len=256)
    model.to(torch.bfloat16)
    stream = token_stream(tok, load_texts("wikitext2", "test"))
    n = args.prompt + args.steps
    rows = torch.stack([stream[i * 5 * n:i * 5 * n + n] for i in range(args.batch)]).cuda()
    prompt, follow = rows[:, :args.prompt], rows[:, args.prompt:]
    failed = False
    for r_k, r_v, bits in CASES:
        p = cut(proj, r_k, r_v, bits)
        ref = forced_logits(model, p, "reference", prompt, follow)
        tri = forced_logits(model, p, "triton", prompt, follow)
        ok_vals = bool(torch.isfinite(tri).all())
        rel = float((tri - ref).abs().max() / ref.abs().max())
        agree = float((tri.argmax(-1) == ref.argmax(-1)).float().mean())
        text_agree = float((ref.argmax(-1)[:, :-1] == follow[:, 1:]).float().mean())
        bad = (not ok_vals) or rel > args.max_rel or agree < args.min_agree
        failed |= bad
        print(json.dumps({"r_k": r_k, "r_v": r_v, "bits": bits, "key_mode": "post_rope", "dtype": "bf16",
                          "max_rel_logit_diff": round(rel, 5), "argmax_agree": round(agree, 4),
                          "reference_top1_on_text": round(text_agree, 4), "finite": ok_vals,
                          "result": "FAIL" if bad else "ok"}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
