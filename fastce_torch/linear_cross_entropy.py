"""Fused linear cross-entropy: the loss of `cross_entropy(hidden @ weight.T + bias, labels)` without the (N, V) logits.

Chunks. The rows are processed in chunks of `chunk_rows(n_rows, vocab, itemsize)` rows: the workspace budget
(`WORKSPACE_BYTES` = 256 MiB of logits) split evenly over as few chunks as it allows, rounded up to a multiple of
`ROWS_MULTIPLE` (whole matmul tiles); `CHUNK_ROWS`, when set, overrides it. Per chunk: the logits come from one
matmul into the workspace, fastce's forward kernel gives each row's loss and log-sum-exp (`_ce_forward`), the
backward kernel overwrites the same fresh logits with d loss / d logits (`_ce_backward_in_place`), and two matmuls
fold that into the chunk's rows of d hidden and into d weight (a column sum into d bias). The last chunk is
shorter (a slice of the workspace).

Reductions.
- "mean" / "sum": the gradients are complete after the forward (the denominator is counted on the device first, no
  host synchronisation); the backward only multiplies them by the upstream scalar, and skips even that on the device
  when the scalar is exactly 1. 6·N·H·V flops in all. Gradients are computed only when grad mode is on and an input
  requires one (2·N·H·V flops otherwise).
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

Autocast: under torch.autocast for the tensors' device type the matmuls run in the autocast dtype, as F.linear's do:
hidden is cast at the entry (through autograd), weight and bias inside the computation (a copy of each), so that a
weight in another dtype (a float32 master weight) has its gradient accumulated in float32 and handed back in its own
dtype. The kernels' own code runs with autocast off.
"""

import contextlib

import torch

from . import distributed, kernels
from .cross_entropy import (
    KERNEL_DTYPES,
    _check_arguments,
    _check_shift,
    _reduce,
    _reference_token_losses,
    _shifted_labels,
    _validate_labels,
)
from .kernels import Options

# Module settings, read at each call. The workspace (chunk rows x V logits)
# is at most WORKSPACE_BYTES: at 256 MiB, 1024 rows of bf16 logits at V=128256, 512 at V=256000.
WORKSPACE_BYTES = 256 << 20
ROWS_MULTIPLE = 128  # chunk rows are a multiple of this (whole matmul tiles) when the budget allows that many
CHUNK_ROWS = None  # an int: the rows per chunk regardless of the budget (tests force several chunks)
# A float32 accumulator for a bf16/fp16 weight's gradient: one rounding instead of one per chunk, 4·V·H more bytes.
ACCUMULATE_WEIGHT_GRAD_IN_FLOAT32 = False


# --- the one place that calls fastce's launchers ----------------------------------------------------------------


def _ce_forward(logits, labels, options):
    """Per-token float32 (loss, lse) of a 2-D logits chunk."""
    loss, lse, _ = kernels.forward(logits, labels, options)
    return loss, lse


def _ce_backward_in_place(logits, labels, lse, grad_loss, options, denominator=None):
    """Overwrites `logits` with d(sum_t grad_loss_t * loss_t / denominator) / d logits; grad_loss is per row or 0-d."""
    kernels.backward(grad_loss, logits, labels, lse, logits, options, denominator)


def _scale_in_place(tensor, factor):
    """tensor *= factor (a 0-d device tensor), on the device, doing nothing when factor is exactly 1."""
    return kernels.scale_unless_one(tensor, factor)


# --- the chunked computation ------------------------------------------------------------------------------------


