"""Calibration: activation collection, PCA bases, error–rank profiles, rank allocation, Stiefel refinement.

``stiefkv.calibrate`` is this package and, called, the calibration function
:func:`stiefkv.calibrate.pipeline.calibrate`: ``stiefkv.calibrate(model, tok, budget=0.5)``. Importing the
package imports nothing heavy; the pipeline (and geoopt) load on the first call.
"""

import sys
import types


class _CallablePackage(types.ModuleType):
    """A package that is also the function it is named after (a submodule import would otherwise rebind the
    parent's attribute from the function to the package)."""

    def __call__(self, *args, **kwargs):
        from .pipeline import calibrate

        return calibrate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
