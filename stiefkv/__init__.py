"""StiefKV: low-rank KV-cache compression learned on the Stiefel manifold.

>>> model, tok = stiefkv.load_model("smollm2")                                   # doctest: +SKIP
>>> proj = stiefkv.calibrate(model, tok, budget=0.5, method="pca")               # doctest: +SKIP
>>> proj.save("p.safetensors"); stiefkv.load(model, "p.safetensors")             # doctest: +SKIP
"""

import logging

# The subpackage stiefkv.calibrate must be imported before the function of the same name is bound below:
# importing a subpackage sets the parent's attribute, which would otherwise shadow the function.
from . import calibrate as _calibrate_package  # noqa: F401
from .attention import LatentCache, LowRankAttention, compressed, load, unload
from .calibrate.pipeline import CalibrationConfig, calibrate
from .models import load_model
from .projections import CheckpointError, Projections

logging.getLogger(__name__).addHandler(logging.NullHandler())

__all__ = [
    "CalibrationConfig", "CheckpointError", "LatentCache", "LowRankAttention", "Projections", "calibrate",
    "compressed", "load", "load_model", "unload",
]
__version__ = "0.1.0"
