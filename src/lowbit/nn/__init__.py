"""Model-level API: ``QuantLinear`` (a drop-in ``nn.Linear``), the scheme registry and ``quantize_model``.

Importing this package does not import triton or transformers.
"""

from .compute import set_compute
from .fuse import FusedProjection, GatedMLP, fuse_projections, unfuse_projections
from .modules import QuantLinear
from .quantize import DEFAULT_SKIP, FUSED_GROUPS, calibrate_absmax, fused_groups, quantize_model
from .schemes import SCHEMES, Scheme, get_scheme

__all__ = [
    "DEFAULT_SKIP",
    "FUSED_GROUPS",
    "FusedProjection",
    "GatedMLP",
    "SCHEMES",
    "QuantLinear",
    "Scheme",
    "calibrate_absmax",
    "fuse_projections",
    "fused_groups",
    "get_scheme",
    "quantize_model",
    "set_compute",
    "unfuse_projections",
]
