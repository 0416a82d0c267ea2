"""Liger-Kernel 0.8.5's GRPO loss by name and signature, computed by fastce_torch.linear_policy_loss:

    # from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    from fastce_torch.liger import LigerFusedLinearGRPOLoss

    loss_fn = LigerFusedLinearGRPOLoss(beta=0.04, loss_type="dapo", temperature=0.7)
    loss, metrics = loss_fn(hidden, lm_head.weight, completion_ids, completion_mask, advantages,
                            ref_per_token_logps=ref_logps, old_per_token_logps=old_logps)

Liger computes each chunk's log-probs, runs the objective in torch and differentiates it with autograd (and
recomputes the chunk's logits in that backward); fastce differentiates the same per-token objective inside its chunk
pass (linear_policy_loss: no recompute, 6 N H V flops). The outputs are Liger's: (loss, metrics), loss a 0-d float32
tensor whose gradients reach _input, lin_weight and bias, metrics a tuple of detached 0-d float32 tensors:
[mean k3 KL (only when beta != 0)] + [clip ratio], each sum(x * attention_mask) / clamp(attention_mask.sum(), 1)
as Liger normalises them; the clip ratio is the token share with (r < 1 - epsilon_low and A < 0) or
(r > 1 + epsilon_high and A > 0) (cispo: r > epsilon_high and A > 0). LigerFusedLinearGRPOFunction.apply takes
Liger's positional arguments (ctx excluded) and returns the same pair.

Liger's arguments, as fastce computes them:
- _input (B, T, H) (Liger 0.8.5 needs 3-D; (B*T, H) is also taken, reshaped by selected_token_ids' (B, T) shape),
  lin_weight (V, H), bias (V,), selected_token_ids (B, T), attention_mask (B, T) (the loss mask), advantages (B,)
  (or (B, T)), old_per_token_logps (None: ratio 1), ref_per_token_logps, temperature, beta, epsilon_low,
  epsilon_high, delta, max_completion_length: linear_policy_loss's keywords of the same meaning.
- loss_type "grpo" (per-sequence means, summed, / B), "bnpo", "dr_grpo", "dapo", "cispo": the same reductions as
  Liger's. dapo / cispo divide by Liger's normaliser (_compute_dapo_normalizer): num_items_in_batch / world size
  when given, else attention_mask.sum() summed over the processes / world size, clamped at 1.
- use_ref_model=False drops the reference log-probs (Liger then takes the KL to the current log-probs: 0); with
  use_ref_model=True and beta != 0 the reference log-probs are required (Liger asserts).
- compiled, chunk_size: accepted, change nothing (fastce's chunks follow its workspace_bytes). sapo_temperature_*,
  vespo_*: accepted, used by no loss type fastce computes.
- Refused with a ValueError naming the option and what to do instead: loss_type "sapo", "vespo", "luspo";
  importance_sampling_level="sequence" (GSPO); use_bias_correction_kl=True; vllm_is_ratio; ref_input / ref_weight /
  ref_bias without ref_per_token_logps (the reference model's log-probs computed inside the loss).
- Different on purpose: a token of attention_mask 0 takes no part (a NaN there leaves the loss finite, where
  Liger's loss * mask is NaN); with delta < 1 + epsilon_high the clip ratio counts the ratio after the delta clamp
  (TRL's metric; Liger's counts it before).
Keyword-only extras go to fastce (FASTCE_GRPO_OPTIONS: backend, workspace_bytes, logit_softcapping, ...).
"""

import warnings

import torch

from ..losses.cross_entropy.linear_policy import linear_policy_loss

__all__ = [
    "FASTCE_GRPO_OPTIONS",
    "LOSS_TYPES_FASTCE",
    "LigerFusedLinearGRPOFunction",
    "LigerFusedLinearGRPOLoss",
    "dapo_normaliser",
    "liger_fused_linear_grpo",
]

