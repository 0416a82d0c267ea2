"""Per-token objectives inside the fused linear chunk pass: linear_policy_loss (the GRPO-family presets of
policy.py) and linear_token_objective (a caller's elementwise objective of the log-probs and entropies).

Why it is fast. log p_t at the temperature is minus the cross-entropy row loss, and the forward kernel's OUTPUTS
variant also gives the row's mean of z, so H_t = lse_t - mean_z_t (row_entropy). For an objective that is
elementwise in (log p_t, H_t) with per-token inputs known up front, its derivative (g_logp_t, g_H_t) is taken right
after the chunk's forward kernel (`objective_chunks`' callback); the backward kernel's entropy variant
(chunk_gradient with upstream (-g_logp, None, g_H, H)) overwrites the chunk's logits with d loss / d logits, and the
engine's two products fold it into d hidden / d weight: 6 N H V flops, the gradients complete after the forward
(as linear_cross_entropy's "mean"), where linear_log_probs + an objective recomputes each chunk in the backward
(8 N H V). The loss is the sum of the per-token terms; the backward only scales the stored gradients by the
upstream scalar (in place, scale_grads), so a second backward through the same loss raises.

Paths. backend="kernel" (or "auto" on CUDA): the chunk loop, through `ObjectiveFunction` eagerly and, for the presets
under torch.compile, the custom op fastce::linear_policy_loss (the closed-form derivative runs inside it); a user
objective under torch.compile runs eagerly behind torch.compiler.disable (a graph break). backend="reference"
(or "auto" off CUDA, or float64): materialised logits, log_softmax, the same formulas, autograd.
"""

import torch

from ...core.custom_ops import Needs, fake_grads, op_schema, or_empty, records_of, scaled_grads
from ...core.options import Options, check_options, check_temperature, use_kernel, with_temperature
from ...core.outputs import PolicyLossOutput
from ...core.reference import transform
from ...linear import engine
from ...linear.engine import Chunking, check_chunking
from ...linear.scale import scale_grads
from . import launch
from .linear_api import check_linear_tensors, vh_weight
from .linear_autograd import row_entropy
from .linear_chunks import chunk_gradient
from .policy import (
    PolicyOptions,
    check_num_items,
    check_policy_options,
    normalisation_weights,
    policy_metrics,
    token_loss,
    token_loss_and_slope,
)

__all__ = [
    "BACKWARD_TWICE",
    "ObjectiveFunction",
    "linear_policy_loss",
    "linear_token_objective",
    "objective_chunks",
    "policy_loss_op",
    "policy_upstream",
]

BACKWARD_TWICE = (
    "fastce_torch: the gradients of linear_policy_loss / linear_token_objective are computed in the forward and "
    "handed over once: compute the loss again instead of backward twice (retain_graph=True) or create_graph=True"
)


def objective_chunks(hidden, weight, bias, labels, options, chunking, needs, upstream_of, with_entropy=True):
    """The chunk loop: per chunk the forward kernel's log p (0 at ignored rows) and, with_entropy, H (else None);
    upstream_of(rows, labels_chunk, logp, entropy) -> (the chunk's summed loss (0-d), g_logp (rows,), g_H (rows,) or
    None); with any of `needs` the chunk's d logits from the backward kernel, folded into the gradients. Returns
    (loss (0-d float32), logp (N,), entropy (N,) or None, (grad_hidden, grad_weight, grad_bias))."""
    n_rows, device = hidden.shape[0], hidden.device
    with engine.kernel_context(hidden):
        weight_c, bias_c = engine.in_compute_dtype(hidden, weight, bias)
        logp = torch.zeros(n_rows, dtype=torch.float32, device=device)
        entropy = torch.zeros(n_rows, dtype=torch.float32, device=device) if with_entropy else None
        total = torch.zeros((), dtype=torch.float32, device=device)
        grads = engine.new_grads(hidden, weight, bias, needs, chunking)
        for rows, hidden_chunk, labels_chunk, logits, dlogits, first in engine.row_chunks(
            hidden, weight_c, bias_c, labels, chunking, None, any(needs)
        ):
            loss, lse, _, *statistics = launch.forward(logits, labels_chunk, options, outputs=with_entropy)
            chunk_logp = torch.where(labels_chunk == options.ignore_index, 0.0, -loss)
            chunk_entropy = None
            if with_entropy:
                chunk_entropy = row_entropy(lse, statistics[1], labels_chunk, options.ignore_index)
                entropy[rows] = chunk_entropy
            logp[rows] = chunk_logp
            value, g_logp, g_entropy = upstream_of(rows, labels_chunk, chunk_logp, chunk_entropy)
            total += value
            if any(needs):
                g_entropy = None if g_entropy is None else g_entropy.float().contiguous()
                upstream = (-g_logp.float().contiguous(), None, g_entropy, chunk_entropy)
                chunk_gradient(logits, dlogits, labels_chunk, lse, options, upstream)
                engine.accumulate_grads(dlogits, hidden_chunk, weight_c, rows, grads, first)
        return total, logp, entropy, engine.finish_grads(grads, weight, bias)


