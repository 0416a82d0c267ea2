"""Fused linear cross-entropy: the loss of `cross_entropy(hidden @ weight.T + bias, labels)` without the (N, V) logits.

Chunks. The rows are processed in chunks of `chunk_rows(n_rows, vocab, itemsize)` rows: the workspace budget
(`WORKSPACE_BYTES` = 256 MiB of logits) split evenly over as few chunks as it allows, rounded up to a multiple of
`ROWS_MULTIPLE` (whole matmul tiles); `CHUNK_ROWS`, when set, overrides it. Per chunk (a `lax.fori_loop` step): the
logits come from one matmul in the inputs' dtype, fastce's forward kernel gives each row's loss and log-sum-exp
(`_ce_forward`), the backward kernel overwrites the same fresh logits with d loss / d logits
(`_ce_backward_in_place`), and two matmuls fold that into the chunk's rows of d hidden and into d weight (a column
sum into d bias). The last chunk is not padded (shapes are static): its start is clamped to N - chunk rows, and the
rows it shares with the chunk before are relabelled "ignored" (loss 0, gradient 0) and keep the values already
written, so no padded copy of hidden or of its gradient is made.

Reductions (jax.custom_vjp).
- "mean" / "sum": the gradients are computed in the forward pass of the VJP and are its residuals (the reduction's
  per-token factor is traced, no host synchronisation); the backward only multiplies them by the upstream scalar.
  6·N·H·V flops in all; a plain forward (no VJP) computes no gradients (2·N·H·V flops).
- "none": the per-token upstream gradients exist only in the backward, so the forward keeps the log-sum-exp (N
  floats) and the backward recomputes each chunk's logits: 8·N·H·V flops.

Memory beyond the inputs: the gradients (hidden's, weight's, bias's, in their dtypes), the workspace (chunk rows x V
in the inputs' dtype, at most WORKSPACE_BYTES) and O(N + V) floats.

Precision: each chunk's matmuls accumulate in float32 and round once to the input dtype. By default the weight
gradient is summed across chunks in the weight's own dtype (one rounding per chunk); a float32 accumulator
(ACCUMULATE_WEIGHT_GRAD_IN_FLOAT32 = True: one rounding at the end) costs 4·V·H more bytes (2 GiB at V=128256,
H=4096), twice a bf16 gradient. Measured (bf16 weight gradient of a softmax-gradient sum over 4096 rows, float64 as
truth; fastce_torch/tests/test_linear_cross_entropy.py::test_weight_gradient_accumulation_error), its rms error
relative to its rms is 2.2e-3 with one rounding (the float32 accumulator), 3.7e-3 with 8 chunks, 6.5e-3 with 32 and
1.2e-2 with 128. The default workspace gives 8 chunks at N=8192, V=128256 (bf16), 16 at N=8192, V=256000.

Labels enter the kernels in an internal int32 form: ignored (and overlap) rows are `_IGNORED`, labels outside
[0, V) are `_OUT_OF_RANGE` (still a NaN loss), so any user ignore_index and label width works.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fastce_jax import kernels
from fastce_jax.cross_entropy import (
    LOGITS_DTYPES,
    _as_array,
    _check_args,
    _check_shift,
    _cross_entropy,
    _interpret,
    _on_gpu,
    _reduce,
    _reference_backward,
    _reference_token_losses,
    _shifted_labels,
    _validate_labels_eagerly,
)
from fastce_jax.kernels import Options

# Module settings, read when a call is traced (jit caches the result). The workspace (chunk rows x V logits) is at
# most WORKSPACE_BYTES: at 256 MiB, 1024 rows of bf16 logits at V=128256, 512 at V=256000.
WORKSPACE_BYTES = 256 << 20
ROWS_MULTIPLE = 128  # chunk rows are a multiple of this (whole matmul tiles) when the budget allows that many
CHUNK_ROWS = None  # an int: the rows per chunk regardless of the budget (tests force several chunks)
# A float32 accumulator for a bf16/fp16 weight's gradient: one rounding instead of one per chunk, 4·V·H more bytes.
ACCUMULATE_WEIGHT_GRAD_IN_FLOAT32 = False

_IGNORED = -1  # internal label of ignored rows, and the ignore_index the kernels are given
_OUT_OF_RANGE = -2  # internal label of every label outside [0, V) that is not ignore_index


def chunk_rows(n_rows: int, vocab: int, itemsize: int) -> int:
    """Rows per chunk: CHUNK_ROWS when set; else the workspace budget split evenly over as few chunks as it allows
    (so the clamped last chunk repeats little work), rounded up to ROWS_MULTIPLE when the budget holds that many
    rows; never more than n_rows, at least 1."""
    if CHUNK_ROWS is not None:
        return max(1, min(int(CHUNK_ROWS), n_rows))
    max_rows = max(1, WORKSPACE_BYTES // (vocab * itemsize))
    multiple = ROWS_MULTIPLE if max_rows >= ROWS_MULTIPLE else 1
    max_rows -= max_rows % multiple
    n_chunks = -(-n_rows // max_rows)
    rows = -(-n_rows // max(1, n_chunks))
    rows = -(-rows // multiple) * multiple
    return max(1, min(rows, n_rows))


class _Static(NamedTuple):
    """Hashable configuration of one call (a custom_vjp nondiff argument)."""

    options: Options  # the kernels' options; ignore_index is _IGNORED
    interpret: bool  # Pallas interpret mode (off GPU)
    reduction: str
    chunk_rows: int
    dtype: str  # compute dtype of the logits
    f32_weight_grad: bool
    with_bias: bool


# --- the one place that calls fastce's launchers -------------------------------------------------------------------


# Each with a jvp rule that is the reference's (as cross_entropy's launchers have): first derivatives come from the
# custom_vjp below and run the kernels; grad of grad, jax.hessian and jvp of grad differentiate through the
# launchers and get the exact derivative of the reference loss and of its gradient.
@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _ce_forward(logits, labels, st: _Static):
    return tuple(kernels.forward(logits, labels, st.options, interpret=st.interpret))


@functools.partial(jax.custom_jvp, nondiff_argnums=(4,))
def _ce_backward_in_place(logits, labels, lse, g, st: _Static):
    return kernels.backward(logits, labels, lse, g, st.options, inplace=True, interpret=st.interpret)


@_ce_forward.defjvp
def _ce_forward_jvp(st: _Static, primals, tangents):
    logits, labels = primals
    loss, lse = _ce_forward(logits, labels, st)
    _, loss_dot = jax.jvp(lambda x: _reference_token_losses(x, labels, st.options), (logits,), (tangents[0],))
    # lse is read only by the backward launcher, whose rule recomputes it from the logits.
    return (loss, lse), (loss_dot, jnp.zeros_like(lse))


@_ce_backward_in_place.defjvp
def _ce_backward_jvp(st: _Static, primals, tangents):
    logits, labels, lse, g = primals
    dlogits = _ce_backward_in_place(logits, labels, lse, g, st)
    _, dlogits_dot = jax.jvp(
        lambda x, w: _reference_backward(x, labels, w, st.options), (logits, g), (tangents[0], tangents[3])
    )
    return dlogits, dlogits_dot


# --- the chunked computation ---------------------------------------------------------------------------------------


def _chunk_inputs(k, hidden, labels, st: _Static):
    """Chunk k's rows: its clamped start, hidden rows, labels (overlap rows relabelled ignored) and the mask of
    rows that are new in this chunk."""
    n = hidden.shape[0]
    rows = st.chunk_rows
    start = jnp.minimum(k * rows, n - rows)
    fresh = start + jnp.arange(rows) >= k * rows
    h_c = jax.lax.dynamic_slice_in_dim(hidden, start, rows, axis=0)
    y_c = jnp.where(fresh, jax.lax.dynamic_slice_in_dim(labels, start, rows), _IGNORED)
    return start, fresh, h_c, y_c


def _chunk_logits(h_c, weight, bias, st: _Static):
    dt = jnp.dtype(st.dtype)
    logits = jax.lax.dot_general(h_c.astype(dt), weight.astype(dt), (((1,), (1,)), ((), ())), preferred_element_type=dt)
    if bias is not None:
        logits = logits + bias.astype(dt)
    return logits


def _put_rows(buffer, start, fresh, values):
    """Write values into buffer[start:start+rows] where fresh, keep the old rows elsewhere."""
    old = jax.lax.dynamic_slice_in_dim(buffer, start, values.shape[0], axis=0)
    mask = fresh.reshape(fresh.shape + (1,) * (values.ndim - 1))
    return jax.lax.dynamic_update_slice_in_dim(buffer, jnp.where(mask, values, old), start, axis=0)


def _accumulate_grads(dlogits, h_c, weight, start, fresh, carry, first, st: _Static):
    """The carry's gradients with chunk k's added: its fresh rows of dhidden (compute dtype), its product into
    dweight (float32 with ACCUMULATE_WEIGHT_GRAD_IN_FLOAT32, else the compute dtype), its column sums into dbias
    (float32). Chunk 0 (``first``) starts dweight and dbias instead of adding to zeros."""
    dt = jnp.dtype(st.dtype)
    dh_c = jax.lax.dot_general(dlogits, weight.astype(dt), (((1,), (0,)), ((), ())), preferred_element_type=dt)
    acc = jnp.float32 if st.f32_weight_grad else dt
    dw_c = jax.lax.dot_general(dlogits, h_c.astype(dt), (((0,), (0,)), ((), ())), preferred_element_type=acc)
    out = dict(dh=_put_rows(carry["dh"], start, fresh, dh_c), dw=dw_c if first else carry["dw"] + dw_c)
    if st.with_bias:
        db_c = jnp.sum(dlogits.astype(jnp.float32), axis=0)
        out["db"] = db_c if first else carry["db"] + db_c
    return out


def _loop(n_rows, st: _Static, first, body):
    """Chunk 0 by ``first`` (it creates the carry, so the weight gradient starts as chunk 0's product instead of
    zeros plus it), the others by ``body`` in a fori_loop."""
    n_chunks = kernels._cdiv(n_rows, st.chunk_rows)
    carry = first()
    if n_chunks > 1:
        carry = jax.lax.fori_loop(1, n_chunks, body, carry)
    return carry


def _fused_forward(hidden, weight, bias, labels, g_tokens, st: _Static):
    """Per-token losses and lse (N,) and, when g_tokens (N,) is given, the gradients of sum_t g_t * loss_t:
    (dhidden in the compute dtype, dweight in float32 or the compute dtype, dbias float32 or None)."""
    n = hidden.shape[0]
    want_grads = g_tokens is not None

    def step(k, carry, first):
        start, fresh, h_c, y_c = _chunk_inputs(k, hidden, labels, st)
        logits = _chunk_logits(h_c, weight, bias, st)
        loss_c, lse_c = _ce_forward(logits, y_c, st)
        out = dict(
            losses=_put_rows(carry["losses"], start, fresh, loss_c), lse=_put_rows(carry["lse"], start, fresh, lse_c)
        )
        if want_grads:
            g_c = jax.lax.dynamic_slice_in_dim(g_tokens, start, st.chunk_rows)
            dlogits = _ce_backward_in_place(logits, y_c, lse_c, g_c, st)
            out.update(_accumulate_grads(dlogits, h_c, weight, start, fresh, carry, first, st))
        return out

    def first():
        carry = dict(losses=jnp.zeros((n,), jnp.float32), lse=jnp.zeros((n,), jnp.float32))
        if want_grads:
            carry["dh"] = jnp.zeros((n, hidden.shape[1]), st.dtype)
        return step(0, carry, first=True)

    carry = _loop(n, st, first, functools.partial(step, first=False))
    grads = (carry["dh"], carry["dw"], carry.get("db")) if want_grads else None
    return carry["losses"], carry["lse"], grads


def _fused_backward(hidden, weight, bias, labels, lse, g_tokens, st: _Static):
    """Gradients of sum_t g_t * loss_t from the saved lse: each chunk's logits are recomputed, no forward kernel."""
    n = hidden.shape[0]

    def step(k, carry, first):
        start, fresh, h_c, y_c = _chunk_inputs(k, hidden, labels, st)
        logits = _chunk_logits(h_c, weight, bias, st)
        lse_c = jax.lax.dynamic_slice_in_dim(lse, start, st.chunk_rows)
        g_c = jax.lax.dynamic_slice_in_dim(g_tokens, start, st.chunk_rows)
        dlogits = _ce_backward_in_place(logits, y_c, lse_c, g_c, st)
        return _accumulate_grads(dlogits, h_c, weight, start, fresh, carry, first, st)

    def first():
        return step(0, dict(dh=jnp.zeros((n, hidden.shape[1]), st.dtype)), first=True)

    carry = _loop(n, st, first, functools.partial(step, first=False))
    return carry["dh"], carry["dw"], carry.get("db")


