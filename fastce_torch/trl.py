"""Compatibility module: `fastce_torch.trl` (patch_trl, unpatch_trl, FastceLogProbs), the import path users have. The
code lives in integrations/trl.py."""

from .integrations.trl import *  # noqa: F403
from .integrations.trl import __all__  # noqa: F401
