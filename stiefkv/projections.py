"""The projection checkpoint: per-layer key and value bases plus provenance, in one safetensors file.

Tensors ``layers.{i}.k`` ``[G, d, r_k]`` and ``layers.{i}.v`` ``[G, d, r_v]`` (float32), or from version 8
``[1, G·d, r]`` for a basis the layer's KV heads share (one latent a token; ``docs/notes/grouped-heads.md``);
the header
metadata key ``stiefkv`` holds a JSON document (format version, key mode, budget, ranks, the model's
fingerprint, method and settings, per-layer errors, from version 2 a sha256 of the tensor data, and from
version 3 how each layer's key and value latents are stored: ``"quant": [["int4-channel", "bf16"], …]``).
A checkpoint whose latents are all bf16 is written as version 2, so older readers still take it.
Written atomically; no pickle. Loading checks everything a reader relies on: the header's types, the
layer count against the fingerprint, each basis's shape, rank, finiteness and orthonormality, and the
checksum — a damaged or edited file is refused with what is wrong, never served.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from stiefkv.quant import FLOAT, POSITION_BYTES, REFERENCE_CONTEXT, QuantSpec

log = logging.getLogger(__name__)

# 2 adds "tensors_sha256", 3 "quant", 4 least-squared-error encoders ("int2-token-mse"), 5 exact recent tokens
# ("int4-token-r64"), 6 log8 scales ("int2-token-log8-r16"), 7 exact tokens held in int8
# ("int2-channel-r16-w8"), 8 bases shared by a layer's KV heads ([1, G·d, r]), 9 key modes per layer, 10 a
# fingerprint whose k/v hashes cover the k_proj/v_proj biases (models that have them); each file is written
# at the lowest version that holds it, so older StiefKV reads what it can; version 1 files load with a
# warning
FORMAT_VERSION = 10
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10)
# in a fingerprint whose hashes and samples cover the k/v biases (version 10; stiefkv.models.fingerprint
# writes it for models that have them); a checkpoint without it is compared on the weights, as it was written
KV_BIASES = "kv_biases"
KEY_MODES = ("pre_rope", "post_rope")
# The checkpoint a compressed model's save_pretrained writes into its folder; load_model applies it.
PROJECTIONS_FILE = "stiefkv_projections.safetensors"
# max |PᵀP − I| allowed for a float32 basis: QR/eigh bases and the Stiefel retraction stay below 1e-5; a
# damaged or scaled basis is far above.
ORTHONORMALITY_TOLERANCE = 1e-3


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or does not fit the model."""


def tensors_sha256(keys: list[torch.Tensor], values: list[torch.Tensor]) -> str:
    """sha256 of the bases' float32 bytes (little-endian, C order) in the fixed order ``layers.0.k,
    layers.0.v, layers.1.k, …``."""
    h = hashlib.sha256()
    for k, v in zip(keys, values):
        for t in (k, v):
            # little-endian float32, as safetensors stores them, whatever the machine's byte order
            h.update(t.detach().to("cpu", torch.float32).numpy().astype("<f4", copy=False).tobytes())
    return h.hexdigest()


def _spec(q) -> QuantSpec:
    """A storage spec as given: a :class:`QuantSpec`, or its text (``"int4-token"``, ``"bf16"``)."""
    if isinstance(q, QuantSpec):
        return q
    if isinstance(q, str):
        try:
            return QuantSpec.parse(q)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
    raise CheckpointError(f"a storage spec is a QuantSpec or its text (e.g. 'int4-token'), got "
                          f"{type(q).__name__}")


def header_sha256(doc: dict) -> str:
    """sha256 of a header's JSON without its own hash (keys sorted): key mode, storage, ranks, budget and
    the rest are what the bases are read as, so an edit of them is damage too."""
    rest = {k: v for k, v in doc.items() if k != "header_sha256"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def orthonormality_error(P: torch.Tensor) -> float:
    """``max |PᵀP − I|`` over every head of ``P`` ``[G, d, r]``, computed in float64."""
    P = P.detach().to("cpu", torch.float64)
    eye = torch.eye(P.shape[-1], dtype=P.dtype)
    return float((P.transpose(-1, -2) @ P - eye).abs().max())


def honour_umask(path: Path) -> None:
    """Give a file written through a private temporary (safetensors creates them 0600) the usual mode."""
    os.chmod(path, 0o666 & ~current_umask())


def ensure_writable(path: str | Path, what: str = "output") -> Path:
    """Check that ``path`` can be created — before any work, so that a bad output location fails in a
    second, not after the calibration. Nothing is left behind: missing folders are not created here (the
    writers create them), the nearest existing one is probed with a temporary file instead.

    Raises ``ValueError`` naming ``what`` and ``path`` when it is a folder or cannot be written.
    """
    import tempfile

    path = Path(path).expanduser()
    if path.is_dir():
        raise ValueError(f"{what} {path} is a folder: give a file name")
    folder = path.absolute().parent
    while not os.path.lexists(folder) and folder != folder.parent:  # a dangling link stops the walk too
        folder = folder.parent
    try:
        if not folder.is_dir():  # a file where a folder of the path should be
            raise NotADirectoryError(20, "Not a directory", str(folder))
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".stiefkv-", suffix=".probe")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename else ""
        why = exc.strerror or type(exc).__name__
        raise ValueError(f"cannot write {what} {path} ({why}{where}): choose a writable location") from None
    return path


