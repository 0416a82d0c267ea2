"""The DLPack exchange between torch and JAX: what jax 0.10.2 accepts, and the traps (exchange.py's docstring).

Each jax behaviour the helpers work around is pinned here, so that an upgrade that changes it fails loudly instead
of silently changing what the numerical suite exercises."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from . import exchange, harness, reference, tolerances

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")

FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def fresh(shape, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=gen) * 3).to(dtype).to(device)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + [torch.int32], ids=str)
def test_contiguous_import_is_zero_copy_and_on_the_same_device(dtype, device):
    t = fresh((5, 37), torch.float32, device).mul(100).to(dtype)
    a = exchange.to_jax(t)
    assert exchange.same_buffer(a, t)
    assert a.dtype == jnp.dtype(str(dtype).removeprefix("torch.")) and a.shape == tuple(t.shape)
    platform = "gpu" if t.is_cuda else "cpu"
    assert all(d.platform == platform for d in a.devices())
    back = exchange.to_torch(a)
    assert back.device == t.device and back.data_ptr() == t.data_ptr()


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=str)
def test_round_trip_is_bit_exact_including_special_values(dtype, device):
    """Through a real JAX copy (a new buffer) and back: every bit survives, signed zeros, infinities, subnormals
    and NaN payloads included."""
    info = torch.finfo(dtype)
    special = torch.tensor(
        [0.0, -0.0, float("inf"), float("-inf"), info.tiny, info.tiny / 4, -info.max, info.max], dtype=dtype
    )
    values = torch.cat([fresh((64,), dtype, "cpu", seed=1), special]).to(device)
    ints = harness.bits(values).clone()
    nan_payload = {2: 0x7F81 if dtype == torch.bfloat16 else 0x7E01, 4: 0x7FC00123}[values.element_size()]
    ints[:3] = nan_payload  # quiet NaNs with a payload
    values = ints.view(dtype)
    copied = jnp.array(exchange.to_jax(values), copy=True)
    back = exchange.to_torch(copied)
    assert back.data_ptr() != values.data_ptr()
    assert torch.equal(harness.bits(back), harness.bits(values))


def test_requires_grad_must_be_detached_before_export(device):
    t = fresh((4, 9), torch.float32, device).requires_grad_()
    with pytest.raises(BufferError, match="require"):
        jax.dlpack.from_dlpack(t)
    a = exchange.to_jax(t)  # detaches: shares the storage, copies nothing
    assert exchange.same_buffer(a, t)
    assert np.array_equal(np.asarray(a), t.detach().cpu().numpy())


def test_strided_rows_are_refused_by_jax_and_copied_by_the_helper(device):
    wide = fresh((6, 40), torch.float32, device)
    rows = wide[:, :33]  # row stride 40 > V = 33: what fastce_torch reads in place
    assert not rows.is_contiguous()
    with pytest.raises(Exception, match="compact"):
        jax.dlpack.from_dlpack(rows)
    a = exchange.to_jax(rows)
    # The documented copy: JAX arrays have no strides.
    assert not exchange.same_buffer(a, rows)
    assert np.array_equal(np.asarray(a), rows.cpu().numpy())


def test_transposed_tensor_is_accepted(device):
    """A compact permutation (column-major rows) is accepted by jax as is (pinned on the CPU; on the GPU a clean
    refusal is tolerated, wrong values never); the helper copies it to row-major first anyway."""
    t = fresh((33, 6), torch.float32, device).t()
    assert not t.is_contiguous()
    try:
        raw = jax.dlpack.from_dlpack(t)
    except Exception:
        if not t.is_cuda:
            raise
    else:
        assert np.array_equal(np.asarray(raw), t.cpu().numpy())
    assert np.array_equal(np.asarray(exchange.to_jax(t)), t.cpu().numpy())


def test_empty_and_zero_d_tensors(device):
    empty = torch.empty((2, 0, 7), device=device)
    assert exchange.to_jax(empty).shape == (2, 0, 7)
    assert exchange.labels_to_jax(torch.empty((0,), dtype=torch.int64, device=device)).shape == (0,)
    scalar = torch.tensor(23, device=device)
    a = exchange.labels_to_jax(scalar)
    assert a.shape == () and a.dtype == jnp.int32 and int(a) == 23


def test_int64_is_silently_wrapped_by_jax_without_x64(device):
    """The trap itself: 2**40 + 3 arrives as 3, a valid class. If this starts failing, jax changed the rule and
    labels_to_jax can be revisited."""
    assert not exchange.x64_enabled()
    labels = torch.tensor([2**40 + 3, 5], device=device)
    try:
        wrapped = np.asarray(jax.dlpack.from_dlpack(labels))
    except Exception:
        if not labels.is_cuda:  # pinned on the CPU; on the GPU refusing int64 would be fine too
            raise
    else:
        assert wrapped.dtype == np.int32 and wrapped.tolist() == [3, 5]


def test_labels_to_jax_refuses_a_value_beyond_int32(device):
    labels = torch.tensor([[1, 2], [2**40 + 3, 7]], device=device)
    with pytest.raises(OverflowError, match=r"labels\[1, 0\] = 1099511627779 does not fit int32"):
        exchange.labels_to_jax(labels)
    with pytest.raises(OverflowError, match="-2147483649"):
        exchange.labels_to_jax(torch.tensor([-(2**31) - 1], device=device))


def test_labels_to_jax_casts_int64_in_range_explicitly(device):
    values = [-(2**31), -100, -1, 0, 1, 262146, 2**31 - 1]
    a = exchange.labels_to_jax(torch.tensor(values, dtype=torch.int64, device=device))
    assert a.dtype == jnp.int32 and np.asarray(a).tolist() == values


def test_labels_to_jax_keeps_int64_under_scoped_x64(device):
    labels = torch.tensor([2**40 + 3, -100, 5], device=device)
    with jax.enable_x64(True):
        a = exchange.labels_to_jax(labels)
        assert a.dtype == jnp.int64 and np.asarray(a).tolist() == [2**40 + 3, -100, 5]
        assert exchange.same_buffer(a, labels)
    assert not exchange.x64_enabled()  # the scope ended


def test_int64_label_beyond_int32_is_nan_in_both_packages(device):
    """Contract: a label outside [0, V) gives NaN for its token and NaN gradient row, never a wrapped class.
    torch takes int64 as is; JAX gets it unwrapped inside jax.enable_x64(True)."""
    fastce_torch = pytest.importorskip("fastce_torch")
    fastce_jax = pytest.importorskip("fastce_jax")
    logits = fresh((3, 50), torch.float32, device, seed=3)
    labels = torch.tensor([2**40 + 3, 5, -100], device=device)  # wrapped, 2**40 + 3 would be class 3
    leaf = logits.clone().requires_grad_()
    t_loss = fastce_torch.cross_entropy(leaf, labels, reduction="none", backend="kernel")
    t_loss.backward(torch.ones_like(t_loss))
    with jax.enable_x64(True):
        x, y = exchange.to_jax(logits), exchange.labels_to_jax(labels)
        j_loss, vjp = jax.vjp(lambda a: fastce_jax.cross_entropy(a, y, reduction="none", backend="kernel"), x)
        (j_grad,) = vjp(jnp.ones_like(j_loss))
    ref = reference.expected(harness.as_f64(logits), labels.cpu().numpy())
    assert np.isnan(ref.loss[0]) and np.isfinite(ref.loss[1]) and ref.loss[2] == 0
    for package, loss, grad in (
        ("torch", t_loss, leaf.grad),
        ("jax", exchange.to_torch(j_loss), exchange.to_torch(j_grad)),
    ):
        tolerances.assert_loss(harness.as_f64(loss), ref, f"{package} loss", dtype=loss.dtype)
        tolerances.assert_grad(harness.as_f64(grad), ref, grad.dtype, f"{package} grad")


def test_fastce_jax_does_not_wrap_numpy_int64_labels_without_x64():
    """NumPy int64 labels reach the kernel unwrapped without x64: truncating 2**32 + 3 to int32 would make it class
    3, a plausible loss instead of NaN."""
    fastce_jax = pytest.importorskip("fastce_jax")
    gen = np.random.default_rng(4)
    logits = gen.standard_normal((2, 10)).astype(np.float32)
    labels = np.array([2**32 + 3, 1], dtype=np.int64)
    loss = np.asarray(fastce_jax.cross_entropy(logits, labels, reduction="none", backend="kernel"))
    assert np.isnan(loss[0]) and np.isfinite(loss[1])


def test_jax_backward_does_not_write_the_shared_buffer(device):
    """fastce_jax's backward may alias its output with the logits residual (input_output_aliases); the residual
    here IS torch's buffer (zero-copy import), an argument nobody donated: XLA must copy, eagerly and under jit.
    (Donating such an array to jit would hand torch's memory to XLA: the caller's mistake, not tested.)"""
    fastce_jax = pytest.importorskip("fastce_jax")
    logits = fresh((4, 300), torch.bfloat16, device, seed=5)
    snapshot = harness.bits(logits).clone()
    x = exchange.to_jax(logits)
    y = exchange.labels_to_jax(torch.tensor([1, 2, -100, 299], device=device))

    def loss_fn(a):
        return fastce_jax.cross_entropy(a, y, backend="kernel", inplace_backward=True)

    grad = jax.grad(loss_fn)(x)
    assert torch.equal(harness.bits(logits), snapshot)
    grad = jax.jit(jax.grad(loss_fn))(x)
    grad.block_until_ready()
    assert torch.equal(harness.bits(logits), snapshot)
    assert not exchange.same_buffer(grad, logits)
