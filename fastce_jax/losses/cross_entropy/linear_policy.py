"""Per-token objectives of log p_t and the entropy H_t inside the fused linear chunk pass: ``linear_policy_loss``
(the GRPO-family presets of policy.py) and ``linear_token_objective`` (a caller's objective), without the (N, V)
logits.

Why it is one pass. log p_t at the temperature is minus the cross-entropy row loss and H_t = lse_t - mean_z_t, both
from the CE forward kernel (its entropy variant). An objective elementwise in (log p_t, H_t) whose other per-token
inputs are known up front has its derivative (g_logp_t, g_H_t) right after the chunk's forward kernel (jax.vjp of
the objective on the chunk's vectors, ``objective_pass``); the CE backward kernel (upstream g_loss = -g_logp, and
g_entropy = g_H with mz = lse - H) then overwrites the chunk's logits with d logits in place and
engine.accumulate_grads folds them into d hidden / d weight / d bias: 6·N·H·V of matmul work, as the fused "mean"
loss. The loss is the sum of the per-token values; the custom_vjp keeps the gradients as residuals and its backward
only scales them by the upstream scalar. A call that is not differentiated runs the forward kernels alone.

backend="reference" (and "auto" off a GPU): the logits materialised, the jnp row statistics (core/reference.py), the
same objective on all rows at once, plain autodiff: the path the kernel pass is tested against.

Not in this slice: sharded heads (the pass runs on the whole arrays, never through distributed/linear_sharded.py),
skip_ignored_rows and logits_dtype="float32" (the engine supports both; the keywords are not exposed yet).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ...core.launch import quiet_triton
from ...core.options import Extras, check_flag, check_float_array, check_options, ignore_value, on_gpu
from ...core.outputs import PolicyLossOutput
from ...core.reference import reference_row_outputs
from ...linear import engine
from . import policy
from .linear_api import check_head_tensors, check_tokens, check_weight_layout, static_config
from .linear_chunks import StaticConfig, ce_backward_in_place, ce_forward

__all__ = ["PassConfig", "objective_pass", "linear_token_objective", "linear_policy_loss"]


class PassConfig(NamedTuple):
    """The static configuration of one objective pass (a custom_vjp nondiff argument, a jit static argument)."""

    st: StaticConfig  # the chunk loop's (st.returns.entropy: the forward kernels give H)
    objective: object  # objective(logp, H or None, *inputs) -> per-token values; hashable
    entropy_grad: bool  # the objective's H derivative goes into the backward kernel


def _checked_values(values, rows: int):
    """The objective's result on a chunk of ``rows`` tokens as float32 (rows,), or an error naming objective."""
    shape = getattr(values, "shape", None)
    if shape is None or tuple(shape) != (rows,):
        raise ValueError(
            f"objective must return per-token values of shape ({rows},) for a chunk of {rows}, got {shape}"
        )
    if not jnp.issubdtype(values.dtype, jnp.floating):
        raise TypeError(f"objective must return a floating array, got {values.dtype}")
    return values.astype(jnp.float32)


def _chunk_objective(cfg: PassConfig, logp, entropy, inputs, keep, want_grads):
    """The chunk's per-token values (0 where not kept) and, when want_grads, (g_logp, g_H or None) per row."""
    with_entropy = cfg.st.returns.entropy

    def values_of(lp, h):
        values = _checked_values(cfg.objective(lp, h if with_entropy else None, *inputs), lp.shape[0])
        return jnp.where(keep, values, 0.0)

    if not want_grads:
        return values_of(logp, entropy), None
    primals = (logp, entropy) if with_entropy else (logp,)
    values, vjp = jax.vjp(lambda *p: values_of(p[0], p[1] if with_entropy else None), *primals)
    cot = vjp(jnp.ones_like(values))
    g_logp = jnp.where(keep, cot[0], 0.0)
    g_entropy = jnp.where(keep, cot[1], 0.0) if with_entropy and cfg.entropy_grad else None
    return values, (g_logp, g_entropy)


