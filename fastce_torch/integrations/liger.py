"""Liger-Kernel's loss entry points by name and signature (liger-kernel 0.8.5), computed by fastce:

    # from liger_kernel.transformers import LigerCrossEntropyLoss, LigerFusedLinearCrossEntropyLoss
    from fastce_torch.liger import LigerCrossEntropyLoss, LigerFusedLinearCrossEntropyLoss

Here too: liger_cross_entropy, liger_fused_linear_cross_entropy and the CrossEntropyOutput record they return
(Liger's liger_kernel.transformers.functional), and LigerCrossEntropyFunction / LigerFusedLinearCrossEntropyFunction
whose `apply` takes liger_kernel.ops' positional arguments and returns its 4-tuple. The distillation losses' names
(LigerJSD, LigerFusedLinearJSD, liger_jsd, liger_fused_linear_jsd) are liger_jsd.py's; fastce_torch.liger hands on
both modules' names.

Liger's arguments, as fastce computes them (docs/integrations.md, "Coming from Liger-Kernel"):
- ignore_index, label_smoothing, reduction: the same keywords. lse_square_scale: z_loss (scale * lse^2 per token).
  softcap: logit_softcapping (None = off; 0 is refused, as Liger refuses it). bias: bias.
- weight (cross-entropy) / ce_weight (fused linear): class weights (fastce's weight= / class_weight=), with torch's
  weighted mean. Liger leaves its z-loss term unweighted and divides it by the token count: with class weights and
  lse_square_scale > 0 the adapter makes two fastce calls (the weighted loss, then the unweighted z-loss output).
- return_z_loss, return_token_accuracy: fastce's return_z_loss / return_accuracy, returned in CrossEntropyOutput's
  z_loss / token_accuracy fields. return_predicted_tokens (logits only): the argmax of the logits by torch (one
  more read of them), -1 on ignored tokens.
- accum_dtype (fused linear): torch.float32 is accumulate_in_float32=True; None, or the weight's own dtype, is the
  default. use_token_scaling: each token's loss times its detached target probability, as fastce's token_weights,
  which costs one more forward pass without gradients (the probabilities must be known before the loss pass, whose
  backward runs in its forward). chunk_mem_const (Liger's chunk budget) changes nothing: fastce's chunks follow its
  workspace_bytes.
- Dtypes as Liger's: the cross-entropy loss and z_loss in the logits' dtype; the fused linear loss float32, its
  z_loss in the hidden states' dtype; token_accuracy float32.
- Refused, with the reason and what to do: return_predicted_tokens in the fused linear loss, other accum_dtype
  values, ce_impl / ce_mode (Liger's own backends), torch's deprecated size_average / reduce (Liger ignores them).
- Different on purpose: a label outside [0, V) gives NaN for its token (no host synchronisation), where Liger's
  logits loss raises AssertionError after synchronising (fastce's validate_labels=True raises ValueError instead).
  The gradient goes into the logits' buffer only when they are an intermediate tensor (Liger: always).
Keyword-only extras go to fastce (`backend`, `validate_labels`, `workspace_bytes`, ...: FASTCE_OPTIONS).
"""

import dataclasses

import torch

from ..losses.cross_entropy.api import cross_entropy
from ..losses.cross_entropy.linear_api import linear_cross_entropy

__all__ = [
    "FASTCE_OPTIONS",
    "CrossEntropyOutput",
    "LigerCrossEntropyFunction",
    "LigerCrossEntropyLoss",
    "LigerFusedLinearCrossEntropyFunction",
    "LigerFusedLinearCrossEntropyLoss",
    "liger_cross_entropy",
    "liger_fused_linear_cross_entropy",
]


@dataclasses.dataclass
class CrossEntropyOutput:
    """Liger's record (liger_kernel.transformers.functional.CrossEntropyOutput): returned when any return_* is on."""

    loss: torch.Tensor
    z_loss: torch.Tensor | None = None
    token_accuracy: torch.Tensor | None = None
    predicted_tokens: torch.Tensor | None = None


# fastce's own keywords a caller may add (keyword-only) to each entry point; the rest the adapter sets itself.
FASTCE_OPTIONS = {
    "cross_entropy": {"backend", "inplace_backward", "validate_labels", "n_items", "logit_scaling", "temperature"},
    "linear_cross_entropy": {
        "backend", "validate_labels", "n_items", "logit_scaling", "temperature", "workspace_bytes", "chunk_rows",
        "skip_ignored_rows", "logits_dtype", "token_weights",
    },
}  # fmt: skip


