"""StiefKV: low-rank KV-cache compression learned on the Stiefel manifold.

>>> model, tok = stiefkv.load_model("smollm2")                                          # doctest: +SKIP
>>> proj = stiefkv.calibrate(model, tok, budget=0.5, method="pca", allocation="uniform")  # doctest: +SKIP
>>> proj.save("p.safetensors"); stiefkv.load(model, "p.safetensors")                    # doctest: +SKIP

Serving (``load``, ``LatentCache``, the kernels) imports nothing of calibration: ``import stiefkv`` and
``stiefkv.load`` work where geoopt is not installed. ``stiefkv.calibrate`` is the calibration subpackage,
callable as the calibration function (it imports the optimizer stack on first call), and
``stiefkv.CalibrationConfig`` is imported on first use.
"""

import logging

from . import calibrate  # light: the package is callable and imports its pipeline on first call
from .attention import LowRankAttention, compressed, load, unload
from .cache import LatentCache
from .compacted import CompactedCache, compact, prefill
from .models import load_model, place_layers
from .projections import CheckpointError, Projections
from .serve import generate
from .static_cache import StaticLatentCache

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "CalibrationConfig", "CheckpointError", "CompactedCache", "LatentCache", "LowRankAttention",
    "Projections", "StaticLatentCache", "calibrate", "compact", "compressed", "generate", "load",
    "load_model", "place_layers", "prefill", "unload",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "CalibrationConfig":
        from .calibrate.pipeline import CalibrationConfig

        return CalibrationConfig
    raise AttributeError(f"module 'stiefkv' has no attribute {name!r}")
