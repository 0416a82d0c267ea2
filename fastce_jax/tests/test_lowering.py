"""Lower every kernel to CUDA (Triton IR) without a GPU.

``jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))`` runs the real
Pallas-Triton lowering on a CPU-only jaxlib; it rejects what the interpreter
accepts (non-power-of-two load shapes, unsupported primitives).  The inputs are
abstract (ShapeDtypeStruct), so even N*V > 2**31 costs nothing.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fastce_jax
from fastce_jax import cross_entropy
from fastce_jax.core import options as core_options
from fastce_jax.core.launch import uses_int64_offsets
from fastce_jax.core.options import Options
from fastce_jax.losses.cross_entropy import launch
from fastce_jax.losses.jsd import launch as jsd_launch
from fastce_jax.losses.jsd import linear_api as jsd_linear_api

ALL = dict(label_smoothing=0.1, z_loss=1e-4, logit_softcapping=30.0, logit_scaling=0.5)
TRITON = "__gpu$xla.gpu.triton"


@pytest.fixture
def compiled(monkeypatch):
    """Pretend this process has a GPU: traced logits then take the platform-dependent route, and lowering for cuda
    keeps the compiled kernels (the other branch is never lowered)."""
    monkeypatch.setattr(core_options, "gpu_available", lambda: True)


def lower_value_and_grad(shape, dtype, label_dtype=jnp.int32, **opts):
    x = jax.ShapeDtypeStruct(shape, dtype)
    y = jax.ShapeDtypeStruct(shape[:-1], label_dtype)
    f = jax.value_and_grad(lambda a, b: cross_entropy(a, b, backend="kernel", **opts))
    return jax.jit(f).trace(x, y).lower(lowering_platforms=("cuda",))


def triton_modules(lowered):
    """{kernel name: Triton IR text} of every pallas_call in a lowering."""
    from jax._src.lib.mlir import ir
    from jax._src.pallas.triton import lowering as triton_lowering

    found = []

    def walk(op):
        for region in op.regions:
            for block in region:
                for inner in block:
                    if inner.name == "stablehlo.custom_call":
                        cfg = inner.attributes["mhlo.backend_config"]
                        found.append(ir.StringAttr(cfg["ir"]).value_bytes)
                    walk(inner.operation)

    walk(lowered.compiler_ir().operation)
    modules = {}
    for blob in found:
        with triton_lowering._new_ir_context():
            text = str(ir.Module.parse(blob))
        modules[re.search(r"tt\.func public @(\w+)", text).group(1)] = text
    return modules


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("v", [1000, 50257, 262147])
@pytest.mark.parametrize("opts", [{}, ALL], ids=["plain", "all"])
def test_lowers_to_triton(compiled, dtype, v, opts):
    text = lower_value_and_grad((8, v), dtype, **opts).as_text()
    assert text.count(TRITON) == 3  # forward, finish, backward


@pytest.mark.parametrize("inplace", [True, False])
def test_backward_aliases_logits(compiled, inplace):
    text = lower_value_and_grad((16, 1000), jnp.bfloat16, inplace_backward=inplace).as_text()
    calls = [line for line in text.splitlines() if TRITON in line]
    aliased = ["output_operand_aliases" in line for line in calls]
    assert aliased == [False, False, inplace]


def test_lowers_under_vmap_and_3d(compiled):
    x = jax.ShapeDtypeStruct((3, 2, 5, 4000), jnp.bfloat16)
    y = jax.ShapeDtypeStruct((3, 2, 5), jnp.int32)
    f = jax.vmap(jax.value_and_grad(lambda a, b: cross_entropy(a, b, backend="kernel", z_loss=1e-4)))
    text = jax.jit(f).trace(x, y).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(TRITON) == 3


def test_lowers_with_int64_labels(compiled):
    with jax.enable_x64(True):
        text = lower_value_and_grad((4, 1000), jnp.bfloat16, jnp.int64, **ALL).as_text()
    assert text.count(TRITON) == 3


def test_64bit_row_offsets(compiled):
    """N*V > 2**31 elements: every logits access is an int64 offset whose row
    part is the zero-extended program id times V in int64."""
    n, v = 8192, 262147
    assert n * v > 2**31 and uses_int64_offsets(n, v, jnp.bfloat16)
    try:
        modules = triton_modules(lower_value_and_grad((n, v), jnp.bfloat16))
    except (ImportError, AttributeError) as e:  # private jax API moved
        pytest.skip(f"cannot parse Triton IR with this jax: {e}")
    assert set(modules) == {"fastce_forward", "fastce_finish", "fastce_backward"}
    for name, text in modules.items():
        # the logits pointer (bf16) is only ever offset by i64 values
        ptrs = re.findall(
            r"tt\.addptr %\w+, %\w+ : (?:tensor<\d+x)?!tt\.ptr<bf16>"
            r">?, (\S+)",
            text,
        )
        assert ptrs and all("i64" in p for p in ptrs), (name, ptrs)
        assert re.search(r"arith\.extui %\w+ : i32 to i64", text), name
        assert f"{v} : i64" in text, name  # the row stride, as an i64 constant


def test_small_arrays_keep_int32_offsets(compiled):
    # Documents the lowering rule the 64-bit test relies on (no i64 below it).
    try:
        modules = triton_modules(lower_value_and_grad((8, 1000), jnp.bfloat16))
    except (ImportError, AttributeError) as e:
        pytest.skip(f"cannot parse Triton IR with this jax: {e}")
    assert not uses_int64_offsets(8, 1000, jnp.bfloat16)
    assert all("i64" not in text for text in modules.values())


def test_forward_config():
    for v in [1, 1000, 32000, 262147, 256000]:
        config = launch.forward_config(v)
        block, chunk = config.block, config.chunk
        for value in (block, chunk):
            assert value & (value - 1) == 0
        assert block <= chunk <= launch.CHUNK and block <= 4096 and config.n_chunks == -(-v // chunk)
        assert config.warps == launch.FORWARD_WARPS
    config = launch.forward_config(256000)
    assert (config.chunk, config.n_chunks) == (16384, 16)
    config = launch.backward_config(262147)
    assert config.block == 2048 and config.warps == 4
    assert np.all(
        [launch.backward_config(v).block & (launch.backward_config(v).block - 1) == 0 for v in (1, 3, 1000, 50257)]
    )


@pytest.mark.parametrize("opts", [{}, ALL], ids=["plain", "all"])
def test_vocab_parallel_mode_lowers_to_triton(opts):
    """The kernels' vocab-parallel mode (a traced vocab_start read from a (1,) operand) lowers to Triton."""
    options = Options(**opts)

    def f(x, y, lse, g, start):
        stats = launch.forward(x, y, options, interpret=False, vocab_start=start, vocab_total=2 * x.shape[1])
        dx = launch.backward(
            x, y, lse, g, options, inplace=True, interpret=False, vocab_start=start, vocab_total=2 * x.shape[1]
        )
        return stats, dx

    shapes = [((8, 64128), jnp.bfloat16), ((8,), jnp.int32), ((8,), jnp.float32), ((8,), jnp.float32), ((), jnp.int32)]
    lowered = jax.jit(f).trace(*(jax.ShapeDtypeStruct(s, d) for s, d in shapes)).lower(lowering_platforms=("cuda",))
    modules = triton_modules(lowered)
    assert sorted(modules) == ["fastce_backward", "fastce_finish", "fastce_forward"], sorted(modules)