def objective_pass(hidden, weight, bias, tokens, inputs, cfg: PassConfig, want_grads: bool):
    """The chunk loop: (loss = the sum of the per-token values, log p (N,), H (N,) or None, gradients (d hidden,
    d weight, d bias) of the loss or None). hidden (N, H), tokens (N,), inputs: a tuple of (N,) arrays."""
    st = cfg.st
    n = hidden.shape[0]
    ign = ignore_value(tokens.dtype, st.options.ignore_index)

    def step(k, carry, first):
        start, fresh, _ = engine.chunk_span(k, n, st)
        h_c, y_c = engine.rows_of(hidden, start, st, None), engine.rows_of(tokens, start, st, None)
        logits = engine.chunk_logits(h_c, weight, bias, st.dtype, st.logits_dtype, st.weight_hv)
        loss_c, lse_c, *extra_c = ce_forward(logits, y_c, st)
        logp_c = -loss_c
        ent_c = extra_c[0] if st.returns.entropy else None
        keep = fresh if ign is None else fresh & (y_c != ign)
        inputs_c = tuple(engine.rows_of(x, start, st, None) for x in inputs)
        values, grads = _chunk_objective(cfg, logp_c, ent_c, inputs_c, keep, want_grads)
        out = dict(
            values=engine.put_rows(carry["values"], start, fresh, values),
            logp=engine.put_rows(carry["logp"], start, fresh, logp_c),
        )
        if ent_c is not None:
            out["entropy"] = engine.put_rows(carry["entropy"], start, fresh, ent_c)
        if want_grads:
            g_logp, g_entropy = grads
            ent = None if g_entropy is None else (g_entropy, lse_c - ent_c)
            dlogits = ce_backward_in_place(logits, y_c, lse_c, -g_logp, st, entropy=ent)
            out.update(engine.accumulate_grads(dlogits, h_c, weight, start, fresh, carry, first, st))
        return out

    def initial():
        carry = dict(values=jnp.zeros((n,), jnp.float32), logp=jnp.zeros((n,), jnp.float32))
        if st.returns.entropy:
            carry["entropy"] = jnp.zeros((n,), jnp.float32)
        if want_grads:
            carry["dh"] = jnp.zeros((n, hidden.shape[1]), st.dtype)
        return carry

    carry = engine.run_chunks(n, st, None, initial, step, weight if want_grads else None)
    grads = (carry["dh"], carry["dw"], carry.get("db")) if want_grads else None
    return jnp.sum(carry["values"]), carry["logp"], carry.get("entropy"), grads


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _objective_loss(hidden, weight, bias, tokens, inputs, cfg: PassConfig):
    loss, logp, entropy, _ = objective_pass(hidden, weight, bias, tokens, inputs, cfg, False)
    return loss, logp, entropy


def _objective_fwd(hidden, weight, bias, tokens, inputs, cfg: PassConfig):
    loss, logp, entropy, grads = objective_pass(hidden, weight, bias, tokens, inputs, cfg, True)
    likes = (jnp.zeros((0,), hidden.dtype), jnp.zeros((0,), weight.dtype), None if bias is None else bias[:0])
    return (loss, logp, entropy), (grads, likes, inputs)


def _objective_bwd(cfg: PassConfig, residuals, g):
    grads, (h_like, w_like, b_like), inputs = residuals
    # The per-token log p and H outputs leave through stop_gradient (linear_policy_loss's metrics): only the
    # loss's cotangent counts; the inputs get no gradient.
    dh, dw, db = engine.finish_grads(grads, h_like, w_like, b_like, scale=g[0].astype(jnp.float32))
    return dh, dw, db, None, jax.tree.map(jnp.zeros_like, inputs)


_objective_loss.defvjp(_objective_fwd, _objective_bwd)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _kernel_objective(h2, weight, bias, tokens, inputs, *, cfg: PassConfig):
    loss, logp, entropy = _objective_loss(h2, weight, bias, tokens, inputs, cfg)
    return loss, jax.lax.stop_gradient(logp), None if entropy is None else jax.lax.stop_gradient(entropy)


def _reference_objective(h2, weight, bias, tokens, inputs, options, objective, with_entropy, dtype, hv):
    """The jnp path: the materialised logits' row statistics, the objective on all rows, plain autodiff."""
    logits = engine.chunk_logits(h2, weight, bias, dtype, None, hv)
    losses, _, _, entropy = reference_row_outputs(logits, tokens, options, Extras(entropy=with_entropy))
    ign = ignore_value(tokens.dtype, options.ignore_index)
    keep = jnp.ones(tokens.shape, bool) if ign is None else tokens != ign
    logp = jnp.where(keep, -losses, 0.0)
    if entropy is not None:
        entropy = jnp.where(keep, entropy, 0.0)
    values = _checked_values(objective(logp, entropy, *inputs), tokens.shape[0])
    values = jnp.where(keep, values, 0.0)
    return jnp.sum(values), jax.lax.stop_gradient(logp), None if entropy is None else jax.lax.stop_gradient(entropy)