def chunk_rows(n_rows, vocab, itemsize):
    """Rows per chunk: CHUNK_ROWS when set; else the workspace budget split evenly over as few chunks as it allows
    (every chunk nearly full), rounded up to ROWS_MULTIPLE when the budget holds that many rows; never more than
    n_rows, at least 1."""
    if CHUNK_ROWS is not None:
        return max(1, min(int(CHUNK_ROWS), n_rows))
    max_rows = max(1, WORKSPACE_BYTES // (vocab * itemsize))
    multiple = ROWS_MULTIPLE if max_rows >= ROWS_MULTIPLE else 1
    max_rows -= max_rows % multiple
    n_chunks = -(-n_rows // max_rows)
    rows = -(-n_rows // max(1, n_chunks))
    rows = -(-rows // multiple) * multiple
    return max(1, min(rows, n_rows))


def _chunk_logits(workspace, hidden_chunk, weight, bias):
    if bias is None:
        torch.matmul(hidden_chunk, weight.t(), out=workspace)
    else:
        torch.addmm(bias, hidden_chunk, weight.t(), out=workspace)
    return workspace


def _in_compute_dtype(hidden, weight, bias):
    """weight and bias in hidden's dtype, the one the matmuls run in: a cast copy only under autocast, where the
    (float32 master) weight and bias stay as given so that their gradients are accumulated in their own dtype."""
    return weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype)


def _interior(hidden):
    """The kernels' own code runs without gradient tracking and without autocast: its matmuls run exactly in the
    dtype linear_cross_entropy chose (autocast was already applied at its entry)."""
    stack = contextlib.ExitStack()
    stack.enter_context(kernels.on_device(hidden))
    stack.enter_context(torch.no_grad())
    stack.enter_context(torch.autocast(hidden.device.type, enabled=False))
    return stack


def _new_grads(hidden, weight, bias, needs):
    need_hidden, need_weight, need_bias = needs
    grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_hidden else None
    # Accumulated over chunks (addmm with beta=1), so it starts at zero. A weight that is not in the compute dtype
    # (a float32 master weight under autocast) gets a float32 accumulator: its gradient is float32 anyway, and one
    # rounding at the end is more accurate than rounding every chunk to the compute dtype and casting back.
    float32_accumulator = ACCUMULATE_WEIGHT_GRAD_IN_FLOAT32 or weight.dtype != hidden.dtype
    accumulate_dtype = torch.float32 if float32_accumulator else weight.dtype
    grad_weight = torch.zeros(weight.shape, dtype=accumulate_dtype, device=weight.device) if need_weight else None
    grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if need_bias else None
    return grad_hidden, grad_weight, grad_bias


def _accumulate_grads(dlogits, hidden_chunk, weight, rows, grads):
    grad_hidden, grad_weight, grad_bias = grads
    if grad_hidden is not None:
        torch.matmul(dlogits, weight, out=grad_hidden[rows])
    if grad_weight is not None:
        if grad_weight.dtype == dlogits.dtype:
            grad_weight.addmm_(dlogits.t(), hidden_chunk)
        elif grad_weight.is_cuda:  # the float32 accumulator: cuBLAS takes bf16/fp16 operands with a float32 output
            torch.addmm(grad_weight, dlogits.t(), hidden_chunk, out_dtype=torch.float32, out=grad_weight)
        else:  # the CPU has no mixed-dtype addmm
            grad_weight.addmm_(dlogits.t().float(), hidden_chunk.float())
    if grad_bias is not None:
        grad_bias += dlogits.sum(0, dtype=torch.float32)


def _finish_grads(grads, weight, bias):
    grad_hidden, grad_weight, grad_bias = grads
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    if grad_bias is not None:
        grad_bias = grad_bias.to(bias.dtype)
    return grad_hidden, grad_weight, grad_bias


def _chunks(hidden, weight, bias, labels):
    """Yields (rows, hidden_chunk, labels_chunk, logits) chunk by chunk; logits is a view of one workspace that the
    next chunk overwrites."""
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    rows_per_chunk = chunk_rows(n_rows, vocab, hidden.element_size())
    workspace = torch.empty(rows_per_chunk, vocab, dtype=hidden.dtype, device=hidden.device)
    for start in range(0, n_rows, rows_per_chunk):
        rows = slice(start, min(start + rows_per_chunk, n_rows))
        hidden_chunk = hidden[rows]
        logits = _chunk_logits(workspace[: rows.stop - start], hidden_chunk, weight, bias)
        yield rows, hidden_chunk, labels[rows], logits


def _fused_forward(hidden, weight, bias, labels, options, denominator=None, needs=(False, False, False)):
    """Token losses (N,) and lse (N,) of 2-D hidden; with any of `needs` (hidden, weight, bias) also the gradients of
    sum_t loss_t / denominator (a 1-element float32 device tensor) computed chunk by chunk. Returns
    (token_losses, lse, (grad_hidden, grad_weight, grad_bias)), None for gradients not needed."""
    n_rows = hidden.shape[0]
    with _interior(hidden):
        weight_c, bias_c = _in_compute_dtype(hidden, weight, bias)
        token_losses = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n_rows, dtype=torch.float32, device=hidden.device)
        grads = _new_grads(hidden, weight, bias, needs)
        one = torch.ones((), dtype=torch.float32, device=hidden.device)
        for rows, hidden_chunk, labels_chunk, logits in _chunks(hidden, weight_c, bias_c, labels):
            loss_chunk, lse_chunk = _ce_forward(logits, labels_chunk, options)
            token_losses[rows] = loss_chunk
            lse[rows] = lse_chunk
            if any(needs):
                _ce_backward_in_place(logits, labels_chunk, lse_chunk, one, options, denominator)
                _accumulate_grads(logits, hidden_chunk, weight_c, rows, grads)
        return token_losses, lse, _finish_grads(grads, weight, bias)


def _fused_backward(grad_losses, hidden, weight, bias, labels, lse, options, needs):
    """Gradients of sum_t grad_losses_t * loss_t, recomputing each chunk's logits from hidden and weight."""
    # no_grad: under create_graph=True autograd runs backward with grad mode on, and these are kernels and out= ops.
    with _interior(hidden):
        grads = _new_grads(hidden, weight, bias, needs)
        if not any(needs):
            return grads
        weight_c, bias_c = _in_compute_dtype(hidden, weight, bias)
        for rows, hidden_chunk, labels_chunk, logits in _chunks(hidden, weight_c, bias_c, labels):
            _ce_backward_in_place(logits, labels_chunk, lse[rows], grad_losses[rows], options)
            _accumulate_grads(logits, hidden_chunk, weight_c, rows, grads)
        return _finish_grads(grads, weight, bias)


def _differentiable_grads(grad_rows, hidden, weight, bias, labels, options, needs):
    """The gradients of sum_t grad_rows_t * loss_t in plain torch (F.linear, then the contract's d loss / d logits
    and the two products), so that autograd can differentiate them again (create_graph=True: gradient penalties,
    Hessian-vector products). It materialises the (N, V) logits; only a second-order computation comes here."""
    # Under autocast a float32 master weight meets bf16 hidden here: compute in hidden's dtype, as the kernels did.
    weight = weight.to(hidden.dtype)
    bias = None if bias is None else bias.to(hidden.dtype)
    logits = torch.nn.functional.linear(hidden, weight, bias)
    vocab = weight.shape[0]
    dlogits = distributed.local_gradient(grad_rows, logits, labels, None, options, 0, vocab).to(logits.dtype)
    need_hidden, need_weight, need_bias = needs
    return (
        dlogits @ weight if need_hidden else None,
        dlogits.t() @ hidden if need_weight else None,
        dlogits.sum(0, dtype=torch.float32).to(bias.dtype) if need_bias else None,
    )


# --- eager autograd -------------------------------------------------------------------------------------------


class _ReducedFunction(torch.autograd.Function):
    """ "mean"/"sum": the gradients are computed in the forward; backward scales them in place by the upstream
    scalar (nothing else holds them, so the caller's .grad takes them over without a copy)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, denominator, options, needs):
        token_losses, _, grads = _fused_forward(hidden, weight, bias, labels, options, denominator, needs)
        ctx.grads = grads
        # References, no copies: read only by a backward that must be differentiable again.
        ctx.save_for_backward(hidden, weight, bias, labels, denominator)
        ctx.options, ctx.needs = options, needs
        return token_losses.sum() / denominator[0]

    @staticmethod
    def backward(ctx, grad_loss):
        if torch.is_grad_enabled():
            # create_graph=True: the gradients computed in the forward are constants to autograd; these are not.
            hidden, weight, bias, labels, denominator = ctx.saved_tensors
            grad_rows = (grad_loss.float() / denominator[0]).expand(labels.shape)
            grads = _differentiable_grads(grad_rows, hidden, weight, bias, labels, ctx.options, ctx.needs)
            return (*grads, None, None, None, None)
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError(
                "fastce_torch.linear_cross_entropy: backward through the same loss twice is not supported (its "
                "gradients are computed in the forward and handed over once); compute the loss again instead of "
                "retain_graph=True"
            )
        grad_loss = grad_loss.detach().to(torch.float32)
        for grad in grads:
            if grad is not None:
                _scale_in_place(grad, grad_loss)
        return (*grads, None, None, None, None)


class _PerTokenFunction(torch.autograd.Function):
    """ "none": the forward keeps lse; the backward recomputes the logits chunk by chunk."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, options):
        token_losses, lse, _ = _fused_forward(hidden, weight, bias, labels, options)
        ctx.save_for_backward(hidden, weight, bias, labels, lse)
        ctx.options = options
        return token_losses

    @staticmethod
    def backward(ctx, grad_losses):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2])
        if torch.is_grad_enabled():  # create_graph=True: a gradient that autograd can differentiate again
            grads = _differentiable_grads(grad_losses.float(), hidden, weight, bias, labels, ctx.options, needs)
            return (*grads, None, None)
        grads = _fused_backward(
            grad_losses.detach().contiguous(), hidden, weight, bias, labels, lse, ctx.options, needs
        )
        return (*grads, None, None)


