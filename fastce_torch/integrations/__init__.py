"""The framework drop-ins: transformers.py (patch_transformers, the causal-LM loss), trl.py (patch_trl), liger.py and
liger_jsd.py (Liger-Kernel's names), unsloth.py (Unsloth's names) and heads.py (what an LM head computes, PEFT LoRA
and DeepSpeed ZeRO-3 included, for the fused route). fastce_torch.transformers, .trl, .liger and .unsloth are the
import paths users have; they hand these modules' names on."""

__all__ = []