def _run(hidden, weight, bias, tokens, inputs, objective, *, with_entropy, entropy_grad, options, backend, hv,
         workspace_bytes):  # fmt: skip
    """(loss, log p (N,), H (N,) or None) of the objective through the kernel pass or the jnp reference."""
    vocab, dim = weight.shape[::-1] if hv else weight.shape
    dtype = jnp.dtype(jnp.result_type(hidden.dtype, weight.dtype, *(() if bias is None else (bias.dtype,))))
    engine.check_chunking(workspace_bytes, None, False)
    if backend == "auto":
        backend = "kernel" if on_gpu(hidden) else "reference"
    h2 = hidden.reshape(-1, dim)
    tokens = jnp.asarray(tokens).reshape(-1)
    inputs = tuple(jnp.asarray(x).reshape(-1) for x in inputs)
    if backend == "reference" or h2.shape[0] == 0 or dtype == jnp.float64:
        return _reference_objective(h2, weight, bias, tokens, inputs, options, objective, with_entropy, dtype, hv)
    st = static_config(
        hidden, weight, bias, options, "sum", dtype, None, Extras(entropy=with_entropy), None,
        workspace_bytes=workspace_bytes, chunk_rows=None, accumulate_in_float32=False, skip_ignored_rows=False, hv=hv,
    )._replace(partitioned=False)  # fmt: skip
    cfg = PassConfig(st, objective, bool(entropy_grad and with_entropy))
    with quiet_triton(st.interpret):
        return _kernel_objective(h2, weight, bias, tokens, inputs, cfg=cfg)


def _check_inputs(inputs, shape):
    if not isinstance(inputs, (tuple, list)):
        raise TypeError(f"inputs must be a tuple of arrays shaped like tokens, got {type(inputs).__name__}")
    out = []
    for i, x in enumerate(inputs):
        x = jnp.asarray(x)
        if tuple(x.shape) != tuple(shape):
            raise ValueError(f"inputs[{i}] must be shaped like tokens {tuple(shape)}, got {tuple(x.shape)}")
        out.append(x)
    return tuple(out)


def _head_options(hidden, weight, bias, tokens, weight_layout, ignore_index, temperature, logit_softcapping,
                  logit_scaling, backend):  # fmt: skip
    hv = check_weight_layout(weight_layout)
    hidden, weight, bias = check_head_tensors(hidden, weight, bias, hv)
    options = check_options(
        ignore_index=ignore_index, reduction="sum", logit_softcapping=logit_softcapping, logit_scaling=logit_scaling,
        label_smoothing=0.0, z_loss=0.0, backend=backend, temperature=temperature,
    )  # fmt: skip
    return hidden, weight, bias, check_tokens(tokens, hidden), options, hv


def linear_token_objective(
    hidden, weight, tokens, objective, inputs=(), *, bias=None, with_entropy=False, temperature=1.0,
    ignore_index=-100, logit_softcapping=0.0, logit_scaling=0.0, workspace_bytes=None, weight_layout="vh",
    backend="auto",
):  # fmt: skip
    """sum over the non-ignored tokens of ``objective(log_probs, entropy, *inputs)``, the log-probabilities (and
    entropies) of ``tokens`` under softmax(softcap(scaling * (hidden @ weight.T + bias)) / temperature), without the
    (N, V) logits.

    objective is called per chunk on 1-D vectors of that chunk's rows (log_probs float32; entropy None unless
    with_entropy; each of ``inputs``, arrays shaped like tokens, sliced alike) and returns the per-token values,
    a floating vector of the same length (else an error naming ``objective``). Ignored tokens see log_probs 0 and
    entropy 0, their values are dropped and they get no gradient. The objective is differentiated by jax.vjp inside
    the chunk pass: jit and grad work; it must be a function of its arguments (pass per-token data through
    ``inputs``, not a closure over traced values) and hashable (a function is). Gradients reach hidden, weight and
    bias only (the inputs get zeros). hidden (..., H), tokens (...) int32 / int64; the other keywords as
    ``linear_log_probs``'s. Returns the 0-d float32 loss.
    """
    if not callable(objective):
        raise TypeError(f"objective must be callable, got {type(objective).__name__}")
    hidden, weight, bias, tokens, options, hv = _head_options(
        hidden, weight, bias, tokens, weight_layout, ignore_index, temperature, logit_softcapping, logit_scaling,
        backend,
    )  # fmt: skip
    with_entropy = check_flag(with_entropy, "with_entropy")
    inputs = _check_inputs(inputs, tokens.shape)
    loss, _, _ = _run(
        hidden, weight, bias, tokens, inputs, objective, with_entropy=with_entropy, entropy_grad=True,
        options=options, backend=backend, hv=hv, workspace_bytes=workspace_bytes,
    )  # fmt: skip
    return loss


def _per_token(x, name, shape, *, required=False):
    """An optional (B, T) float array as float32, or None."""
    if x is None:
        if required:
            raise ValueError(f"{name} is required here")
        return None
    x = check_float_array(x, name)
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have tokens' shape {tuple(shape)}, got {tuple(x.shape)}")
    return x.astype(jnp.float32)