# --- custom ops for torch.compile -----------------------------------------------------------------------------
# A custom op cannot return None: gradients that are not needed come back as empty tensors.


def _or_empty(tensor, like):
    return like.new_empty(0) if tensor is None else tensor


@torch.library.custom_op("fastce::linear_cross_entropy_reduced", mutates_args=())
def _reduced_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    denominator: torch.Tensor,
    ignore_index: int,
    logit_softcapping: float,
    logit_scaling: float,
    label_smoothing: float,
    z_loss: float,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    options = Options(ignore_index, logit_softcapping, logit_scaling, label_smoothing, z_loss)
    needs = (need_hidden, need_weight, need_bias)
    token_losses, _, grads = _fused_forward(hidden, weight, bias, labels, options, denominator, needs)
    loss = token_losses.sum() / denominator[0]
    return (loss, *(_or_empty(grad, hidden) for grad in grads))


def _fake_grads(hidden, weight, bias, needs):
    """The gradients' shapes and dtypes for the compiler (an empty stand-in where one is not needed)."""
    need_hidden, need_weight, need_bias = needs
    return (
        hidden.new_empty(hidden.shape if need_hidden else (0,)),
        weight.new_empty(weight.shape if need_weight else (0,)),
        hidden.new_empty((weight.shape[0],) if need_bias else (0,), dtype=bias.dtype if need_bias else hidden.dtype),
    )