def _finish_grads(grads, hidden, weight, bias, scale=None):
    """Scale (by the upstream, when given) and cast each gradient to its input's dtype: one fused pass each."""
    dh, dw, db = grads

    def fin(g, like):
        # A bf16 gradient times the float32 scale is computed in float32 and rounded once.
        return (g if scale is None else g * scale).astype(like.dtype)

    return fin(dh, hidden), fin(dw, weight), None if bias is None else fin(db, bias)


# --- custom_vjp: "mean"/"sum" (the gradients are residuals) and "none" (lse is) ------------------------------------


def _token_scale(labels, n_items, st: _Static):
    """d loss / d loss_t of the reduction (the same _reduce the loss uses): 1/denominator for "mean", 1 for
    "sum", 1/n_items with n_items.  Traced; no host synchronisation."""
    zeros = jnp.zeros(labels.shape, jnp.float32)
    return jax.grad(lambda t: _reduce(t, labels, st.reduction, n_items, _IGNORED))(zeros)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _reduced_loss(hidden, weight, bias, labels, n_items, st: _Static):
    losses, _, _ = _fused_forward(hidden, weight, bias, labels, None, st)
    return _reduce(losses, labels, st.reduction, n_items, _IGNORED)


def _reduced_fwd(hidden, weight, bias, labels, n_items, st: _Static):
    g_tokens = _token_scale(labels, n_items, st)
    losses, _, grads = _fused_forward(hidden, weight, bias, labels, g_tokens, st)
    loss = _reduce(losses, labels, st.reduction, n_items, _IGNORED)
    # Zero-size stand-ins keep the input dtypes for the backward's casts.
    likes = (jnp.zeros((0,), hidden.dtype), jnp.zeros((0,), weight.dtype), None if bias is None else bias[:0])
    return loss, (grads, likes)