def _policy_inputs(tokens, advantages, mask, ignore_index):
    """(advantages (B, T) float32, mask (B, T) float32: the caller's mask (default all), 0 on ignored tokens)."""
    shape = tuple(tokens.shape)
    advantages = check_float_array(advantages, "advantages")
    if tuple(advantages.shape) == shape[:1]:
        advantages = jnp.broadcast_to(advantages[:, None], shape)
    elif tuple(advantages.shape) != shape:
        raise ValueError(f"advantages must have shape (B,) = {shape[:1]} or (B, T) = {shape}, got {advantages.shape}")
    if mask is None:
        mask = jnp.ones(shape, jnp.float32)
    else:
        mask = jnp.asarray(mask)
        if tuple(mask.shape) != shape:
            raise ValueError(f"mask must have tokens' shape {shape}, got {tuple(mask.shape)}")
        if not (mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.floating)):
            raise TypeError(f"mask must be bool or floating, got {mask.dtype}")
        mask = mask.astype(jnp.float32)
    ign = ignore_value(tokens.dtype, ignore_index)
    if ign is not None:
        mask = jnp.where(tokens == ign, 0.0, mask)
    return advantages.astype(jnp.float32), mask


def linear_policy_loss(
    hidden, weight, tokens, advantages, *, bias=None, mask=None, old_log_probs=None, ref_log_probs=None,
    loss_type="grpo", epsilon_low=0.2, epsilon_high=None, delta=None, beta=0.0, entropy_coef=0.0, temperature=1.0,
    max_completion_length=None, num_items_in_batch=None, ignore_index=-100, logit_softcapping=0.0, logit_scaling=0.0,
    workspace_bytes=None, weight_layout="vh", backend="auto",
) -> PolicyLossOutput:  # fmt: skip
    """TRL's GRPO-family policy loss (GRPOTrainer._compute_loss, token level) from the policy's hidden states,
    without the (N, V) logits: one fused pass computes the loss and (under grad) its gradients.

    hidden (B, T, H); tokens (B, T) the sampled completion tokens, aligned (position t scores tokens[b, t]);
    advantages (B,) or (B, T); mask (B, T) float or bool (default tokens != ignore_index; ignored tokens are always
    out); old_log_probs (B, T) (default the current log-probs detached: ratio 1); ref_log_probs (B, T), required
    when beta != 0. loss_type: "grpo", "bnpo", "dr_grpo" (needs max_completion_length), "dapo", "cispo"
    (policy.py has the formulas). epsilon_high None means epsilon_low; delta: the two-sided clip's upper bound on the
    ratio. dapo / cispo divide by num_items_in_batch when given, else by mask.sum(): TRL divides its
    num_items_in_batch by the processes and the accumulation steps, so pass the normaliser you want. entropy_coef:
    TRL's entropy bonus (loss -= entropy_coef * the masked mean of H). temperature, logit_softcapping,
    logit_scaling, weight_layout, workspace_bytes, backend: as linear_log_probs's.

    Returns PolicyLossOutput(loss, kl, entropy, clip_ratio_low, clip_ratio_high, clip_ratio_region): the loss 0-d
    float32, differentiable in hidden, weight and bias; the metrics detached float32 masked means as TRL logs them
    (kl 0 when beta == 0; cispo: high is TRL's cispo_clip_ratio, low 0, region = high).
    """
    hidden, weight, bias, tokens, options, hv = _head_options(
        hidden, weight, bias, tokens, weight_layout, ignore_index, temperature, logit_softcapping, logit_scaling,
        backend,
    )  # fmt: skip
    if hidden.ndim != 3:
        raise ValueError(f"hidden must have shape (B, T, H), got {tuple(hidden.shape)}")
    po = policy.check_policy_options(
        loss_type=loss_type, epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta, beta=beta,
        entropy_coef=entropy_coef, max_completion_length=max_completion_length, has_old=old_log_probs is not None,
    )  # fmt: skip
    shape = tuple(tokens.shape)
    advantages, mask = _policy_inputs(tokens, advantages, mask, options.ignore_index)
    old = _per_token(old_log_probs, "old_log_probs", shape)
    ref = _per_token(ref_log_probs, "ref_log_probs", shape, required=po.beta != 0.0)
    normaliser = policy.check_normaliser(num_items_in_batch)
    w, e = policy.token_weights(mask, po, normaliser)
    zeros = jnp.zeros(shape, jnp.float32)
    inputs = (zeros if old is None else old, advantages, zeros if ref is None else ref, w, e, mask)
    loss, logp, entropy = _run(
        hidden, weight, bias, tokens, inputs, policy.PolicyObjective(po), with_entropy=True,
        entropy_grad=po.entropy_coef != 0.0, options=options, backend=backend, hv=hv,
        workspace_bytes=workspace_bytes,
    )  # fmt: skip
    metrics = policy.policy_metrics(
        logp.reshape(shape), entropy.reshape(shape), old, advantages, ref, mask, po
    )  # fmt: skip
    return PolicyLossOutput(loss.astype(jnp.float32), *metrics)