@_reduced_op.register_fake
def _(hidden, weight, bias, labels, denominator, *options_and_needs):
    return (hidden.new_empty((), dtype=torch.float32), *_fake_grads(hidden, weight, bias, options_and_needs[-3:]))


def _reduced_setup_context(ctx, inputs, output):
    ctx.needs = inputs[-3:]
    ctx.save_for_backward(*output[1:])


def _reduced_backward(ctx, grad_loss, *unused_grads_of_grads):
    # Out of place under the compiler (it plans that memory itself); eager scales in place.
    # Exact zeros stay zero whatever the factor, as the eager scale kernel keeps them.
    grads = [
        torch.where(g == 0, 0, g * grad_loss.to(g.dtype)) if need else None
        for g, need in zip(ctx.saved_tensors, ctx.needs)
    ]
    return (*grads, None, None, None, None, None, None, None, None, None, None)


torch.library.register_autograd(
    "fastce::linear_cross_entropy_reduced", _reduced_backward, setup_context=_reduced_setup_context
)


@torch.library.custom_op("fastce::linear_cross_entropy_forward", mutates_args=())
def _per_token_forward_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    ignore_index: int,
    logit_softcapping: float,
    logit_scaling: float,
    label_smoothing: float,
    z_loss: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    options = Options(ignore_index, logit_softcapping, logit_scaling, label_smoothing, z_loss)
    token_losses, lse, _ = _fused_forward(hidden, weight, bias, labels, options)
    return token_losses, lse


@_per_token_forward_op.register_fake
def _(hidden, weight, bias, labels, *options):
    n_rows = hidden.shape[0]
    return hidden.new_empty(n_rows, dtype=torch.float32), hidden.new_empty(n_rows, dtype=torch.float32)


