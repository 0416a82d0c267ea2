"""Fused cross-entropy for JAX: the custom_vjp around the Pallas kernels and the public ``cross_entropy`` and
``cross_entropy_reference``. Options, checks and the jnp formulas are in contract.py; the loss contract is
CONTRACT.md at the repository root.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import contract, kernels, ops, token_inputs
from .contract import Options

# Where the kernels run: compiled (GPU), interpreted (Pallas interpret=True), or, for backend="auto" under a trace
# in a process with a GPU backend, decided when the computation is lowered (jax.lax.platform_dependent: the compiled
# kernels on cuda/rocm, the reference elsewhere).
COMPILED, INTERPRETED, COMPILED_ELSE_REFERENCE = "compiled", "interpreted", "compiled_else_reference"


def _route(x, backend: str) -> str:
    """The path for logits x: "reference" or one of the kernel modes above."""
    if backend == "reference":
        return "reference"
    on_gpu = contract.placement(x)
    if on_gpu is None and not contract.gpu_available():
        on_gpu = False  # traced on a machine without GPUs: it can only run on the CPU (or another non-GPU device)
    if backend == "auto":
        return {True: COMPILED, False: "reference", None: COMPILED_ELSE_REFERENCE}[on_gpu]
    # backend="kernel" asks for the kernels: traced in a GPU process, the compiled ones (staging out interpret
    # mode as well would fail where it cannot be traced, e.g. inside shard_map with check_vma=True).
    return INTERPRETED if on_gpu is False else COMPILED


# ----------------------------------------------------------------------------
# custom_vjp around the kernels.
# ----------------------------------------------------------------------------


def _reference_forward(logits, labels, options: Options, returns=contract.NO_EXTRAS, weight=None):
    if returns:
        loss, lse, accuracy, entropy = contract.reference_row_outputs(logits, labels, options, returns, weight)
        return (loss, lse) + tuple(v for v in (accuracy, entropy) if v is not None)
    # The reference backward recomputes from the logits; the lse slot only keeps both branches' outputs alike.
    loss = contract.reference_token_losses(logits, labels, options, weight)
    return loss, jnp.zeros_like(loss)


def _route_forward(logits, labels, options: Options, mode: str, configs, returns=contract.NO_EXTRAS, weight=None):
    kw = {"returns": returns} if returns else {}
    # Class weights travel as one more operand (none without them).
    weights = () if weight is None else (weight,)

    def compiled(x, y, *w, interpret=False):
        return ops.forward(x, y, options, interpret=interpret, config=configs[0], **kw, **dict(zip(["weight"], w)))

    if mode in (COMPILED, INTERPRETED):
        return compiled(logits, labels, *weights, interpret=mode == INTERPRETED)

    def elsewhere(x, y, *w):
        return _reference_forward(x, y, options, returns, *w)

    return jax.lax.platform_dependent(logits, labels, *weights, cuda=compiled, rocm=compiled, default=elsewhere)


def _route_backward(
    logits, labels, lse, g, options: Options, inplace: bool, mode: str, configs, g_lse=None, weight=None,
    g_entropy=None, mz=None,
):  # fmt: skip
    kw = {} if g_lse is None else {"g_lse": g_lse}
    if weight is not None:
        kw["weight"] = weight
    if g_entropy is not None:
        kw.update(g_entropy=g_entropy, mz=mz)

    def compiled(x, y, lse, g, *gl, interpret=False):
        return ops.backward(
            x, y, lse, g, options, inplace=inplace, interpret=interpret, config=configs[1], **dict(zip(kw, gl))
        )

    extra = tuple(kw.values())
    if mode in (COMPILED, INTERPRETED):
        return compiled(logits, labels, lse, g, *extra, interpret=mode == INTERPRETED)

    def elsewhere(x, y, lse, g, *gl):
        named = dict(zip(kw, gl))
        named.pop("mz", None)  # the reference recomputes it
        return contract.reference_backward(x, y, g, options, **named)

    return jax.lax.platform_dependent(logits, labels, lse, g, *extra, cuda=compiled, rocm=compiled, default=elsewhere)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _kernel_token_losses(logits, labels, weight, options: Options, inplace: bool, mode: str, configs, returns):
    """Per-token losses; with any extra output asked for, the tuple (loss, lse, accuracy?, entropy?) of the
    forward kernels (lse differentiable when a returned z_loss needs it, entropy differentiable, accuracy not).
    weight: class weights (V,) or None (a constant: contract.check_class_weight refuses its gradient). A call
    that is not differentiated runs this (no residuals kept)."""
    outs = _route_forward(logits, labels, options, mode, configs, returns, weight)
    return tuple(outs) if returns else outs[0]


def _kernel_fwd(logits, labels, weight, options: Options, inplace: bool, mode: str, configs, returns):
    # symbolic_zeros: the primals arrive wrapped (CustomVJPPrimal); weight may be None.
    logits, labels, weight = (None if a is None else a.value for a in (logits, labels, weight))
    # logits (..., V) and labels (...) keep their shape here so that a sharding
    # of any leading axis reaches ops.py without a reshape across devices.
    outs = _route_forward(logits, labels, options, mode, configs, returns, weight)
    entropy = outs[-1] if returns.entropy else None
    # Residuals: only what the backward reads.  logits stays in its own dtype
    # (no float32 copy); lse (and the entropy, when returned) is N floats.
    return (tuple(outs) if returns else outs[0]), (logits, labels, outs[1], entropy, weight)


def _is_zero(cotangent) -> bool:
    """Whether a cotangent is symbolically zero (its output is not differentiated)."""
    return isinstance(cotangent, jax.custom_derivatives.SymbolicZero)


def _kernel_bwd(options: Options, inplace: bool, mode: str, configs, returns, residuals, g):
    logits, labels, lse, entropy, weight = residuals
    cotangents = list(g) if returns else [g]
    no_weight_grad = None if weight is None else jnp.zeros_like(weight)
    # Only lse's cotangent (from a returned z_loss) and the entropy's flow back; accuracy is not differentiable.
    # An output that is not differentiated gets a symbolic zero: its kernel variant does not run.
    g_lse = cotangents[1] if contract.lse_differentiated(options, returns) else None
    g_lse = None if _is_zero(g_lse) else g_lse
    g_entropy = cotangents[-1] if returns.entropy and not _is_zero(cotangents[-1]) else None
    g_loss = cotangents[0]
    if _is_zero(g_loss):
        if g_lse is None and g_entropy is None:
            return jnp.zeros_like(logits), None, no_weight_grad
        g_loss = jnp.zeros(labels.shape, jnp.float32)
    # g_loss is the per-token upstream factor: 1/denominator (broadcast) for "mean", 1 for "sum", the caller's
    # cotangent (times the token weights) for "none".
    mz = None if g_entropy is None else lse - entropy  # sum_j p_j z_j per row
    dlogits = _route_backward(
        logits, labels, lse, g_loss, options, inplace, mode, configs, g_lse, weight, g_entropy, mz
    )
    return dlogits, None, no_weight_grad


_kernel_token_losses.defvjp(_kernel_fwd, _kernel_bwd, symbolic_zeros=True)


@functools.partial(jax.jit, static_argnames=("options", "reduction", "inplace", "mode", "configs", "returns"))
def _kernel_loss(
    logits, labels, n_items, weight, token_weights, *, options: Options, reduction: str, inplace: bool, mode: str,
    configs, returns,
):  # fmt: skip
    """The kernel path, jitted once per static configuration: an eager call reuses its trace and executable
    instead of tracing and lowering the Pallas kernels again (under an outer jit it is inlined). token_weights
    multiply the per-token losses outside the custom_vjp, so they reach the backward kernel as its per-row
    upstream factor (no extra pass)."""
    outs = _kernel_token_losses(logits, labels, weight, options, inplace, mode, configs, returns)
    loss, lse, *rest = outs if returns else (outs, None)
    accuracy = rest.pop(0) if returns.accuracy else None
    entropy = rest.pop(0) if returns.entropy else None
    return contract.reduce_outputs(
        loss, lse, accuracy, entropy, labels, reduction, n_items, options, returns, logits.shape[-1], weight,
        token_weights=token_weights, entropy_grad=True,
    )  # fmt: skip


# ----------------------------------------------------------------------------
# Public API.
# ----------------------------------------------------------------------------


def _cross_entropy(
    logits,
    labels,
    options: Options,
    reduction,
    n_items,
    backend,
    inplace_backward,
    returns=contract.NO_EXTRAS,
    weight=None,
    token_weights=None,
):
    """The loss of checked arguments (labels from contract.check_labels, token_weights from
    token_inputs.check_token_weights, aligned with the labels); a CrossEntropyOutput when ``returns`` asks for any
    extra output."""
    route = _route(logits, backend)
    logits = jnp.asarray(logits)
    if logits.dtype == jnp.float64:
        # The kernels compute in float32: float64 logits (which exist only with x64 on; without it jnp.asarray made
        # them float32 above) go to the reference, computed in float64, whatever the backend says.
        route = "reference"
    labels = jnp.asarray(labels)
    if route == "reference" or labels.size == 0:  # an empty grid has no kernel
        if returns:
            loss, lse, accuracy, entropy = contract.reference_row_outputs(logits, labels, options, returns, weight)
        else:
            loss, lse, accuracy, entropy = contract.reference_token_losses(logits, labels, options, weight), *[None] * 3
        return contract.reduce_outputs(
            loss, lse, accuracy, entropy, labels, reduction, n_items, options, returns, logits.shape[-1], weight,
            token_weights=token_weights, entropy_grad=True,
        )  # fmt: skip
    vocab = logits.shape[-1]
    configs = (kernels.forward_config(vocab), kernels.backward_config(vocab))
    with kernels.quiet_triton(interpret=route == INTERPRETED):
        return _kernel_loss(
            logits,
            labels,
            n_items,
            weight,
            token_weights,
            options=options,
            reduction=reduction,
            inplace=inplace_backward,
            mode=route,
            configs=configs,
            returns=returns,
        )


def cross_entropy(
    logits,
    labels,
    *,
    ignore_index=-100,
    reduction="mean",
    n_items=None,
    logit_softcapping=0.0,
    logit_scaling=0.0,
    label_smoothing=0.0,
    z_loss=0.0,
    backend="auto",
    inplace_backward=True,
    validate_labels=False,
    shift=0,
    return_z_loss=False,
    return_lse=False,
    return_accuracy=False,
    return_entropy=False,
    weight=None,
    temperature=1.0,
    token_weights=None,
    where=None,
):
    """Cross-entropy of ``logits`` (..., V) against integer ``labels`` (...).

    Per token, with z the (scaled, softcapped) logits and lse = logsumexp(z):
    ``(1 - eps)(lse - z_y) + eps (lse - mean(z)) + z_loss * lse**2``; see
    CONTRACT.md for every rule (ignore_index, NaN for out-of-range labels,
    -inf logits, reductions, n_items).

    Args:
      logits: float32/bfloat16/float16 array (..., V); float64 (with x64 on) is computed in float64 by the
        jnp reference whatever ``backend`` says (a float64 loss and gradient).
      labels: int32/int64 array shaped like ``logits.shape[:-1]``.
      ignore_index: label value whose tokens get loss 0 and gradient 0.
      reduction: "mean" (over non-ignored tokens, or over ``n_items``), "sum"
        or "none" (per-token losses shaped like ``labels``).
      n_items: optional denominator for "mean" and "sum": a Python number > 0 or a 0-d
        (possibly traced) array, e.g. transformers' ``num_items_in_batch``.
      logit_softcapping: t > 0 applies ``z = t * tanh(z / t)`` (Gemma 2).
      logit_scaling: s != 0 applies ``z = s * z`` first (Cohere).
      label_smoothing: eps in [0, 1].
      z_loss: coefficient of ``lse**2``.
      backend: "auto" (kernels for GPU arrays, the jnp reference elsewhere),
        "kernel" (Pallas kernels always; interpret mode off GPU) or "reference".
        Under jit/grad/vmap in a process with a GPU backend, "auto" decides
        when the computation is lowered, by the platform it runs on
        (``jax.lax.platform_dependent``); "kernel" there means the compiled
        kernels.  Reverse mode runs the kernels; derivatives of those
        derivatives (grad of grad, jax.hessian, jvp of grad) are the
        reference's, exact. Forward mode on the loss itself (jax.jvp,
        jax.linearize, jax.jacfwd) raises JAX's TypeError for a custom_vjp
        function: use backend="reference" for it.
      inplace_backward: let the backward kernel's output alias the logits
        residual (``input_output_aliases``); XLA reuses that buffer when the
        logits are dead after the backward (e.g. computed inside the same jit),
        and otherwise inserts a copy.  False never aliases.
      validate_labels: eagerly raise ValueError naming the first label that is
        neither in [0, V) nor ``ignore_index``.  Needs concrete labels: under
        jit/vmap it raises ValueError instead of validating.
      shift: k >= 0 (True = 1) scores position t against label t + k along labels' last (sequence) axis: the
        loss of ``cross_entropy(logits[..., :-k, :], labels[..., k:])`` ("none": shaped like ``labels[..., k:]``)
        without slicing the logits; the kernels run on the full logits with the last k positions ignored. k >= the
        sequence length leaves no token (as the slice does).
      return_z_loss, return_lse, return_accuracy, return_entropy: extra outputs (CONTRACT.md "Extra outputs"),
        computed in the same kernel passes: the z-loss term z_loss * lse**2 reduced like the loss
        (differentiable), the per-token lse (-inf where ignored), the accuracy of the argmax (per token for
        "none", else the fraction of non-ignored rows) and the entropy of softmax(z) reduced like the loss
        (differentiable: dH/dz_j = p_j (mz - z_j), mz = lse - H, added in the backward kernel's pass); lse and
        accuracy carry no gradient (stop_gradient).
      weight: class weights (V,), as torch.nn.functional.cross_entropy's ``weight`` (CONTRACT.md "Class
        weights"): floating point, computed in float32 by the kernels; "mean" is the weighted mean. They are a
        constant: differentiating with respect to them raises ValueError.
      temperature: T > 0 (a Python float): the transformed logits are ``softcap(scale * x) / T`` in every output
        and gradient (folded into the scaling and soft-capping: T = 1 runs exactly today's kernels).
      token_weights: per-token weights shaped like ``labels`` (advantages, masks; may be negative): each token's
        loss (its z-loss term included) is multiplied by its weight before the reduction; "mean" still divides by
        the number of non-ignored tokens (or n_items), "none" returns weight * loss. With ``shift`` they are aligned
        with the labels (w[..., t] goes with labels[..., t]). The z_loss output is weighted like the loss's term;
        lse, accuracy and entropy are not. A constant: differentiating with respect to them raises ValueError.
      where: optax's mask, a bool array shaped like ``labels``: False leaves the token out exactly as ignore_index
        does (loss 0, gradient 0, not counted by "mean"); folded into the labels (O(N), no extra kernel pass).
        With ``shift`` it goes with the labels (where[..., t] with labels[..., t]).

    Returns:
      float32 loss (scalar, or shaped like ``labels`` for reduction="none"); float64 for float64 logits.
      Its gradient w.r.t. logits has logits' dtype. With any return_* True, a
      ``CrossEntropyOutput(loss, z_loss, lse, accuracy, entropy)`` with None for what was not asked.
    """
    options = contract.check_options(
        ignore_index=ignore_index,
        reduction=reduction,
        logit_softcapping=logit_softcapping,
        logit_scaling=logit_scaling,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        backend=backend,
        temperature=temperature,
    )
    logits = contract.check_float_array(logits, "logits")
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape (..., V) with V >= 1, got {tuple(logits.shape)}")
    labels = contract.check_labels(labels, logits.shape[:-1], options.ignore_index)
    labels = token_inputs.masked_labels(labels, where, options.ignore_index)
    inplace_backward = contract.check_flag(inplace_backward, "inplace_backward")
    check = contract.check_flag(validate_labels, "validate_labels")
    n_items = contract.check_n_items(n_items)
    returns = contract.check_extras(
        return_z_loss=return_z_loss,
        return_lse=return_lse,
        return_accuracy=return_accuracy,
        return_entropy=return_entropy,
    )
    shift = token_inputs.check_shift(shift)
    weight = contract.check_class_weight(weight, logits.shape[-1])
    token_weights = token_inputs.check_token_weights(token_weights, labels.shape)
    kept = None
    if shift:
        labels, kept = token_inputs.shifted_labels(labels, shift, options.ignore_index)
        token_weights = token_inputs.shifted_token_weights(token_weights, shift)
    if check:
        contract.validate_labels(labels, logits.shape[-1], options.ignore_index)
    loss = _cross_entropy(
        logits, labels, options, reduction, n_items, backend, inplace_backward, returns, weight, token_weights
    )
    return token_inputs.keep_positions(loss, kept, reduction)


def cross_entropy_reference(logits, labels, **options):
    """Pure-jnp ``cross_entropy``: the same keywords (``backend`` is ignored),
    differentiable by plain autodiff; float32 math (float64 for float64 logits),
    so it materialises (N, V) float32 values."""
    return cross_entropy(logits, labels, **dict(options, backend="reference"))
