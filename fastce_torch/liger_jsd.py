"""Compatibility module: `fastce_torch.liger_jsd` (LigerJSD, LigerFusedLinearJSD, liger_jsd, liger_fused_linear_jsd),
an import path of 0.1.0; `fastce_torch.liger` has the same names. The code lives in integrations/liger_jsd.py."""

from .integrations.liger_jsd import *  # noqa: F403
from .integrations.liger_jsd import __all__  # noqa: F401
