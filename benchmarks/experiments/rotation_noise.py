"""The quantization error of latents stored per token: unturned PCA basis, the Hadamard/DCT start, and the
rotation ``stiefkv.calibrate.rotation.learn_rotation`` learns from it, on a real model's keys and values.

PCA bases from the first sequences; rotations fitted on those and judged on the last one (as the pipeline
does); errors are relative to the Hadamard start's, on sequences that neither basis nor rotation saw.
Prints one line per layer, latent and rank; no rows are written (see README.md).

    python benchmarks/experiments/rotation_noise.py smollm2 --layers 2,10,20,28 --ranks 64,32
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--layers", default="2,10,20,28")
    ap.add_argument("--ranks", default="64,32")
    ap.add_argument("--bits", default="2,4")
    ap.add_argument("--sequences", type=int, default=6, help="4 fit the basis and rotation, 2 test them")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    import stiefkv
    from stiefkv.calibrate.profile import spreading_rotation
    from stiefkv.calibrate.rotation import learn_rotation, quant_error
    from stiefkv.data import calibration_sequences
    from stiefkv.models import decoder_layers, dims_of
    from stiefkv.quant import QuantSpec

    model, tok = stiefkv.load_model(args.model, device=args.device)
    dims = dims_of(model.config)
    seqs = calibration_sequences(model, tok, data="wikitext2", num_sequences=args.sequences,
                                 seq_len=args.seq_len, seed=0).to(args.device)
    layers = [int(x) for x in args.layers.split(",")]
    acts: dict[tuple[int, str], torch.Tensor] = {}
    for i in layers:
        for name in ("k_proj", "v_proj"):  # keys before RoPE, as pre_rope compresses them
            def hook(mod, inp, out, key=(i, name)):
                acts[key] = out.detach().float()
            getattr(decoder_layers(model)[i].self_attn, name).register_forward_hook(hook)
    with torch.no_grad():
        model(seqs, use_cache=False)
    fit_n = args.sequences - 2
    for (i, name), out in sorted(acts.items()):
        x = out.view(args.sequences, args.seq_len, dims.G, dims.d).transpose(1, 2)
        fit, test = x[:fit_n], x[fit_n:]
        _, U = torch.linalg.eigh(torch.einsum("bgnd,bgne->gde", fit, fit))
        U = U.flip(-1)
        for r in (int(v) for v in args.ranks.split(",")):
            P = U[..., :r] @ spreading_rotation(r).to(x.device)
            cells = []
            for bits in (int(b) for b in args.bits.split(",")):
                spec = QuantSpec(bits, "token")
                t0 = time.perf_counter()
                res = learn_rotation(torch.matmul(fit, P), spec)
                seconds = time.perf_counter() - t0
                z = torch.matmul(test, P)
                start = float(quant_error(z, spec).sum())
                plain = float(quant_error(torch.matmul(test, U[..., :r]), spec).sum())
                learned = float(quant_error(torch.matmul(z, res.R), spec).sum())
                cells.append(f"int{bits}: unturned {plain / start:.2f}, learned {learned / start:.3f} "
                             f"({seconds:.1f} s)")
            print(f"layer {i:2d} {name} r {r}: error / Hadamard's — " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
