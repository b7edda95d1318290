"""Text sources for calibration and evaluation.

``wikitext2`` reads ``wikitext-2/`` (validation for calibration, test for evaluation) from the first of
``$STIEFKV_DATA_DIR``, ``../shared/data`` beside the repository checkout and ``./data`` that holds it, and
falls back to the ``datasets`` library; a ``.txt``/``.jsonl`` file or a folder of them is read as is;
``self`` samples sequences from the model (the data-free fallback). Calibration never reads the test split.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

WIKITEXT_FILES = {"calibration": "wiki.valid.tokens", "test": "wiki.test.raw"}
WIKITEXT_HF = {"calibration": ("wikitext-2-v1", "validation"), "test": ("wikitext-2-raw-v1", "test")}


class DataError(ValueError):
    """Data that cannot be found or read, with what to do."""


def repository_data_dir() -> Path:
    """``../shared/data`` beside the repository checkout this package is installed from (editable install)."""
    return Path(__file__).resolve().parents[2] / "shared" / "data"


def data_dirs() -> list[tuple[str, Path]]:
    """Where local data is looked for, in order, each with how it was chosen."""
    places = []
    value = os.environ.get("STIEFKV_DATA_DIR")
    if value:
        places.append(("$STIEFKV_DATA_DIR", Path(value).expanduser()))
    places.append(("beside the repository checkout", repository_data_dir()))
    places.append(("the working directory", Path.cwd() / "data"))
    return places


def data_dir() -> Path | None:
    """The first of :func:`data_dirs` that exists, None if none does."""
    return next((path for _, path in data_dirs() if path.is_dir()), None)


def _wikitext(split: str) -> str:
    """WikiText-2's ``split``: from the first data folder that holds it, else the ``datasets`` library."""
    name = WIKITEXT_FILES[split]
    local = _local_wikitext(split)
    if local is not None:
        return local.read_text(encoding="utf-8")
    looked = [f"{root / 'wikitext-2' / name} ({how})" for how, root in data_dirs()]
    try:
        import datasets
    except ImportError:
        looked.append("the datasets library (not installed)")
        raise DataError(f"WikiText-2 not found; looked in: {'; '.join(looked)}. Set STIEFKV_DATA_DIR to a "
                        f"folder holding wikitext-2/{name}, or pip install datasets (needs the Hugging Face "
                        "hub)") from None
    hf_name, hf_split = WIKITEXT_HF[split]
    try:
        rows = datasets.load_dataset("wikitext", hf_name, split=hf_split)
    except Exception as exc:  # noqa: BLE001  (the hub raises many types; any failure means the same here)
        looked.append(f"the Hugging Face hub ({type(exc).__name__})")
        raise DataError(f"WikiText-2 not found; looked in: {'; '.join(looked)}. Set STIEFKV_DATA_DIR to a "
                        f"folder holding wikitext-2/{name}") from None
    return "".join(rows["text"])


def _read_file(path: Path) -> list[str]:
    try:
        return _read_texts(path)
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason}); convert it to "
                        "UTF-8") from None


def _read_texts(path: Path) -> list[str]:
    if path.suffix == ".txt":
        return [path.read_text(encoding="utf-8-sig")]  # an editor's byte-order mark is not text
    if path.suffix == ".jsonl":
        texts = []
        with path.open(encoding="utf-8-sig") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    text = row["text"] if isinstance(row, dict) else row
                except (json.JSONDecodeError, KeyError):
                    raise DataError(f"{path}:{n}: expected a JSON object with a 'text' field") from None
                if not isinstance(text, str):
                    raise DataError(f"{path}:{n}: 'text' must be a string, got {type(text).__name__}")
                texts.append(text)
        return texts
    raise DataError(f"{path}: data files must be .txt or .jsonl")


def _local_wikitext(split: str) -> Path | None:
    """WikiText-2's ``split`` file in the first data folder that holds it, None if none does."""
    name = WIKITEXT_FILES[split]
    return next((p for _, root in data_dirs() if (p := root / "wikitext-2" / name).is_file()), None)


def _data_files(spec: str) -> list[Path]:
    """The .txt/.jsonl files a data spec that is a file or a folder names (a folder's sorted), or the
    :class:`DataError` that says what is wrong with it."""
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix not in (".txt", ".jsonl"):
            raise DataError(f"{path}: data files must be .txt or .jsonl")
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".jsonl") and p.is_file())
        if not files:
            raise DataError(f"folder {path} holds no .txt or .jsonl files")
        return files
    raise DataError(f"data {spec!r} is not 'wikitext2', 'self', nor an existing .txt/.jsonl file or folder")


def check_data(spec: str, split: str = "calibration") -> None:
    """Refuse a data spec :func:`load_texts` would refuse, without reading it: run before a model loads, so
    a typo in ``--data`` costs no load. WikiText-2 is found locally or left to the ``datasets`` library (the
    hub is not asked here)."""
    if spec == "self" and split != "calibration":
        raise DataError("--data self samples calibration text from the model itself; evaluation scores test "
                        "text: give wikitext2, or a .txt/.jsonl file or folder")
    if spec == "self":
        return
    if spec == "wikitext2":
        if _local_wikitext(split) is None and importlib.util.find_spec("datasets") is None:
            _wikitext(split)  # raises, naming every place it looked
        return
    _data_files(spec)


