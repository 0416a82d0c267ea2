"""Sharded heads for the fused linear cross-entropy: a column-parallel (vocab-parallel) weight, and a DTensor weight
(FSDP2's `fully_shard`, or a tensor-parallel DTensor).

Vocab-parallel (`process_group=`, or hidden a Replicate DTensor with the weight sharded on its rows): each rank
holds the weight rows (and bias entries) of a contiguous slice of the vocabulary, hidden and labels (global ids)
are the same on every rank. The rows are chunked as in linear_cross_entropy; per chunk each rank computes its
logits slice (one matmul), the kernels' vocab-parallel statistics (vocab_parallel.shard_statistics), and the two O(rows)
all-reduces of vocab_parallel.combine_statistics give every rank the chunk's global logsumexp and loss. For "mean"/"sum"
the chunk's d logits follow at once (the kernels' vocab-parallel backward, in place) and fold into d weight (local,
no communication) and d hidden (this rank's columns' share), as the unsharded loop does; "none" keeps the global
lse (N floats) and recomputes each chunk in the backward. d hidden is then summed over the ranks: one all-reduce of
N x H (inherent to a column-parallel layer, as its input gradient). Nothing weight- or logits-sized is communicated.
Every rank uses the same rows per chunk (from the widest slice), so every rank runs the same collectives. The
return_* outputs' statistics ride on the same combine (vocab_parallel.combine_statistics with extras).

DTensor weight with a plain hidden: the data-parallel case of FSDP2 (each rank's hidden and labels are its own
batch): when the LM head is a module of its own under fully_shard and the loss reads `lm_head.weight` without
calling the module, the weight is still the sharded DTensor there. The weight (and a DTensor bias) is gathered
(what FSDP2's unshard does), the unsharded fused loss runs on this rank's rows, and the weight's gradient is
reduce-scattered back to its own placements, averaged over the mesh's ranks as FSDP2 averages its gradients: the
same .grad as calling lm_head(hidden) and cross_entropy under FSDP2. Inside the FSDP2 module's own forward
(lm_head in the root's group, or a call through lm_head) the weight is already a plain tensor and none of this
applies. Treating the sharded rows as a vocabulary split instead would need the same hidden on every rank, which a
data-parallel batch is not, so that reading is reserved for hidden passed as a Replicate DTensor.
"""

import torch
import torch.distributed as dist

from ..core.options import compute_dtype, is_dtensor, loss_divisor, use_kernel
from ..core.options import validate_labels as validate_label_values
from ..core.outputs import CrossEntropyOutput
from ..core.reference import logits_gradient, token_loss_from_statistics, transform
from ..linear import engine
from ..linear.scale import scale_unless_one
from ..losses.cross_entropy import launch
from ..losses.cross_entropy.linear_autograd import BACKWARD_TWICE, row_entropy
from ..losses.cross_entropy.linear_dispatch import output_fields, unsharded_loss, unsharded_outputs
from .dtensor import LocalShard
from .vocab_parallel import combine_statistics, gathered_slices, shard_gradient, shard_statistics

__all__ = ["VERIFIED_WIDTHS", "sharded_linear_cross_entropy", "vocab_parallel_linear_cross_entropy"]

VERIFIED_WIDTHS = set()  # (group, rank, width) whose rank * width layout the ranks' gathered slices confirmed


