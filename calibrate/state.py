"""Calibration progress on disk, so that an interrupted run resumes where it stopped.

One safetensors file beside the output (``OUTPUT.partial``): the PCA eigenvectors and error–rank
profiles of the first pass, the ranks, and the bases and errors of every finished layer, with the
settings and model fingerprint they belong to. Written atomically after every layer of both passes.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from stiefkv.models import same_model
from stiefkv.projections import safetensors_writer, write_atomically

log = logging.getLogger(__name__)

STATE_FIELDS = ("settings", "fingerprint", "profiles", "ranks", "errors", "refine")


# settings that change memory or speed, not the result: a resumed run may take others (after running out of
# memory, a smaller batch)
RESUMABLE_CHANGES = ("batch_size",)


@dataclass
class CalibrationState:
    settings: dict
    fingerprint: dict
    eig_k: list[torch.Tensor] = field(default_factory=list)  # per layer [G, d, d], leading first
    eig_v: list[torch.Tensor] = field(default_factory=list)
    profiles: list[dict] = field(default_factory=list)
    ranks: list[tuple[int, int]] = field(default_factory=list)
    quant: list[list[str]] = field(default_factory=list)  # per layer [key, value] storage; empty: bf16
    keys: list[torch.Tensor] = field(default_factory=list)  # finished layers, in order
    values: list[torch.Tensor] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    refine: list[dict] = field(default_factory=list)
    earlier: float = 0.0  # seconds the interrupted runs it continues spent, up to their last save
    started: float = field(default_factory=time.perf_counter, repr=False)  # this run's (not saved)

    @property
    def seconds(self) -> float:
        """Seconds spent on this calibration: the earlier runs' and this one's so far."""
        return self.earlier + time.perf_counter() - self.started

    def save(self, path: Path | None) -> None:
        """Write atomically (a temporary file beside ``path``, then a rename); nothing when ``path`` is
        None."""
        if path is None:
            return
        path = Path(path)
        tensors = {}
        for name in ("eig_k", "eig_v", "keys", "values"):
            for i, t in enumerate(getattr(self, name)):
                # clone: a full-rank basis may share storage with its eigenvectors; safetensors refuses that
                tensors[f"{name}.{i}"] = t.detach().to("cpu", torch.float32).clone(
                    memory_format=torch.contiguous_format)
        doc = {"settings": self.settings, "fingerprint": self.fingerprint, "profiles": self.profiles,
               "ranks": [list(r) for r in self.ranks], "quant": self.quant, "errors": self.errors,
               "refine": self.refine, "seconds": round(self.seconds, 1),
               "counts": {name: len(getattr(self, name)) for name in ("eig_k", "eig_v", "keys", "values")}}
        text = json.dumps(doc)
        write_atomically(path, safetensors_writer(tensors, {"stiefkv_state": text}), "the progress file")

    @classmethod
    def load(cls, path: Path, settings: dict, fingerprint: dict, like=None) -> CalibrationState:
        """The saved state if it belongs to these settings and this model; a ``ValueError`` naming why not.
        ``like``: the model's fingerprint taken as a stored one was (``functools.partial(fingerprint_like,
        model)``), so that a file written before fingerprints covered the k/v biases still resumes."""
        from safetensors import SafetensorError, safe_open

        damaged = (f"{path} is damaged or not a StiefKV progress file ({{}}): delete it to start over "
                   "(or run without --resume)")
        try:
            with safe_open(str(path), framework="pt") as f:
                doc = json.loads((f.metadata() or {})["stiefkv_state"])
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            missing = [k for k in ("counts", *STATE_FIELDS) if k not in doc]
        except (SafetensorError, OSError, RuntimeError, KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(damaged.format(f"{type(exc).__name__}: {exc}")) from None
        if missing:
            raise ValueError(damaged.format(f"no {', '.join(missing)}"))
        counts = doc["counts"]
        if like is not None:
            fingerprint = like(doc["fingerprint"])
        if not same_model(doc["fingerprint"], fingerprint):
            raise ValueError(f"{path} was written for another model; delete it or drop --resume")
        changed = sorted(k for k in set(settings) | set(doc["settings"])
                         if settings.get(k) != doc["settings"].get(k) and k not in RESUMABLE_CHANGES)
        old_file = "parameters_sha256" not in doc["settings"]
        if "parameters_sha256" in changed and (old_file or "dtype" in changed):
            # a progress file from before 2026-12-07 has no such hash; another dtype is said as a setting
            changed.remove("parameters_sha256")
        if "parameters_sha256" in changed:
            raise ValueError(f"{path} was written for another model (its weights differ beyond the keys' and "
                             "values' projections); delete it or drop --resume")
        if "data" in changed and doc["settings"].get("sequences_sha256") == settings.get("sequences_sha256"):
            changed.remove("data")  # the same token ids, the file named another way (./x, an absolute path)
        if changed:
            was = ", ".join(f"{k} {_short(doc['settings'].get(k))} there, {_short(settings.get(k))} now"
                            for k in changed)
            raise ValueError(f"{path} was written with other settings ({was}): rerun with its settings to "
                             "continue it, or delete it to start over")
        state = cls(settings=doc["settings"], fingerprint=doc["fingerprint"], profiles=doc["profiles"],
                    ranks=[tuple(r) for r in doc["ranks"]], quant=doc.get("quant", []), errors=doc["errors"],
                    refine=doc["refine"], earlier=float(doc.get("seconds", 0.0)))
        try:
            for name, n in counts.items():
                setattr(state, name, [tensors[f"{name}.{i}"] for i in range(n)])
        except (KeyError, TypeError) as exc:
            raise ValueError(damaged.format(f"missing tensor {exc}")) from None
        if not all(torch.isfinite(t).all() for name in counts for t in getattr(state, name)):
            raise ValueError(damaged.format("non-finite values"))
        log.info("resuming from %s: %d of the first pass's layers and %d bases done", path, len(state.eig_k),
                 len(state.keys))
        return state


def _short(value) -> str:
    """A setting as a message shows it: digests and long paths cut to their start."""
    text = str(value)
    return text if len(text) <= 24 else text[:12] + "…"