def _fastce_options(entry, options):
    unknown = sorted(set(options) - FASTCE_OPTIONS[entry])
    if unknown:
        raise TypeError(
            f"unexpected keyword(s) {', '.join(unknown)}: past Liger's own arguments, fastce_torch.liger takes only "
            f"these fastce_torch.{entry} keywords: {', '.join(sorted(FASTCE_OPTIONS[entry]))}"
        )
    return options


def _check_liger_options(label_smoothing, reduction, softcap, flags):
    """Liger's own argument checks (its asserts), as ValueError / TypeError naming the argument."""
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
        raise TypeError(f"label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be between 0.0 and 1.0, got {label_smoothing!r}")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap <= 0):
        raise ValueError(f"softcap must be None (off) or a number > 0, got {softcap!r}")
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")


def _refuse_legacy_reduction(size_average, reduce):
    for name, value in (("size_average", size_average), ("reduce", reduce)):
        if value is not None:
            raise ValueError(
                f"{name}={value!r}: torch's deprecated form of reduction=, which Liger accepts and ignores; pass "
                "reduction='mean', 'sum' or 'none' instead"
            )


def _refuse_predicted_tokens(return_predicted_tokens):
    if return_predicted_tokens:
        raise NotImplementedError(
            "return_predicted_tokens=True: fastce's fused linear loss does not return the argmax of the logits it "
            "never stores; use return_token_accuracy=True for the accuracy, or take the argmax of logits you compute"
        )


def _check_accum_dtype(accum_dtype, weight=None):
    """None, float32, or (once the head is known) the head's own dtype: the cases fastce has."""
    if accum_dtype is not None and not (isinstance(accum_dtype, torch.dtype) and accum_dtype.is_floating_point):
        raise TypeError(f"accum_dtype must be None or a floating torch.dtype, got {accum_dtype!r}")
    if accum_dtype not in (None, torch.float32) and weight is not None and accum_dtype != weight.dtype:
        raise NotImplementedError(
            f"accum_dtype={accum_dtype}: fastce accumulates the weight's gradient in the weight's dtype "
            f"({weight.dtype}, accum_dtype=None) or in float32 (accum_dtype=torch.float32, fastce's "
            "accumulate_in_float32=True); pass one of those"
        )


def _refuse_liger_backends(ce_impl, ce_mode, chunk_mem_const):
    if ce_impl is not None or ce_mode is not None:
        raise NotImplementedError(
            f"ce_impl={ce_impl!r}, ce_mode={ce_mode!r} choose among Liger's own kernels; fastce has one "
            "implementation: pass None for both"
        )
    if isinstance(chunk_mem_const, bool) or not isinstance(chunk_mem_const, int) or chunk_mem_const < 1:
        raise ValueError(f"chunk_mem_const must be an int >= 1, got {chunk_mem_const!r}")


def _softcapping(softcap):
    return float(softcap) if softcap is not None else 0.0


def _liger_terms(call, weight_kw, weight, lse_square_scale, return_z_loss, return_token_accuracy, options):
    """Liger's (loss, z_loss, token_accuracy) from fastce: one call, or two when class weights meet a z-loss (Liger's
    z-loss term is unweighted and divided by the token count, fastce's is weighted like the loss)."""
    scale = float(lse_square_scale)
    if weight is None or not scale:
        out = call(
            **options, **{weight_kw: weight}, z_loss=scale, return_z_loss=return_z_loss,
            return_accuracy=return_token_accuracy,
        )  # fmt: skip
        if return_z_loss or return_token_accuracy:
            return out.loss, out.z_loss, out.accuracy
        return out, None, None
    if call is cross_entropy:  # two losses of one logits buffer: neither backward may overwrite it
        options = dict(options, inplace_backward=False)
    weighted = call(**options, **{weight_kw: weight}, return_accuracy=return_token_accuracy)
    unweighted = call(**options, z_loss=scale, return_z_loss=True)
    loss = (weighted.loss if return_token_accuracy else weighted) + unweighted.z_loss
    accuracy = weighted.accuracy if return_token_accuracy else None
    return loss, unweighted.z_loss if return_z_loss else None, accuracy


def _as_dtype(tensor, dtype):
    return tensor.to(dtype) if tensor is not None else None