LOSS_TYPES_FASTCE = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
# fastce_torch.linear_policy_loss keywords a caller may add (keyword-only) to the module.
FASTCE_GRPO_OPTIONS = {
    "backend", "workspace_bytes", "logit_softcapping", "logit_scaling", "ignore_index", "weight_layout",
}  # fmt: skip

_REFUSED_LOSS_TYPES = {
    "sapo": "SAPO's sigmoid gate is per-token: write it for fastce_torch.linear_token_objective",
    "luspo": "LUSPO's length-weighted loss is per-token: write it for fastce_torch.linear_token_objective",
    "vespo": "VESPO's weight depends on the whole sequence's ratio: compute the log-probs with "
    "fastce_torch.linear_log_probs and the objective in torch",
}


def _check_fastce_options(options):
    unknown = sorted(set(options) - FASTCE_GRPO_OPTIONS)
    if unknown:
        raise TypeError(
            f"unexpected keyword(s) {', '.join(unknown)}: past Liger's own arguments, LigerFusedLinearGRPOLoss "
            f"takes only these fastce_torch.linear_policy_loss keywords: {', '.join(sorted(FASTCE_GRPO_OPTIONS))}"
        )
    return options


def _check_settings(loss_type, importance_sampling_level, use_bias_correction_kl, sapo_pos, sapo_neg, delta):
    """Liger's constructor checks, and the refusals of what fastce does not compute."""
    if sapo_pos <= 0:
        raise ValueError(f"sapo_temperature_pos must be positive, got {sapo_pos}")
    if sapo_neg <= 0:
        raise ValueError(f"sapo_temperature_neg must be positive, got {sapo_neg}")
    if delta is not None and delta <= 0:
        raise ValueError(f"delta must be positive, got {delta}")
    if loss_type in _REFUSED_LOSS_TYPES:
        raise ValueError(
            f"loss_type={loss_type!r} is not computed by fastce_torch.liger.LigerFusedLinearGRPOLoss (it computes "
            f"{', '.join(LOSS_TYPES_FASTCE)}): {_REFUSED_LOSS_TYPES[loss_type]}, or use Liger's own class"
        )
    if loss_type not in LOSS_TYPES_FASTCE:
        raise ValueError(f"Unknown loss type: {loss_type!r} (fastce computes {', '.join(LOSS_TYPES_FASTCE)})")
    if importance_sampling_level == "sequence":
        raise ValueError(
            'importance_sampling_level="sequence" (GSPO\'s sequence-level ratio) is not per-token, so fastce does not '
            "fuse it: compute the log-probs with fastce_torch.linear_log_probs (differentiable) and the objective in "
            "torch, or use Liger's own class"
        )
    if importance_sampling_level != "token":
        raise ValueError(
            f"Unknown importance sampling level: {importance_sampling_level!r}. Possible values are 'token' and "
            "'sequence'."
        )
    if use_bias_correction_kl:
        raise ValueError(
            "use_bias_correction_kl=True (the KL times the importance ratio) is not computed by fastce's GRPO preset: "
            "write the objective for fastce_torch.linear_token_objective, or use Liger's own class"
        )


def dapo_normaliser(attention_mask, num_items_in_batch=None):
    """Liger's dapo / cispo normaliser (LigerFusedLinearPPOBase._compute_dapo_normalizer): num_items_in_batch /
    world size when given, else attention_mask.sum() summed over the processes / world size; clamped at 1."""
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    world_size = torch.distributed.get_world_size() if distributed else 1
    if num_items_in_batch is not None:
        normaliser = torch.as_tensor(num_items_in_batch, device=attention_mask.device).to(torch.float32)
        return torch.clamp(normaliser.reshape(()) / world_size, min=1.0)
    normaliser = attention_mask.detach().to(torch.float32).sum()
    if distributed:
        torch.distributed.all_reduce(normaliser, op=torch.distributed.ReduceOp.SUM)
    return torch.clamp(normaliser / world_size, min=1.0)


