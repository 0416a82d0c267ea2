"""linear_cross_entropy(..., weight_layout="hv"): an (H, V) kernel (Flax nn.Dense / nnx.Linear) used as stored.

The values are checked in shared_tests/test_weight_layout.py (both packages against the float64 reference); here
what only JAX can show: the compiled HLO of the chunked kernel path holds no transposed copy of the weight or of its
gradient (no array shaped (V, H) at all, no copy / transpose of a weight-sized array) where passing ``kernel.T`` in
the default layout does not (the positive control: (V, H) arrays, and on the CPU copies), and the
vocabulary-sharded head (the weight sharded along its axis 1) against the reference, in the 4-device child
(test_sharding.py's SHARDED_ELSEWHERE).
"""

import collections
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fastce_jax

N, H, V = 12, 24, 300  # V != H, so a (V, H) array can only be the weight transposed
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(\S+)\s+([\w-]+)\(")


def weight_sized(compiled_text):
    """Counter of (shape, opcode) over the compiled HLO's instructions whose result is (H, V) or (V, H) float32."""
    found = collections.Counter()
    for line in compiled_text.splitlines():
        m = INSTRUCTION.match(line)
        if m and re.match(rf"f32\[({H},{V}|{V},{H})\]", m.group(1)):
            found[(m.group(1).split("{")[0], m.group(2))] += 1
    return found


def compiled(weight, layout, transpose_inside=False, reduction="mean"):
    hidden = jax.random.normal(jax.random.PRNGKey(0), (N, H))
    labels = jax.random.randint(jax.random.PRNGKey(1), (N,), 0, V)

    def loss(h, w):
        w = w.T if transpose_inside else w
        out = fastce_jax.linear_cross_entropy(
            h, w, labels, weight_layout=layout, backend="kernel", chunk_rows=5, reduction=reduction
        )
        return jnp.sum(out)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(hidden, weight).compile().as_text()


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_hv_compiles_without_a_transposed_weight(reduction):
    kernel = jnp.ones((H, V), jnp.float32)  # as Flax stores it
    ops = weight_sized(compiled(kernel, "hv", reduction=reduction))
    assert ops, "the weight should appear in the HLO"
    # Nothing (V, H) but a product: XLA's GPU layout assignment may compute d weight as a (V, H) dot and bitcast it
    # to the (H, V) gradient (a bitcast moves no data); a transposed weight or gradient would be a (V, H) parameter,
    # copy, transpose or fusion.
    assert not [k for k in ops if k[0] == f"f32[{V},{H}]" and k[1] != "dot"], ops
    assert not [k for k in ops if k[1] in ("copy", "transpose")], ops
    # the chunk matmuls read the (H, V) weight itself (on the GPU the d weight product may come out (V, H), bitcast)
    assert {(f"f32[{H},{V}]", "dot"), (f"f32[{V},{H}]", "dot")} & set(ops), ops


def test_transposing_the_kernel_instead_shows_a_transposed_weight():
    """The control: the same loss from ``kernel.T`` in the default layout holds (V, H) arrays (the transposed weight
    the chunk loop reads, its (V, H) gradient), which the check above refuses (so it can fail); on the CPU XLA
    materialises the transposes as copies."""
    kernel = jnp.ones((H, V), jnp.float32)
    ops = weight_sized(compiled(kernel, "vh", transpose_inside=True))
    assert [k for k in ops if k[0] == f"f32[{V},{H}]"], ops
    if jax.default_backend() == "cpu":
        assert [k for k in ops if k[1] in ("copy", "transpose")], ops


@pytest.mark.parametrize("layout", ["vocab", "2d"])
def test_hv_sharded_vocabulary(layout):
    """The vocabulary-sharded head in the (H, V) layout: the weight sharded along its axis 1 (and the rows over
    another mesh axis for "2d"); loss and gradients against the float64 reference, d weight keeps the weight's
    sharding."""
    devices = jax.devices()
    if len(devices) < 2:
        pytest.skip("needs several devices (run through test_sharding.py::test_sharded_suite_on_4_cpu_devices)")
    from shared_tests import test_linear_cross_entropy as lin

    from .test_sharding import collectives, linear_case, linear_mesh

    _, case = linear_case("mean-bias")
    mesh = linear_mesh(devices, layout)
    rows, vocab = (None, "d") if layout == "vocab" else ("r", "v")
    inputs = lin.make_inputs(case, "cpu")
    hidden, weight, bias, labels, upstream, _ = inputs
    h = jax.device_put(jnp.asarray(hidden.numpy()), NamedSharding(mesh, P(rows, None)))
    w = jax.device_put(jnp.asarray(weight.numpy().T.copy()), NamedSharding(mesh, P(None, vocab)))  # (H, V)
    b = jax.device_put(jnp.asarray(bias.numpy()), NamedSharding(mesh, P(vocab)))
    y = jax.device_put(jnp.asarray(labels.numpy()), NamedSharding(mesh, P(rows)))
    kwargs = lin.kwargs_of(case, None)

    def objective(h, w, b):
        loss = fastce_jax.linear_cross_entropy(h, w, y, bias=b, backend="kernel", weight_layout="hv", **kwargs)
        return loss * float(upstream), loss

    f = jax.jit(jax.value_and_grad(objective, argnums=(0, 1, 2), has_aux=True))
    with jax.default_matmul_precision("float32"):
        (_, loss), (dh, dw, db) = f(h, w, b)
        found = collectives(f.lower(h, w, b).compile().as_text())
    # Nothing weight-sized gathered: the per-chunk statistics' all-reduces, d hidden's and d weight's blocks only.
    v_local = case.vocab // math.prod(mesh.shape[a] for a in (vocab,))
    assert all(size <= max(3 * case.chunk_rows, case.shape[0] * case.width, v_local * case.width) for _, size in found)
    assert any(op == "all-reduce" and size == 3 * case.chunk_rows for op, size in found), found
    assert dw.shape == (case.width, case.vocab) and dw.sharding.is_equivalent_to(w.sharding, 2)
    chunks = math.ceil(case.shape[0] / case.chunk_rows)
    grads = [np.asarray(dh), np.asarray(dw).T, np.asarray(db)]
    lin.check_result(case, inputs, (np.asarray(loss), grads), chunks)