def policy_upstream(per_token, options):
    """The presets' chunk callback: per_token = (advantages, w, e, old or None, ref or None), flat (N,) float32."""
    advantages, w, e, old, ref = per_token

    def upstream_of(rows, labels_chunk, logp, entropy):
        part = [None if t is None else t[rows] for t in (advantages, w, e, old, ref)]
        loss, slope = token_loss_and_slope(logp, part[0], part[3], part[4], options)
        kept = part[1] != 0
        value = torch.where(kept, part[1] * loss, 0.0).sum()
        g_logp = torch.where(kept, part[1] * slope, 0.0)
        g_entropy = None
        if options.entropy_coef != 0.0:
            value = value + torch.where(part[2] != 0, part[2] * entropy, 0.0).sum()
            g_entropy = part[2]
        return value, g_logp, g_entropy

    return upstream_of


def _objective_upstream(objective, inputs, ignore_index, with_entropy, need_grads):
    """A caller's objective as a chunk callback: autograd on the chunk's vectors (ignored rows dropped)."""

    def upstream_of(rows, labels_chunk, logp, entropy):
        logp = logp.detach().requires_grad_(need_grads)
        entropy = entropy.detach().requires_grad_(need_grads) if with_entropy else None
        with torch.enable_grad():
            values = objective(logp, entropy, *(x[rows] for x in inputs))
            values = checked_values(values, logp.shape)
            value = torch.where(labels_chunk == ignore_index, 0.0, values).sum().float()
        if not need_grads:
            return value.detach(), logp.detach(), None
        wrt = [logp] + ([entropy] if with_entropy else [])
        grads = torch.autograd.grad(value, wrt, allow_unused=True, materialize_grads=True)
        return value.detach(), grads[0], grads[1] if with_entropy else None

    return upstream_of


def checked_values(values, shape):
    """The objective's per-token losses: a floating tensor of the chunk's shape, else an error naming `objective`."""
    if not isinstance(values, torch.Tensor) or not values.dtype.is_floating_point:
        raise TypeError(f"objective must return a floating tensor of per-token losses, got {values!r:.80}")
    if tuple(values.shape) != tuple(shape):
        raise ValueError(f"objective must return per-token losses shaped {tuple(shape)}, got {tuple(values.shape)}")
    return values


