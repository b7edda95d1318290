"""Helpers shared by the tests: a comparator that explains itself and never lets NaN through, a stand-in
tokenizer, and a tiny model saved as a real Hugging Face folder (for the CLI, offline)."""

from pathlib import Path

import torch

# (atol, rtol) per dtype for results computed in fp32 internally and returned in that dtype.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float | None = None,
                 rtol: float | None = None, what: str = "") -> None:
    """Fail with the worst element and its index; NaN or inf anywhere in either tensor fails."""
    if atol is None or rtol is None:
        atol_d, rtol_d = TOLERANCES.get(actual.dtype, TOLERANCES[torch.float32])
        atol = atol_d if atol is None else atol
        rtol = rtol_d if rtol is None else rtol
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    a, e = actual.detach().float().cpu(), expected.detach().float().cpu()
    for name, t in (("actual", a), ("expected", e)):
        bad = (~torch.isfinite(t)).sum().item()
        assert bad == 0, f"{what}: {name} has {bad} non-finite values"
    err = (a - e).abs()
    bound = atol + rtol * e.abs()
    bad = err > bound
    if bad.any():
        idx = torch.nonzero(bad)[0].tolist()
        worst = int(torch.argmax(err - bound))
        raise AssertionError(
            f"{what}: {bad.sum().item()}/{bad.numel()} elements off (atol={atol}, rtol={rtol}); "
            f"first at {idx}: {a[tuple(idx)].item():.6g} vs {e[tuple(idx)].item():.6g}; "
            f"max abs err {err.flatten()[worst].item():.3g}"
        )


class CharTokenizer:
    """A stand-in tokenizer: one id per character (mod the tiny vocabulary)."""

    eos_token_id = 2
    bos_token_id = 1
    pad_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 90 for c in text]}


def corpus_text(sentences: int = 400) -> str:
    return " ".join(f"sentence {i} about the topic {i % 7}." for i in range(sentences))


def save_tiny_model(folder: Path, model=None) -> Path:
    """A tiny random model with a character-level tokenizer saved as a Hugging Face folder, loadable by
    ``stiefkv.load_model(str(folder))`` without the network."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.tiny import tiny_model

    model = tiny_model() if model is None else model
    model.save_pretrained(folder)
    chars = [chr(c) for c in range(32, 127)][: model.config.vocab_size - 3]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {c: i + 3 for i, c in enumerate(chars)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                  eos_token="</s>")
    tok.save_pretrained(folder)
    return folder


def greedy_by_backend(model, proj, x: torch.Tensor, new_tokens: int = 12) -> dict[str, torch.Tensor]:
    """Greedy ``generate`` of ``model`` served with ``proj`` by the Triton kernels and by the PyTorch
    reference, from the same prompt ``x``: ``{"triton": tokens, "reference": tokens}``."""
    import stiefkv

    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    outs = {}
    for backend in ("triton", "reference"):
        stiefkv.load(model, proj, backend=backend)
        outs[backend] = model.generate(x, attention_mask=torch.ones_like(x), **kw)
    return outs


def compiles_for_the_gpu(script: str) -> None:
    """Run ``script`` (it compiles kernels with ``triton.compile`` for a GPU target and prints "compiled")
    in a fresh process without ``TRITON_INTERPRET`` and with a fresh cache directory, so that it really
    compiles; skip where this triton has no NVIDIA backend."""
    import os
    import subprocess
    import sys
    import tempfile

    import pytest

    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError:
        pytest.skip("this triton has no NVIDIA backend to compile with")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with tempfile.TemporaryDirectory() as cache:
        env["TRITON_CACHE_DIR"] = cache
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                              timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def save_tiny_gguf(path: Path, architecture: str = "llama") -> Path:
    """A one-layer random model of ``architecture`` (``llama``, or ``phi3`` with its fused QKV and gate-up
    weights) with a 16-token tokenizer, written as a float32 GGUF file that transformers converts."""
    import gguf
    import numpy as np

    V, D, F, H, G = 16, 8, 12, 2, 1
    d = D // H
    rng = np.random.default_rng(0)

    def weight(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    w = gguf.GGUFWriter(str(path), architecture)
    w.add_name("tiny")
    w.add_context_length(64)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_block_count(1)
    w.add_head_count(H)
    w.add_head_count_kv(G)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(d)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(V - 3)])
    w.add_token_scores([0.0] * V)
    w.add_token_types([2, 3, 3] + [1] * (V - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(0)
    layer = {"attn_output": weight(D, D), "ffn_down": weight(D, F), "attn_norm": np.ones(D, np.float32),
             "ffn_norm": np.ones(D, np.float32)}
    if architecture == "phi3":
        layer |= {"attn_qkv": weight(D + 2 * G * d, D), "ffn_up": weight(2 * F, D)}
    else:
        layer |= {"attn_q": weight(D, D), "attn_k": weight(G * d, D), "attn_v": weight(G * d, D),
                  "ffn_up": weight(F, D), "ffn_gate": weight(F, D)}
    tensors = {"token_embd.weight": weight(V, D), "output_norm.weight": np.ones(D, np.float32),
               "output.weight": weight(V, D)} | {f"blk.0.{k}.weight": v for k, v in layer.items()}
    for name, tensor in tensors.items():
        w.add_tensor(name, tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
