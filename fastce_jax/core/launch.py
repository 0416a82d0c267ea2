"""The loss-neutral host side of a Pallas kernel launch, shared by every loss's launchers (losses/*/launch.py):

* quiet_triton and the Triton deprecation filter (jax 0.11 deprecates the Pallas Triton backend and warns each time
  a Triton pallas_call is lowered);
* same_variance and launch: a pallas_call's operands and outputs made varying over the same manual mesh axes (inside
  a ``jax.shard_map`` with check_vma=True), and the call itself, refused in interpret mode there;
* uses_int64_offsets: when the Triton lowering switches to 64-bit offsets.

64-bit offsets.  The Triton lowering (jax/_src/pallas/triton/lowering.py,
``_compute_offsets_from_indices``) computes every load/store offset in int64
whenever the *whole* operand is larger than 2**32 bytes, and it casts the block
start indices (our row index from the index_map, an int32 program id) to that
type *before* multiplying by the row stride.  So a squeezed row dim
``(None, W)`` with index_map ``(i, j)`` gives the 64-bit product ``i * V`` for
N*V > 2**31 elements (in bf16/f16 that is > 2**32 bytes; in f32 the switch
already happens at 2**30 elements).  Below the threshold every offset is < 2**31
and int32 is exact.  The in-row parts (``j * W`` from a Blocked dim, our
``pl.ds`` starts and the label) are < V + W, far below 2**31.  Hence the logits
are passed as a plain (N, V) array; no flat view or manual int64 product is
needed.  ``fastce_jax/tests/test_lowering.py`` checks the emitted Triton IR for i64
offsets on a >2**31-element abstract input.
"""

from __future__ import annotations

import contextlib
import warnings

import jax
import jax.numpy as jnp

__all__ = [
    "TRITON_DEPRECATION",
    "quiet_triton",
    "vary",
    "same_variance",
    "launch",
    "uses_int64_offsets",
]

# jax 0.11 deprecates the Pallas Triton backend and warns each time a Triton
# pallas_call is *lowered*.  See ``quiet_triton`` for how it is filtered.
TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated"


def _ignore_triton_deprecation_globally() -> None:
    # The deprecation is raised while the *enclosing* jit lowers, which happens
    # after our launcher has returned, with no fastce_jax frame on the stack: a
    # catch_warnings around the pallas_call cannot see it.  So every compiled
    # (non-interpret) launch makes sure a process filter for exactly this
    # message and category is installed (again, when a user's catch_warnings
    # block that was open at the first launch dropped it on exit).  Interpret
    # mode (CPU) never lowers to Triton and never installs it.
    for action, message, category, _, _ in warnings.filters:
        if (
            action == "ignore"
            and category is DeprecationWarning
            and getattr(message, "pattern", None) == TRITON_DEPRECATION
        ):
            return
    warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)


@contextlib.contextmanager
def quiet_triton(interpret: bool):
    """Silences the Triton deprecation around our own pallas_call sites and around
    the entry points' eager calls of their jitted kernel paths (which lower on the
    call, after tracing returned: the block must span the call); under an outer
    jit see ``_ignore_triton_deprecation_globally``.
    """
    if not interpret:
        _ignore_triton_deprecation_globally()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)
        yield


def vary(x, axes: frozenset):
    """x, made varying over the manual mesh axes ``axes`` it does not vary over yet."""
    missing = tuple(sorted(axes - jax.typeof(x).manual_axis_type.varying))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def same_variance(*arrays):
    """The arrays, each made varying over every manual mesh axis any of them varies
    over, and that common ManualAxisType for the outputs' ShapeDtypeStruct.

    Inside a ``jax.shard_map`` with check_vma=True a pallas_call's out_shape must
    say over which manual axes its outputs vary; the outputs depend on every
    input, so they vary like their union.  Outside shard_map the type is empty
    and ignored.
    """
    varying = frozenset().union(*(jax.typeof(a).manual_axis_type.varying for a in arrays))
    return tuple(vary(a, varying) for a in arrays), jax.sharding.ManualAxisType(varying=varying)


def launch(call, operands, mat, interpret: bool):
    """call(*operands), a pallas_call whose outputs vary like ``mat``."""
    if interpret and mat.varying:
        # Pallas' interpreter evaluates the kernel body with shard_map's
        # varying-axes checks on, although the body was traced with them off,
        # so the first comparison of a loaded block with a constant fails
        # ("eq requires varying manual axes to match"); the compiled kernels
        # do not go through it.
        raise NotImplementedError(
            "fastce_jax's kernels in Pallas interpret mode (no GPU) cannot run inside jax.shard_map with "
            "check_vma=True (a limitation of Pallas' interpreter); on CPU use backend='auto' or 'reference', "
            "or check_vma=False.  On a GPU the compiled kernels work with check_vma=True."
        )
    return call(*operands)


def uses_int64_offsets(n_rows: int, vocab: int, dtype) -> bool:
    """Whether Pallas-Triton emits 64-bit offsets for an (n_rows, vocab) operand
    (mirrors the lowering's rule; documented for the 64-bit-offset test)."""
    return n_rows * vocab * jnp.dtype(dtype).itemsize > 2**32