class ObjectiveFunction(torch.autograd.Function):
    """The kernel path, eager: (loss, logp, entropy) with the gradients computed in the forward and scaled in the
    backward; logp and entropy (N,) carry no gradient (the metrics' inputs)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, options, chunking, needs, upstream_of, with_entropy):
        loss, logp, entropy, ctx.grads = objective_chunks(
            hidden, weight, bias, labels, options, chunking, needs, upstream_of, with_entropy
        )
        entropy = torch.zeros_like(logp) if entropy is None else entropy
        ctx.mark_non_differentiable(logp, entropy)
        return loss, logp, entropy

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        grads, ctx.grads = ctx.grads, None
        if grads is None or torch.is_grad_enabled():
            raise RuntimeError(BACKWARD_TWICE)
        return (*scale_grads(grads, grad_loss.float()), *(None,) * 6)


# --- the presets' custom op, for torch.compile -------------------------------------------------------------------

_SETTINGS = op_schema(Options, Chunking, Needs, PolicyOptions)


@torch.library.custom_op(
    "fastce::linear_policy_loss",
    mutates_args=(),
    schema="(Tensor hidden, Tensor weight, Tensor? bias, Tensor labels, Tensor advantages, Tensor weights, "
    f"Tensor entropy_weights, Tensor? old, Tensor? ref, {_SETTINGS}) -> "
    "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
)
def policy_loss_op(hidden, weight, bias, labels, advantages, weights, entropy_weights, old, ref, *settings):
    """(loss, logp, entropy, grad_hidden, grad_weight, grad_bias) of the presets (empty stand-ins where no gradient
    is needed)."""
    options, chunking, needs, policy = records_of(settings, Options, Chunking, Needs, PolicyOptions)[:4]
    upstream_of = policy_upstream((advantages, weights, entropy_weights, old, ref), policy)
    loss, logp, entropy, grads = objective_chunks(hidden, weight, bias, labels, options, chunking, needs, upstream_of)
    return (loss, logp, entropy, *(or_empty(grad, hidden) for grad in grads))


@policy_loss_op.register_fake
def _(hidden, weight, bias, labels, *rest):
    needs = records_of(rest[5:], Options, Chunking, Needs, PolicyOptions)[2]
    rows = [hidden.new_empty(hidden.shape[0], dtype=torch.float32) for _ in range(2)]
    return (hidden.new_empty((), dtype=torch.float32), *rows, *fake_grads(hidden, weight, bias, needs))


def _setup_context(ctx, inputs, output):
    ctx.needs = records_of(inputs[9:], Options, Chunking, Needs, PolicyOptions)[2]
    ctx.n_inputs = len(inputs)
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.save_for_backward(*output[3:])


def _backward(ctx, grad_loss, *unused):
    grads = scaled_grads(ctx.saved_tensors, ctx.needs, grad_loss)
    return (*grads, *(None,) * (ctx.n_inputs - 3))


torch.library.register_autograd("fastce::linear_policy_loss", _backward, setup_context=_setup_context)


# --- the public functions ------------------------------------------------------------------------------------------


def _prepared(hidden, weight, bias, tokens, weight_layout, ignore_index, softcap, scaling, temperature, backend):
    """Checked head tensors in their compute dtype and the transform's Options (the temperature folded in)."""
    if isinstance(hidden, torch.Tensor) and hidden.dim() >= 1:
        weight = vh_weight(weight, hidden, weight_layout)
    check_linear_tensors(hidden, weight, bias, tokens)
    options = check_options(ignore_index, "none", None, softcap, scaling, 0.0, 0.0, backend)
    options = with_temperature(options, check_temperature(temperature))
    hidden, weight, bias = engine.autocast_or_common_dtype(hidden, weight, bias)
    return hidden, weight, bias, options


def _per_token(value, name, tokens, dtype, allow_rows=False):
    """A per-token input shaped like tokens ((B,) too with allow_rows), floating or bool, as `dtype` (B, T)."""
    if value is None:
        return None
    shapes = [tuple(tokens.shape)] + ([tuple(tokens.shape[:1])] if allow_rows else [])
    if not isinstance(value, torch.Tensor) or tuple(value.shape) not in shapes:
        raise ValueError(f"{name} must be a tensor shaped {' or '.join(map(str, shapes))}, got {value!r:.80}")
    if not (value.dtype.is_floating_point or value.dtype == torch.bool):
        raise TypeError(f"{name} must be floating (or bool), got {value.dtype}")
    if value.device != tokens.device:
        raise ValueError(f"{name} is on {value.device} but tokens on {tokens.device}")
    value = value.detach().to(dtype)
    return value[:, None].expand(tokens.shape) if value.dim() == 1 and tokens.dim() == 2 else value


def _reference_values(hidden, weight, bias, tokens, options, chunking, with_entropy=True):
    """The plain-torch path's (logp, entropy) (B, T), differentiable: materialised logits, log_softmax."""
    logits = engine.reference_logits(hidden, weight, bias, chunking)
    z = transform(logits, options, tokens)
    z = z if z.dtype == torch.float64 else z.float()
    log_p = torch.log_softmax(z, dim=-1)
    ignored = tokens == options.ignore_index
    picked = log_p.gather(-1, torch.where(ignored, 0, tokens).long().unsqueeze(-1)).squeeze(-1)
    logp = torch.where(ignored, 0.0, picked)
    if not with_entropy:
        return logp, None
    p = log_p.exp()
    entropy = -torch.where(p > 0, p * log_p, 0.0).sum(-1)
    return logp, torch.where(ignored, 0.0, entropy)


