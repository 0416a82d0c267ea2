"""Compatibility module: `fastce_torch.unsloth` (fast_cross_entropy_loss, patch_loss_functions, Unsloth's names), the
import path users have. The code lives in integrations/unsloth.py."""

from .integrations.unsloth import *  # noqa: F403
from .integrations.unsloth import __all__  # noqa: F401
