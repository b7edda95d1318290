"""The real SmolLM2 served through the compiled decode kernel with int4 ``post_rope`` latents at small ranks,
against the PyTorch reference backend on the same tokens (issue 14, docs/notes/serving.md item 11).

The wide int4 tile computed wrong logits on the H200 at ranks padded to 16 (r 11/13 and 16/16), bf16,
one to three queries: decode. Random-input kernel tests found it; this checks the model end to end.
Per case: PCA bases cut to the ranks (int4 per-token codes for keys and values), a prefill of a WikiText-2
test prompt for each of ``--batch`` rows, then ``--steps`` decode steps fed the text's next tokens (teacher
forcing: every run sees the same inputs). The truth is the PyTorch reference backend on the float32 model;
the bf16 model is served by both backends, and each one's mean KL from the truth and its next-token
agreement with it are reported. The bf16 reference backend's distance is the noise level: rounding moves
int4 codes by a step, and with them the logits, in every backend. A case fails where the kernels' KL is
more than ``--max-ratio`` times the bf16 reference's (plus ``--kl-floor``). The control cases (int8; r 7/16)
take loops the fix did not touch.

    usage: python benchmarks/experiments/smollm2_int4_decode_check.py MODEL [--steps 32] [--batch 3]
Exits 1 when a case fails.
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
    (11, 13, 4), (16, 16, 4), (24, 40, 4), (64, 64, 4), (7, 16, 4), (16, 16, 8), (24, 40, 8),
]


def cut(proj: Projections, r_k: int, r_v: int, bits: int) -> Projections:
    """``proj``'s bases cut to their first ``r_k`` / ``r_v`` columns, stored as ``bits``-bit token codes."""
    spec = QuantSpec(bits, "token")
    return Projections(keys=[k[..., :r_k].contiguous() for k in proj.keys],
                       values=[v[..., :r_v].contiguous() for v in proj.values], key_mode=proj.key_mode,
                       fingerprint=proj.fingerprint, budget=proj.budget, method=proj.method,
                       quant=[(spec, spec)] * len(proj.keys))


def to_dtype(model, dtype: torch.dtype):
    """``model`` with its parameters in ``dtype``; its buffers (RoPE's inverse frequencies) stay float32, as
    ``from_pretrained(dtype=...)`` leaves them (``Module.to`` would round them too)."""
    for param in model.parameters():
        param.data = param.data.to(dtype)
    return model


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
    ap.add_argument("--max-ratio", type=float, default=2.0)
    ap.add_argument("--kl-floor", type=float, default=1e-3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("this check compiles the kernels: it needs a CUDA device", file=sys.stderr)
        return 2
    model, tok = stiefkv.load_model(args.model, device="cuda")
    proj = stiefkv.calibrate(model, tok, budget=1.0, bits="16", method="pca", allocation="uniform",
                             key_mode="post_rope", num_sequences=8, seq_len=256)
    to_dtype(model, torch.bfloat16)  # every run holds the same (bf16-rounded) weights; the truth in fp32
    stream = token_stream(tok, load_texts("wikitext2", "test"))
    n = args.prompt + args.steps
    rows = torch.stack([stream[i * 5 * n:i * 5 * n + n] for i in range(args.batch)]).cuda()
    prompt, follow = rows[:, :args.prompt], rows[:, args.prompt:]
    failed = False
    for r_k, r_v, bits in CASES:
        p = cut(proj, r_k, r_v, bits)
        truth = forced_logits(to_dtype(model, torch.float32), p, "reference", prompt, follow).log_softmax(-1)
        to_dtype(model, torch.bfloat16)
        runs = {b: forced_logits(model, p, b, prompt, follow).log_softmax(-1)
                for b in ("reference", "triton")}
        kl = {b: float((truth.exp() * (truth - lp)).sum(-1).mean()) for b, lp in runs.items()}
        agree = {b: float((lp.argmax(-1) == truth.argmax(-1)).float().mean()) for b, lp in runs.items()}
        finite = all(bool(torch.isfinite(x).all()) for x in (truth, *runs.values()))
        bad = not finite or kl["triton"] > args.max_ratio * kl["reference"] + args.kl_floor
        failed |= bad
        print(json.dumps({"r_k": r_k, "r_v": r_v, "bits": bits, "key_mode": "post_rope",
                          "kl_from_fp32": {b: round(v, 5) for b, v in kl.items()},
                          "top1_agree_fp32": {b: round(v, 4) for b, v in agree.items()}, "finite": finite,
                          "result": "FAIL" if bad else "ok"}), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