def linear_policy_loss(
    hidden, weight, tokens, advantages, *, bias=None, mask=None, old_log_probs=None, ref_log_probs=None,
    loss_type="grpo", epsilon_low=0.2, epsilon_high=None, delta=None, beta=0.0, entropy_coef=0.0, temperature=1.0,
    max_completion_length=None, num_items_in_batch=None, ignore_index=-100, logit_softcapping=0.0,
    logit_scaling=0.0, workspace_bytes=None, weight_layout="vh", backend="auto",
):  # fmt: skip
    """The GRPO-family policy loss of TRL's GRPOTrainer (token-level importance sampling) on the LM head's
    log-probabilities, without the (N, V) logits and with the gradients of hidden, weight and bias computed in the
    forward pass (6 N H V flops): PolicyLossOutput(loss, kl, entropy, clip_ratio_low, clip_ratio_high,
    clip_ratio_region), the metrics detached float32 masked means over `mask`.

    hidden (B, T, H), weight (V, H) (weight_layout="hv": (H, V)), bias (V,) or None; tokens (B, T) the sampled
    completion tokens (position t scores tokens[b, t]); advantages (B,) or (B, T); mask (B, T) float or bool (default
    tokens != ignore_index; ignored tokens are always masked out); old_log_probs (B, T) (default: the current
    log-probs, detached: ratio 1); ref_log_probs (B, T), required when beta != 0. loss_type "grpo", "bnpo", "dr_grpo"
    (needs max_completion_length), "dapo", "cispo"; epsilon_high None: epsilon_low; delta: two-sided clipping. The
    dapo / cispo normaliser is num_items_in_batch when given (a number or 0-d tensor; TRL divides its own by the
    processes and the accumulation steps: pass the normaliser you want), else the mask's sum. entropy_coef: loss -=
    entropy_coef * masked mean of the entropy. temperature, logit_softcapping, logit_scaling: the log-probs'
    transform, as linear_log_probs'. The per-token formulas and weights: policy.py."""
    hidden, weight, bias, options = _prepared(
        hidden, weight, bias, tokens, weight_layout, ignore_index, logit_softcapping, logit_scaling, temperature,
        backend,
    )  # fmt: skip
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be (B, T, H), got {tuple(hidden.shape)}")
    policy = check_policy_options(
        loss_type, epsilon_low, epsilon_high, delta, beta, entropy_coef, max_completion_length
    )
    if beta != 0.0 and ref_log_probs is None:
        raise ValueError("beta != 0 needs ref_log_probs (B, T), the reference model's log-probs")
    chunking = check_chunking(workspace_bytes, None, False)
    kernel = use_kernel(hidden, backend)
    dtype = torch.float32 if kernel or hidden.dtype != torch.float64 else torch.float64
    advantages = _per_token(advantages, "advantages", tokens, dtype, allow_rows=True)
    if advantages is None:
        raise ValueError("advantages must be a tensor shaped (B,) or (B, T), got None")
    old = _per_token(old_log_probs, "old_log_probs", tokens, dtype)
    ref = _per_token(ref_log_probs, "ref_log_probs", tokens, dtype)
    mask = _per_token(mask, "mask", tokens, dtype)
    ignored = tokens == ignore_index
    mask = torch.where(ignored, 0.0, 1.0 if mask is None else mask).to(dtype)
    num_items_in_batch = check_num_items(num_items_in_batch)
    w, e = normalisation_weights(mask, loss_type, max_completion_length, num_items_in_batch, policy.entropy_coef)
    if not kernel:
        logp, entropy = _reference_values(hidden, weight, bias, tokens, options, chunking)
        terms = torch.where(w != 0, w * token_loss(logp, advantages, old, ref, policy), 0.0)
        loss = terms.sum() + torch.where(e != 0, e * entropy, 0.0).sum()
    else:
        flat = [None if t is None else t.reshape(-1).contiguous() for t in (advantages, w, e, old, ref)]
        hidden_2d, labels_1d = hidden.reshape(-1, hidden.shape[-1]), tokens.reshape(-1).contiguous()
        needs = engine.gradients_needed(hidden, weight, bias)
        if torch.compiler.is_compiling():
            loss, logp, entropy = policy_loss_op(
                hidden_2d, weight, bias, labels_1d, *flat, *options, *chunking, *needs, *policy
            )[:3]
        else:
            loss, logp, entropy = ObjectiveFunction.apply(
                hidden_2d, weight, bias, labels_1d, options, chunking, needs, policy_upstream(flat, policy), True
            )
        logp, entropy = logp.view(tokens.shape), entropy.view(tokens.shape)
    metrics = policy_metrics(logp, entropy, advantages, old, ref, mask, policy)
    return PolicyLossOutput(loss, *metrics)


