"""Compatibility module: Liger-Kernel's names (`from fastce_torch.liger import LigerCrossEntropyLoss, LigerJSD, ...`),
the import path users have. The code lives in integrations/liger.py (cross-entropy), integrations/liger_jsd.py
(distillation) and integrations/liger_grpo.py (LigerFusedLinearGRPOLoss); __all__ is the union of theirs."""

from .integrations import liger as cross_entropy_names
from .integrations import liger_grpo as grpo_names
from .integrations import liger_jsd as jsd_names
from .integrations.liger import *  # noqa: F403
from .integrations.liger_grpo import *  # noqa: F403
from .integrations.liger_jsd import *  # noqa: F403

__all__ = [*cross_entropy_names.__all__, *jsd_names.__all__, *grpo_names.__all__]