def safetensors_writer(tensors: dict, metadata: dict):
    """A writer for :func:`write_atomically` of ``tensors`` as one safetensors file: the bytes are made
    first and written as they are, to the temporary file or in place into a device or pipe
    (``safetensors.torch.save_file`` renames a temporary file of its own over its target: over
    ``/dev/null`` it made a regular file)."""
    from safetensors.torch import save

    data = save(tensors, metadata=metadata)

    def write(target) -> None:
        with open(target, "wb") as f:
            f.write(data)
    return write


def write_atomically(path: str | Path, write, what: str = "file") -> Path:
    """``write(tmp)`` a temporary file beside ``path``, then rename it over ``path``, so that a failed write
    (a full disk, a size limit) leaves what was there. A link is followed (its target is replaced, the link
    kept), an existing file keeps its mode, and a target that is not a regular file (``/dev/stdout``, a pipe)
    is written in place. A failure is an ``OSError`` naming ``path`` (not the temporary file) and the
    reason; the temporary name is short, so any legal name can be written."""
    import stat
    import tempfile

    path = Path(path).expanduser()
    if path.is_dir():
        raise IsADirectoryError(21, f"cannot write {what} {path}: it is a folder; give a file name")
    target = Path(os.path.realpath(path))
    tmp = None
    try:
        if target.exists() and not target.is_file():  # a device or a pipe: nothing to replace atomically
            write(target)
            return path
        mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else None
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=target.parent, prefix=".stiefkv-", suffix=".tmp")
        os.close(fd)
        tmp = Path(name)
        write(tmp)
        if mode is None:
            honour_umask(tmp)
        else:
            os.chmod(tmp, mode)
        os.replace(tmp, target)
    except Exception as exc:
        if isinstance(exc, OSError) or type(exc).__name__ == "SafetensorError":
            reason = getattr(exc, "strerror", None) or str(exc)
            if tmp is not None:
                reason = reason.replace(str(tmp), "").strip(" :")
            raise OSError(getattr(exc, "errno", None) or 5, f"cannot write {what} {path}: {reason}") from None
        raise
    finally:
        if tmp is not None:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
    return path