def _reduced_bwd(st: _Static, residuals, g):
    grads, (h_like, w_like, b_like) = residuals
    dh, dw, db = _finish_grads(grads, h_like, w_like, b_like, scale=g)
    return dh, dw, db, None, None


_reduced_loss.defvjp(_reduced_fwd, _reduced_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _per_token_losses(hidden, weight, bias, labels, st: _Static):
    return _fused_forward(hidden, weight, bias, labels, None, st)[0]


def _per_token_fwd(hidden, weight, bias, labels, st: _Static):
    losses, lse, _ = _fused_forward(hidden, weight, bias, labels, None, st)
    return losses, (hidden, weight, bias, labels, lse)


def _per_token_bwd(st: _Static, residuals, g):
    hidden, weight, bias, labels, lse = residuals
    grads = _fused_backward(hidden, weight, bias, labels, lse, g.astype(jnp.float32), st)
    dh, dw, db = _finish_grads(grads, hidden, weight, bias)
    return dh, dw, db, None


_per_token_losses.defvjp(_per_token_fwd, _per_token_bwd)


# --- the function --------------------------------------------------------------------------------------------------


def _check_tensors(hidden, weight, bias):
    hidden = _as_array(hidden, "hidden")
    weight = _as_array(weight, "weight")
    for name, x in (("hidden", hidden), ("weight", weight)) + ((("bias", bias),) if bias is not None else ()):
        # float64 is accepted as in cross_entropy: computed in float64 by the reference, whatever the backend.
        if jnp.dtype(x.dtype) not in LOGITS_DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16, float16 or float64, got {x.dtype}")
    if hidden.ndim < 1 or hidden.shape[-1] < 1:
        raise ValueError(f"hidden must have shape (..., H) with H >= 1, got {tuple(hidden.shape)}")
    if weight.ndim != 2 or weight.shape[0] < 1 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must have shape (V, H) = (V, {hidden.shape[-1]}) with V >= 1 (nn.Linear / lm_head layout), "
            f"got {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape (V,) = ({weight.shape[0]},), got {tuple(bias.shape)}")
    return hidden, weight


