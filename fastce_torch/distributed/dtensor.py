"""DTensor logits sharded on their last dimension (Shard(-1)) for cross_entropy: this rank's columns are taken
out (with a backward that hands the gradient back in the logits' own placements), run through the vocab-parallel path
(vocab_parallel.py eagerly, vocab_parallel_traced.py under torch.compile), and the results placed as loss_parallel
places them. LocalShard serves linear_sharded.py's DTensor weights too."""

import torch

from ..core.outputs import CrossEntropyOutput, weighted_output
from .vocab_parallel import vocab_parallel_cross_entropy
from .vocab_parallel_traced import traced_vocab_parallel_cross_entropy

__all__ = ["LocalShard", "dtensor_cross_entropy"]


class LocalShard(torch.autograd.Function):
    """dtensor.to_local(), with a backward that hands the gradient back as a DTensor of the input's own placements,
    global shape and strides. to_local's own backward derives the global strides from the local gradient; with
    uneven shards (V not a multiple of the mesh size) those differ from the input's (13 local columns of V = 37 on
    3 ranks give a row stride of 39, not 37), and torch 2.11's gradient accumulation then re-lays the .grad out
    through a replicated DTensor, handing back a Replicate gradient instead of the logits' placements."""

    @staticmethod
    def forward(ctx, tensor):
        ctx.spec = (tensor.device_mesh, tuple(tensor.placements), tensor.shape, tensor.stride())
        return tensor.to_local()

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed.tensor import DTensor

        mesh, placements, shape, stride = ctx.spec
        return DTensor.from_local(grad, mesh, placements, run_check=False, shape=shape, stride=stride)


def dtensor_cross_entropy(
    logits, labels, reduction, n_items, options, use_kernel, process_group, vocab_start, extras=None,
    token_weights=None,
):  # fmt: skip
    """A DTensor whose last dimension is sharded on exactly one mesh dimension (the tensor-parallel one); the other
    mesh dimensions may shard leading (batch) dimensions or replicate. Returns a DTensor with loss_parallel's
    placements: "none" per-token losses placed like the labels, "sum"/"mean" a scalar replicated on the
    tensor-parallel dimension and Partial(sum) on batch-sharded ones. The gradient is a fresh DTensor with the
    logits' placements (the DTensor's storage is never overwritten). With extras: a CrossEntropyOutput of DTensors,
    per-token fields placed like the labels, reduced ones like the loss (a reduced accuracy, a fraction of this
    shard's rows, needs rows that are not sharded). token_weights: placed like the labels (a DTensor, or a plain
    tensor where the labels may be one): each rank weights its own rows' losses (weighted_output)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    if process_group is not None or vocab_start is not None:
        raise ValueError(
            "a DTensor carries its own process group and offsets: pass neither process_group nor vocab_start"
        )
    mesh, placements, ndim = logits.device_mesh, tuple(logits.placements), logits.dim()
    last = ndim - 1

    def shards(p, dim):
        return isinstance(p, Shard) and p.dim % ndim == dim

    vocab_dims = [i for i, p in enumerate(placements) if shards(p, last)]
    others_ok = all(i in vocab_dims or p.is_replicate() or p.is_shard() for i, p in enumerate(placements))
    if len(vocab_dims) != 1 or not others_ok:
        raise NotImplementedError(
            f"fastce_torch takes a DTensor sharded on its last (vocabulary) dimension on exactly one mesh dimension, "
            f"other mesh dimensions Shard or Replicate; got placements {placements}. For other layouts call "
            f"cross_entropy on logits.full_tensor() or on logits.to_local() with process_group="
        )
    tp_dim = vocab_dims[0]
    batch_sharded = any(p.is_shard() and i != tp_dim for i, p in enumerate(placements))
    if extras is not None and extras.accuracy and reduction != "none" and batch_sharded:
        raise NotImplementedError(
            "return_accuracy with a reduced loss over batch-sharded DTensor logits (a fraction of each shard's rows "
            "does not add up over the shards): use reduction='none' and reduce the per-token accuracy yourself"
        )
    if reduction == "mean" and batch_sharded and n_items is None:
        raise ValueError(
            "reduction='mean' over a batch-sharded DTensor needs the global token count: pass n_items "
            "(or use reduction='sum' and divide yourself)"
        )
    label_placements = tuple(Replicate() if i == tp_dim else p for i, p in enumerate(placements))
    if isinstance(labels, DTensor):
        if tuple(labels.placements) != label_placements:
            raise ValueError(f"labels must be placed {label_placements} (the logits' without the vocabulary dim)")
        local_labels = labels.to_local()
    elif batch_sharded:
        raise ValueError(f"with batch-sharded logits pass labels as a DTensor placed {label_placements}")
    else:
        local_labels = labels
    local_weights = token_weights
    if isinstance(token_weights, DTensor):
        if tuple(token_weights.placements) != label_placements:
            raise ValueError(f"token_weights must be placed {label_placements} (like the labels)")
        local_weights = token_weights.to_local()
    elif token_weights is not None and batch_sharded:
        raise ValueError(f"with batch-sharded logits pass token_weights as a DTensor placed {label_placements}")
    # Shard's chunking (torch.chunk): ceil(V / n) columns per rank, the last ranks get fewer (or none).
    vocab_total, n_ranks, rank = logits.shape[-1], mesh.size(tp_dim), mesh.get_local_rank(tp_dim)
    chunk = -(-vocab_total // n_ranks)
    start = min(rank * chunk, vocab_total)
    local = LocalShard.apply(logits)
    if local.shape[-1] != min(chunk, vocab_total - start):
        raise NotImplementedError(
            f"this rank holds {local.shape[-1]} columns where Shard's chunking gives "
            f"{min(chunk, vocab_total - start)}; call cross_entropy on to_local() with vocab_start="
        )
    if local.shape[-1] == 0:
        raise NotImplementedError("a rank holds no vocabulary columns (V < mesh size); not supported")
    layout = (mesh.get_group(tp_dim), start, vocab_total, False)
    # Token weights: this rank's rows' per-token losses, weighted and reduced locally (a Partial sum over batch
    # shards, as the unweighted loss).
    inner_reduction, inner_n_items = (reduction, n_items) if token_weights is None else ("none", None)
    if torch.compiler.is_compiling() and extras is None:
        loss = traced_vocab_parallel_cross_entropy(
            local, local_labels, inner_reduction, inner_n_items, options, layout, use_kernel
        )
    else:
        loss = vocab_parallel_cross_entropy(
            local, local_labels, inner_reduction, inner_n_items, False, options, layout, use_kernel, extras
        )
    if token_weights is not None:
        loss = weighted_output(loss, local_labels, local_weights, reduction, n_items, options.ignore_index)
    if reduction == "none":
        out_placements = label_placements
    else:
        out_placements = tuple(
            Replicate() if i == tp_dim or p.is_replicate() else Partial("sum") for i, p in enumerate(placements)
        )
    if extras is None:
        return DTensor.from_local(loss, mesh, out_placements, run_check=False)
    fields = {}
    for name, value in loss._asdict().items():
        if value is not None:
            per_token = name == "lse" or reduction == "none"
            placed = label_placements if per_token else out_placements
            if name == "accuracy" and not per_token:
                placed = tuple(Replicate() for _ in placements)  # rows not sharded (checked above)
            value = DTensor.from_local(value, mesh, placed, run_check=False)
        fields[name] = value
    return CrossEntropyOutput(**fields)
