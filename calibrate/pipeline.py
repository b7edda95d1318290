"""The calibration pipeline: data → per-layer statistics → bases at allocated ranks → checkpoint.

:class:`CalibrationConfig` is the one source of defaults for the Python API and the CLI.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, fields

import torch
from tqdm.auto import tqdm

from stiefkv.calibrate import allocate
from stiefkv.calibrate.collect import LayerInputs
from stiefkv.calibrate.objective import ErrorStats, compressed_layer_output
from stiefkv.calibrate.pca import SecondMoments, top_eigenvectors
from stiefkv.data import calibration_sequences
from stiefkv.models import arch_of, dims_of, fingerprint, rope_spec
from stiefkv.projections import KEY_MODES, Projections

log = logging.getLogger(__name__)

METHODS = ("pca",)


@dataclass
class CalibrationConfig:
    """Every calibration setting, with its default.

    budget : fraction of the full KV cache kept, in (0, 1].
    method : how bases are found (``pca``).
    key_mode : ``pre_rope`` (keys before RoPE; better) or ``post_rope`` (faster kernels).
    allocation : how ranks are spread over layers (``uniform``).
    data : ``wikitext2``, a .txt/.jsonl file or folder, or ``self``.
    num_sequences, seq_len : size of the calibration set.
    batch_size : sequences per forward pass.
    rank_step : ranks are multiples of this.
    seed : seeds data sampling and every random step.
    """

    budget: float = 0.5
    method: str = "pca"
    key_mode: str = "pre_rope"
    allocation: str = "uniform"
    data: str = "wikitext2"
    num_sequences: int = 64
    seq_len: int = 512
    batch_size: int = 8
    rank_step: int = 8
    seed: int = 0

    def validate(self) -> "CalibrationConfig":
        if not 0 < self.budget <= 1:
            raise ValueError(f"budget must be in (0, 1], got {self.budget}")
        for name, allowed in (("method", METHODS), ("key_mode", KEY_MODES), ("allocation", allocate.ALLOCATIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
        for name in ("num_sequences", "seq_len", "batch_size", "rank_step"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be ≥ 1, got {getattr(self, name)}")
        return self

    @classmethod
    def from_kwargs(cls, **kwargs) -> "CalibrationConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown calibration settings {sorted(unknown)}; known: {sorted(known)}")
        return cls(**kwargs).validate()


def calibrate(model, tokenizer, **settings) -> Projections:
    """Learn low-rank key and value bases for every layer of ``model``.

    Keyword arguments are the fields of :class:`CalibrationConfig` (``budget=``, ``method=``,
    ``key_mode=``, ``allocation=``, ``data=``, ``num_sequences=``, ``seq_len=``, ``seed=``, …).
    Returns :class:`~stiefkv.Projections`; save it with ``.save(path)``.
    """
    cfg = CalibrationConfig.from_kwargs(**settings)
    arch_of(model.config)
    dims = dims_of(model.config)
    t0 = time.perf_counter()
    seqs = calibration_sequences(model, tokenizer, data=cfg.data, num_sequences=cfg.num_sequences,
                                 seq_len=cfg.seq_len, seed=cfg.seed)
    ranks = allocate.uniform(dims.L, cfg.budget, dims.d, cfg.rank_step)
    keys, values, errors = pca_layerwise(model, seqs, ranks, key_mode=cfg.key_mode, batch_size=cfg.batch_size)
    elapsed = time.perf_counter() - t0
    log.info("calibrated %d layers in %.1f s; mean layer error %.4f", dims.L, elapsed,
             sum(e["rel_error"] for e in errors) / len(errors))
    settings = asdict(cfg) | {"tokens": int(seqs.numel()), "seconds": round(elapsed, 1),
                              "model": getattr(model, "stiefkv_spec", None)}
    return Projections(keys=keys, values=values, key_mode=cfg.key_mode, fingerprint=fingerprint(model),
                       budget=cfg.budget, method=cfg.method, settings=settings, errors=errors)


@torch.no_grad()
def pca_layerwise(model, sequences: torch.Tensor, ranks: list[tuple[int, int]], *, key_mode: str,
                  batch_size: int = 8):
    """PCA bases at ``ranks`` for every layer, and each layer's output error with them.

    Layers go one at a time over the held calibration activations; each layer's inputs come from the
    uncompressed layers before it.
    """
    rope = rope_spec(model.config)
    inputs = LayerInputs(model, sequences, batch_size=batch_size)
    keys, values, errors = [], [], []
    for i in tqdm(range(inputs.num_layers), desc="PCA layers", unit="layer"):
        layer = inputs.layers[i]
        target = inputs.run()
        moments = SecondMoments(model, key_mode)
        for batch in inputs.batches():
            moments(batch)
        (rk, rv) = ranks[i]
        P_k, P_v = top_eigenvectors(moments.keys[i], rk), top_eigenvectors(moments.values[i], rv)
        stats = ErrorStats()
        for batch in inputs.batches(target):
            stats.add(compressed_layer_output(layer, batch, P_k.to(target.device), P_v.to(target.device),
                                              key_mode=key_mode, rope=rope), batch.output)
        keys.append(P_k)
        values.append(P_v)
        errors.append({"layer": i} | stats.as_dict())
        inputs.advance(target)
    return keys, values, errors