def current_umask() -> int:
    try:  # Linux reports it without changing it
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(eq=False)  # lists of tensors have no truth value: compare checkpoints by header_sha256
class Projections:
    """Low-rank bases for every layer of one model.

    Attributes
    ----------
    keys, values : per layer ``[G, d, r_k]`` / ``[G, d, r_v]`` float32 with orthonormal columns, or
        ``[1, G·d, r]``: one basis (and one latent a token) shared by the layer's KV heads.
    key_mode : ``"pre_rope"`` or ``"post_rope"``: every layer's, unless ``layer_key_modes`` says otherwise.
    fingerprint : what the model must match (see :func:`stiefkv.models.fingerprint`).
    budget : requested fraction of the full KV cache.
    method, settings : how the bases were made (data, tokens, steps, seed, loss, …).
    errors : per layer ``{"rel_error": …, "cosine": …}`` on calibration data.
    quant : per layer ``(key spec, value spec)``, how the cache stores each latent
        (:class:`~stiefkv.quant.QuantSpec`); None (the default) keeps every latent in bf16.
    layer_key_modes : per layer ``"pre_rope"`` or ``"post_rope"``, where layers differ (``calibrate
        --key-mode auto``: after RoPE where a layer keeps its keys at full rank); None: ``key_mode`` for all.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    key_mode: str
    fingerprint: dict
    budget: float
    method: str = "pca"
    settings: dict = field(default_factory=dict)
    errors: list[dict] = field(default_factory=list)
    quant: list[tuple[QuantSpec, QuantSpec]] | None = None
    layer_key_modes: list[str] | None = None

    def __post_init__(self):
        self._check_fields()

    def _check_fields(self) -> None:
        """Check the fields against each other (key modes, one value basis and one storage pair per key
        basis) and bring them to their plain form (specs parsed, one mode for all layers as ``key_mode``,
        all-bf16 storage as None). Run at construction and again by :meth:`validate`: the fields are plain
        attributes, and may have been edited since."""
        if self.key_mode not in KEY_MODES:
            raise CheckpointError(f"key_mode must be one of {KEY_MODES}, got {self.key_mode!r}")
        if self.layer_key_modes is not None:
            modes = list(self.layer_key_modes)
            if len(modes) != len(self.keys) or any(m not in KEY_MODES for m in modes):
                raise CheckpointError(f"layer_key_modes must give one of {KEY_MODES} for each of the "
                                      f"{len(self.keys)} layers, got {modes!r}")
            self.layer_key_modes = modes
            if len(set(modes)) == 1:  # one mode for every layer is the plain form: key_mode says it
                self.key_mode, self.layer_key_modes = modes[0], None
        if len(self.keys) != len(self.values):
            raise CheckpointError(f"{len(self.keys)} key bases but {len(self.values)} value bases")
        if not self.keys:
            raise CheckpointError("no layers: a checkpoint holds bases for every layer of the model")
        if self.quant is not None:
            if len(self.quant) != len(self.keys):
                raise CheckpointError(f"{len(self.quant)} layers of storage specs for {len(self.keys)} "
                                      "layers")
            if any(isinstance(pair, str) for pair in self.quant):
                raise CheckpointError("quant gives each layer a (key spec, value spec) pair, e.g. "
                                      "[('int4-token', 'int4-token')] * layers; got a string for a layer")
            self.quant = [tuple(_spec(q) for q in pair) for pair in self.quant]
            if any(len(pair) != 2 for pair in self.quant):
                raise CheckpointError("quant gives each layer a (key spec, value spec) pair")
            if not any(q.quantized for pair in self.quant for q in pair):
                self.quant = None  # all bf16: the same as saying nothing

    @property
    def key_modes(self) -> list[str]:
        """Each layer's key mode: how its key latents are made and read."""
        if self.layer_key_modes is not None:
            return list(self.layer_key_modes)
        return [self.key_mode] * len(self.keys)

    @property
    def key_mode_summary(self) -> str:
        """``pre_rope``, ``post_rope``, or per layer e.g. ``post_rope (29 layers), pre_rope (layer 0)``."""
        if self.layer_key_modes is None:
            return self.key_mode
        parts = []
        for mode in KEY_MODES:
            at = [i for i, m in enumerate(self.layer_key_modes) if m == mode]
            if at:
                parts.append(f"{mode} ({len(at)} layers)" if len(at) > 3
                             else f"{mode} (layer{'s' if len(at) > 1 else ''} {', '.join(map(str, at))})")
        return ", ".join(sorted(parts, key=len, reverse=True))

    @property
    def specs(self) -> list[tuple[QuantSpec, QuantSpec]]:
        """``(key, value)`` storage per layer, bf16 where nothing is quantized."""
        return self.quant if self.quant is not None else [(FLOAT, FLOAT)] * len(self.keys)

    @property
    def quantized(self) -> bool:
        return self.quant is not None

    def kv_bytes_per_token(self, context: int = REFERENCE_CONTEXT) -> float:
        """Bytes per token of a served cache holding ``context`` tokens, everything counted: every layer's
        latents at their storage (codes, scales and lows, the exact window) and the int32 positions. Float
        latents count as bf16 (2 bytes), as a bf16 model holds them; a float32 model's are twice that."""
        if isinstance(context, bool) or not isinstance(context, int) or context < 1:
            raise ValueError(f"context must be a whole number of tokens ≥ 1, got {context!r}")
        latents = sum(k.shape[0] * qk.bytes_per_token(rk, context)  # G latents a token, or 1 shared
                      + v.shape[0] * qv.bytes_per_token(rv, context)
                      for k, v, (rk, rv), (qk, qv) in zip(self.keys, self.values, self.ranks, self.specs))
        return latents + POSITION_BYTES

    @property
    def ranks(self) -> list[tuple[int, int]]:
        """``(r_k, r_v)`` per layer."""
        return [(int(k.shape[-1]), int(v.shape[-1])) for k, v in zip(self.keys, self.values)]

    @property
    def achieved_budget(self) -> float:
        """The latents' bytes per token over the uncompressed bf16 cache's ``L · G · 2d · 2``: with bf16
        latents ``Σ (r_k + r_v) / (L · 2d)``. (The positions, 4 bytes per token, are in
        :meth:`kv_bytes_per_token`.)"""
        channels = self.keys[0].shape[0] * self.keys[0].shape[1]  # G·d, per head or shared
        return (self.kv_bytes_per_token() - POSITION_BYTES) / (len(self.keys) * channels * 2 * 2)

    @property
    def shared(self) -> bool:
        """Whether any layer has a basis shared by its KV heads (``[1, G·d, r]``)."""
        return any(_shared_shape(P.shape, self.fingerprint) for P in self.keys + self.values)

    def validate(self, where: str = "projections") -> Projections:
        """Raise :class:`CheckpointError` unless every basis is finite, orthonormal and of a valid shape.

        Checks the fields as construction does (:meth:`_check_fields`: they may have been edited since),
        then, per layer and latent: a float ``[G, d, r]`` tensor with ``G``/``d`` from the fingerprint
        (when it has them) and ``1 ≤ r ≤ d``, or a shared ``[1, G·d, r]`` with ``1 ≤ r ≤ G·d``; every value
        finite; ``max |PᵀP − I| ≤``
        :data:`ORTHONORMALITY_TOLERANCE`; and as many layers as the fingerprint's ``L``.
        """
        self._check_fields()
        fp = self.fingerprint if isinstance(self.fingerprint, dict) else {}
        L, G, d = fp.get("L"), fp.get("G"), fp.get("d")
        if _is_int(L) and L != len(self.keys):
            raise CheckpointError(f"{where}: {len(self.keys)} layers of bases, but the model fingerprint has "
                                  f"L={L}: the file is truncated or was edited; recalibrate")
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            for name, P in (("k", k), ("v", v)):
                what = f"{where}: layer {i} {'key' if name == 'k' else 'value'} basis"
                if not isinstance(P, torch.Tensor) or P.dim() != 3 or not P.is_floating_point():
                    shape = tuple(P.shape) if isinstance(P, torch.Tensor) else type(P).__name__
                    raise CheckpointError(f"{what} must be a float tensor [G, d, r], got {shape}")
                g, dd, r = P.shape
                if not _shared_shape(P.shape, fp) and ((_is_int(G) and g != G) or (_is_int(d) and dd != d)):
                    raise CheckpointError(f"{what} has shape {tuple(P.shape)}; the fingerprint says G={G}, "
                                          f"d={d}")
                if not 1 <= r <= dd:
                    raise CheckpointError(f"{what} has rank {r}; ranks must be between 1 and d={dd}")
                if not torch.isfinite(P).all():
                    raise CheckpointError(f"{what} holds NaN or inf values: the checkpoint is damaged or was "
                                          "made from a model whose activations were not finite; recalibrate")
                err = orthonormality_error(P)
                if not err <= ORTHONORMALITY_TOLERANCE:
                    raise CheckpointError(
                        f"{what} is not orthonormal: max |PᵀP − I| = {err:.3g} > "
                        f"{ORTHONORMALITY_TOLERANCE:g} (the tolerance for float32 bases): the checkpoint is "
                        "damaged or was edited; recalibrate"
                    )
        return self

    @property
    def format_version(self) -> int:
        """The lowest version that holds this checkpoint: 2 for bf16 latents, 3 for quantized ones, 4 when a
        latent's encoder searches its range (which version 3 readers do not know), 5 when a latent keeps its
        recent tokens exact (which earlier readers would quantize), 6 when a latent has log8 scales, 7 when
        it holds its exact tokens in int8 (which earlier readers would keep in bf16), 8 with bases shared by
        a layer's KV heads, 9 when layers differ in key mode (which earlier readers would serve alike), 10
        when the fingerprint covers the model's k/v biases (which earlier readers would take for other
        weights)."""
        if isinstance(self.fingerprint, dict) and self.fingerprint.get(KV_BIASES):
            return 10
        if self.layer_key_modes is not None:
            return 9
        if self.shared:
            return 8
        if not self.quantized:
            return 2
        specs = [s for pair in self.quant for s in pair]
        if any(s.window8 for s in specs):
            return 7
        if any(s.log8 for s in specs):
            return 6
        if any(s.recent for s in specs):
            return 5
        return 4 if any(s.mse for s in specs) else 3

    def summary(self) -> str:
        """What ``stiefkv inspect`` prints: the model, method and settings, the bytes a token, and per layer
        the ranks × storages, bytes and errors."""
        s, fp = self.settings, self.fingerprint
        steps = s.get("steps", "–") if self.method == "stiefel" else "–"
        L, G, d = fp.get("L"), fp.get("G"), fp.get("d")
        lines = [
            f"model {s.get('model') or fp.get('architecture')} ({fp.get('architecture')}, L={L} "
            f"H={fp.get('H')} G={G} d={d}) · method {self.method} · key mode "
            f"{self.key_mode_summary}" + (" · bases shared by each layer's KV heads" if self.shared else "")
            + f" · budget {_fmt(self.budget, 'g')} (achieved {self.achieved_budget:.4f})",
            f"data {s.get('data')} · {s.get('tokens')} tokens · seed {s.get('seed')} · allocation "
            f"{s.get('allocation')} · bits {s.get('bits', '–')} · order {s.get('order', '–')} · steps "
            f"{steps}",
            f"KV cache: {self.kv_bytes_per_token():.1f} bytes per token (a {REFERENCE_CONTEXT}-token cache, "
            "positions included)"
            + (f" against {L * G * 4 * d} for the uncompressed bf16 cache" if L and G and d else ""),
            "",
            "| layer | keys | values | B/token | rel. error | cosine |",
            "|---|---|---|---|---|---|",
        ]
        # an edited file's entries without a whole layer number: by their place
        errors = {(e["layer"] if isinstance(e.get("layer"), int) else i): e
                  for i, e in enumerate(self.errors) if isinstance(e, dict)}
        for i, ((rk, rv), (qk, qv)) in enumerate(zip(self.ranks, self.specs)):
            e = errors.get(i, {})
            g = self.keys[i].shape[0]
            layer_bytes = g * (qk.bytes_per_token(rk) + qv.bytes_per_token(rv))
            lines.append(f"| {i} | {rk} × {qk} | {rv} × {qv} | {layer_bytes:.1f} | "
                         f"{_fmt(e.get('rel_error'))} | {_fmt(e.get('cosine'))} |")
        return "\n".join(lines)

    def __repr__(self) -> str:
        # the bases' values are no summary: what the checkpoint is, in one line (print .summary() for more)
        return (f"Projections({self.method}, {len(self.keys)} layers, key mode {self.key_mode_summary}, "
                f"budget {self.budget:g}, ranks {self.ranks[:2]}{'…' if len(self.ranks) > 2 else ''})")

    def header(self) -> dict:
        doc = {
            "format_version": self.format_version,
            "key_mode": self.key_mode,
            "budget": self.budget,
            "achieved_budget": self.achieved_budget,
            "ranks": [list(r) for r in self.ranks],
            # copies: the document is the caller's to edit, the checkpoint's own fields are not
            "fingerprint": copy.deepcopy(self.fingerprint),
            "method": self.method,
            "settings": copy.deepcopy(self.settings),
            "errors": copy.deepcopy(self.errors),
            "tensors_sha256": tensors_sha256(self.keys, self.values),
        }
        if self.layer_key_modes is not None:
            doc["layer_key_modes"] = list(self.layer_key_modes)
        if self.quantized:
            doc["quant"] = [[str(qk), str(qv)] for qk, qv in self.quant]
            doc["kv_bytes_per_token"] = self.kv_bytes_per_token()
        doc["header_sha256"] = header_sha256(doc)
        return doc

    def save(self, path: str | Path) -> Path:
        """Write atomically (a temporary file beside ``path``, then a rename); refuse invalid bases.

        The file gets the mode any new file would (``0666`` less the umask).
        """

        path = Path(path).expanduser()
        text = self.header_text(path)
        tensors = {}
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            # clone: a basis may share storage with another tensor (a full-rank PCA slice), which
            # safetensors refuses to write
            tensors[f"layers.{i}.k"] = k.detach().to("cpu", torch.float32).clone(
                memory_format=torch.contiguous_format)
            tensors[f"layers.{i}.v"] = v.detach().to("cpu", torch.float32).clone(
                memory_format=torch.contiguous_format)
        return write_atomically(path, safetensors_writer(tensors, {"stiefkv": text}), "checkpoint")

    def header_text(self, path: str | Path) -> str:
        """The header :meth:`save` would write to ``path``, as JSON; ``ValueError`` (naming ``path``) for
        bases or fields it would refuse, so that a caller can check before writing anything else."""
        self.validate(f"refusing to write {path}")
        try:
            header = self.header()
            text = json.dumps(header, allow_nan=False)
        except (TypeError, ValueError) as exc:  # a field that is not JSON (a Path, a tensor, a NaN)
            raise ValueError(f"refusing to write {path}: its header is not JSON ({exc})") from None
        _check_header(header, Path(path), writing=True)
        return text

    @classmethod
    def load(cls, path: str | Path) -> Projections:
        """Read and check a checkpoint; a missing, foreign, damaged or edited file raises
        :class:`CheckpointError`."""
        return cls.load_with_header(path)[0]

    @classmethod
    def load_with_header(cls, path: str | Path) -> tuple[Projections, dict]:
        """:meth:`load`, and the header document as the file holds it (``stiefkv inspect --json``), not as
        :meth:`header` would write it now: both from one read, so that the header shown is the one checked
        (a second read could meet another file written there since)."""
        from safetensors import SafetensorError, safe_open

        path = Path(path).expanduser()  # as save, ensure_writable and save_pretrained take it
        if not path.is_file():
            raise CheckpointError(f"checkpoint {path} does not exist" if not path.exists()
                                  else f"checkpoint {path} is not a file")
        if not os.access(path, os.R_OK):  # safetensors reports a file it may not read as missing
            raise CheckpointError(f"checkpoint {path} cannot be read (permission denied): make it readable "
                                  f"(chmod u+r {path}) or run as its owner")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{path} is not a readable safetensors file ({exc})") from None
        if "stiefkv" not in meta and path.name.endswith(".partial"):
            raise CheckpointError(f"{path} is the progress file of an interrupted calibration, not a "
                                  "checkpoint: rerun its stiefkv calibrate command with --resume to finish "
                                  "it")
        if "stiefkv" not in meta:
            raise CheckpointError(f"{path} is a safetensors file but not a StiefKV checkpoint (no 'stiefkv' "
                                  "header)")
        try:
            doc = json.loads(meta["stiefkv"])
        except (json.JSONDecodeError, RecursionError) as exc:  # nested past the parser's depth: not ours
            raise CheckpointError(f"{path} has a damaged StiefKV header (not JSON: "
                                  f"{str(exc)[:120]})") from None
        _check_header(doc, path)
        n = len(doc["ranks"])
        expected = {f"layers.{i}.{x}" for i in range(n) for x in "kv"}
        missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
        if missing or extra:
            raise CheckpointError(
                f"{path}: its header lists {n} layers but the file holds "
                + (f"no tensor {', '.join(missing[:3])}" if missing
                   else f"extra tensors {', '.join(extra[:3])}")
                + ": the file is damaged or was edited; recalibrate"
            )
        keys = [tensors[f"layers.{i}.k"] for i in range(n)]
        values = [tensors[f"layers.{i}.v"] for i in range(n)]
        odd = next((name for name, t in tensors.items() if t.dtype != torch.float32), None)
        if odd is not None:
            dtype = str(tensors[odd].dtype).removeprefix("torch.")
            raise CheckpointError(f"{path}: tensor {odd} is {dtype}; bases are float32: the file was edited "
                                  "or written by another tool")
        odd = next((name for name, t in tensors.items() if t.dim() != 3), None)
        if odd is not None:
            raise CheckpointError(f"{path}: tensor {odd} has shape {list(tensors[odd].shape)}, not a basis "
                                  "[G, d, r]: the file is damaged or was edited; recalibrate")
        proj = cls(keys=keys, values=values, key_mode=doc["key_mode"], fingerprint=doc["fingerprint"],
                   budget=float(doc["budget"]), method=doc.get("method", "?"),
                   settings=doc.get("settings", {}), errors=doc.get("errors", []),
                   quant=_quant_of(doc, path), layer_key_modes=doc.get("layer_key_modes"))
        modes = doc.get("layer_key_modes")
        # one mode in every layer is folded into key_mode below: it must be key_mode (an older reader reads
        # key_mode alone); differing modes meet the version check after
        if modes is not None and len(set(modes)) == 1 and modes[0] != doc["key_mode"]:
            raise CheckpointError(f"{path}: layer_key_modes {sorted(set(map(str, modes)))} beside key_mode "
                                  f"{doc['key_mode']!r}: one mode in every layer is key_mode's; the file "
                                  "was edited; recalibrate")
        if proj.layer_key_modes is not None and doc["format_version"] < 9:
            raise CheckpointError(f"{path}: per-layer key modes in a format version {doc['format_version']} "
                                  "file (they need 9): the file was edited; recalibrate")
        if proj.shared and doc["format_version"] < 8:
            raise CheckpointError(f"{path}: bases shared by the KV heads in a format version "
                                  f"{doc['format_version']} file (they need 8): the file was edited; "
                                  "recalibrate")
        if [list(r) for r in proj.ranks] != doc["ranks"]:
            raise CheckpointError(f"{path}: tensor shapes {proj.ranks} disagree with the ranks in its header "
                                  f"{doc['ranks']}: the file is damaged or was edited; recalibrate")
        checksum = doc.get("tensors_sha256")
        if checksum is None:
            log.warning("%s is a format version %d checkpoint without a checksum: its tensors cannot be "
                        "checked for damage (recalibrate, or load and save it again, to add one)", path,
                        doc["format_version"])
        elif checksum != tensors_sha256(keys, values):
            raise CheckpointError(f"{path}: the tensor data does not match the sha256 in its header: the "
                                  "file is corrupt (copy it again or recalibrate)")
        proj.validate(str(path))
        # last, so that a header edited into something invalid is named by what is invalid
        if "header_sha256" not in doc:
            log.info("%s has no header checksum (written before 2026-12-07): an edit of its key mode or "
                     "storage cannot be detected (load and save it again to add one)", path)
        elif doc["header_sha256"] != header_sha256(doc):
            raise CheckpointError(f"{path}: its header does not match the sha256 it carries: the header was "
                                  "edited or damaged (its key mode, storage or ranks would be read wrongly); "
                                  "copy the file again or recalibrate")
        return proj, json.loads(meta["stiefkv"])  # parsed anew: proj holds the first parse's dicts

    @staticmethod
    def stored_header(path: str | Path) -> dict:
        """The header document as the file holds it, not as :meth:`header` would write it now, unchecked
        (:meth:`load_with_header` reads it with the checked checkpoint)."""
        from safetensors import SafetensorError, safe_open

        path = Path(path).expanduser()
        try:
            with safe_open(str(path), framework="pt") as f:
                return json.loads((f.metadata() or {})["stiefkv"])
        except (SafetensorError, OSError, KeyError, ValueError, RecursionError) as exc:
            raise CheckpointError(f"{path}: no readable StiefKV header ({type(exc).__name__}: "
                                  f"{str(exc)[:120]}); check it with stiefkv inspect") from None

    def check(self, model) -> None:
        """Raise :class:`CheckpointError` naming every difference between this checkpoint and ``model``
        (and on bases that are not finite or not orthonormal)."""
        from stiefkv.models import fingerprint_like, has_kv_biases, same_weights

        mine = self.fingerprint
        theirs = fingerprint_like(model, mine)  # an older checkpoint's hashes leave the k/v biases out
        diffs = [f"{key}: checkpoint {mine.get(key)!r}, model {theirs.get(key)!r}"
                 for key in ("architecture", "L", "H", "G", "d", "D", "rope")
                 if mine.get(key) != theirs.get(key)]
        if not diffs and not same_weights(mine, theirs):
            dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
            old = "kv_weights_sample" not in mine and dtype != "float32"
            diffs.append("same shapes but different k_proj/v_proj weights or biases (another checkpoint of "
                         "this architecture?" + (f" Or the same one in another precision: this checkpoint "
                                            f"predates weight samples, which tell a {dtype} model's weights "
                                            "from others; load the model in float32, stiefkv.load it, then "
                                            "cast)" if old else ")"))
        if diffs:
            raise CheckpointError(
                "this checkpoint was made for another model — " + "; ".join(diffs)
                + ". Calibrate one for this model with `stiefkv calibrate`."
            )
        if not mine.get(KV_BIASES) and has_kv_biases(model):
            log.info("this checkpoint predates fingerprints of the k/v biases (format version 10): it was "
                     "checked against the model's k_proj/v_proj weights only, not their biases")
        G, d = theirs["G"], theirs["d"]
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if not all(P.shape[:2] in ((G, d), (1, G * d)) for P in (k, v)):
                raise CheckpointError(f"layer {i}: bases {tuple(k.shape)}/{tuple(v.shape)} do not fit G={G}, "
                                      f"d={d}")
        self.validate()


