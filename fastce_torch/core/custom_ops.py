"""The torch.library plumbing that every custom op of the package uses (the cross-entropy, JSD, vocab-parallel and
linear ops, which torch.compile traces instead of the eager autograd Functions).

A custom op takes tensors and scalars only: each op takes the fields of its settings records (Options or
JsdOptions, linear/engine.Chunking, Needs) after its tensors, in each record's own order, spelled out once by
op_schema and read back by records_of; optional tensors come last (split_tensors). A custom op cannot return None:
a gradient that is not needed comes back as an empty stand-in (or_empty). The fake implementations give each
gradient the shape, dtype and layout that the chunk loops give the real one (fake_grads: the weight's gradient in the
weight's own layout, as linear/engine.new_grads allocates it, so a transposed view's gradient is transposed too), and
a reduced op's backward scales the gradients computed in its forward out of place (scaled_grads).
"""

from typing import NamedTuple

import torch

__all__ = ["Needs", "fake_grads", "op_schema", "or_empty", "records_of", "scaled_grads", "split_tensors"]


class Needs(NamedTuple):
    """Which of (hidden, weight, bias) a linear loss owes a gradient, as the linear custom ops take it."""

    need_hidden: bool
    need_weight: bool
    need_bias: bool


_SCHEMA_TYPES = {int: "int", float: "float", bool: "bool", int | None: "int?"}


def op_schema(*records):
    """The records' fields as torch.library schema arguments ("int ignore_index, float logit_softcapping, ..."), so
    that a custom op takes each record's fields in the one order the record defines."""
    return ", ".join(
        f"{_SCHEMA_TYPES[record.__annotations__[name]]} {name}" for record in records for name in record._fields
    )


def records_of(settings, *records):
    """The records back from an op's trailing scalars (op_schema's order): one instance of each record, then the
    settings that follow them, as a tuple."""
    out, start = [], 0
    for record in records:
        end = start + len(record._fields)
        out.append(record(*settings[start:end]))
        start = end
    return (*out, tuple(settings[start:]))


def split_tensors(settings, count):
    """(the op's trailing scalars, its last `count` arguments: the optional tensors, passed explicitly)."""
    return tuple(settings[:-count]), tuple(settings[-count:])


def or_empty(tensor, like):
    """`tensor`, or an empty stand-in (like's dtype and device) for a gradient that is not needed."""
    return like.new_empty(0) if tensor is None else tensor


def fake_grads(hidden, weight, bias, needs):
    """The gradients of (hidden, weight, bias) as a linear op's fake implementation gives them (an empty stand-in
    where one is not needed): hidden's shape and dtype, the weight's in the weight's own layout (new_grads'
    preserve_format: a weight_layout="hv" or other transposed view gets a transposed gradient), the bias's in its
    dtype."""
    need_hidden, need_weight, need_bias = needs
    return (
        hidden.new_empty(hidden.shape if need_hidden else (0,)),
        torch.empty_like(weight) if need_weight else weight.new_empty((0,)),
        hidden.new_empty((weight.shape[0],) if need_bias else (0,), dtype=bias.dtype if need_bias else hidden.dtype),
    )


def scaled_grads(grads, needs, grad_loss):
    """A reduced op's backward: the gradients its forward computed, times the upstream scalar, out of place (under the
    compiler, which plans that memory itself; eager calls scale in place, linear/scale.py), exact zeros kept zero
    whatever the factor as the eager scaling keeps them; None where not needed."""
    return [torch.where(g == 0, 0, g * grad_loss.to(g.dtype)) if need else None for g, need in zip(grads, needs)]