def load_texts(spec: str, split: str = "calibration") -> list[str]:
    """Documents of a data spec (``wikitext2``, a file or a folder); ``self`` is handled by the caller."""
    if split not in WIKITEXT_FILES:
        raise ValueError(f"split must be one of {tuple(WIKITEXT_FILES)}, got {split!r}")
    if spec == "wikitext2":
        return [_wikitext(split)]
    return [text for f in _data_files(spec) for text in _read_file(f)]


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All documents tokenized once and joined, ``[T]`` int64 (separated by EOS)."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    for text in texts:
        if ids and eos is not None:
            ids.append(eos)
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
    return torch.tensor(ids, dtype=torch.long)


def check_vocabulary(model, ids: torch.Tensor, data: str) -> None:
    """Refuse token ids ``[S, N]`` of ``data`` that ``model`` has no embedding for (a tokenizer that is not
    the model's own): one line before the work, not an ``IndexError`` from the embedding in its first
    forward. One pass over the ids."""
    from stiefkv.models import check_token_ids

    try:
        check_token_ids(model, ids, f"the tokenizer's ids of data {data!r}")
    except ValueError as exc:
        raise DataError(f"{exc}: give the model's own tokenizer") from None


def windows(stream: torch.Tensor, length: int) -> torch.Tensor:
    """Non-overlapping windows ``[W, length]`` (the tail shorter than ``length`` is dropped)."""
    n = stream.numel() // length
    return stream[: n * length].view(n, length)


def calibration_sequences(model, tokenizer, *, data: str = "wikitext2", num_sequences: int = 64,
                          seq_len: int = 512, seed: int = 0) -> torch.Tensor:
    """``[num_sequences, seq_len]`` token ids for calibration, drawn reproducibly from ``data``."""
    if num_sequences < 1 or seq_len < 2:
        raise ValueError(f"need num_sequences ≥ 1 and seq_len ≥ 2, got {num_sequences} and {seq_len}")
    if data == "self":
        return sample_from_model(model, tokenizer, num_sequences=num_sequences, seq_len=seq_len, seed=seed)
    pool = windows(token_stream(tokenizer, load_texts(data, "calibration")), seq_len)
    if len(pool) < num_sequences:
        raise DataError(f"data {data!r} gives only {len(pool)} sequences of {seq_len} tokens; "
                        f"asked for {num_sequences}: lower --num-sequences or --seq-len, or add text")
    g = torch.Generator().manual_seed(seed)
    seqs = pool[torch.randperm(len(pool), generator=g)[:num_sequences].sort().values]
    check_vocabulary(model, seqs, data)
    return seqs


@torch.no_grad()
def sample_from_model(model, tokenizer, *, num_sequences: int, seq_len: int, seed: int = 0,
                      batch_size: int = 16) -> torch.Tensor:
    """Sequences sampled from the model itself, starting at BOS (the data-free calibration set)."""
    log.warning("calibrating on %d × %d tokens sampled from the model itself (--data self)", num_sequences,
                seq_len)
    start = start_token(model, tokenizer)
    device = next(model.parameters()).device
    torch.manual_seed(seed)
    out = []
    for i in range(0, num_sequences, batch_size):
        n = min(batch_size, num_sequences - i)
        prompt = torch.full((n, 1), start, dtype=torch.long, device=device)
        seqs = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, top_k=0,
                              temperature=1.0, max_new_tokens=seq_len - 1, min_new_tokens=seq_len - 1,
                              pad_token_id=tokenizer.pad_token_id)
        out.append(seqs[:, :seq_len].cpu())
    return torch.cat(out)


def start_token(model, tokenizer) -> int:
    """The token sampled sequences start at: the tokenizer's BOS, else its EOS, else the BOS, then the EOS,
    of the model's generation config or config (a tokenizer may name neither where the model does); a
    :class:`DataError` where none does, or the one found is outside the model's vocabulary."""
    names = ("bos_token_id", "eos_token_id")
    found = [getattr(tokenizer, name, None) for name in names]
    found += [getattr(source, name, None) for name in names
              for source in (getattr(model, "generation_config", None), model.config)]
    ids = [t[0] if isinstance(t, (list, tuple)) and t else t for t in found]  # several end tokens: the first
    start = next((t for t in ids if isinstance(t, int) and not isinstance(t, bool)), None)
    if start is None:
        raise DataError("--data self starts every sample at a BOS or EOS token, and neither the tokenizer "
                        "nor the model's config names one: give calibration text (--data wikitext2, a file "
                        "or a folder)")
    vocab = getattr(model.config, "vocab_size", None)
    if vocab is not None and not 0 <= start < vocab:
        raise DataError(f"--data self starts every sample at token {start} (BOS or EOS), outside the model's "
                        f"vocabulary [0, {vocab}): give the model's own tokenizer, or calibration text")
    return start