def _layout(group, vocab_start, width, device):
    """(group, vocab_start, vocab_total, widest slice). Without vocab_start the slices start at rank * width; the
    first call for a (group, width) checks that every rank holds that width (one gather of O(world) integers, then
    remembered), since unequal widths would give the ranks different chunk counts and so different collectives.
    An explicit vocab_start gathers the slices every call (a host synchronisation), as cross_entropy does."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("process_group given but torch.distributed is not initialised (init_process_group)")
    if vocab_start is None:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        key = (id(group), rank, width)
        if key not in VERIFIED_WIDTHS:
            try:  # rank * width tiles [0, V) exactly when every width is the same
                gathered_slices(group, rank * width, width, device)
            except ValueError as error:
                raise ValueError(
                    "linear_cross_entropy with process_group: without vocab_start every rank must hold the same "
                    "number of weight rows (pass vocab_start= for unequal slices)"
                ) from error
            VERIFIED_WIDTHS.add(key)
        return group, rank * width, world * width, width
    if isinstance(vocab_start, bool) or not isinstance(vocab_start, int) or vocab_start < 0:
        raise ValueError(f"vocab_start must be a non-negative int, got {vocab_start!r}")
    slices = gathered_slices(group, vocab_start, width, device)
    return group, vocab_start, slices[-1][0], max(w for _, w in slices[:-1])


def _sum_over_ranks(tensor, group):
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
    return tensor


def _slice_entropy_gradient(grad_entropy, logits, labels, lse, mean_z, options):
    """d(sum_t g_t H_t) / d logits of a vocabulary slice in plain torch (float32; float64 for float64 logits), from
    the global lse and mz = E_p[z]: p_j (mz - z_j) dz/dx, 0 on ignored rows (the kernels' entropy variant)."""
    ignored = (labels == options.ignore_index).unsqueeze(-1)
    z = transform(logits, options, labels)
    lse, mean_z = (torch.where(ignored, 0.0, t.to(z.dtype).unsqueeze(-1)) for t in (lse, mean_z))
    grad = torch.exp(z - lse) * (mean_z - z)
    if options.logit_softcapping > 0.0:
        tanh_z = z / options.logit_softcapping
        grad = grad * (1.0 - tanh_z * tanh_z)
    if options.logit_scaling != 0.0:
        grad = grad * options.logit_scaling
    return torch.where(ignored, 0.0, grad * grad_entropy.to(z.dtype).unsqueeze(-1))


def _chunk_gradient(logits, dlogits, labels, lse, options, layout, use_kernel, upstream, denominator=None):
    """Writes into dlogits (the chunk's local logits themselves, or the inputs'-dtype chunk next to float32 logits)
    d/d logits of its columns (no communication) of sum_t (g_t loss_t / denominator + g_lse_t lse_t + g_H_t H_t),
    upstream = (g, g_lse, g_H, mz) per row (each upstream None for none of that part; g may be 0-d; mz the global
    E_p[z] = lse - H). The kernels add the entropy's part in the loss's pass."""
    _, vocab_start, vocab_total, _ = layout
    grad_rows, grad_lse, grad_entropy, mean_z = upstream
    float32 = dict(dtype=torch.float32 if logits.dtype != torch.float64 else torch.float64, device=logits.device)
    passes = []
    if use_kernel and grad_entropy is not None:
        zero = torch.zeros((), **float32)
        denominator = None if denominator is None else denominator.reshape(1)
        passes.append(
            lambda out: launch.backward(
                zero if grad_rows is None else grad_rows,
                logits,
                labels,
                lse,
                out,
                options,
                denominator,
                vocab_start=vocab_start,
                vocab_total=vocab_total,
                grad_entropy=grad_entropy,
                mean_z=mean_z,
            )  # fmt: skip
        )
    elif grad_rows is not None:
        passes.append(
            lambda out: shard_gradient(
                grad_rows, denominator, logits, labels, lse, out, options, vocab_start, vocab_total, use_kernel
            )
        )
    if grad_entropy is not None and not use_kernel:
        passes.append(
            lambda out: out.copy_(_slice_entropy_gradient(grad_entropy, logits, labels, lse, mean_z, options))
        )
    if grad_lse is not None:
        if use_kernel:
            passes.append(
                lambda out: launch.lse_backward(grad_lse, logits, labels, lse, out, options, vocab_total=vocab_total)
            )
        else:
            lse_options = options._replace(label_smoothing=0.0, z_loss=0.0)
            passes.append(
                lambda out: out.copy_(
                    logits_gradient(grad_lse.to(lse.dtype), logits, labels, lse, lse_options, vocab_total, vocab_total)
                )
            )
    if len(passes) == 1:
        passes[0](dlogits)
        return
    # Several parts in float32, rounded to the gradient's dtype once.
    total = torch.empty(logits.shape, **float32)
    passes[0](total)
    part = torch.empty_like(total)
    for add in passes[1:]:
        add(part)
        total += part
    dlogits.copy_(total)


def _recomputed_grads(hidden, weight, bias, labels, lse, upstream, needs, ctx):
    """The gradients of sum_t (g_t loss_t + g_lse_t lse_t + g_H_t H_t) (upstream as _chunk_gradient's, per row),
    each chunk's logits recomputed; d hidden summed over the ranks."""
    with engine.kernel_context(hidden):
        grads = engine.new_grads(hidden, weight, bias, needs, ctx.chunking)
        if any(needs):
            weight_c, bias_c = engine.in_compute_dtype(hidden, weight, bias)
            for rows, hidden_chunk, labels_chunk, logits, dlogits, first in engine.row_chunks(
                hidden, weight_c, bias_c, labels, ctx.chunking
            ):
                rows_upstream = tuple(None if part is None else part[rows] for part in upstream)
                _chunk_gradient(
                    logits, dlogits, labels_chunk, lse[rows], ctx.options, ctx.layout, ctx.use_kernel, rows_upstream
                )
                engine.accumulate_grads(dlogits, hidden_chunk, weight_c, rows, grads, first)
        grads = engine.finish_grads(grads, weight, bias)
        if grads[0] is not None:
            _sum_over_ranks(grads[0], ctx.layout[0])
    return grads


def _detached(tensor, dtype):
    return None if tensor is None else tensor.detach().contiguous().to(dtype)


class _VocabParallelLinearFunction(torch.autograd.Function):
    """hidden (N, H) replicated, weight (V_local, H) and bias (V_local,) this rank's rows, labels (N,) global. With
    extras (the return_* outputs): (loss, lse, argmax, entropy per row), lse differentiable for the z_loss output,
    the entropy for the entropy output. token_weights (N,) or None: the per-row factors of a reduced loss (0 where
    ignored), in its gradient computed in the forward ("none" is weighted by the caller)."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, labels, denominator, options, chunking, needs, layout, use_kernel, extras,
        token_weights=None,
    ):  # fmt: skip
        group, vocab_start, vocab_total, widest = layout
        reduced = denominator is not None
        grad_now = needs if reduced else (False, False, False)
        outputs = extras is not None
        n_rows = hidden.shape[0]
        dtype = compute_dtype(hidden.dtype)
        with_sum_z = options.label_smoothing > 0.0
        # The same rows per chunk on every rank (from the widest slice): the ranks' collectives pair up.
        itemsize = engine.logit_bytes(hidden, chunking, True)  # the backward's passes compute gradients
        step = engine.rows_per_chunk(n_rows, widest, itemsize, chunking.workspace_bytes, chunking.chunk_rows)
        chunking = chunking._replace(chunk_rows=step)
        with engine.kernel_context(hidden):
            weight_c, bias_c = engine.in_compute_dtype(hidden, weight, bias)
            token_losses = torch.zeros(n_rows, dtype=dtype, device=hidden.device)
            lse = torch.full((n_rows,), float("-inf"), dtype=dtype, device=hidden.device)
            if outputs:
                argmax = torch.zeros(n_rows, dtype=torch.int64, device=hidden.device)
                mean_z = torch.zeros(n_rows, dtype=dtype, device=hidden.device)
            grads = engine.new_grads(hidden, weight, bias, grad_now, chunking)
            one = torch.ones((), dtype=torch.float32, device=hidden.device)
            for rows, hidden_chunk, labels_chunk, logits, dlogits, first in engine.row_chunks(
                hidden, weight_c, bias_c, labels, chunking, with_grads=any(grad_now)
            ):
                lse_local, z_label, sum_z, *local_extras = shard_statistics(
                    logits, labels_chunk, options, vocab_start, vocab_total, use_kernel, outputs
                )
                chunk_lse, z_label, sum_z, *chunk_extras = combine_statistics(
                    lse_local, z_label, sum_z, group, logits.shape[-1], False, with_sum_z,
                    local_extras if outputs else None, vocab_total,
                )  # fmt: skip
                token_losses[rows] = token_loss_from_statistics(
                    chunk_lse, z_label, sum_z, labels_chunk, options, vocab_total
                )
                lse[rows] = chunk_lse
                if outputs:
                    argmax[rows], mean_z[rows] = chunk_extras
                if any(grad_now):
                    factor = one if token_weights is None else token_weights[rows]
                    _chunk_gradient(
                        logits, dlogits, labels_chunk, chunk_lse, options, layout, use_kernel,
                        (factor, None, None, None), denominator,
                    )  # fmt: skip
                    engine.accumulate_grads(dlogits, hidden_chunk, weight_c, rows, grads, first)
            grads = engine.finish_grads(grads, weight, bias)
            if grads[0] is not None:
                _sum_over_ranks(grads[0], group)
        ctx.options, ctx.chunking, ctx.layout, ctx.use_kernel = options, chunking, layout, use_kernel
        ctx.grads = grads if reduced else None
        ctx.reduced, ctx.extras = reduced, extras
        weighted = token_losses if token_weights is None else token_losses * token_weights
        loss = weighted.sum() / denominator if reduced else token_losses
        if not outputs:
            if not reduced:
                ctx.save_for_backward(hidden, weight, bias, labels, lse, None)
            return loss
        entropy = row_entropy(lse, mean_z, labels, options.ignore_index)
        if not reduced or extras.z_loss or extras.entropy:
            ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy)
        ctx.mark_non_differentiable(argmax, *(() if extras.z_loss else (lse,)), *(() if extras.entropy else (entropy,)))
        ctx.set_materialize_grads(False)
        return loss, lse, argmax, entropy

    @staticmethod
    def backward(ctx, grad_output, *grad_extras):
        if torch.is_grad_enabled():
            raise NotImplementedError(
                "create_graph=True through a vocab-parallel linear_cross_entropy is not supported"
            )
        nones = (None,) * 9
        extras = ctx.extras
        grad_lse = grad_extras[0] if grad_extras and extras.z_loss else None
        grad_entropy = grad_extras[2] if grad_extras and extras.entropy else None
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2])
        if ctx.reduced:
            grads, ctx.grads = ctx.grads, None
            if grads is None:
                raise RuntimeError(BACKWARD_TWICE)
            if grad_output is not None:
                factor = grad_output.detach().to(torch.float32)
                for grad in grads:
                    if grad is not None:
                        if ctx.use_kernel:
                            scale_unless_one(grad, factor)
                        else:
                            grad.mul_(factor.to(grad.dtype))
            else:
                grads = (None, None, None)
            if grad_lse is None and grad_entropy is None:
                return (*grads, *nones)
            grad_output = None
        else:
            grads = (None, None, None)
            if grad_output is None and grad_lse is None and grad_entropy is None:
                return (*grads, *nones)
        hidden, weight, bias, labels, lse, entropy = ctx.saved_tensors
        needs = (needs[0], needs[1], bias is not None and needs[2])
        upstream = (
            _detached(grad_output, lse.dtype), _detached(grad_lse, lse.dtype), _detached(grad_entropy, lse.dtype),
            None if entropy is None else lse - entropy,
        )  # fmt: skip
        extra_grads = _recomputed_grads(hidden, weight, bias, labels, lse, upstream, needs, ctx)
        grads = [a if b is None else (b if a is None else a + b) for a, b in zip(grads, extra_grads)]
        return (*grads, *nones)


def vocab_parallel_linear_cross_entropy(
    hidden, weight, bias, labels, options, reduction, n_items, backend, chunking, layout, extras=None,
    token_weights=None,
):  # fmt: skip
    """hidden (..., H) and labels (...) the same on every rank, weight (V_local, H) and bias (V_local,) this rank's
    rows; the loss of the full head on every rank (with extras, a Extras asking for some:
    CrossEntropyOutput). token_weights: shaped like labels, 0 where ignored (linear_api.py prepares them), or None."""
    hidden, weight, bias = engine.autocast_or_common_dtype(hidden, weight, bias)
    kernel = use_kernel(hidden, backend)
    hidden_2d = hidden.reshape(-1, hidden.shape[-1])
    labels_1d = labels.reshape(-1).contiguous()
    needs = engine.gradients_needed(hidden, weight, bias)
    # Labels are the same on every rank, so the local kept-token count is the global one.
    denominator = loss_divisor(labels_1d, reduction, n_items, options.ignore_index)
    weights_1d = None if token_weights is None else token_weights.reshape(-1).contiguous()
    out = _VocabParallelLinearFunction.apply(
        hidden_2d, weight, bias, labels_1d, denominator, options, chunking, needs, layout, kernel, extras,
        weights_1d,
    )  # fmt: skip
    loss, *statistics = (out,) if extras is None else out
    if reduction == "none":  # "none" is weighted here (the reduced losses in the Function)
        loss = (loss if weights_1d is None else loss * weights_1d).view(labels.shape)
    if extras is None:
        return loss
    lse, argmax, entropy = statistics
    return output_fields(
        loss, lse, argmax, entropy, labels, options, extras, reduction, n_items, layout[2], None, weights_1d
    )


# --- DTensor weights -------------------------------------------------------------------------------------------


class _Gathered(torch.autograd.Function):
    """A DTensor (Shard / Replicate placements) as the full plain tensor on every rank; the backward hands each
    rank's full gradient back in the DTensor's placements, averaged over the mesh (FSDP2's reduce-scatter, with an
    all-reduce over replicated mesh dimensions as HSDP has)."""

    @staticmethod
    def forward(ctx, tensor):
        from torch.distributed.tensor import Replicate

        mesh, placements = tensor.device_mesh, tuple(tensor.placements)
        ctx.spec = mesh, placements, tensor.shape, tensor.stride()
        return tensor.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed.tensor import DTensor, Partial

        mesh, placements, shape, stride = ctx.spec
        partial = DTensor.from_local(
            grad.contiguous() / mesh.size(), mesh, [Partial("sum")] * mesh.ndim, run_check=False, shape=shape,
            stride=stride,
        )  # fmt: skip
        return partial.redistribute(mesh, placements)


def _check_dtensor_weight(tensor, name):
    bad = [p for p in tensor.placements if not (p.is_replicate() or (p.is_shard() and p.dim % tensor.dim() == 0))]
    if bad:
        raise NotImplementedError(
            f"linear_cross_entropy takes a DTensor {name} sharded on its rows (Shard(0)) or replicated; got "
            f"placements {tuple(tensor.placements)}"
        )


class _ReplicatedLocal(torch.autograd.Function):
    """A Replicate DTensor's local tensor; its gradient (already summed over the ranks) comes back Replicate."""

    @staticmethod
    def forward(ctx, tensor):
        ctx.spec = tensor.device_mesh, tuple(tensor.placements), tensor.shape, tensor.stride()
        return tensor.to_local()

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = ctx.spec
        return DTensor.from_local(grad, mesh, placements, run_check=False, shape=shape, stride=stride)


def _dtensor_vocab_parallel(
    hidden, weight, bias, labels, options, reduction, n_items, backend, chunking, extras, token_weights=None
):
    """hidden a Replicate DTensor, weight Shard(0) on a 1-D mesh (bias Shard(0) or None): vocab-parallel, the loss
    (and every extra output) a Replicate DTensor, the gradients DTensors placed like their inputs."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = weight.device_mesh
    tensors = [("hidden", hidden, Replicate()), ("weight", weight, Shard(0))]
    if bias is not None:
        tensors.append(("bias", bias, Shard(0)))
    for name, tensor, placement in tensors:
        if not is_dtensor(tensor) or tensor.device_mesh != mesh or tuple(tensor.placements) != (placement,):
            raise NotImplementedError(
                "vocab-parallel linear_cross_entropy over DTensors takes hidden Replicate and weight (and bias) "
                f"Shard(0) on one 1-D mesh; {name} is {getattr(tensor, 'placements', 'a plain tensor')}"
            )
    if is_dtensor(labels):
        labels = labels.full_tensor()
    vocab_total, n_ranks, rank = weight.shape[0], mesh.size(), mesh.get_local_rank()
    # Shard's chunking (torch.chunk): ceil(V / n) rows per rank, the last ranks fewer.
    chunk = -(-vocab_total // n_ranks)
    start = min(rank * chunk, vocab_total)
    local_weight = LocalShard.apply(weight)
    local_bias = None if bias is None else LocalShard.apply(bias)
    if local_weight.shape[0] == 0:
        raise NotImplementedError("a rank holds no weight rows (V < mesh size); not supported")
    layout = (mesh.get_group(), start, vocab_total, chunk)
    if is_dtensor(token_weights):
        token_weights = token_weights.full_tensor()
    loss = vocab_parallel_linear_cross_entropy(
        _ReplicatedLocal.apply(hidden), local_weight, local_bias, labels, options, reduction, n_items, backend,
        chunking, layout, extras, token_weights,
    )  # fmt: skip
    if extras is None:
        return DTensor.from_local(loss, mesh, [Replicate()], run_check=False)
    fields = {
        name: None if value is None else DTensor.from_local(value, mesh, [Replicate()], run_check=False)
        for name, value in loss._asdict().items()
    }
    return CrossEntropyOutput(**fields)


@torch.compiler.disable
def sharded_linear_cross_entropy(
    hidden, weight, bias, labels, options, reduction, n_items, backend, chunking, extras, validate_labels,
    process_group, vocab_start, token_weights=None,
):  # fmt: skip
    """linear_cross_entropy's entry for process_group= / vocab_start= or DTensor inputs (eager: the collectives
    run in an autograd.Function; under torch.compile a graph break)."""
    dtensors = [is_dtensor(t) for t in (hidden, weight, bias)]
    if any(dtensors):
        if process_group is not None or vocab_start is not None:
            raise ValueError(
                "a DTensor carries its own process group and offsets: pass neither process_group nor vocab_start"
            )
        if dtensors[0]:
            if validate_labels:
                full = labels.full_tensor() if is_dtensor(labels) else labels
                validate_label_values(full, weight.shape[0], options.ignore_index)
            return _dtensor_vocab_parallel(
                hidden, weight, bias, labels, options, reduction, n_items, backend, chunking,
                extras if any(extras) else None, token_weights,
            )  # fmt: skip
        for name, tensor in (("weight", weight), ("bias", bias)):
            if is_dtensor(tensor):
                _check_dtensor_weight(tensor, name)
        if is_dtensor(labels):
            raise ValueError("with a plain hidden (this rank's rows) labels must be a plain tensor too")
        full_weight = _Gathered.apply(weight) if dtensors[1] else weight
        full_bias = _Gathered.apply(bias) if dtensors[2] else bias
        if validate_labels:
            validate_label_values(labels, full_weight.shape[0], options.ignore_index)
        if any(extras):
            return unsharded_outputs(
                hidden, full_weight, full_bias, labels, options, reduction, n_items, backend, chunking, extras,
                None, token_weights,
            )  # fmt: skip
        return unsharded_loss(
            hidden, full_weight, full_bias, labels, options, reduction, n_items, backend, chunking, None, token_weights
        )
    if process_group is None:
        raise ValueError("vocab_start is only meaningful with process_group (a vocab-parallel weight)")
    layout = _layout(process_group, vocab_start, weight.shape[0], hidden.device)
    if validate_labels:
        validate_label_values(labels, layout[2], options.ignore_index)
    return vocab_parallel_linear_cross_entropy(
        hidden, weight, bias, labels, options, reduction, n_items, backend, chunking, layout,
        extras if any(extras) else None, token_weights,
    )  # fmt: skip