@torch.library.custom_op("fastce::linear_cross_entropy_backward", mutates_args=())
def _per_token_backward_op(
    grad_losses: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    lse: torch.Tensor,
    ignore_index: int,
    logit_softcapping: float,
    logit_scaling: float,
    label_smoothing: float,
    z_loss: float,
    need_hidden: bool,
    need_weight: bool,
    need_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    options = Options(ignore_index, logit_softcapping, logit_scaling, label_smoothing, z_loss)
    needs = (need_hidden, need_weight, need_bias)
    grads = _fused_backward(grad_losses.contiguous(), hidden, weight, bias, labels, lse, options, needs)
    return tuple(_or_empty(grad, hidden) for grad in grads)


@_per_token_backward_op.register_fake
def _(grad_losses, hidden, weight, bias, labels, lse, *options_and_needs):
    return _fake_grads(hidden, weight, bias, options_and_needs[-3:])


def _per_token_setup_context(ctx, inputs, output):
    hidden, weight, bias, labels, *options = inputs
    ctx.options = options
    ctx.has_bias = bias is not None
    ctx.save_for_backward(hidden, weight, bias, labels, output[1])


def _per_token_backward(ctx, grad_losses, unused_grad_lse):
    hidden, weight, bias, labels, lse = ctx.saved_tensors
    needs = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.has_bias and ctx.needs_input_grad[2]
    grads = _per_token_backward_op(grad_losses, hidden, weight, bias, labels, lse, *ctx.options, *needs)
    grads = [grad if need else None for grad, need in zip(grads, needs)]
    return (*grads, None, None, None, None, None, None)


torch.library.register_autograd(
    "fastce::linear_cross_entropy_forward", _per_token_backward, setup_context=_per_token_setup_context
)


# --- the function -----------------------------------------------------------------------------------------------


# float64 is accepted as in cross_entropy: computed in float64 by the plain-torch reference, whatever the backend.
LINEAR_DTYPES = (*KERNEL_DTYPES, torch.float64)


def _check_tensors(hidden, weight, bias, labels):
    for name, tensor in (("hidden", hidden), ("weight", weight)):
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in LINEAR_DTYPES:
            got = getattr(tensor, "dtype", type(tensor))
            raise TypeError(f"{name} must be float32, bfloat16, float16 or float64, got {got}")
    if hidden.dim() < 1:
        raise ValueError("hidden must have at least one dimension (..., H)")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be (V, H) with H = hidden.shape[-1] (nn.Linear's layout): hidden {tuple(hidden.shape)}, "
            f"weight {tuple(weight.shape)}"
        )
    if weight.shape[0] < 1:
        raise ValueError("weight must have a vocabulary dimension of at least 1")
    if weight.device != hidden.device:
        raise ValueError(f"weight is on {weight.device} but hidden on {hidden.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must be None or a (V,) = ({weight.shape[0]},) tensor, got {bias!r:.80}")
        if bias.dtype not in LINEAR_DTYPES:
            raise TypeError(f"bias must be float32, bfloat16, float16 or float64, got {bias.dtype}")
        if bias.device != hidden.device:
            raise ValueError(f"bias is on {bias.device} but hidden on {hidden.device}")
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"labels must be an int32 or int64 tensor, got {getattr(labels, 'dtype', type(labels))}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"labels must have the leading shape of hidden: hidden {tuple(hidden.shape)}, labels {tuple(labels.shape)}"
        )


def _common_dtype(hidden, weight, bias):
    """Mixed dtypes compute in their promoted dtype (as jnp.result_type does in fastce_jax): the narrower tensors are
    cast, a copy of each, and autograd hands each gradient back in its own tensor's dtype."""
    dtype = hidden.dtype if bias is None else torch.promote_types(hidden.dtype, bias.dtype)
    dtype = torch.promote_types(dtype, weight.dtype)
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def _autocast_or_common_dtype(hidden, weight, bias):
    """Under torch.autocast for the tensors' device type the matmuls run in the autocast dtype, as F.linear's do:
    hidden is cast (through autograd, so its gradient comes back in its own dtype, as F.linear's would); weight and
    bias are cast inside the computation instead, and their gradients accumulated and handed back in their own
    dtype. float64 is not autocast-eligible (torch leaves it alone) and keeps the promotion rule. Without autocast,
    mixed dtypes compute in their promoted dtype (_common_dtype)."""
    device_type = hidden.device.type
    tensors = [t for t in (hidden, weight, bias) if t is not None]
    if not torch.is_autocast_enabled(device_type) or any(t.dtype == torch.float64 for t in tensors):
        return _common_dtype(hidden, weight, bias)
    return hidden.to(torch.get_autocast_dtype(device_type)), weight, bias


