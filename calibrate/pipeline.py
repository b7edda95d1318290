"""The calibration pipeline: data → per-layer statistics → bases at allocated ranks → checkpoint.

:class:`CalibrationConfig` is the one source of defaults for the Python API and the CLI.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import numbers
import os
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

from stiefkv.calibrate import allocate, distributed
from stiefkv.calibrate.collect import LayerBatch, LayerInputs
from stiefkv.calibrate.distributed import Shard
from stiefkv.calibrate.objective import ErrorStats, compressed_layer_output
from stiefkv.calibrate.pca import SecondMoments, top_eigenvectors
from stiefkv.calibrate.profile import (
    ANCHOR_BITS,
    KL_SEQUENCES,
    MSE_BITS,
    MSE_CHOICES,
    PROFILE_STORAGES,
    WEIGHTINGS,
    LayerProfile,
    OutputKL,
    add_quant_profile,
    candidate_ranks,
    layer_latent_input,
    mse_for,
    profile_layer,
    profile_layer_kl,
    storage_basis,
    storage_candidates,
)
from stiefkv.calibrate.rotation import learn_rotation
from stiefkv.calibrate.state import CalibrationState
from stiefkv.calibrate.stiefel import RefineSettings, refine_layer
from stiefkv.data import calibration_sequences
from stiefkv.kernels._common import KERNEL_BITS
from stiefkv.layers import NO_QUANT
from stiefkv.models import (
    arch_of,
    check_context,
    check_token_ids,
    dims_of,
    fingerprint,
    fingerprint_like,
    layer_devices,
    parameters_sha256,
    rope_spec,
)
from stiefkv.projections import KEY_MODES, Projections, ensure_writable
from stiefkv.quant import BITS, DEFAULT_RECENT, FLOAT, GROUP, REFERENCE_CONTEXT, QuantSpec, quantized_length

log = logging.getLogger(__name__)

CALIBRATION_KEY_MODES = (*KEY_MODES, "auto")

METHODS = ("stiefel", "pca")
ORDERS = ("sequential", "independent")
LOSSES = ("output", "output+kl")
PROFILES = ("pca", "stiefel")
BITS_CHOICES = tuple(str(b) for b in BITS) + ("auto",)


@dataclass
class CalibrationConfig:
    """Every calibration setting, with its default.

    budget : the cache's bytes per token as a fraction of the uncompressed bf16 cache's, in (0, 1]: latents at
        their bit width, scales, lows and exact tokens counted; the positions (4 bytes a token) too where
        latents may be codes (``bits`` other than 16), on top with ``bits="16"`` (so that 1 is full rank).
    bits : how latents are stored: ``auto`` (per layer and separately for keys and values, the rank, bit
        width and group layout chosen together by the knapsack; bf16 and full rank are candidates),
        ``16`` (bf16 latents, ranks only: the allocation of earlier versions) or ``8``/``4``/``3``/``2``
        (that width everywhere; rank and layout chosen). With ``allocation="uniform"`` a fixed width stores
        every latent at it in per-token groups, at the largest rank the budget holds; ``auto`` and ``16``
        store bf16 there (auto's choice needs the profiles uniform does not make).
    mse : which latents (``none``, ``values`` or ``all``) of 4 bits and fewer encode each group on its
        least-squared-error range instead of its min–max range (no bytes added). Off by default: it halves
        the squared error at 2 bits yet raised the PPL of KIVI and of ``auto`` at 6.25 % (BENCHMARKS.md §1b;
        clipping errs the same way in every token, and attention averages tokens).
    profile_storages : for ``weighting="kl"``, ``anchors`` (the default) measures only int2's and int4's
        KL of each layout and predicts int3 and int8 from their quantization noise; ``all`` measures every
        storage. Anchors take about 40 % less first-pass time (2-core CPU), and the allocation differs in
        0–13 of SmolLM2's 60 latents at ≤ 8 % more profiled KL
        (`benchmarks/experiments/storage_kl_prediction.py`; whole-test-set PPL in BENCHMARKS.md §1b). The
        ``output`` and ``update`` profiles measure every storage at every rank either way.
    recent : the newest tokens every quantized latent keeps exact (KIVI's residual; their bytes are counted,
        in a cache of 2048 tokens). Each query then reads its own recent keys exact, as in decoding. None
        (the default): :func:`default_recent` of the budget, 16, and 8 below a 10 % budget.
    kernel_storage : choose only storages the fused kernels read in place during decode — 8 to 2 bits per
        token, no exact window (``recent`` must be 0 or left at its default) — besides bf16: what
        :func:`stiefkv.generate` serves fastest, at some quality per byte (the channel layout and the
        window are what ``auto`` otherwise uses at low budgets).
    log8 : offer, beside each per-token storage, the same codes on one 8-bit power-of-two scale per group,
        symmetric about zero (1 byte a group instead of a float16 scale and low: 4). Their KL is predicted
        from the per-token anchors' by quantization noise, so profiling costs no more model tails.
    window8 : hold every quantized latent's exact tokens (the ``recent`` newest, a channel group still
        filling) as int8 codes on log8 scales instead of bf16 (a byte a channel and a scale byte per 64); the
        knapsack spends what they save. The tokens leaving the window are quantized from those codes.
    rotation : turn a basis stored per token by a Hadamard/DCT rotation inside its subspace (spreads the
        dominant channel over all, so one scale per token fits them).
    quant_aware : refine the bases with the quantizer in the loss (straight-through gradient).
    learn_rotation : after refinement, turn each basis stored per token in ≤ 4 bits by a rotation learned on
        the orthogonal group to narrow its tokens' ranges (:mod:`stiefkv.calibrate.rotation`); kept per head
        only where it lowers the held-out quantization error.
    share_heads : one basis per layer for all its KV heads (``[1, G·d, r]``, one latent a token, ranks in
        steps of ``G · rank_step``) instead of one per head, at the same bytes: on SmolLM2 at 50 %, ranks
        only, +14.2 % PPL against +50.1 % (``docs/notes/grouped-heads.md``); slower decode where a layer
        has many KV heads (Llama-3-8B's 8: 2.1-4.4x the kernel time), so off by default.
    method : ``stiefel`` (PCA start refined on the Stiefel manifold against the layer output) or ``pca``.
    key_mode : ``pre_rope`` (keys before RoPE; better where key ranks are cut), ``post_rope`` (faster
        kernels), or ``auto``: profiled and allocated as ``pre_rope``, then layer by layer ``post_rope``
        where the allocation keeps the layer's keys at full rank, ``pre_rope`` where it cuts them
        (:func:`served_key_modes`).
    allocation : ``dp`` (per-layer ranks by exact knapsack over error–rank profiles) or ``uniform``.
    weighting : a layer's profile error relative to its output ``‖y‖`` (``output``) or to its update
        ``‖y − x‖`` (``update``), or ``kl``: the whole model's next-token KL with only that layer compressed.
    profile : bases used for the profiles: ``pca`` (cheap) or ``stiefel`` (refined at every rank).
    order : ``sequential`` (each layer sees the already-compressed layers before it) or ``independent``.
    data : ``wikitext2``, a .txt/.jsonl file or folder, or ``self``.
    num_sequences, seq_len : size of the calibration set. Storages none of whose codes a sequence of
        ``seq_len`` tokens holds (the channel layout below ``recent`` + 64 tokens) are left out of the
        choice: their profiles would measure no error (:func:`measured_on`).
    profile_sequences : how many of the calibration sequences the profiles use.
    steps, lr, step_sequences : Riemannian Adam steps per layer, learning rate, sequences per step.
    loss, kl_weight : ``output`` (layer-output error) or ``output+kl`` (plus ``kl_weight`` × the KL between
        the original and the compressed attention rows, by StreamKL).
    batch_size : sequences per forward pass.
    rank_step : ranks are multiples of this.
    seed : seeds data sampling and every random step.

    On a CPU, ``num_sequences``, ``profile_sequences`` and ``step_sequences`` default to the smaller
    :data:`CPU_SIZES` (a 2-core machine calibrated SmolLM2 in 14–20 minutes with ``bits="auto"``, 1.29×
    ``bits=16``'s time; BENCHMARKS.md, claims),
    wherever they are not given.
    """

    budget: float = 0.5
    bits: str = "auto"
    method: str = "stiefel"
    key_mode: str = "pre_rope"
    allocation: str = "dp"
    weighting: str = "kl"
    profile: str = "pca"
    order: str = "sequential"
    data: str = "wikitext2"
    num_sequences: int = 64
    seq_len: int = 512
    profile_sequences: int = 8
    steps: int = 100
    lr: float = 1e-2
    step_sequences: int = 4
    loss: str = "output"
    kl_weight: float = 0.1
    batch_size: int = 8
    rank_step: int = 8
    seed: int = 0
    mse: str = "none"
    recent: int | None = None
    profile_storages: str = "anchors"
    rotation: bool = True
    quant_aware: bool = False
    learn_rotation: bool = False
    kernel_storage: bool = False
    log8: bool = True
    window8: bool = True
    share_heads: bool = False

    def _check_types(self) -> None:
        """Each setting of the type of its default: a number where a number goes (never a bool), a bool
        where a switch goes (the string ``"false"`` is true to Python), text for the choices (``bits`` an
        integer too, ``data`` a path too)."""
        for f in fields(self):
            value, default = getattr(self, f.name), f.default
            if default is None:
                continue  # recent: checked below
            if isinstance(default, bool):
                ok, kind = isinstance(value, bool), "True or False"
            elif isinstance(default, int):
                ok, kind = isinstance(value, numbers.Integral) and not isinstance(value, bool), "an integer"
            elif isinstance(default, float):
                ok, kind = isinstance(value, numbers.Real) and not isinstance(value, bool), "a number"
            elif f.name == "bits":
                ok, kind = isinstance(value, (str, int)) and not isinstance(value, bool), "text or an integer"
            elif f.name == "data":
                ok, kind = isinstance(value, (str, os.PathLike)), "a name or a path"
            else:
                ok, kind = isinstance(value, str), "a string"
            if not ok:
                raise TypeError(f"calibration setting {f.name} must be {kind}, got {value!r} "
                                f"({type(value).__name__})")

    def validate(self) -> "CalibrationConfig":
        self._check_types()
        self.data = os.fspath(self.data)  # a Path is written into the progress file and checkpoint as text
        if not 0 < self.budget <= 1:
            raise ValueError(f"budget must be in (0, 1], got {self.budget}")
        if not 0 <= self.seed <= SEED_MAX:  # per-layer seeds are seed·100003 + layer, in torch's int64
            raise ValueError(f"seed must be in 0 … {SEED_MAX}, got {self.seed}")
        if str(self.bits) not in BITS_CHOICES:
            raise ValueError(f"bits must be one of {', '.join(BITS_CHOICES)}; got {self.bits!r}")
        self.bits = str(self.bits)
        if self.allocation == "uniform" and self.bits == "auto":
            # auto chooses widths from the profiles uniform does not make: bf16, as the header then says
            self.bits = "16"
        for name, allowed in (("method", METHODS), ("key_mode", CALIBRATION_KEY_MODES),
                              ("allocation", allocate.ALLOCATIONS), ("weighting", WEIGHTINGS),
                              ("profile", PROFILES), ("order", ORDERS), ("loss", LOSSES),
                              ("mse", MSE_CHOICES), ("profile_storages", PROFILE_STORAGES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {getattr(self, name)!r}")
        if self.recent is not None and (not isinstance(self.recent, int) or isinstance(self.recent, bool)
                                        or self.recent < 0):
            raise ValueError(f"recent must be an integer ≥ 0 (tokens kept exact), got {self.recent!r}")
        if self.kernel_storage:
            widths = " or ".join(map(str, KERNEL_BITS))
            if self.bits not in ("auto", "16", *map(str, KERNEL_BITS)):
                raise ValueError(f"kernel_storage keeps codes the kernels read ({widths} bits, or auto among "
                                 f"them); got bits {self.bits}")
            if self.recent not in (None, 0, DEFAULT_RECENT, default_recent(self.budget)):
                raise ValueError(f"kernel_storage keeps no exact recent tokens (the kernels read codes "
                                 f"only); got recent {self.recent}: leave it at its default or set 0")
        if self.recent is None:
            self.recent = default_recent(self.budget)
        for name in ("num_sequences", "seq_len", "batch_size", "rank_step", "profile_sequences",
                     "step_sequences"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be ≥ 1, got {getattr(self, name)}")
        if self.seq_len < 2:  # one token to predict from, one to score
            raise ValueError(f"seq_len must be ≥ 2, got {self.seq_len}")
        if self.weighting == "kl" and self.profile != "pca":
            raise ValueError(f"weighting 'kl' profiles with PCA bases only: profile {self.profile!r} needs "
                             "weighting 'output' or 'update' (--weighting)")
        if self.steps < 0 or not 0 < self.lr < math.inf or not 0 <= self.kl_weight < math.inf:
            raise ValueError(f"need steps ≥ 0, a finite lr > 0 and a finite kl_weight ≥ 0; got {self.steps}, "
                             f"{self.lr}, {self.kl_weight}")
        return self

    @classmethod
    def from_kwargs(cls, device: str | torch.device | None = None, **kwargs) -> "CalibrationConfig":
        """The settings ``kwargs``, the rest defaults; the CPU's smaller data sizes where ``device`` is a
        CPU."""
        known = {f.name for f in fields(cls)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown calibration settings {sorted(unknown)}; known: {sorted(known)}")
        sizes = CPU_SIZES if device is not None and torch.device(device).type == "cpu" else {}
        return cls(**(sizes | kwargs)).validate()


SEED_MAX = 2**32 - 1

# Settings that do nothing under another one's value: given anyway, they are named (the user meant something)
REFINEMENT_SETTINGS = ("steps", "lr", "step_sequences", "loss", "kl_weight", "order")
PROFILE_SETTINGS = ("weighting", "profile", "profile_sequences", "profile_storages")


def unused_settings(given: dict, cfg: CalibrationConfig) -> list[str]:
    """What of the settings ``given`` has no effect under ``cfg``, one sentence each."""
    notes = []
    if cfg.method == "pca" and not (cfg.allocation == "dp" and cfg.profile == "stiefel"):
        # profile 'stiefel' refines the profiles' bases with these settings, whatever the method
        notes += [f"{k} has no effect with method 'pca' (no refinement)" for k in REFINEMENT_SETTINGS
                  if k in given]
    elif "kl_weight" in given and cfg.loss != "output+kl":
        notes.append("kl_weight has no effect without loss 'output+kl' (--loss output+kl)")
    if cfg.allocation == "uniform":
        notes += [f"{k} has no effect with allocation 'uniform' (no profiles)" for k in PROFILE_SETTINGS
                  if k in given]
    quantized = storages(cfg) is not None or uniform_specs(cfg) is not None
    if not quantized:
        notes += [f"{k} has no effect with bf16 latents (bits 16, or allocation 'uniform' with bits auto)"
                  for k in ("recent", "window8", "log8", "kernel_storage") if k in given]
    elif cfg.kernel_storage:
        notes += [f"{k} has no effect with kernel_storage (the kernels read codes only: no exact tokens, no "
                  "log8 scales)" for k in ("recent", "window8", "log8") if k in given]
    for k in ("step_sequences", "profile_sequences"):
        n, most = getattr(cfg, k), cfg.num_sequences
        if k in given and isinstance(n, int) and isinstance(most, int) and n > most:
            notes.append(f"{k} {n} exceeds num_sequences {most}: {most} are used")
    if quantized and cfg.recent is not None and cfg.recent >= REFERENCE_CONTEXT:
        notes.append(f"recent {cfg.recent} keeps every token of the {REFERENCE_CONTEXT}-token cache the "
                     "budget is counted at exact: the codes are never read there")
    return notes


SMALL_BUDGET = 0.1
SMALL_BUDGET_RECENT = 8


def default_recent(budget: float) -> int:
    """The exact recent tokens a calibration keeps unless told: :data:`~stiefkv.quant.DEFAULT_RECENT` (16),
    and 8 below a budget of :data:`SMALL_BUDGET`, where the bytes of 8 more exact tokens buy more as codes
    (SmolLM2, 147 windows: 6.25 % 44.76 → 43.95, 9.375 % 31.69 → 31.66; from 12.5 % up 16 did as well or
    better: 26.23 against 26.29; BENCHMARKS.md §1b)."""
    return SMALL_BUDGET_RECENT if budget < SMALL_BUDGET else DEFAULT_RECENT


# Where the model runs on a CPU: a quarter of the tokens per refinement step, one sequence for the kl
# profiles, half the calibration set (BENCHMARKS.md §1d measures the time and the quality).
CPU_SIZES = {"num_sequences": 32, "profile_sequences": 1, "step_sequences": 2}


def check_calibration_call(model, settings: dict) -> None:
    """Clear errors for a call :func:`calibrate` cannot take: no model, a model served by ``stiefkv.load``
    (its layers' outputs are already the compressed ones: the bases would fit those), and a ``device`` (the
    model's is used). Text data without a tokenizer is refused later, after the settings' own checks."""
    from stiefkv.attention import is_compressed

    if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"calibrate takes a loaded causal LM (stiefkv.load_model(...)), got "
                        f"{type(model).__name__}")
    arch_of(model.config)  # first: what follows looks for the decoder layers of a supported model
    if is_compressed(model):
        raise ValueError("this model is served by stiefkv.load: calibrating it would fit its compressed "
                         "layers' outputs. Calibrate the original: stiefkv.unload(model), or load it with "
                         "stiefkv.load_model(..., projections=False)")
    if "device" in settings:
        raise TypeError("calibrate has no device setting: it calibrates where the model is (model.to(device) "
                        "first, or stiefkv.place_layers for several devices)")


def check_sequence_settings(sequences: torch.Tensor, settings: dict) -> None:
    """Refuse a ``data``, ``num_sequences`` or ``seq_len`` given beside pre-tokenized ``sequences`` ``[S, N]``
    that they contradict: the sequences are the calibration text and their shape its size, so such a setting
    would be ignored, and a setting ignored without a word hides the caller's mistake. Values the shape
    agrees with pass (a caller that passes its sizes along)."""
    if "data" in settings:
        raise ValueError(f"data={settings['data']!r} and sequences= both name the calibration text: give one "
                         "(sequences= are calibrated on as they are)")
    S, N = sequences.shape
    for name, value in (("num_sequences", S), ("seq_len", N)):
        if name in settings and settings[name] != value:
            raise ValueError(f"{name}={settings[name]} contradicts sequences= of shape [{S}, {N}], whose "
                             f"shape sets it: leave {name} out, or pass sequences of that size")


def calibrate(model, tokenizer, *, progress: str | Path | None = None, resume: bool = False,
              sequences: torch.Tensor | None = None, **settings) -> Projections:
    """Learn low-rank key and value bases for every layer of ``model``.

    Keyword arguments are the fields of :class:`CalibrationConfig` (``budget=``, ``method=``,
    ``key_mode=``, ``allocation=``, ``order=``, ``steps=``, ``lr=``, ``seed=``, ``data=``,
    ``num_sequences=``, ``seq_len=``, …). With ``progress=PATH`` every finished step is written there, and
    ``resume=True`` continues from it. ``sequences`` ``[S, N]`` token ids replace ``data`` (pre-tokenized
    calibration text; ``tokenizer`` may then be None; ``data=`` is then refused, and ``num_sequences=`` and
    ``seq_len=`` unless they equal ``S`` and ``N``). Returns :class:`~stiefkv.Projections`; save it with
    ``.save(path)``.

    Inside a ``torch.distributed`` process group (``torchrun``; :mod:`stiefkv.calibrate.distributed`) each
    process calibrates on its share of the sequences and every process returns the same result; only rank 0
    writes ``progress``.
    """
    check_calibration_call(model, settings)
    cfg = CalibrationConfig.from_kwargs(device=next(model.parameters()).device, **settings)
    for note in unused_settings(settings, cfg):
        log.warning("%s", note)
    dims = dims_of(model.config)
    if dims.d % cfg.rank_step:
        raise ValueError(f"rank_step {cfg.rank_step} must divide the model's head dimension d={dims.d} "
                         f"(e.g. --rank-step {next(s for s in (8, 4, 2, 1) if dims.d % s == 0)})")
    progress = Path(progress) if progress is not None else None
    if progress is not None:
        ensure_writable(progress, "progress file")
        if progress.exists() and not resume:
            log.warning("%s exists from an earlier run; starting over (resume=True / --resume continues it)",
                        progress)
    t0 = time.perf_counter()
    if sequences is not None:
        check_token_ids(model, sequences, "sequences", least=2)
        check_sequence_settings(sequences, settings)
        seqs = sequences.long().cpu()
        cfg.data, cfg.num_sequences, cfg.seq_len = "tensor", seqs.shape[0], seqs.shape[1]
    check_sequence_length(cfg)
    check_budget(cfg, dims)
    check_context(model.config, cfg.seq_len, "seq_len")
    if sequences is None and cfg.data == "self" and len(layer_devices(model)) > 1:
        raise ValueError("--data self samples text with the whole model's forward, which does not run over "
                         "layers placed on several devices: calibrate on text (--data wikitext2 or a file)")
    if sequences is None and tokenizer is None:
        raise ValueError("calibrate needs the model's tokenizer to read or sample its calibration text "
                         "(data=); pass it, or give pre-tokenized sequences= [S, N] instead")
    if sequences is None:
        seqs = calibration_sequences(model, tokenizer, data=cfg.data, num_sequences=cfg.num_sequences,
                                     seq_len=cfg.seq_len, seed=cfg.seed)
    fp = fingerprint(model)
    shard = distributed.current(len(seqs))
    if shard.active:
        check_distributed(shard, model, cfg, fp, seqs)
        progress = progress if shard.leader else None
    # what a resumed run must share with the interrupted one beyond the settings: the very token ids (a data
    # file edited in between) and the model's dtype
    run = {"sequences_sha256": hashlib.sha256(seqs.numpy().tobytes()).hexdigest()[:16],
           "dtype": str(next(model.parameters()).dtype), "parameters_sha256": parameters_sha256(model)}
    like = functools.partial(fingerprint_like, model)
    state = shard.broadcast(initial_state(progress, resume, cfg, fp, run, like) if shard.leader else None)
    local = shard.select(seqs)
    profiled = profiled_config(cfg)
    if len(state.eig_k) < dims.L:
        first_pass(model, local, profiled, state, progress, shard)
    if not state.ranks:
        allocation = shard.broadcast(choose_allocation(cfg, state, dims) if shard.leader else None)
        state.ranks, quant = allocation
        state.quant = [[str(q) for q in pair] for pair in quant] if quant else []
        state.save(progress)
    key_modes = served_key_modes(cfg, state.ranks, dims)
    if cfg.key_mode == "auto":
        cut = [i for i, m in enumerate(key_modes) if m == "pre_rope"]
        log.info("key mode auto: post_rope (no key rebuild or rotation at decode) where a layer keeps its "
                 "keys at full rank; pre_rope (RoPE makes keys high-rank) where it cuts them: %s",
                 f"layer{'s' if len(cut) > 1 else ''} {', '.join(map(str, cut))}" if cut else "no layer")
    second_pass(model, local, cfg, state, progress, shard, key_modes=key_modes,
                profiled_key_mode=profiled.key_mode)
    elapsed = state.earlier + time.perf_counter() - t0  # a resumed run: with the interrupted ones' time
    resumed = f" ({time.perf_counter() - t0:.1f} s of them in this run)" if state.earlier else ""
    log.info("calibrated %d layers in %.1f s%s; mean layer error %.4f", dims.L, elapsed, resumed,
             sum(e["rel_error"] for e in state.errors) / len(state.errors))
    meta = asdict(cfg) | {"tokens": int(seqs.numel()), "seconds": round(elapsed, 1),
                          "model": getattr(model, "stiefkv_spec", None),
                          "profiles": state.profiles, "refine": state.refine}
    return Projections(keys=state.keys, values=state.values, key_mode=key_modes[0], layer_key_modes=key_modes,
                       fingerprint=fp, budget=cfg.budget, method=cfg.method, settings=meta,
                       errors=state.errors, quant=layer_specs(state) if state.quant else None).validate()


PROFILED_KEY_MODE = "pre_rope"  # what key_mode "auto" profiles and allocates in


def profiled_config(cfg: CalibrationConfig) -> CalibrationConfig:
    """The settings the first pass profiles in: ``cfg``, with key mode ``auto`` read as
    :data:`PROFILED_KEY_MODE` (the served key mode is chosen from the allocation that follows)."""
    return replace(cfg, key_mode=PROFILED_KEY_MODE) if cfg.key_mode == "auto" else cfg


def served_key_modes(cfg: CalibrationConfig, ranks: list[tuple[int, int]], dims) -> list[str]:
    """The key mode each layer is refined and served in: ``cfg.key_mode``, or for ``auto`` ``post_rope``
    where the layer's key latent keeps its full rank (``d``, ``G·d`` shared), ``pre_rope`` where it is cut.

    Keys after RoPE lose far more than keys before it once their rank is cut (RoPE makes them high-rank:
    SmolLM2 12.5 %, 36.79 against 26.23), but at full rank nothing is cut and only the codes' noise differs
    (50 %: 21.970 either way; ``docs/notes/quantized-latents.md``), while ``post_rope`` decode skips the key
    rebuild and rotation. The allocation is ``pre_rope``'s: SmolLM2's 25 % cuts layer 0's keys alone, and
    forcing them whole cost +0.4 % PPL (22.235 against 22.15).
    """
    if cfg.key_mode != "auto":
        return [cfg.key_mode] * len(ranks)
    full = dims.d * (dims.G if cfg.share_heads else 1)  # a key latent's full rank: d, or G·d shared
    return ["post_rope" if rk == full else PROFILED_KEY_MODE for rk, _ in ranks]


def initial_state(progress: Path | None, resume: bool, cfg: CalibrationConfig, fp: dict,
                  run: dict | None = None, like=None) -> CalibrationState:
    """The progress of an interrupted run (``resume``), or a new state; ``run``: more that must match;
    ``like``: as :meth:`CalibrationState.load`'s."""
    settings = asdict(cfg) | (run or {})
    if resume and progress is not None and progress.is_file():
        return CalibrationState.load(progress, settings, fp, like)
    if resume and progress is None:
        log.warning("resume has no effect without progress=PATH (the file an interrupted run kept its "
                    "progress in): starting from the beginning")
    elif resume:
        log.info("nothing to resume at %s: starting from the beginning", progress)
    return CalibrationState(settings=settings, fingerprint=fp)


def check_distributed(shard: Shard, model, cfg: CalibrationConfig, fp: dict, seqs: torch.Tensor) -> None:
    """Refuse settings a distributed run cannot honour, and processes that disagree on settings, model or
    data."""
    if len(layer_devices(model)) > 1:
        raise ValueError("a model placed over several devices calibrates in one process: run it without "
                         "torchrun, or give each process the whole model")
    if cfg.learn_rotation or (cfg.allocation == "dp" and cfg.profile == "stiefel"):
        what = "learn_rotation" if cfg.learn_rotation else "profile 'stiefel'"
        raise ValueError(f"{what} runs in one process only; calibrate without it, or in one process")
    distributed.check_same(shard, "settings", asdict(cfg))
    digest = hashlib.sha256(seqs.numpy().tobytes()).hexdigest()[:16]
    distributed.check_same(shard, "model or data", {"model": fp, "data": digest})


def storages(cfg: CalibrationConfig) -> dict[str, list[QuantSpec]] | None:
    """The storages the allocation chooses among for keys (``k``) and values (``v``), or None for bf16
    latents (ranks only): those of the settings that calibration sequences of ``cfg.seq_len`` tokens can
    measure (:func:`measured_on`)."""
    specs = offered_storages(cfg)
    if specs is None:
        return None
    return {which: [s for s in options if measured_on(s, cfg.seq_len)] for which, options in specs.items()}


def measured_on(spec: QuantSpec, seq_len: int) -> bool:
    """Whether a sequence of ``seq_len`` tokens stored as ``spec`` holds any token as codes. One that holds
    none (a channel group fills only after :data:`~stiefkv.quant.GROUP` tokens older than the ``recent`` exact
    ones: 80 by default) is profiled at its exact tokens' error, none, and the knapsack would take it at its
    fewest bits, whatever its error in a long cache."""
    return not spec.quantized or quantized_length(seq_len, spec) > 0


def check_sequence_length(cfg: CalibrationConfig) -> None:
    """Warn of the storages of the settings left out because ``cfg.seq_len`` quantizes none of their tokens
    (:func:`measured_on`); refuse where that leaves a latent nothing to be stored in."""
    offered = offered_storages(cfg) or {}
    left_out = {s for options in offered.values() for s in options if not measured_on(s, cfg.seq_len)}
    if not left_out:
        return
    layouts = " and ".join(sorted({s.layout for s in left_out}))
    why = f"they keep the {cfg.recent} newest tokens exact" + (
        f" and quantize channel groups of {GROUP} tokens" if "channel" in layouts else "")
    if not all(storages(cfg).values()):
        raise ValueError(f"seq_len {cfg.seq_len} quantizes no token of the bits {cfg.bits} storages "
                         f"({why}): use seq_len {min(map(least_length, left_out))} or more, or bits 16")
    log.warning("seq_len %d quantizes no token of the %s storages (%s): calibration would measure no error "
                "for them and the allocation would take them at their fewest bits, so they are left out; "
                "seq_len %d or more offers them", cfg.seq_len, layouts, why,
                max(map(least_length, left_out)))


def least_length(spec: QuantSpec) -> int:
    """The fewest tokens of which a cache of ``spec`` holds one as codes
    (:func:`~stiefkv.quant.quantized_length` > 0): one past the exact window, a whole group past it per
    channel."""
    return spec.recent + (GROUP if spec.layout == "channel" else 1)


def offered_storages(cfg: CalibrationConfig) -> dict[str, list[QuantSpec]] | None:
    """The storages the settings offer for keys (``k``) and values (``v``), whatever the sequences' length;
    None for bf16 latents (ranks only)."""
    if cfg.bits == "16" or cfg.allocation == "uniform":
        return None
    bf16 = [FLOAT] if cfg.bits == "auto" else []
    if cfg.kernel_storage:  # what the decode kernel reads in place: per token, no window
        widths = KERNEL_BITS if cfg.bits == "auto" else (int(cfg.bits),)
        return {which: [QuantSpec(b, "token", mse=mse_for(cfg.mse, which) and b <= MSE_BITS) for b in widths]
                + bf16 for which in ("k", "v")}
    return {which: storage_candidates(cfg.bits, mse_for(cfg.mse, which), cfg.recent, cfg.log8,
                                         cfg.window8) + bf16
            for which in ("k", "v")}


def uniform_specs(cfg: CalibrationConfig) -> tuple[QuantSpec, QuantSpec] | None:
    """The storage of every key and value latent under ``allocation="uniform"`` with a fixed width (None for
    bf16): per-token groups, which the decode kernels read in place, with ``recent`` exact tokens (none with
    ``kernel_storage``), ``mse`` as it says for each."""
    if cfg.allocation != "uniform" or cfg.bits == "16":
        return None
    b = int(cfg.bits)

    def spec(which: str) -> QuantSpec:
        mse = mse_for(cfg.mse, which) and b <= MSE_BITS
        if cfg.kernel_storage:
            return QuantSpec(b, "token", mse=mse)
        return QuantSpec(b, "token", mse=mse, recent=cfg.recent, window8=cfg.window8)

    return spec("k"), spec("v")


def check_budget(cfg: CalibrationConfig, dims) -> None:
    """Refuse, before any work, a budget below the smallest cache the settings can represent."""
    fixed = uniform_specs(cfg)
    specs = storages(cfg) or ({"k": [fixed[0]], "v": [fixed[1]]} if fixed else [FLOAT])
    floor = allocate.smallest_budget(dims.L, dims.G, dims.d, cfg.rank_step, specs, cfg.share_heads)
    if specs == [FLOAT]:  # the bf16 allocation counts rank units, as earlier versions did: positions aside
        floor = cfg.rank_step / dims.d
    if cfg.budget < floor:
        bf16 = specs == [FLOAT]
        what = "bf16 latents" if bf16 else f"--bits {cfg.bits}"
        least = f"rank {cfg.rank_step} in every layer" + ("" if bf16 else " at the fewest bits")
        auto = storages(replace(cfg, bits="auto")) or [FLOAT]
        fits = cfg.bits != "auto" and cfg.budget >= allocate.smallest_budget(
            dims.L, dims.G, dims.d, cfg.rank_step, auto, cfg.share_heads)
        raise ValueError(f"budget {cfg.budget:g} is below the smallest cache {what} can make for this model: "
                         f"{floor:.4g} ({least}); raise the budget"
                         + (" or let the bit widths be chosen (--bits auto)" if fits else ""))


def layer_specs(state: CalibrationState) -> list[tuple[QuantSpec, QuantSpec]]:
    return [tuple(QuantSpec.parse(q) for q in pair) for pair in state.quant]


def choose_allocation(cfg: CalibrationConfig, state: CalibrationState,
                      dims) -> tuple[list[tuple[int, int]], list[tuple[QuantSpec, QuantSpec]] | None]:
    """Ranks per layer, and the storage of each latent when latents are quantized (None: bf16)."""
    fixed = uniform_specs(cfg)
    if fixed is not None:
        ranks = allocate.uniform_storage(dims.L, dims.G, dims.d, cfg.rank_step, cfg.budget, *fixed,
                                         shared=cfg.share_heads)
        return ranks, [fixed] * dims.L
    specs = storages(cfg)
    if specs is None:
        return choose_ranks(cfg, state, dims), None
    profiles = [LayerProfile(**p) for p in state.profiles]
    return allocate.storage_dp(profiles, cfg.budget, dims.G, dims.d, cfg.rank_step, specs, cfg.weighting,
                               shared=cfg.share_heads)


def choose_ranks(cfg: CalibrationConfig, state: CalibrationState, dims) -> list[tuple[int, int]]:
    """bf16 latents: ranks per layer (uniform, or the knapsack over rank units)."""
    g = dims.G if cfg.share_heads else 1  # shared: G·r jointly costs what r a head does
    if cfg.allocation == "uniform":
        ranks = allocate.uniform(dims.L, cfg.budget, dims.d, cfg.rank_step)
    else:
        profiles = [LayerProfile(**p) for p in state.profiles]
        for p in profiles:
            p.ranks = [r // g for r in p.ranks]
        ranks = allocate.dp(profiles, cfg.budget, dims.d, cfg.rank_step, cfg.weighting)
    return [(g * rk, g * rv) for rk, rv in ranks]


PHASES = 2  # 1: PCA (and profiles), 2: bases at the allocated ranks


class PhaseProgress:
    """A progress bar over the layers of one calibration phase, and a log line with the expected whole time
    once the first layer this run computes is done (finished layers of a resumed run are not counted)."""

    def __init__(self, index: int, name: str, total: int, shown: bool = True):
        self.label, self.total, self.shown = f"phase {index}/{PHASES} {name}", total, shown
        self.bar, self.first, self.started = None, None, 0.0

    def begin(self, i: int) -> None:
        if self.bar is None:
            self.bar = tqdm(total=self.total, initial=i, desc=self.label, unit="layer",
                            disable=not self.shown)
            self.first, self.started = i, time.perf_counter()

    def end(self, i: int) -> None:
        self.bar.update(1)
        if i == self.first and self.shown:
            took, left = time.perf_counter() - self.started, self.total - i - 1
            log.info("%s: layer %d took %.1f s; expect about %.0f s more for the other %d layers",
                     self.label, i, took, took * left, left)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def check_finite(x: torch.Tensor, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` when activations ``x`` hold NaN or inf."""
    if torch.isfinite(x).all():
        return
    if x.dtype in (torch.float16, torch.bfloat16):
        why = f"it overflows in {str(x.dtype).removeprefix('torch.')} — try --dtype float32"
    else:
        why = "the model's weights are not finite (is the model file damaged?)"
    raise ValueError(f"{where} of the model produced NaN/inf activations on the calibration data: {why}")


@torch.no_grad()
def first_pass(model, seqs: torch.Tensor, cfg: CalibrationConfig, state: CalibrationState,
               progress: Path | None = None, shard: Shard | None = None) -> None:
    """Per layer, on the uncompressed model's activations: PCA eigenvectors, and error–rank profiles for
    ``dp``. ``seqs`` are the sequences this process holds of ``shard``'s (default: all).

    Saved to ``progress`` after every layer; layers already in ``state`` (a resumed run) are only run
    forward to reach the next one, so a resumed pass gives what an uninterrupted one does.
    """
    shard = Shard(0, 1, len(seqs)) if shard is None else shard
    rope, dims = rope_spec(model.config), dims_of(model.config)
    inputs = LayerInputs(model, seqs, batch_size=cfg.batch_size)
    check_finite(inputs.hidden, "the token embeddings")
    ranks = [r * (dims.G if cfg.share_heads else 1) for r in candidate_ranks(dims.d, cfg.rank_step)]
    output_kl = None
    if cfg.allocation == "dp" and cfg.weighting == "kl":
        n = shard.held(min(KL_SEQUENCES, cfg.profile_sequences, shard.total))
        output_kl = OutputKL(model, inputs.hidden[:n], inputs.context, shard)
        if output_kl.base is not None:
            check_finite(output_kl.base, "the output (LM head)")
    bar = PhaseProgress(1, "profiles" if cfg.allocation == "dp" else "PCA", inputs.num_layers, shard.leader)
    try:
        for i in range(inputs.num_layers):
            fresh = i >= len(state.eig_k)
            if fresh:  # timed with the layer's own forward and advance, which every later layer pays too
                bar.begin(i)
            layer, target = inputs.layers[i], inputs.run()
            check_finite(target, f"layer {i}")
            if fresh:
                first_pass_layer(model, layer, i, inputs, target, output_kl, ranks, cfg, rope, state, shard)
                state.save(progress)
            inputs.advance(target)
            if fresh:
                bar.end(i)
    finally:
        bar.close()


def first_pass_layer(model, layer, i: int, inputs: LayerInputs, target, output_kl, ranks,
                     cfg: CalibrationConfig, rope, state: CalibrationState, shard: Shard) -> None:
    """Layer ``i``'s eigenvectors (and profile) appended to ``state``."""
    moments = SecondMoments(model, cfg.key_mode, shared=cfg.share_heads)
    for batch in inputs.batches():
        moments(batch)
    eig_k, eig_v = (top_eigenvectors(shard.sum_(m[i]), m[i].shape[-1])  # all: d, or G·d shared
                    for m in (moments.keys, moments.values))
    device = target.device

    def basis_k(r):
        return eig_k[..., :r].to(device)

    def basis_v(r):
        return eig_v[..., :r].to(device)

    specs = {which: [s for s in options if s.quantized] for which, options in (storages(cfg) or {}).items()}
    if output_kl is not None:
        hidden = inputs.hidden[:0 if output_kl.base is None else output_kl.base.shape[0]]
        prof = profile_layer_kl(layer, output_kl, i, hidden, basis_k, basis_v,
                                key_mode=cfg.key_mode, rope=rope, ranks=ranks)
        if specs:
            batch = LayerBatch(i, hidden, hidden, *output_kl.context.on(hidden.device))

            def measure(P_k, P_v, quant):
                return max(0.0, output_kl(i, hidden, lambda b: compressed_layer_output(
                    layer, b, P_k, P_v, key_mode=cfg.key_mode, rope=rope, quant=quant)))

            add_quant_profile(prof, layer, batch, basis_k, basis_v, specs, measure, key_mode=cfg.key_mode,
                              rotation=cfg.rotation,
                              anchor_bits=ANCHOR_BITS if cfg.profile_storages == "anchors" else (),
                              shard=shard)
    elif cfg.allocation == "dp":
        prof = profile(layer, inputs, target, eig_k, eig_v, ranks, cfg, rope, shard)
        if specs:
            n = shard.held(min(cfg.profile_sequences, shard.total))
            batches = list(inputs.batches(target[:n], hidden=inputs.hidden[:n]))

            def measure(P_k, P_v, quant):
                local = 0.0
                for b in batches:
                    y_hat = compressed_layer_output(layer, b, P_k, P_v, key_mode=cfg.key_mode, rope=rope,
                                                    quant=quant)
                    local += float((y_hat.double() - b.output.double()).pow(2).sum())
                return shard.sum(local)[0]

            # its first batch only tells the device (a process may hold none of the profile's sequences)
            first = next(inputs.batches(target[:1], hidden=inputs.hidden[:1]))
            add_quant_profile(prof, layer, first, basis_k, basis_v, specs, measure, key_mode=cfg.key_mode,
                              rotation=cfg.rotation)
    state.eig_k.append(eig_k)
    state.eig_v.append(eig_v)
    if cfg.allocation == "dp":
        state.profiles.append(prof.as_dict())


def profile(layer, inputs: LayerInputs, target, eig_k, eig_v, ranks, cfg: CalibrationConfig,
            rope, shard: Shard) -> LayerProfile:
    n = shard.held(min(cfg.profile_sequences, shard.total))
    batches = list(inputs.batches(target[:n], hidden=inputs.hidden[:n]))
    device = target.device
    if cfg.profile == "pca":
        prof = profile_layer(layer, batches, lambda r: eig_k[..., :r].to(device),
                             lambda r: eig_v[..., :r].to(device), key_mode=cfg.key_mode, rope=rope,
                             ranks=ranks)
        return summed_profile(prof, shard)
    data = concat_batches(batches)
    full_v, full_k = eig_v.to(device), eig_k.to(device)
    settings = refine_settings(cfg)
    refined_k = {r: refine_layer(layer, data, eig_k[..., :r].to(device), full_v, key_mode=cfg.key_mode,
                                 rope=rope, settings=settings, seed=cfg.seed).P_k for r in ranks}
    refined_v = {r: refine_layer(layer, data, full_k, eig_v[..., :r].to(device), key_mode=cfg.key_mode,
                                 rope=rope, settings=settings, seed=cfg.seed).P_v for r in ranks}
    return profile_layer(layer, batches, refined_k.__getitem__, refined_v.__getitem__, key_mode=cfg.key_mode,
                         rope=rope, ranks=ranks)


def summed_profile(prof: LayerProfile, shard: Shard) -> LayerProfile:
    """``prof``'s sums (squared errors and their references) over every process's sequences."""
    if not shard.active:
        return prof
    n = len(prof.k)
    sums = shard.sum(*prof.k, *prof.v, prof.sq_output, prof.sq_update)
    prof.k, prof.v = list(sums[:n]), list(sums[n:2 * n])
    prof.sq_output, prof.sq_update = sums[-2:]
    return prof


def refine_settings(cfg: CalibrationConfig, quant: tuple = NO_QUANT) -> RefineSettings:
    return RefineSettings(steps=cfg.steps, lr=cfg.lr, batch_size=cfg.step_sequences,
                          kl_weight=cfg.kl_weight if cfg.loss == "output+kl" else 0.0,
                          quant=quant if cfg.quant_aware else NO_QUANT)


def concat_batches(batches: list[LayerBatch]) -> LayerBatch:
    b = batches[0]
    return LayerBatch(b.layer_idx, torch.cat([x.hidden for x in batches]),
                      torch.cat([x.output for x in batches]), b.position_embeddings, b.attention_mask,
                      b.position_ids)


def second_pass(model, seqs: torch.Tensor, cfg: CalibrationConfig, state: CalibrationState,
                progress: Path | None, shard: Shard | None = None, key_modes: list[str] | None = None,
                profiled_key_mode: str | None = None) -> None:
    """Bases at the allocated ranks, layer by layer: PCA, refined on the Stiefel manifold for ``stiefel``.

    ``sequential`` feeds each layer the output of the compressed layers before it, with the uncompressed
    model's output of that layer as the target; ``independent`` feeds every layer the uncompressed inputs.
    Finished layers (``state.keys``) are reused, not recomputed, so a resumed run gives the same result.
    ``seqs`` are the sequences this process holds of ``shard``'s (default: all). ``key_modes``: each layer's
    (default ``cfg.key_mode`` for all). Where the first pass's key eigenvectors were of another key mode
    (``profiled_key_mode``, ``key_mode="auto"``), a layer's key basis starts from the eigenvectors of its
    keys in the layer's key mode on the inputs this pass feeds it.
    """
    shard = Shard(0, 1, len(seqs)) if shard is None else shard
    key_modes = [cfg.key_mode] * len(state.ranks) if key_modes is None else key_modes
    rope = rope_spec(model.config)
    inputs = LayerInputs(model, seqs, batch_size=cfg.batch_size)
    # PCA bases come from the first pass whatever the order: only refinement needs the compressed inputs.
    sequential = cfg.order == "sequential" and cfg.method == "stiefel"
    compressed_hidden = inputs.hidden if sequential else None
    bar = PhaseProgress(2, f"{cfg.method} layers", inputs.num_layers, shard.leader)
    try:
        for i in range(inputs.num_layers):
            done = i < len(state.keys)
            if not done:  # timed with the layer's forward and advance, as in the first pass
                bar.begin(i)
            layer, target = inputs.layers[i], inputs.run()
            check_finite(target, f"layer {i}")
            lcfg = cfg if key_modes[i] == cfg.key_mode else replace(cfg, key_mode=key_modes[i])
            rekey = profiled_key_mode not in (None, lcfg.key_mode)
            x = compressed_hidden.to(inputs.device) if sequential else inputs.hidden
            data = LayerBatch(i, x, target, inputs.position_embeddings, inputs.attention_mask,
                              inputs.position_ids)
            if not done:
                eig_k = key_eigenvectors(model, inputs, target, x, i, lcfg, shard) if rekey else None
                P_k, P_v = fit_layer(layer, data, state, i, lcfg, rope, shard, eig_k=eig_k)
                state.keys.append(P_k.cpu())
                state.values.append(P_v.cpu())
                # Reported errors are on the uncompressed model's inputs, comparable across methods and orders
                # (and with `stiefkv eval`); the chained error adds the drift of the compressed layers before.
                error = {"layer": i} | summed(layer_error(layer, inputs, target, inputs.hidden, P_k, P_v,
                                                          lcfg, rope, quant_of(state, i)), shard).as_dict()
            if sequential:
                compressed_hidden, chained = compressed_outputs(layer, inputs, x, target, state.keys[i],
                                                                state.values[i], lcfg, rope,
                                                                quant_of(state, i))
                check_finite(compressed_hidden, f"layer {i} with compressed keys and values")
                if not done:
                    error["rel_error_chained"] = round(summed(chained, shard).rel_error, 6)
            if not done:
                state.errors.append(error)
                state.save(progress)
            inputs.advance(target)
            if not done:
                bar.end(i)
    finally:
        bar.close()


def key_eigenvectors(model, inputs: LayerInputs, target, x, i: int, cfg: CalibrationConfig,
                     shard: Shard) -> torch.Tensor:
    """Layer ``i``'s key eigenvectors in ``cfg.key_mode`` on inputs ``x`` (every process's sequences)."""
    moments = SecondMoments(model, cfg.key_mode, shared=cfg.share_heads)
    for batch in inputs.batches(target, hidden=x):
        moments(batch)
    m = shard.sum_(moments.keys[i])
    return top_eigenvectors(m, m.shape[-1])


def fit_layer(layer, data: LayerBatch, state: CalibrationState, i: int, cfg: CalibrationConfig, rope,
              shard: Shard | None = None, eig_k: torch.Tensor | None = None):
    """Layer ``i``'s bases at its allocated ranks, from ``state``'s eigenvectors (the keys' from ``eig_k``
    where given)."""
    rk, rv = state.ranks[i]
    device = data.hidden.device
    # Copies, never views: at full rank a slice is the whole eigenvector tensor, and a basis sharing its
    # storage cannot be saved (safetensors refuses shared tensors).
    quant = layer_specs(state)[i] if state.quant else NO_QUANT
    P_k = (state.eig_k[i] if eig_k is None else eig_k)[..., :rk].to(device).clone(
        memory_format=torch.contiguous_format)
    P_v = state.eig_v[i][..., :rv].to(device).clone(memory_format=torch.contiguous_format)
    if cfg.rotation:
        P_k, P_v = storage_basis(P_k, quant[0]), storage_basis(P_v, quant[1])
    if cfg.method == "stiefel" and cfg.steps > 0:
        # Per-layer seed: a resumed run draws the same minibatches for the layers it still has to do.
        result = refine_layer(layer, data, P_k, P_v, key_mode=cfg.key_mode, rope=rope,
                              settings=refine_settings(cfg, quant), seed=cfg.seed * 100_003 + i, shard=shard)
        state.refine.append({"layer": i, "holdout_start": result.holdout_start,
                             "holdout_best": result.holdout_best, "steps": result.steps_run})
        P_k, P_v = result.P_k, result.P_v
    if cfg.learn_rotation:
        P_k, P_v = (rotated_basis(layer, data, P, spec, which, cfg, state, i)
                    for P, spec, which in ((P_k, quant[0], "k"), (P_v, quant[1], "v")))
    return P_k, P_v


ROTATION_SEQUENCES = 4  # the calibration sequences a learned rotation sees (the last one judges it)


def rotated_basis(layer, data: LayerBatch, P: torch.Tensor, spec: QuantSpec, which: str,
                  cfg: CalibrationConfig, state: CalibrationState, i: int) -> torch.Tensor:
    """``P`` turned by :func:`~stiefkv.calibrate.rotation.learn_rotation` when its latent is stored per token
    in 4 bits or fewer (``P`` itself otherwise); the held-out errors go to ``state.refine``."""
    if not (spec.quantized and spec.layout == "token" and spec.bits <= 4):
        return P
    n = min(ROTATION_SEQUENCES, data.hidden.shape[0])
    batch = LayerBatch(i, data.hidden[:n], data.output[:n], data.position_embeddings, data.attention_mask,
                       data.position_ids)
    x = layer_latent_input(layer, batch, which, key_mode=cfg.key_mode)
    result = learn_rotation(torch.matmul(x, P), spec, holdout=1 if n > 1 else 0)
    state.refine.append({"layer": i, "rotation": which, "quant_error_start": result.error_start,
                         "quant_error_best": result.error_best})
    return torch.matmul(P, result.R)


def summed(stats: ErrorStats, shard: Shard) -> ErrorStats:
    """``stats`` over every process's sequences."""
    if shard.active:
        sq_err, sq_ref, cos_sum, tokens = shard.sum(stats.sq_err, stats.sq_ref, stats.cos_sum, stats.tokens)
        stats = ErrorStats(sq_err, sq_ref, cos_sum, int(tokens))
    return stats


def quant_of(state: CalibrationState, i: int) -> tuple[QuantSpec, QuantSpec]:
    return layer_specs(state)[i] if state.quant else NO_QUANT


@torch.no_grad()
def layer_error(layer, inputs: LayerInputs, target, hidden, P_k, P_v, cfg, rope,
                quant=NO_QUANT) -> ErrorStats:
    """The layer's output error with bases ``P_k, P_v`` (latents stored as ``quant``) on inputs ``hidden``
    against ``target``."""
    return compressed_outputs(layer, inputs, hidden, target, P_k, P_v, cfg, rope, quant)[1]


@torch.no_grad()
def compressed_outputs(layer, inputs: LayerInputs, x, target, P_k, P_v, cfg, rope,
                       quant=NO_QUANT) -> tuple[torch.Tensor, ErrorStats]:
    """The compressed layer's outputs ``[S, N, D]`` on ``x``, and their error against ``target``."""
    device = x.device
    stats, outs = ErrorStats(), []
    for b in inputs.batches(target, hidden=x):
        y_hat = compressed_layer_output(layer, b, P_k.to(device), P_v.to(device), key_mode=cfg.key_mode,
                                        rope=rope, quant=quant)
        stats.add(y_hat, b.output)
        outs.append(y_hat)
    return torch.cat(outs), stats
