"""Tiny random models of every supported architecture, and random bases for them (no downloads)."""

import torch

import stiefkv
from stiefkv.models import dims_of, fingerprint, transformers_major

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]


def tiny_config(arch: str = "llama", *, heads: int = 6, kv_heads: int = 2, head_dim: int = 24,
                layers: int = 2, rope_parameters: dict | None = None):
    from transformers import AutoConfig

    kwargs = dict(vocab_size=97, hidden_size=48, intermediate_size=56, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  max_position_embeddings=512, tie_word_embeddings=False)
    if arch == "mistral":
        kwargs["sliding_window"] = None
    if arch == "qwen2":
        kwargs["use_sliding_window"] = False
    config = AutoConfig.for_model(arch, **kwargs)
    if rope_parameters is not None and transformers_major() >= 5:
        config.rope_parameters = rope_parameters
    elif rope_parameters is not None:  # transformers 4 keeps the base apart from the scaling
        scaling = dict(rope_parameters)
        config.rope_theta = scaling.pop("rope_theta")
        config.rope_scaling = scaling
    return config


def tiny_model(arch: str = "llama", dtype=torch.float32, **kwargs):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    config = tiny_config(arch, **kwargs)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    # Random init is too tame to exercise the attention: widen the q/k weights so softmax is peaked.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return model.eval()


def random_bases(G: int, d: int, r: int, generator=None) -> torch.Tensor:
    """``[G, d, r]`` with orthonormal columns."""
    a = torch.randn(G, d, r, generator=generator, dtype=torch.float64)
    return torch.linalg.qr(a)[0].float()


def random_projections(model, rk: int, rv: int, key_mode: str = "pre_rope",
                       seed: int = 0, shared: bool = False) -> stiefkv.Projections:
    """Random orthonormal bases: ``[G, d, r]`` a layer, or with ``shared`` one ``[1, G·d, r]`` for all its KV
    heads (``rk``, ``rv`` then the shared latents' ranks)."""
    dims = dims_of(model.config)
    g = torch.Generator().manual_seed(seed)
    heads, width = (1, dims.G * dims.d) if shared else (dims.G, dims.d)
    keys = [random_bases(heads, width, rk, g) for _ in range(dims.L)]
    values = [random_bases(heads, width, rv, g) for _ in range(dims.L)]
    return stiefkv.Projections(keys=keys, values=values, key_mode=key_mode, fingerprint=fingerprint(model),
                               budget=(rk + rv) / (2 * dims.d), method="random")


def tiny_tokenizer(vocab: int = 97):
    """A word-level tokenizer over ``vocab`` tokens ``t0 … t{vocab-1}`` (``t0`` is EOS and padding)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    backend = Tokenizer(models.WordLevel(words, unk_token="t1"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="t0", pad_token="t0", unk_token="t1")
    tok.padding_side = "left"
    return tok