def _reference_log_probs(use_ref_model, beta, ref_per_token_logps, ref_input, ref_weight, ref_bias):
    """The reference log-probs fastce uses (None: the KL term is 0), with Liger's checks and warning."""
    computed_inside = ref_input is not None or ref_weight is not None or ref_bias is not None
    if use_ref_model and ref_per_token_logps is None:
        if computed_inside:
            raise ValueError(
                "ref_input / ref_weight / ref_bias (the reference model's log-probs computed inside the loss) are not "
                "supported by fastce_torch.liger.LigerFusedLinearGRPOLoss: compute them with "
                "fastce_torch.linear_log_probs(ref_input.view(B, T, H), ref_weight, selected_token_ids, "
                "bias=ref_bias, temperature=...) under torch.no_grad() and pass ref_per_token_logps"
            )
        if beta != 0.0:
            raise ValueError("If use_ref_model is True, ref_per_token_logps or ref_input must be provided")
    if use_ref_model and ref_per_token_logps is not None and ref_input is not None:
        warnings.warn("Both ref_per_token_logps and ref_input are provided. Using ref_per_token_logps.", stacklevel=3)
    return ref_per_token_logps if use_ref_model else None


def liger_fused_linear_grpo(
    _input, weight, selected_token_ids, attention_mask, advantages, bias=None, ref_per_token_logps=None,
    old_per_token_logps=None, ref_input=None, ref_weight=None, ref_bias=None, beta=0.04, epsilon_low=0.2,
    epsilon_high=0.2, loss_type="dapo", max_completion_length=None, importance_sampling_level="token",
    sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, temperature=1.0, compiled=True, use_ref_model=True,
    chunk_size=1, vllm_is_ratio=None, delta=None, use_bias_correction_kl=False, vespo_k_pos=2.0,
    vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0, num_items_in_batch=None, **fastce_options,
):  # fmt: skip
    """LigerFusedLinearGRPOFunction's computation (its positional arguments, ctx excluded) -> (loss, metrics)."""
    del compiled, chunk_size, vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg  # no meaning here
    _check_fastce_options(fastce_options)
    _check_settings(
        loss_type, importance_sampling_level, use_bias_correction_kl, sapo_temperature_pos, sapo_temperature_neg,
        delta,
    )  # fmt: skip
    if vllm_is_ratio is not None:
        raise ValueError(
            "vllm_is_ratio (a per-token factor on the policy term, not on the KL) is not computed by fastce's GRPO "
            "preset: write the objective with the ratio as an input for fastce_torch.linear_token_objective, or use "
            "Liger's own class"
        )
    if not isinstance(selected_token_ids, torch.Tensor) or selected_token_ids.dim() != 2:
        raise ValueError(f"selected_token_ids must be a (B, T) tensor, got {selected_token_ids!r:.80}")
    if not isinstance(_input, torch.Tensor) or _input.dim() not in (2, 3):
        raise ValueError(f"_input must be a (B, T, H) (or (B*T, H)) tensor, got {_input!r:.80}")
    hidden = _input.view(*selected_token_ids.shape, _input.shape[-1]) if _input.dim() == 2 else _input
    if isinstance(attention_mask, torch.Tensor) and not (
        attention_mask.dtype.is_floating_point or attention_mask.dtype == torch.bool
    ):
        attention_mask = attention_mask.to(torch.float32)  # TRL's completion_mask is an integer tensor
    ref = _reference_log_probs(use_ref_model, beta, ref_per_token_logps, ref_input, ref_weight, ref_bias)
    if loss_type in ("dapo", "cispo"):
        num_items_in_batch = dapo_normaliser(attention_mask, num_items_in_batch)
    out = linear_policy_loss(
        hidden, weight, selected_token_ids, advantages, bias=bias, mask=attention_mask,
        old_log_probs=None if old_per_token_logps is None else old_per_token_logps.float(),
        ref_log_probs=None if ref is None else ref.float(), loss_type=loss_type, epsilon_low=epsilon_low,
        epsilon_high=epsilon_high, delta=delta, beta=beta if ref is not None else 0.0, temperature=temperature,
        max_completion_length=max_completion_length, num_items_in_batch=num_items_in_batch, **fastce_options,
    )  # fmt: skip
    metrics = ([out.kl] if beta != 0.0 else []) + [out.clip_ratio_region]
    return out.loss, tuple(metrics)


