"""The projection checkpoint: per-layer key and value bases plus provenance, in one safetensors file.

Tensors ``layers.{i}.k`` ``[G, d, r_k]`` and ``layers.{i}.v`` ``[G, d, r_v]`` (float32); the header
metadata key ``stiefkv`` holds a JSON document (format version, key mode, budget, ranks, the model's
fingerprint, method and settings, per-layer errors). Written atomically; no pickle.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

FORMAT_VERSION = 1
KEY_MODES = ("pre_rope", "post_rope")
# The checkpoint a compressed model's save_pretrained writes into its folder; load_model applies it.
PROJECTIONS_FILE = "stiefkv_projections.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit the model."""


@dataclass
class Projections:
    """Low-rank bases for every layer of one model.

    Attributes
    ----------
    keys, values : per layer ``[G, d, r_k]`` / ``[G, d, r_v]`` float32 with orthonormal columns.
    key_mode : ``"pre_rope"`` or ``"post_rope"``.
    fingerprint : what the model must match (see :func:`stiefkv.models.fingerprint`).
    budget : requested fraction of the full KV cache.
    method, settings : how the bases were made (data, tokens, steps, seed, loss, …).
    errors : per layer ``{"rel_error": …, "cosine": …}`` on calibration data.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    key_mode: str
    fingerprint: dict
    budget: float
    method: str = "pca"
    settings: dict = field(default_factory=dict)
    errors: list[dict] = field(default_factory=list)

    def __post_init__(self):
        if self.key_mode not in KEY_MODES:
            raise CheckpointError(f"key_mode must be one of {KEY_MODES}, got {self.key_mode!r}")
        if len(self.keys) != len(self.values):
            raise CheckpointError(f"{len(self.keys)} key bases but {len(self.values)} value bases")

    @property
    def ranks(self) -> list[tuple[int, int]]:
        """``(r_k, r_v)`` per layer."""
        return [(int(k.shape[-1]), int(v.shape[-1])) for k, v in zip(self.keys, self.values)]

    @property
    def achieved_budget(self) -> float:
        """``Σ (r_k + r_v) / (L · 2d)``: the fraction of the full cache actually kept."""
        d = self.keys[0].shape[1]
        return sum(rk + rv for rk, rv in self.ranks) / (len(self.keys) * 2 * d)

    def header(self) -> dict:
        return {
            "format_version": FORMAT_VERSION,
            "key_mode": self.key_mode,
            "budget": self.budget,
            "achieved_budget": self.achieved_budget,
            "ranks": [list(r) for r in self.ranks],
            "fingerprint": self.fingerprint,
            "method": self.method,
            "settings": self.settings,
            "errors": self.errors,
        }

    def save(self, path: str | Path) -> Path:
        """Write atomically (a temporary file beside ``path``, then a rename)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            tensors[f"layers.{i}.k"] = k.detach().to("cpu", torch.float32).contiguous()
            tensors[f"layers.{i}.v"] = v.detach().to("cpu", torch.float32).contiguous()
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            save_file(tensors, str(tmp), metadata={"stiefkv": json.dumps(self.header())})
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Projections":
        """Read a checkpoint; a missing, foreign or corrupt file raises :class:`CheckpointError`."""
        from safetensors import SafetensorError, safe_open

        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"checkpoint {path} does not exist")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except (SafetensorError, OSError, ValueError) as exc:
            raise CheckpointError(f"{path} is not a readable safetensors file ({exc})") from None
        if "stiefkv" not in meta:
            raise CheckpointError(f"{path} is a safetensors file but not a StiefKV checkpoint (no 'stiefkv' header)")
        try:
            doc = json.loads(meta["stiefkv"])
            if doc["format_version"] > FORMAT_VERSION:
                raise CheckpointError(
                    f"{path} has format version {doc['format_version']}; this StiefKV reads up to "
                    f"{FORMAT_VERSION}: upgrade stiefkv"
                )
            n = len(doc["ranks"])
            keys = [tensors[f"layers.{i}.k"] for i in range(n)]
            values = [tensors[f"layers.{i}.v"] for i in range(n)]
            proj = cls(keys=keys, values=values, key_mode=doc["key_mode"], fingerprint=doc["fingerprint"],
                       budget=doc["budget"], method=doc.get("method", "?"), settings=doc.get("settings", {}),
                       errors=doc.get("errors", []))
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path} has a damaged StiefKV header or is missing tensors ({exc!r})") from None
        if [list(r) for r in proj.ranks] != doc["ranks"]:
            raise CheckpointError(f"{path}: tensor shapes disagree with the ranks in its header")
        return proj

    def check(self, model) -> None:
        """Raise :class:`CheckpointError` naming every difference between this checkpoint and ``model``."""
        from stiefkv.models import fingerprint

        mine, theirs = self.fingerprint, fingerprint(model)
        diffs = [f"{key}: checkpoint {mine.get(key)!r}, model {theirs.get(key)!r}"
                 for key in ("architecture", "L", "H", "G", "d", "D", "rope") if mine.get(key) != theirs.get(key)]
        if not diffs and mine.get("kv_weights_sha256") != theirs.get("kv_weights_sha256"):
            diffs.append("same shapes but different k_proj/v_proj weights (another checkpoint of this architecture?)")
        if diffs:
            raise CheckpointError(
                "this checkpoint was made for another model — " + "; ".join(diffs)
                + ". Calibrate one for this model with `stiefkv calibrate`."
            )
        G, d = theirs["G"], theirs["d"]
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k.shape[:2] != (G, d) or v.shape[:2] != (G, d):
                raise CheckpointError(f"layer {i}: bases {tuple(k.shape)}/{tuple(v.shape)} do not fit G={G}, d={d}")
