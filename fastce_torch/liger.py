"""Compatibility module: Liger-Kernel's names (`from fastce_torch.liger import LigerCrossEntropyLoss, LigerJSD, ...`),
the import path users have. The code lives in integrations/liger.py (cross-entropy), integrations/liger_jsd.py
(distillation) and integrations/liger_grpo.py (LigerFusedLinearGRPOLoss)."""

from .integrations.liger import *  # noqa: F403
from .integrations.liger import __all__ as _cross_entropy_names
from .integrations.liger_grpo import *  # noqa: F403
from .integrations.liger_grpo import __all__ as _grpo_names
from .integrations.liger_jsd import *  # noqa: F403
from .integrations.liger_jsd import __all__ as _jsd_names

__all__ = [*_cross_entropy_names, *_jsd_names, *_grpo_names]
