"""Route TRL's fused LM head through fastce's kernels.

    import fastce_torch
    fastce_torch.patch_trl()      # SFTTrainer, GRPOTrainer, RLOOTrainer (and the log-probs of DPO / KTO) use fastce
    ...
    fastce_torch.unpatch_trl()    # TRL's own kernel again

TRL (1.x) trains causal LMs through its own fused head: `trl.trainer.utils.add_fused_lm_head` wraps the model so that
`model(..., labels=..., fused_lm_head=True)` runs the backbone and computes per-token log-probabilities (and the
entropy, the top-1 flag, ...) from the hidden states and lm_head's weight, without the logits. Its trainers call the
model that way for their losses, so transformers' loss function (patch_transformers) is not on their path. The one
place the head's numbers are computed is `trl.trainer.utils._ChunkedLogProbFunction.apply(hidden, weight, bias,
targets, temperature, chunk_size, final_logit_softcapping, logit_scale, outputs)`, looked up on each call;
patch_trl() replaces it with FastceLogProbs, which computes the same outputs with
`fastce_torch.linear_cross_entropy(..., reduction="none", return_entropy=..., return_accuracy=...)`: the same
transform (logit scale, then softcapping, then the temperature), log p = -loss, the entropy differentiable, is_top1
= fastce's accuracy (ties to the first index, as TRL's). TRL's chunk size is not used (fastce picks its chunks from
its workspace budget).

TRL's own function stays in use for the calls fastce cannot answer exactly: the outputs fastce does not compute
(`log_sum_sq_probs`, `mean_logits`, which DPO and KTO ask for), a logit scale of 0 (fastce reads 0 as "no
scaling"), and DeepSpeed ZeRO-3 partitioned weights (TRL gathers the weight around this call and again in its own
backward, which fastce's recomputing backward would not do). TRL itself refuses a PEFT adapter on lm_head for this
head.
"""

import inspect

from ..core.options import BACKENDS
from ..losses.cross_entropy.linear_api import linear_cross_entropy
from .heads import is_zero3_parameter

__all__ = ["FastceLogProbs", "patch_trl", "unpatch_trl"]

_NAME = "_ChunkedLogProbFunction"
_FASTCE_OUTPUTS = {"log_probs", "entropy", "is_top1"}
state = {"original": None, "options": {"backend": "auto"}}  # TRL's own function while patched, and the options


def _answerable(weight, logit_scale, outputs):
    return set(outputs) <= _FASTCE_OUTPUTS and logit_scale != 0 and not is_zero3_parameter(weight)


class FastceLogProbs:
    """Stands in for TRL's `_ChunkedLogProbFunction` (only its `apply` is called): the same arguments and
    outputs, (log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1) per target row, None where not asked."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None, logit_scale=1.0,
              outputs=("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")):  # fmt: skip
        original = state["original"]
        if original is None or not _answerable(weight, logit_scale, outputs):
            fallback = original or _trl_utils().__dict__[_NAME]
            return fallback.apply(
                hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale, outputs
            )
        result = linear_cross_entropy(
            hidden, weight, targets, bias=bias, reduction="none", temperature=float(temperature),
            logit_softcapping=float(final_logit_softcapping or 0.0),
            logit_scaling=0.0 if logit_scale == 1.0 else float(logit_scale),
            return_entropy="entropy" in outputs, return_accuracy="is_top1" in outputs, **state["options"],
        )  # fmt: skip
        # TRL's targets are never ignored (it drops or clamps the ignored positions first): log p = -loss everywhere.
        log_probs = -result.loss
        entropy = result.entropy if "entropy" in outputs else None
        is_top1 = result.accuracy > 0.5 if "is_top1" in outputs else None
        return log_probs, entropy, None, None, is_top1


def _trl_utils():
    import trl.trainer.utils as trl_utils

    return trl_utils


def patch_trl(*, backend="auto"):
    """Make TRL's fused LM head (add_fused_lm_head, used by SFTTrainer, GRPOTrainer, RLOOTrainer, DPOTrainer,
    KTOTrainer) compute with fastce_torch.linear_cross_entropy (see the module docstring for what stays TRL's).
    Idempotent; backend as in linear_cross_entropy. Raises RuntimeError on a TRL without that head."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    trl_utils = _trl_utils()
    current = trl_utils.__dict__.get(_NAME)
    if current is None or not hasattr(current, "apply"):
        raise RuntimeError(
            f"patch_trl(): this TRL ({getattr(__import__('trl'), '__version__', '?')}) has no "
            f"trl.trainer.utils.{_NAME}, the fused LM head fastce replaces (TRL 1.x has it)"
        )
    if state["original"] is None:
        if current is FastceLogProbs:  # pragma: no cover - our state was lost (module reloaded)
            raise RuntimeError("TRL is patched by an earlier copy of fastce_torch.trl")
        if "outputs" not in inspect.signature(current.forward).parameters:
            raise RuntimeError(f"patch_trl(): TRL's {_NAME} does not have the signature fastce_torch.trl knows")
        state["original"] = current
    state["options"] = {"backend": backend}
    trl_utils._ChunkedLogProbFunction = FastceLogProbs


def unpatch_trl():
    """Put TRL's own fused-head function back (a no-op when not patched)."""
    if state["original"] is None:
        return
    _trl_utils()._ChunkedLogProbFunction = state["original"]
    state["original"] = None
    state["options"] = {"backend": "auto"}
