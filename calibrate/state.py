"""Calibration progress on disk, so that an interrupted run resumes where it stopped.

One safetensors file beside the output (``OUTPUT.partial``): the PCA eigenvectors and error–rank
profiles of the first pass, the ranks, and the bases and errors of every finished layer, with the
settings and model fingerprint they belong to. Written atomically after each step.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger(__name__)


@dataclass
class CalibrationState:
    settings: dict
    fingerprint: dict
    eig_k: list[torch.Tensor] = field(default_factory=list)  # per layer [G, d, d], leading first
    eig_v: list[torch.Tensor] = field(default_factory=list)
    profiles: list[dict] = field(default_factory=list)
    ranks: list[tuple[int, int]] = field(default_factory=list)
    keys: list[torch.Tensor] = field(default_factory=list)  # finished layers, in order
    values: list[torch.Tensor] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    refine: list[dict] = field(default_factory=list)

    def save(self, path: Path | None) -> None:
        if path is None:
            return
        from safetensors.torch import save_file

        tensors = {}
        for name in ("eig_k", "eig_v", "keys", "values"):
            for i, t in enumerate(getattr(self, name)):
                tensors[f"{name}.{i}"] = t.detach().to("cpu", torch.float32).contiguous()
        doc = {"settings": self.settings, "fingerprint": self.fingerprint, "profiles": self.profiles,
               "ranks": [list(r) for r in self.ranks], "errors": self.errors, "refine": self.refine,
               "counts": {name: len(getattr(self, name)) for name in ("eig_k", "eig_v", "keys", "values")}}
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        save_file(tensors, str(tmp), metadata={"stiefkv_state": json.dumps(doc)})
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path, settings: dict, fingerprint: dict) -> "CalibrationState":
        """The saved state if it belongs to these settings and this model; a ``ValueError`` naming why not."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            doc = json.loads(f.metadata()["stiefkv_state"])
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        if doc["fingerprint"] != fingerprint:
            raise ValueError(f"{path} was written for another model; delete it or drop --resume")
        changed = sorted(k for k in set(settings) | set(doc["settings"])
                         if settings.get(k) != doc["settings"].get(k))
        if changed:
            raise ValueError(f"{path} was written with other settings ({', '.join(changed)}); "
                             "use the same settings, or delete it to start over")
        state = cls(settings=doc["settings"], fingerprint=doc["fingerprint"], profiles=doc["profiles"],
                    ranks=[tuple(r) for r in doc["ranks"]], errors=doc["errors"], refine=doc["refine"])
        for name, n in doc["counts"].items():
            setattr(state, name, [tensors[f"{name}.{i}"] for i in range(n)])
        log.info("resuming from %s: %d layers finished", path, len(state.keys))
        return state