class LigerCrossEntropyFunction:
    """liger_kernel.ops.LigerCrossEntropyFunction's `apply`, computed by fastce_torch.cross_entropy."""

    @staticmethod
    def apply(
        _input, target, weight=None, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0, reduction="mean",
        softcap=None, return_z_loss=False, return_token_accuracy=False, return_predicted_tokens=False,
        **fastce_options,
    ):  # fmt: skip
        """Returns (loss, z_loss, token_accuracy, predicted_tokens), None for what was not asked."""
        flags = dict(return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy)
        _check_liger_options(
            label_smoothing, reduction, softcap, dict(flags, return_predicted_tokens=return_predicted_tokens)
        )
        options = dict(
            logits=_input, labels=target, ignore_index=ignore_index, reduction=reduction,
            label_smoothing=float(label_smoothing), logit_softcapping=_softcapping(softcap),
        )  # fmt: skip
        options.update(_fastce_options("cross_entropy", fastce_options))
        predicted = None
        if return_predicted_tokens:  # softcapping is monotonic: the raw logits' argmax
            with torch.no_grad():
                predicted = torch.where(target == ignore_index, -1, _input.argmax(-1))
        loss, z_loss, accuracy = _liger_terms(
            cross_entropy, "weight", weight, lse_square_scale, *flags.values(), options
        )
        return (
            _as_dtype(loss, _input.dtype),
            _as_dtype(z_loss, _input.dtype),
            _as_dtype(accuracy, torch.float32),
            predicted,
        )


class LigerFusedLinearCrossEntropyFunction:
    """liger_kernel.ops.LigerFusedLinearCrossEntropyFunction's `apply`, computed by linear_cross_entropy."""

    @staticmethod
    def apply(
        _input, weight, target, bias=None, ce_weight=None, ignore_index=-100, lse_square_scale=0.0,
        label_smoothing=0.0, reduction="mean", softcap=None, return_z_loss=False, accum_dtype=None,
        use_token_scaling=False, return_token_accuracy=False, return_predicted_tokens=False, ce_impl=None,
        ce_mode=None, chunk_mem_const=1, **fastce_options,
    ):  # fmt: skip
        """Returns (loss, z_loss, token_accuracy, None): fastce refuses return_predicted_tokens here."""
        flags = dict(return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy)
        checked = dict(flags, use_token_scaling=use_token_scaling, return_predicted_tokens=return_predicted_tokens)
        _check_liger_options(label_smoothing, reduction, softcap, checked)
        _refuse_predicted_tokens(return_predicted_tokens)
        _check_accum_dtype(accum_dtype, weight)
        _refuse_liger_backends(ce_impl, ce_mode, chunk_mem_const)
        options = dict(
            hidden=_input, weight=weight, labels=target, bias=bias, ignore_index=ignore_index, reduction=reduction,
            label_smoothing=float(label_smoothing), logit_softcapping=_softcapping(softcap),
            accumulate_in_float32=accum_dtype == torch.float32,
        )  # fmt: skip
        options.update(_fastce_options("linear_cross_entropy", fastce_options))
        if use_token_scaling:
            scaling = _target_probabilities(options)
            given = options.get("token_weights")
            options["token_weights"] = scaling if given is None else given * scaling
        loss, z_loss, accuracy = _liger_terms(
            linear_cross_entropy, "class_weight", ce_weight, lse_square_scale, *flags.values(), options
        )
        return loss, _as_dtype(z_loss, _input.dtype), _as_dtype(accuracy, torch.float32), None


def _target_probabilities(options):
    """use_token_scaling's factors: softmax(softcap(logits))[label], detached, 0 on ignored tokens (a forward pass
    of fastce's per-token loss without smoothing, z-loss or class weights: p = exp(-loss))."""
    kept = {"ignore_index", "logit_softcapping", *FASTCE_OPTIONS["linear_cross_entropy"]}
    same = {k: v for k, v in options.items() if k in kept - {"n_items", "token_weights", "validate_labels"}}
    with torch.no_grad():
        hidden, weight, bias = (
            t.detach() if t is not None else None for t in map(options.get, ("hidden", "weight", "bias"))
        )
        token_loss = linear_cross_entropy(hidden, weight, options["labels"], bias=bias, reduction="none", **same)
    return torch.where(options["labels"] == options["ignore_index"], 0.0, torch.exp(-token_loss))


def _loss_or_output(results, return_z_loss, return_token_accuracy, return_predicted_tokens):
    """A functional entry point's result from its Function's (loss, z_loss, token_accuracy, predicted_tokens): the
    loss alone, or CrossEntropyOutput when any return_* is on."""
    if not (return_z_loss or return_token_accuracy or return_predicted_tokens):
        return results[0]
    return CrossEntropyOutput(*results)


def liger_cross_entropy(
    input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean",
    label_smoothing=0.0, lse_square_scale=0.0, softcap=None, return_z_loss=False, return_token_accuracy=False,
    return_predicted_tokens=False, **fastce_options,
):  # fmt: skip
    """liger_kernel.transformers.functional.liger_cross_entropy: the loss, or CrossEntropyOutput if any return_*."""
    _refuse_legacy_reduction(size_average, reduce)
    results = LigerCrossEntropyFunction.apply(
        input, target, weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap, return_z_loss,
        return_token_accuracy, return_predicted_tokens, **fastce_options,
    )  # fmt: skip
    return _loss_or_output(results, return_z_loss, return_token_accuracy, return_predicted_tokens)