def _shared_shape(shape, fingerprint) -> bool:
    """A ``[1, G·d, r]`` basis of a model with ``G > 1`` KV heads of dim ``d`` (from ``fingerprint``)."""
    fp = fingerprint if isinstance(fingerprint, dict) else {}
    G, d = fp.get("G"), fp.get("d")
    return _is_int(G) and _is_int(d) and G > 1 and tuple(shape[:2]) == (1, G * d)


def _quant_of(doc: dict, path: Path) -> list[tuple[QuantSpec, QuantSpec]] | None:
    """The header's ``quant`` list as specs (None when absent); a malformed one raises
    :class:`CheckpointError`."""
    quant = doc.get("quant")
    if quant is None:
        return None
    n = len(doc["ranks"])
    if doc["format_version"] < 3:
        raise CheckpointError(f"{path} has a damaged StiefKV header: 'quant' in a format version "
                              f"{doc['format_version']} file (quantized latents are version 3)")
    if (not isinstance(quant, list) or len(quant) != n
            or not all(isinstance(q, list) and len(q) == 2 and all(isinstance(x, str) for x in q)
                       for q in quant)):
        raise CheckpointError(f"{path} has a damaged StiefKV header: quant is not a list of {n} [key, value] "
                              "storage names; recalibrate, or restore the file")
    try:
        specs = [(QuantSpec.parse(k), QuantSpec.parse(v)) for k, v in quant]
    except ValueError as exc:
        raise CheckpointError(f"{path} has a damaged StiefKV header: {exc}; recalibrate, or restore the "
                              "file") from None
    if doc["format_version"] < 4 and any(s.mse for pair in specs for s in pair):
        raise CheckpointError(f"{path} has a damaged StiefKV header: an -mse storage in a format version "
                              f"{doc['format_version']} file (those are version 4)")
    if doc["format_version"] < 5 and any(s.recent for pair in specs for s in pair):
        raise CheckpointError(f"{path} has a damaged StiefKV header: a storage with exact recent tokens "
                              f"(-r) in a format version {doc['format_version']} file (those are version 5)")
    if doc["format_version"] < 6 and any(s.log8 for pair in specs for s in pair):
        raise CheckpointError(f"{path} has a damaged StiefKV header: a storage with log8 scales in a format "
                              f"version {doc['format_version']} file (those are version 6)")
    if doc["format_version"] < 7 and any(s.window8 for pair in specs for s in pair):
        raise CheckpointError(f"{path} has a damaged StiefKV header: a storage with int8 exact tokens (-w8) "
                              f"in a format version {doc['format_version']} file (those are version 7)")
    return specs