def _internal_labels(labels, vocab: int, ignore_index: int):
    """int32 labels for the kernels: ignored -> _IGNORED, outside [0, V) -> _OUT_OF_RANGE (NaN loss)."""
    labels = jnp.asarray(labels)
    ign = kernels._ignore_index_for(labels, ignore_index)
    ignored = (labels == ign) if ign is not None else jnp.zeros(labels.shape, bool)
    in_range = (labels >= 0) & (labels < vocab)
    return jnp.where(ignored, _IGNORED, jnp.where(in_range, labels, _OUT_OF_RANGE)).astype(jnp.int32)


def linear_cross_entropy(
    hidden,
    weight,
    labels,
    *,
    bias=None,
    ignore_index=-100,
    reduction="mean",
    n_items=None,
    logit_softcapping=0.0,
    logit_scaling=0.0,
    label_smoothing=0.0,
    z_loss=0.0,
    backend="auto",
    validate_labels=False,
    shift=0,
):
    """``cross_entropy(hidden @ weight.T + bias, labels, ...)`` without the (N, V) logits.

    Args:
      hidden: float32/bfloat16/float16/float64 (..., H), e.g. the final hidden states (a float64 common dtype is
        computed in float64 by the reference, whatever ``backend`` says).
      weight: (V, H), the LM head as ``nn.Linear`` / transformers' ``lm_head`` store it (a Flax
        ``Dense`` kernel is (H, V): pass its ``.T``).
      labels: int32/int64 (...), hidden's leading shape.
      bias: optional (V,).
      ignore_index, reduction, n_items, logit_softcapping, logit_scaling, label_smoothing, z_loss,
      validate_labels: as in ``fastce_jax.cross_entropy`` (CONTRACT.md).
      shift: as in ``fastce_jax.cross_entropy``, along hidden's second-to-last (sequence) axis: the loss of
        ``linear_cross_entropy(hidden[..., :-k, :], weight, labels[..., k:])`` without slicing hidden.
      backend: "auto" (the chunked kernel path for GPU arrays, "reference" elsewhere), "kernel" (the chunked
        path always; Pallas interpret mode off GPU) or "reference" (the plain matmul, then the jnp reference
        loss: it materialises the logits). Traced (under jit), "auto" assumes the arrays live on the default
        backend: to jit over CPU arrays in a process whose default backend is a GPU, pass backend="reference"
        (cross_entropy, whose fallback needs no matmul, decides that when the computation is lowered).

    The logits are computed in the inputs' common dtype (with float32 accumulation inside the matmul, as XLA's
    GPU matmuls do); the loss is float32 (float64 for a float64 common dtype). Gradients flow to hidden, weight
    and bias, in their dtypes. The extra memory is the gradients plus one chunk of logits (at most
    ``WORKSPACE_BYTES``; see the module docstring).

    Returns:
      float32 loss: a scalar, or shaped like ``labels`` for reduction="none".
    """
    hidden, weight = _check_tensors(hidden, weight, bias)
    kwargs = dict(
        ignore_index=ignore_index,
        reduction=reduction,
        n_items=n_items,
        logit_softcapping=logit_softcapping,
        logit_scaling=logit_scaling,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        backend=backend,
        inplace_backward=True,
        validate_labels=validate_labels,
    )
    # hidden (..., H) stands in for the logits (..., V): the checks only read its leading shape and dtype.
    (_, labels, n_items, ignore_index, scaling, softcap, smoothing, z_loss) = _check_args(hidden, labels, **kwargs)
    if shift := _check_shift(shift):
        labels, kept = _shifted_labels(labels, shift, ignore_index)
        loss = linear_cross_entropy(
            hidden,
            weight,
            labels,
            bias=bias,
            ignore_index=ignore_index,
            reduction=reduction,
            n_items=n_items,
            logit_softcapping=logit_softcapping,
            logit_scaling=logit_scaling,
            label_smoothing=label_smoothing,
            z_loss=z_loss,
            backend=backend,
            validate_labels=validate_labels,
        )
        return loss[..., :kept] if reduction == "none" else loss
    vocab, dim = weight.shape
    if validate_labels:
        _validate_labels_eagerly(labels, vocab, ignore_index)
    dtype = jnp.result_type(hidden.dtype, weight.dtype, *(() if bias is None else (bias.dtype,)))
    if backend == "auto":
        backend = "kernel" if _on_gpu(hidden) else "reference"
    lead = tuple(hidden.shape[:-1])
    h2 = hidden.reshape(-1, dim)
    n = h2.shape[0]
    # No tokens: no chunk to launch; float64: the chunks compute in float32.
    if backend == "reference" or n == 0 or jnp.dtype(dtype) == jnp.float64:
        logits = jax.lax.dot_general(
            h2.astype(dtype), weight.astype(dtype), (((1,), (1,)), ((), ())), preferred_element_type=dtype
        )
        if bias is not None:
            logits = logits + bias.astype(dtype)
        kwargs.update(n_items=n_items, backend="reference", validate_labels=False)
        return _cross_entropy(logits.reshape(lead + (vocab,)), labels, kwargs)

    st = _Static(
        options=Options(_IGNORED, softcap, scaling, smoothing, z_loss),
        interpret=_interpret(hidden),
        reduction=reduction,
        chunk_rows=chunk_rows(n, vocab, jnp.dtype(dtype).itemsize),
        dtype=jnp.dtype(dtype).name,
        f32_weight_grad=ACCUMULATE_WEIGHT_GRAD_IN_FLOAT32,
        with_bias=bias is not None,
    )
    y1 = _internal_labels(labels, vocab, ignore_index).reshape(-1)
    if reduction == "none":
        return _per_token_losses(h2, weight, bias, y1, st).reshape(lead)
    return _reduced_loss(h2, weight, bias, y1, n_items, st)