class LigerFusedLinearGRPOFunction:
    """liger_kernel.chunked_loss.grpo_loss.LigerFusedLinearGRPOFunction: only `apply` (Liger's positional arguments
    after ctx: _input, weight, selected_token_ids, attention_mask, advantages, bias, ref_per_token_logps,
    old_per_token_logps, ref_input, ref_weight, ref_bias, beta, epsilon_low, epsilon_high, loss_type, ...)."""

    apply = staticmethod(liger_fused_linear_grpo)


class LigerFusedLinearGRPOLoss(torch.nn.Module):
    """liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss (0.8.5): forward(_input (B, T, H), lin_weight (V, H),
    selected_token_ids (B, T), attention_mask (B, T), advantages (B,), ...) -> (loss, metrics) (module docstring).
    Keyword-only extras are fastce_torch.linear_policy_loss keywords (FASTCE_GRPO_OPTIONS)."""

    def __init__(
        self, beta=0.04, compiled=True, use_ref_model=True, chunk_size=1, epsilon_low=0.2, epsilon_high=0.2,
        loss_type="dapo", max_completion_length=None, importance_sampling_level="token", sapo_temperature_pos=1.0,
        sapo_temperature_neg=1.05, temperature=1.0, delta=None, use_bias_correction_kl=False, vespo_k_pos=2.0,
        vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0, **fastce_options,
    ):  # fmt: skip
        super().__init__()
        _check_settings(
            loss_type, importance_sampling_level, use_bias_correction_kl, sapo_temperature_pos,
            sapo_temperature_neg, delta,
        )  # fmt: skip
        self.fastce_options = _check_fastce_options(fastce_options)
        self.beta = beta
        self.compiled = compiled
        self.use_ref_model = use_ref_model
        self.chunk_size = chunk_size
        self.epsilon_low = epsilon_low
        self.epsilon_high = epsilon_high
        self.loss_type = loss_type
        self.max_completion_length = max_completion_length
        self.importance_sampling_level = importance_sampling_level
        self.sapo_temperature_pos = sapo_temperature_pos
        self.sapo_temperature_neg = sapo_temperature_neg
        self.temperature = temperature
        self.delta = delta
        self.use_bias_correction_kl = use_bias_correction_kl
        self.vespo_k_pos = vespo_k_pos
        self.vespo_lambda_pos = vespo_lambda_pos
        self.vespo_k_neg = vespo_k_neg
        self.vespo_lambda_neg = vespo_lambda_neg

    def forward(
        self, _input, lin_weight, selected_token_ids, attention_mask, advantages, bias=None, ref_per_token_logps=None,
        old_per_token_logps=None, ref_input=None, ref_weight=None, ref_bias=None, vllm_is_ratio=None,
        num_items_in_batch=None,
    ):  # fmt: skip
        return liger_fused_linear_grpo(
            _input, lin_weight, selected_token_ids, attention_mask, advantages, bias, ref_per_token_logps,
            old_per_token_logps, ref_input, ref_weight, ref_bias, self.beta, self.epsilon_low, self.epsilon_high,
            self.loss_type, self.max_completion_length, self.importance_sampling_level, self.sapo_temperature_pos,
            self.sapo_temperature_neg, self.temperature, self.compiled, self.use_ref_model, self.chunk_size,
            vllm_is_ratio, self.delta, self.use_bias_correction_kl, self.vespo_k_pos, self.vespo_lambda_pos,
            self.vespo_k_neg, self.vespo_lambda_neg, num_items_in_batch, **self.fastce_options,
        )  # fmt: skip
