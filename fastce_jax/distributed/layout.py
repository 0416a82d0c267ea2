"""Where a sharded operand's blocks lie, loss-neutral: the helpers every custom_partitioning rule of the package
shares (partitioning.py for cross_entropy's logits, losses/jsd/autograd.py for jsd's, linear_sharded.py for the
fused linear loss): the mesh axes of a PartitionSpec entry and back (mesh_axes, mesh_entry), the plan of logits
sharded by XLA's propagation (plan: rows and vocabulary axes, the shardings to ask for), the linear index of a
device's block (shard_index), and the vmap and one-device rules of the ops (as_leading_batch, single_device).
Imports nothing of the package.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = [
    "mesh_axes",
    "mesh_entry",
    "shard_index",
    "plan",
    "shardings",
    "row_shardings",
    "as_leading_batch",
    "single_device",
]


def mesh_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names), as a tuple."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def mesh_entry(axes):
    """The PartitionSpec entry of a tuple of mesh axes: None, the one name, or the tuple."""
    return None if not axes else axes[0] if len(axes) == 1 else axes


def shard_index(mesh: Mesh, axes: tuple[str, ...]):
    """Linear index of this device's block along a dimension sharded over
    ``axes`` (the first axis is the most significant, as in a PartitionSpec)."""
    index = jnp.int32(0)
    for name in axes:
        index = index * mesh.shape[name] + jax.lax.axis_index(name)
    return index


def plan(arg):
    """(mesh, per-leading-dim spec entries, vocabulary axes) for logits ``arg``
    (a ShapeDtypeStruct with the sharding XLA gave it).

    A dimension whose size its mesh axes do not divide (JAX's own shardings
    cannot say that, but XLA's propagation might) is replicated instead: uneven
    blocks would be padded, and the statistics must not see padding.
    """
    sharding, shape = arg.sharding, arg.shape
    if not isinstance(sharding, NamedSharding):
        # No mesh to name axes with (the program's shardings were not built
        # from a Mesh): run replicated on a one-axis mesh of the same devices.
        devices = sorted(sharding.device_set, key=lambda d: d.id)
        return Mesh(np.array(devices), ("fastce_replicated",)), (None,) * (len(shape) - 1), ()
    mesh = sharding.mesh
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
    entries = []
    for size, entry in zip(shape, spec):
        axes = mesh_axes(entry)
        if axes and size % math.prod(mesh.shape[a] for a in axes) != 0:
            axes = ()
        entries.append(mesh_entry(axes))
    return mesh, tuple(entries[:-1]), mesh_axes(entries[-1])


def shardings(mesh, rows, vocab_axes):
    """(logits sharding, per-row sharding) for a plan."""
    return NamedSharding(mesh, P(*rows, mesh_entry(vocab_axes))), NamedSharding(mesh, P(*rows))


def row_shardings(arg, n_logits: int, n_rows: int, n_shared: int):
    """(mesh, operand shardings, per-row sharding) of a launch on the rows only, for logits ``arg`` as XLA sharded
    them: the rows keep their sharding (plan: mesh axes that divide them), the vocabulary is replicated (a sharded
    one is gathered); ``n_logits`` logits operands, then ``n_rows`` per-row operands that follow the rows, then
    ``n_shared`` replicated ones."""
    mesh, rows, _ = plan(arg)
    logits, per_row = NamedSharding(mesh, P(*rows, None)), NamedSharding(mesh, P(*rows))
    return mesh, (logits,) * n_logits + (per_row,) * n_rows + (NamedSharding(mesh, P()),) * n_shared, per_row


def as_leading_batch(axis_size, in_batched, args):
    """Every argument with the vmapped axis first (custom_vmap puts it there)."""
    return [a if b else jnp.broadcast_to(a, (axis_size,) + a.shape) for a, b in zip(args, in_batched)]


def single_device() -> bool:
    """Whether this process has one device: nothing to partition, the kernels are called directly."""
    return jax.device_count() == 1