def linear_token_objective(
    hidden, weight, tokens, objective, inputs=(), *, bias=None, with_entropy=False, temperature=1.0,
    ignore_index=-100, logit_softcapping=0.0, logit_scaling=0.0, workspace_bytes=None, weight_layout="vh",
    backend="auto",
):  # fmt: skip
    """sum over the non-ignored tokens of objective(log_probs, entropy, *inputs), a per-token loss of the LM head's
    log-probabilities at the temperature (and entropies with with_entropy, else entropy is None), without the
    (N, V) logits: objective is called per chunk on 1-D vectors of that chunk's rows (inputs: tensors shaped like
    tokens, sliced per chunk the same way; no gradient reaches them) and differentiated there with
    torch.autograd.grad, so the gradients of hidden, weight and bias are complete after the forward (6 N H V flops).
    Ignored tokens: log_probs 0, entropy 0, their losses dropped. Returns a 0-d float32 loss (float64 for float64
    inputs). Under torch.compile the call runs eagerly (a graph break). The keywords are linear_policy_loss's."""
    if not callable(objective):
        raise TypeError(f"objective must be callable, got {objective!r:.80}")
    if not isinstance(inputs, (tuple, list)):
        raise TypeError(f"inputs must be a tuple of tensors shaped like tokens, got {type(inputs).__name__}")
    if not isinstance(with_entropy, bool):
        raise TypeError(f"with_entropy must be a bool, got {with_entropy!r}")
    return _token_objective(
        hidden, weight, tokens, objective, tuple(inputs), bias, with_entropy, temperature, ignore_index,
        logit_softcapping, logit_scaling, workspace_bytes, weight_layout, backend,
    )  # fmt: skip


@torch.compiler.disable
def _token_objective(
    hidden, weight, tokens, objective, inputs, bias, with_entropy, temperature, ignore_index, softcap, scaling,
    workspace_bytes, weight_layout, backend,
):  # fmt: skip
    hidden, weight, bias, options = _prepared(
        hidden, weight, bias, tokens, weight_layout, ignore_index, softcap, scaling, temperature, backend
    )
    for x in inputs:
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(tokens.shape):
            raise ValueError(f"inputs must be tensors shaped like tokens {tuple(tokens.shape)}, got {x!r:.80}")
        if x.device != tokens.device:
            raise ValueError(f"inputs must be on the tokens' device {tokens.device}, got one on {x.device}")
    chunking = check_chunking(workspace_bytes, None, False)
    inputs = tuple(x.detach() for x in inputs)
    if not use_kernel(hidden, backend):
        logp, entropy = _reference_values(hidden, weight, bias, tokens, options, chunking, with_entropy)
        flat = [None if t is None else t.reshape(-1) for t in (logp, entropy)]
        values = checked_values(objective(*flat, *(x.reshape(-1) for x in inputs)), flat[0].shape)
        loss = torch.where(tokens.reshape(-1) == ignore_index, 0.0, values).sum()
        return loss if loss.dtype == torch.float64 else loss.float()
    needs = engine.gradients_needed(hidden, weight, bias)
    flat_inputs = tuple(x.reshape(-1) for x in inputs)
    upstream_of = _objective_upstream(objective, flat_inputs, ignore_index, with_entropy, any(needs))
    hidden_2d, labels_1d = hidden.reshape(-1, hidden.shape[-1]), tokens.reshape(-1).contiguous()
    return ObjectiveFunction.apply(
        hidden_2d, weight, bias, labels_1d, options, chunking, needs, upstream_of, with_entropy
    )[0]