def test_lowers_inside_shard_map_with_check_vma(compiled):
    """Inside a user's shard_map with check_vma=True the pallas_calls' outputs carry the inputs' varying axes."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    P = jax.sharding.PartitionSpec

    def body(a, b):
        return jax.lax.psum(cross_entropy(a, b, backend="kernel", reduction="sum", **ALL), "d")

    f = jax.shard_map(
        jax.value_and_grad(body), mesh=mesh, in_specs=(P("d", None), P("d")), out_specs=(P(), P("d", None))
    )
    x, y = jax.ShapeDtypeStruct((16, 1000), jnp.bfloat16), jax.ShapeDtypeStruct((16,), jnp.int32)
    text = jax.jit(f).trace(x, y).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count(TRITON) == 3


RETURNS = dict(return_z_loss=True, return_lse=True, return_accuracy=True, return_entropy=True)


def lower_outputs(shape, dtype, differentiated=("z_loss", "lse", "accuracy", "entropy"), **kw):
    """The lowering of value_and_grad of loss + z_loss (the z_loss output's gradient flows through lse), with the
    other outputs computed too; the outputs not in ``differentiated`` are returned but not differentiated."""
    x = jax.ShapeDtypeStruct(shape, dtype)
    y = jax.ShapeDtypeStruct(shape[:-1], jnp.int32)

    def f(a, b):
        out = cross_entropy(a, b, backend="kernel", **kw)
        if not isinstance(out, tuple):
            return out
        fields = out._asdict().items()
        extras = sum(jnp.sum(v) for k, v in fields if v is not None and k != "loss" and k in differentiated)
        return out.loss + 0.0 * extras

    return jax.jit(jax.value_and_grad(f)).trace(x, y).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("v", [1000, 262147])
@pytest.mark.parametrize("opts", [{}, ALL], ids=["plain", "all"])
@pytest.mark.parametrize(
    "asked", [RETURNS, dict(return_accuracy=True), dict(return_entropy=True), dict(return_z_loss=True)]
)
def test_outputs_lower_to_triton(compiled, v, opts, asked):
    modules = triton_modules(lower_outputs((8, v), jnp.bfloat16, **opts, **asked))
    assert sorted(modules) == ["fastce_backward", "fastce_finish", "fastce_forward"], sorted(modules)


def test_outputs_without_partials_keep_the_default_kernels(compiled):
    """lse, and z_loss with a zero coefficient, need no partial: the kernels are the default ones, byte for byte;
    accuracy and a returned but not differentiated entropy change the forward and finish kernels only, a
    differentiated z_loss the backward only, a differentiated entropy all three."""
    default = triton_modules(lower_outputs((8, 50257), jnp.bfloat16, **ALL))
    plain = triton_modules(lower_outputs((8, 50257), jnp.bfloat16, **dict(ALL, z_loss=0.0), return_z_loss=True))
    assert triton_modules(lower_outputs((8, 50257), jnp.bfloat16, **ALL, return_lse=True)) == default
    assert plain == triton_modules(lower_outputs((8, 50257), jnp.bfloat16, **dict(ALL, z_loss=0.0)))
    for asked, changed in [
        (dict(return_accuracy=True), {"fastce_forward", "fastce_finish"}),
        (dict(return_entropy=True, differentiated=()), {"fastce_forward", "fastce_finish"}),
        (dict(return_entropy=True), {"fastce_forward", "fastce_finish", "fastce_backward"}),
        (dict(return_z_loss=True), {"fastce_backward"}),
    ]:
        variant = triton_modules(lower_outputs((8, 50257), jnp.bfloat16, **ALL, **asked))
        assert {k for k in default if variant[k] != default[k]} == changed, asked


@pytest.mark.parametrize("opts", [{}, ALL], ids=["plain", "all"])
def test_vocab_parallel_outputs_lower_to_triton(opts):
    """The vocab-parallel mode's extra partials and the backward's lse cotangent lower to Triton."""
    options = Options(**opts)

    def f(x, y, lse, g, start):
        stats = launch.forward(
            x, y, options, interpret=False, vocab_start=start, vocab_total=2 * x.shape[1], extras=(True, True)
        )
        dx = launch.backward(
            x, y, lse, g, options, inplace=True, interpret=False, vocab_start=start, vocab_total=2 * x.shape[1], g_lse=g
        )
        return stats, dx

    shapes = [((8, 64128), jnp.bfloat16), ((8,), jnp.int32), ((8,), jnp.float32), ((8,), jnp.float32), ((), jnp.int32)]
    lowered = jax.jit(f).trace(*(jax.ShapeDtypeStruct(s, d) for s, d in shapes)).lower(lowering_platforms=("cuda",))
    assert sorted(triton_modules(lowered)) == ["fastce_backward", "fastce_finish", "fastce_forward"]


def test_temperature_and_token_weights_keep_the_default_kernels(compiled):
    """temperature=1 and token weights (the backward's per-row upstream factor) lower to exactly the default
    kernels; another temperature only changes the constants folded into scaling and soft-capping."""
    default = triton_modules(lower_outputs((8, 50257), jnp.bfloat16, **ALL))
    assert triton_modules(lower_outputs((8, 50257), jnp.bfloat16, **ALL, temperature=1.0)) == default
    x = jax.ShapeDtypeStruct((8, 50257), jnp.bfloat16)
    y = jax.ShapeDtypeStruct((8,), jnp.int32)
    w = jax.ShapeDtypeStruct((8,), jnp.float32)
    f = jax.value_and_grad(lambda a, b, c: cross_entropy(a, b, backend="kernel", token_weights=c, **ALL))
    weighted = triton_modules(jax.jit(f).trace(x, y, w).lower(lowering_platforms=("cuda",)))
    assert weighted == default


def lower_jsd(n, v, v_teacher, beta, labels=True, **opts):
    """The lowering of value_and_grad of jsd (bf16 logits, a wider teacher head) for cuda."""
    shapes = [((n, v), jnp.bfloat16), ((n, v_teacher), jnp.bfloat16)] + [((n,), jnp.int32)] * labels
    f = jax.value_and_grad(lambda a, b, *c: fastce_jax.jsd(a, b, *c, beta=beta, backend="kernel", **opts))
    return jax.jit(f).trace(*(jax.ShapeDtypeStruct(s, d) for s, d in shapes)).lower(lowering_platforms=("cuda",))


JSD_ALL = dict(temperature=0.7, student_softcapping=30.0, teacher_softcapping=20.0)


JSD_FORWARD = ["fastce_jsd_finish", "fastce_jsd_partials"]  # and fastce_jsd_mixture for a mixture
JSD_MIXTURE = sorted(JSD_FORWARD + ["fastce_jsd_backward", "fastce_jsd_mixture"])


@pytest.mark.parametrize("beta,n", [(0.0, 8), (0.5, 8), (1.0, 8), (0.5, 4096)])
def test_jsd_kernels_lower_to_triton(compiled, beta, n):
    """Forward KL, the mixture and reverse KL (with labels, temperature and both soft-cappings; the mixture without
    labels) lower to the forward's kernels (the mixture's second pass too) and the backward, whose output aliases
    the student logits; the mixture's one log per element is the GPU's lg2.approx in both of its passes. n = 8
    splits each row into segments (forward_segments), n = 4096 keeps one per row."""
    config = jsd_launch.jsd_config(50257)
    assert (jsd_launch.forward_segments(n, 50257, config.forward_block, config.forward_programs)[0] > 1) == (n == 8)
    lowered = lower_jsd(n, 50257, 50304, beta, labels=beta != 0.5, **(JSD_ALL if beta != 0.5 else {}))
    expected = JSD_MIXTURE if beta == 0.5 else sorted(JSD_FORWARD + ["fastce_jsd_backward"])
    modules = triton_modules(lowered)
    assert sorted(modules) == expected
    if beta == 0.5:  # the mixture's one log per element is the GPU's lg2.approx, not libdevice's logf
        for name in ("fastce_jsd_mixture", "fastce_jsd_backward"):
            assert "lg2.approx.f32" in modules[name], name
    calls = [line for line in lowered.as_text().splitlines() if TRITON in line]
    assert ["output_operand_aliases" in line for line in calls] == [False] * (len(expected) - 1) + [True]


def test_jsd_auto_backend_decides_when_lowered(compiled):
    """backend="auto" traced in a GPU process: the kernels when lowered for cuda, the jnp reference for the CPU."""
    shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in [(8, 1000), (8, 1000)]]
    f = jax.jit(jax.value_and_grad(lambda a, b: fastce_jax.jsd(a, b, beta=0.5, **JSD_ALL)))
    assert sorted(triton_modules(f.trace(*shapes).lower(lowering_platforms=("cuda",)))) == JSD_MIXTURE
    assert TRITON not in f.trace(*shapes).lower(lowering_platforms=("cpu",)).as_text()


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_linear_jsd_lowers_to_triton(monkeypatch, reduction):
    """linear_jsd's chunk loop: the forward kernel, and the backward kernel in the forward ("mean": gradients in
    the forward pass) or in the recomputing backward ("none")."""
    monkeypatch.setattr(jsd_linear_api, "on_gpu", lambda x: True)  # traced hidden states taken as GPU arrays
    shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in [(64, 32), (1000, 32), (64, 48), (1024, 48)]]

    def f(h, w, ht, wt):
        loss = fastce_jax.linear_jsd(h, w, ht, wt, beta=0.5, reduction=reduction, backend="kernel", **JSD_ALL)
        return jnp.sum(loss)

    lowered = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).trace(*shapes).lower(lowering_platforms=("cuda",))
    assert sorted(triton_modules(lowered)) == JSD_MIXTURE


def test_jsd_64bit_row_offsets(compiled):
    """N * V > 2**31 elements: the jsd kernels' logits accesses use int64 offsets (as test_64bit_row_offsets)."""
    n, v = 8192, 262147
    try:
        modules = triton_modules(lower_jsd(n, v, v + 5, 0.5))
    except (ImportError, AttributeError) as e:  # private jax API moved
        pytest.skip(f"cannot parse Triton IR with this jax: {e}")
    assert sorted(modules) == JSD_MIXTURE
    for name, text in modules.items():
        if name == "fastce_jsd_finish":  # reads no logits
            continue
        ptrs = re.findall(r"tt\.addptr %\w+, %\w+ : (?:tensor<\d+x)?!tt\.ptr<bf16>>?, (\S+)", text)
        assert ptrs and all("i64" in p for p in ptrs), (name, ptrs)