def liger_fused_linear_cross_entropy(
    input, weight, target, bias=None, ce_weight=None, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0,
    reduction="mean", softcap=None, return_z_loss=False, accum_dtype=None, use_token_scaling=False,
    return_token_accuracy=False, return_predicted_tokens=False, chunk_mem_const=1, **fastce_options,
):  # fmt: skip
    """liger_kernel.transformers.functional.liger_fused_linear_cross_entropy: input (BT, H), weight (V, H)."""
    results = LigerFusedLinearCrossEntropyFunction.apply(
        input, weight, target, bias, ce_weight, ignore_index, lse_square_scale, label_smoothing, reduction, softcap,
        return_z_loss, accum_dtype, use_token_scaling, return_token_accuracy, return_predicted_tokens, None, None,
        chunk_mem_const, **fastce_options,
    )  # fmt: skip
    return _loss_or_output(results, return_z_loss, return_token_accuracy, return_predicted_tokens)


class LigerCrossEntropyLoss(torch.nn.Module):
    """liger_kernel.transformers.LigerCrossEntropyLoss: forward(_input (BT, V), target (BT,)) -> the loss, or
    CrossEntropyOutput if any return_*. Keyword-only extras are fastce_torch.cross_entropy keywords."""

    def __init__(
        self, weight=None, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0, reduction="mean",
        softcap=None, return_z_loss=False, return_token_accuracy=False, return_predicted_tokens=False,
        **fastce_options,
    ):  # fmt: skip
        super().__init__()
        flags = dict(return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy)
        _check_liger_options(
            label_smoothing, reduction, softcap, dict(flags, return_predicted_tokens=return_predicted_tokens)
        )
        self.fastce_options = _fastce_options("cross_entropy", fastce_options)
        self.weight = weight
        self.ignore_index = ignore_index
        self.lse_square_scale = lse_square_scale
        self.label_smoothing = label_smoothing
        self.reduction = reduction
        self.softcap = softcap
        self.return_z_loss = return_z_loss
        self.return_token_accuracy = return_token_accuracy
        self.return_predicted_tokens = return_predicted_tokens

    def forward(self, _input, target):
        return liger_cross_entropy(
            _input, target, self.weight, None, self.ignore_index, None, self.reduction, self.label_smoothing,
            self.lse_square_scale, self.softcap, self.return_z_loss, self.return_token_accuracy,
            self.return_predicted_tokens, **self.fastce_options,
        )  # fmt: skip


class LigerFusedLinearCrossEntropyLoss(torch.nn.Module):
    """liger_kernel.transformers.LigerFusedLinearCrossEntropyLoss: forward(lin_weight (V, H), _input (BT, H),
    target (BT,), bias=None) -> the loss, or CrossEntropyOutput if return_z_loss / return_token_accuracy.
    Keyword-only extras are fastce_torch.linear_cross_entropy keywords (workspace_bytes, ...)."""

    def __init__(
        self, ce_weight=None, ignore_index=-100, lse_square_scale=0.0, label_smoothing=0.0, reduction="mean",
        softcap=None, return_z_loss=False, accum_dtype=None, use_token_scaling=False, return_token_accuracy=False,
        return_predicted_tokens=False, **fastce_options,
    ):  # fmt: skip
        super().__init__()
        flags = dict(return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy)
        checked = dict(flags, use_token_scaling=use_token_scaling, return_predicted_tokens=return_predicted_tokens)
        _check_liger_options(label_smoothing, reduction, softcap, checked)
        _refuse_predicted_tokens(return_predicted_tokens)
        _check_accum_dtype(accum_dtype)
        self.fastce_options = _fastce_options("linear_cross_entropy", fastce_options)
        self.ce_weight = ce_weight
        self.ignore_index = ignore_index
        self.lse_square_scale = lse_square_scale
        self.label_smoothing = label_smoothing
        self.reduction = reduction
        self.softcap = softcap
        self.return_z_loss = return_z_loss
        self.accum_dtype = accum_dtype
        self.use_token_scaling = use_token_scaling
        self.return_token_accuracy = return_token_accuracy
        self.return_predicted_tokens = return_predicted_tokens

    def forward(self, lin_weight, _input, target, bias=None):
        return liger_fused_linear_cross_entropy(
            _input, lin_weight, target, bias, self.ce_weight, self.ignore_index, self.lse_square_scale,
            self.label_smoothing, self.reduction, self.softcap, self.return_z_loss, self.accum_dtype,
            self.use_token_scaling, self.return_token_accuracy, self.return_predicted_tokens,
            **self.fastce_options,
        )  # fmt: skip
