"""Compatibility module: `fastce_torch.transformers` (patch_transformers, fastce_for_causal_lm_loss, ...), the import
path users have. The code lives in integrations/transformers.py."""

from .integrations.transformers import *  # noqa: F403
from .integrations.transformers import __all__  # noqa: F401