def _denominator(labels, reduction, n_items, ignore_index):
    """What the summed loss is divided by, as a 1-element float32 tensor on labels' device, without a host sync."""
    if n_items is not None:
        if torch.is_tensor(n_items):
            return n_items.to(device=labels.device, dtype=torch.float32).reshape(1)
        return torch.full((1,), float(n_items), dtype=torch.float32, device=labels.device)
    if reduction == "mean":
        return (labels != ignore_index).sum().clamp_min(1).to(torch.float32).reshape(1)
    return torch.ones(1, dtype=torch.float32, device=labels.device)


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
    """fastce_torch.cross_entropy(hidden @ weight.T + bias, labels, ...) without ever allocating the logits.

    hidden (..., H), weight (V, H) as nn.Linear / lm_head store it, bias (V,) or None, labels (...) int32/int64;
    hidden, weight and bias are float32, bfloat16, float16 or float64 on one device; mixed dtypes compute in the
    promoted dtype (a cast copy of the narrower ones), each gradient in its own tensor's dtype; a float64 promoted
    dtype is computed in float64 by plain torch, whatever `backend` says. Every keyword is cross_entropy's
    (CONTRACT.md). Returns a float32 scalar ("mean", "sum") or per-token losses shaped like labels ("none"), float64
    when computed in float64. backend: "auto" = the chunked kernels for CUDA tensors, plain torch (matmul + the
    reference loss) elsewhere; "kernel" = the chunked kernels always (CPU: Triton's interpreter); "reference" =
    plain torch.

    For "mean"/"sum" with gradients enabled the gradients are computed during the forward (see the module
    docstring), so a second backward through the same loss (retain_graph=True) raises.

    shift=k (True = 1): cross_entropy's, along hidden's second-to-last (the sequence) dimension: the loss of
    `linear_cross_entropy(hidden[..., :-k, :], weight, labels[..., k:])` without slicing (or copying) hidden.
    """
    _check_tensors(hidden, weight, bias, labels)
    vocab = weight.shape[0]
    # The option checks of cross_entropy, on a stand-in for the logits that holds no memory.
    logits_shape = (*hidden.shape[:-1], vocab)
    stand_in = hidden.new_empty(1).as_strided(logits_shape, (0,) * len(logits_shape))
    _check_arguments(
        stand_in,
        labels,
        ignore_index,
        reduction,
        n_items,
        logit_softcapping,
        logit_scaling,
        label_smoothing,
        z_loss,
        backend,
    )
    if shift := _check_shift(shift, labels):
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
    if validate_labels:
        _validate_labels(labels, vocab, ignore_index)
    options = Options(
        ignore_index, float(logit_softcapping), float(logit_scaling), float(label_smoothing), float(z_loss)
    )
    hidden, weight, bias = _autocast_or_common_dtype(hidden, weight, bias)
    use_kernel = hidden.dtype != torch.float64 and (backend == "kernel" or (backend == "auto" and hidden.is_cuda))
    if not use_kernel:
        token_losses = _reference_token_losses(torch.nn.functional.linear(hidden, weight, bias), labels, options)
        return _reduce(token_losses, labels, reduction, n_items, ignore_index)
    hidden_2d = hidden.reshape(-1, hidden.shape[-1])
    labels_1d = labels.reshape(-1).contiguous()
    compiling = torch.compiler.is_compiling()
    if reduction == "none":
        if compiling:
            token_losses = _per_token_forward_op(hidden_2d, weight, bias, labels_1d, *options)[0]
        else:
            token_losses = _PerTokenFunction.apply(hidden_2d, weight, bias, labels_1d, options)
        return token_losses.view(labels.shape)
    grad_enabled = torch.is_grad_enabled()
    needs = (
        grad_enabled and hidden.requires_grad,
        grad_enabled and weight.requires_grad,
        grad_enabled and bias is not None and bias.requires_grad,
    )
    denominator = _denominator(labels_1d, reduction, n_items, ignore_index)
    if compiling:
        return _reduced_op(hidden_2d, weight, bias, labels_1d, denominator, *options, *needs)[0]
    return _ReducedFunction.apply(hidden_2d, weight, bias, labels_1d, denominator, options, needs)