def _check_header(doc, path: Path, writing: bool = False) -> None:
    """Raise :class:`CheckpointError` naming the first field of the header document with a wrong type (with
    ``writing``, a ``ValueError``: a header :meth:`Projections.load` would refuse is not written)."""

    def bad(what: str) -> Exception:
        if writing:
            return ValueError(f"refusing to write {path}: {what}")
        return CheckpointError(f"{path} has a damaged StiefKV header: {what}; recalibrate, or restore the "
                               "file")

    if not isinstance(doc, dict):
        raise bad(f"a JSON {type(doc).__name__} instead of an object")
    version = doc.get("format_version")
    if not _is_int(version):
        raise bad(f"format_version is {version!r}, not an integer")
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{path} has format version {version}; this StiefKV reads up to "
                              f"{FORMAT_VERSION}: upgrade stiefkv")
    if version not in READABLE_VERSIONS:
        raise bad(f"unknown format_version {version}")
    for key in ("key_mode", "budget", "ranks", "fingerprint"):
        if key not in doc:
            raise bad(f"no {key!r}")
    if doc["key_mode"] not in KEY_MODES:
        raise bad(f"key_mode {doc['key_mode']!r} is not one of {', '.join(KEY_MODES)}")
    budget = doc["budget"]
    if not _is_number(budget) or not math.isfinite(budget) or not 0 < budget <= 1:
        raise bad(f"budget {budget!r} is not a number in (0, 1]")
    ranks = doc["ranks"]
    if (not isinstance(ranks, list) or not ranks
            or not all(isinstance(r, list) and len(r) == 2 and all(_is_int(x) for x in r) for r in ranks)):
        raise bad("ranks is not a non-empty list of [r_k, r_v] integer pairs")
    if any(x < 1 for r in ranks for x in r):
        raise bad(f"a layer has rank 0 (ranks {ranks}); every rank must be at least 1")
    modes = doc.get("layer_key_modes")
    if modes is not None and (not isinstance(modes, list) or len(modes) != len(ranks)
                              or not all(m in KEY_MODES for m in modes)):
        raise bad(f"layer_key_modes is not a list of {', '.join(KEY_MODES)} for each layer")
    fp = doc["fingerprint"]
    if not isinstance(fp, dict):
        raise bad("fingerprint is not an object")
    for key in ("L", "G", "d"):
        if not _is_int(fp.get(key)) or fp[key] < 1:
            raise bad(f"fingerprint {key} is {fp.get(key)!r}, not a positive integer")
    if fp["L"] != len(ranks):
        raise bad(f"ranks list {len(ranks)} layers but the model fingerprint has L={fp['L']}")
    most = fp["d"] * (fp["G"] if version >= 8 else 1)  # a shared basis spans the layer's G·d channels
    if any(x > most for r in ranks for x in r):
        raise bad(f"a rank exceeds the head dimension d={fp['d']} (ranks {ranks})" if most == fp["d"] else
                  f"a rank exceeds the layer's G·d = {most} channels (ranks {ranks})")
    for key, kind in (("method", str), ("settings", dict), ("errors", list), ("tensors_sha256", str)):
        if key in doc and not isinstance(doc[key], kind):
            raise bad(f"{key} is a {type(doc[key]).__name__}, not a {kind.__name__}")
    if not all(isinstance(e, dict) for e in doc.get("errors", [])):
        raise bad("errors is not a list of objects")
    if version >= 2 and "tensors_sha256" not in doc:
        raise bad("no 'tensors_sha256' (format version 2 always has one)")


def _fmt(value, spec: str = ".4f") -> str:
    """A header value as text: numbers formatted, anything else as it is (a header may be hand-edited)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return format(value, spec)
    return "–" if value is None else str(value)
