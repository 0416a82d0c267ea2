"""fastce_torch used the way training loops use a loss: in-place ops on the returned loss, masks written
into per-token losses, overlapping and strided logits, second-order and repeated backward, torch.func, the
transformers Trainer and MoE router losses, devices and streams. Gradients are checked against the float64 reference
of shared_tests/reference.py (CPU: Triton's interpreter; --gpu: CUDA)."""

import numpy as np
import pytest
import torch

import fastce_torch
from fastce_torch import cross_entropy
from fastce_torch.core.launch import forget_launches
from fastce_torch.core.options import Options
from fastce_torch.losses.cross_entropy import launch

from .checks import assert_grad, assert_loss, expected, tiny_causal_lm

pytestmark = pytest.mark.filterwarnings(
    "ignore:divide by zero:RuntimeWarning", "ignore::DeprecationWarning", "ignore:invalid value:RuntimeWarning"
)

VOCAB = 300  # not a power of two: the last tile is partial
RTOL = 2e-5  # float32 logits: loss and gradient are float32-accurate


def problem(device, shape=(2, 5), vocab=VOCAB, seed=0, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn((*shape, vocab), generator=generator, dtype=torch.float64) * 2.0).to(dtype)
    labels = torch.randint(0, vocab, shape, generator=generator)
    labels.view(-1)[::4] = -100
    return logits.to(device), labels.to(device)


def assert_close(actual, wanted, rtol=RTOL, atol=1e-7):
    actual = actual.detach().double().cpu().numpy()
    wanted = np.asarray(wanted, dtype=np.float64)
    assert actual.shape == wanted.shape
    assert not np.isnan(actual).any() and not np.isnan(wanted).any()
    np.testing.assert_allclose(actual, wanted, rtol=rtol, atol=atol)


def intermediate(leaf):
    """A non-leaf copy of leaf, like lm_head's output: the in-place backward may write its gradient there."""
    return leaf * 1.0


# --- in-place ops on the returned loss -------------------------------------------------------------------------


@pytest.mark.parametrize("inplace_backward", [True, False])
@pytest.mark.parametrize("op", ["loss /= accum", "loss *= scale", "loss += coef * aux"])
def test_inplace_arithmetic_on_the_reduced_loss(device, op, inplace_backward):
    logits, labels = problem(device)
    leaf = logits.clone().requires_grad_()
    loss = cross_entropy(intermediate(leaf), labels, backend="kernel", inplace_backward=inplace_backward)
    ref = expected(logits, labels, reduction="mean")
    if op == "loss /= accum":
        loss /= 4
        want_loss, want_grad = ref.loss / 4, ref.grad / 4
    elif op == "loss *= scale":
        loss *= 2.5
        want_loss, want_grad = ref.loss * 2.5, ref.grad * 2.5
    else:  # an MoE router's auxiliary loss, over the same parameters
        aux = (leaf.double() ** 2).mean()
        loss += 0.01 * aux
        x = logits.double().cpu().numpy()
        want_loss, want_grad = ref.loss + 0.01 * (x**2).mean(), ref.grad + 0.01 * 2 * x / x.size
    loss.backward()
    assert_close(loss, want_loss)
    assert_close(leaf.grad, want_grad)


@pytest.mark.parametrize("inplace_backward", [True, False])
@pytest.mark.parametrize("op", ["per_token *= mask", "per_token[idx] = 0"])
def test_writes_into_per_token_losses(device, op, inplace_backward):
    logits, labels = problem(device, shape=(3, 7))
    leaf = logits.clone().requires_grad_()
    per_token = cross_entropy(
        intermediate(leaf), labels, reduction="none", backend="kernel", inplace_backward=inplace_backward
    )
    generator = torch.Generator().manual_seed(5)
    if op == "per_token *= mask":
        upstream = torch.rand(labels.shape, generator=generator).to(device)
        per_token *= upstream
    else:
        upstream = torch.ones(labels.shape, device=device)
        idx = (torch.tensor([0, 2, 2]), torch.tensor([1, 3, 6]))
        per_token[idx] = 0
        upstream[idx] = 0
    per_token.sum().backward()
    ref = expected(logits, labels, reduction="none", upstream=upstream)
    assert_close(per_token, ref.loss * upstream.double().cpu().numpy())
    assert_grad(leaf.grad, ref)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_a_detached_loss_owns_only_its_own_storage(device, reduction):
    """The loss does not keep the launch's scratch (lse, chunk partials, counters) alive: it is its own small
    allocation, as F.cross_entropy's is."""
    logits, labels = problem(device, shape=(4, 9))
    loss = cross_entropy(intermediate(logits.clone().requires_grad_()), labels, reduction=reduction, backend="kernel")
    kept = loss.detach()
    assert kept._base is None
    assert kept.untyped_storage().nbytes() == kept.numel() * 4


# --- layouts: overlapping rows, strided 3-D logits -------------------------------------------------------------


def test_expanded_rows_get_the_out_of_place_gradient(device):
    """One row expanded to four shares its memory: an in-place gradient would overwrite it four times."""
    logits, labels = problem(device, shape=(1,))
    leaf = logits.clone().requires_grad_()
    rows = intermediate(leaf).expand(4, VOCAB)
    labels4 = torch.tensor([3, 17, -100, 299], device=device)
    cross_entropy(rows, labels4, reduction="sum", backend="kernel").backward()
    ref = expected(logits.expand(4, VOCAB), labels4, reduction="sum")
    assert_close(leaf.grad, ref.grad.sum(0, keepdims=True))


def test_as_strided_overlapping_rows_get_the_out_of_place_gradient(device):
    step, n_rows = 100, 4  # rows start 100 elements apart and are 300 long: each overlaps the next two
    generator = torch.Generator().manual_seed(3)
    flat = torch.randn(step * (n_rows - 1) + VOCAB, generator=generator).to(device)
    leaf = flat.clone().requires_grad_()
    rows = intermediate(leaf).as_strided((n_rows, VOCAB), (step, 1))
    labels = torch.tensor([0, 150, 299, 42], device=device)
    cross_entropy(rows, labels, backend="kernel").backward()
    ref = expected(flat.as_strided((n_rows, VOCAB), (step, 1)), labels, reduction="mean")
    want = np.zeros(flat.numel())
    for r in range(n_rows):
        want[r * step : r * step + VOCAB] += ref.grad[r]
    assert_close(leaf.grad, want)


def spy_on_launchers(monkeypatch):
    """Records the logits (and gradient buffer) each launcher is given."""
    seen = {"forward": [], "backward": []}
    forward, backward = launch.forward, launch.backward

    def spy_forward(logits, *args, **kwargs):
        seen["forward"].append((logits.data_ptr(), logits.stride()))
        return forward(logits, *args, **kwargs)

    def spy_backward(grad_loss, logits, labels, lse, grad, *args, **kwargs):
        seen["backward"].append((logits.data_ptr(), grad.data_ptr()))
        return backward(grad_loss, logits, labels, lse, grad, *args, **kwargs)

    monkeypatch.setattr(launch, "forward", spy_forward)
    monkeypatch.setattr(launch, "backward", spy_backward)
    return seen


def test_sliced_3d_logits_reach_the_kernels_without_a_copy(device, monkeypatch):
    """The slice form `cross_entropy(logits[:, :-1], input_ids[:, 1:])` with batch > 1: the kernels read the
    lm_head output where it is and write the gradient back into it."""
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(3, 8, 16, generator=generator).to(device)
    weight = (torch.randn(VOCAB, 16, generator=generator) * 0.5).to(device).requires_grad_()
    ids = torch.randint(0, VOCAB, (3, 8), generator=generator).to(device)
    seen = spy_on_launchers(monkeypatch)
    full = hidden @ weight.T
    logits = full[:, :-1]
    assert not logits.is_contiguous()
    loss = cross_entropy(logits, ids[:, 1:], backend="kernel")
    ref = expected(full[:, :-1], ids[:, 1:], reduction="mean")
    loss.backward()
    assert seen["forward"] == [(full.data_ptr(), logits.stride())]
    assert seen["backward"] == [(full.data_ptr(), full.data_ptr())]  # the gradient lands in lm_head's output
    assert_loss(loss, ref)
    h = hidden[:, :-1].double().cpu().numpy().reshape(-1, 16)
    assert_close(weight.grad, ref.grad.reshape(-1, VOCAB).T @ h, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
def test_sliced_3d_logits_peak_memory(device):
    """On the GPU: the loss of logits[:, :-1] (bf16, 4 x 2049 x 32000) makes no copy of the logits. The forward adds
    only per-token scratch; the backward adds one logits-sized buffer, autograd's own gradient of the slice (its
    SliceBackward fills a full-size tensor), where a copy plus an out-of-place gradient would add two."""
    batch, seq, vocab = 4, 2049, 32000
    full = torch.randn(batch, seq, vocab, device=device, dtype=torch.bfloat16).requires_grad_()
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    logits = full * 1.0  # the intermediate (lm_head's output)
    size = logits.numel() * logits.element_size()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = cross_entropy(logits[:, :-1], ids[:, 1:])
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < 0.01 * size
    torch.autograd.grad(loss, logits)
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() - before < 1.05 * size


# --- second order, repeated backward ---------------------------------------------------------------------------


@pytest.mark.parametrize("inplace_backward", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gradient_penalty_through_the_kernel_equals_the_reference(device, inplace_backward, reduction):
    """create_graph=True through the kernel path: the penalty's gradient (through the logits, to the leaf and to a
    weight upstream of them) equals the plain-torch reference's, and the logits are not consumed by it."""
    logits, labels = problem(device)
    weight = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(3)).to(device) / VOCAB**0.5
    options = dict(label_smoothing=0.1, z_loss=1e-3, logit_softcapping=5.0)
    upstream = torch.rand(labels.shape, generator=torch.Generator().manual_seed(4)).to(device)

    def penalty_gradients(backend):
        leaf, w = logits.clone().requires_grad_(), weight.clone().requires_grad_()
        x = leaf @ w
        loss = cross_entropy(
            x, labels, backend=backend, inplace_backward=inplace_backward, reduction=reduction, **options
        )
        loss = (loss * upstream).sum() if reduction == "none" else loss
        (grad,) = torch.autograd.grad(loss, x, create_graph=True)
        return torch.autograd.grad(grad.pow(2).sum(), (leaf, w))

    got, want = penalty_gradients("kernel"), penalty_gradients("reference")
    for g, r in zip(got, want):
        scale = float(r.abs().max())
        assert scale > 1e-5  # a second derivative that is not trivially zero
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5 * scale)


def test_reference_backend_gives_the_second_order_gradient(device):
    """A gradient penalty through the reference backend, against the same penalty in float64 autograd."""
    logits, labels = problem(device)
    options = dict(label_smoothing=0.1, z_loss=1e-3, logit_softcapping=5.0)

    def penalty_gradient(x, loss_fn):
        x = x.clone().requires_grad_()
        (grad,) = torch.autograd.grad(loss_fn(x), x, create_graph=True)
        (second,) = torch.autograd.grad(grad.pow(2).sum(), x)
        return second

    def float64_loss(x):
        z = 5.0 * torch.tanh(x / 5.0)
        lse = torch.logsumexp(z, -1)
        kept = labels != -100
        z_label = z.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        token = 0.9 * (lse - z_label) + 0.1 * (lse - z.mean(-1)) + 1e-3 * lse**2
        return torch.where(kept, token, 0.0).sum() / kept.sum()

    got = penalty_gradient(logits, lambda x: cross_entropy(x, labels, backend="reference", **options))
    want = penalty_gradient(logits.double(), float64_loss)
    assert want.abs().max() > 1e-3  # a second derivative that is not trivially zero
    assert_close(got, want.cpu().numpy(), rtol=1e-4, atol=1e-6)


def test_second_backward_names_inplace_backward_false(device):
    logits, labels = problem(device)
    loss = cross_entropy(intermediate(logits.clone().requires_grad_()), labels, backend="kernel")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace_backward=False"):
        loss.backward()


def test_two_losses_over_the_same_logits_name_inplace_backward_false(device):
    logits, labels = problem(device)
    other = torch.roll(labels, 1, dims=-1)
    x = intermediate(logits.clone().requires_grad_())
    total = cross_entropy(x, labels, backend="kernel") + cross_entropy(x, other, backend="kernel")
    with pytest.raises(RuntimeError, match="inplace_backward=False"):
        total.backward()


def test_two_losses_and_second_backward_work_out_of_place(device):
    logits, labels = problem(device)
    other = torch.roll(labels, 1, dims=-1)
    leaf = logits.clone().requires_grad_()
    x = intermediate(leaf)
    total = cross_entropy(x, labels, backend="kernel", inplace_backward=False) + cross_entropy(
        x, other, backend="kernel", inplace_backward=False
    )
    total.backward(retain_graph=True)
    total.backward()  # accumulates a second time
    want = 2 * (expected(logits, labels, reduction="mean").grad + expected(logits, other, reduction="mean").grad)
    assert_close(leaf.grad, want)


# --- torch.func ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_torch_func_grad_and_grad_and_value(device, reduction):
    logits, labels = problem(device)
    ref = expected(logits, labels, reduction=reduction)
    grad = torch.func.grad(lambda x: cross_entropy(x, labels, reduction=reduction, backend="kernel"))(logits)
    assert_grad(grad, ref)
    grad, value = torch.func.grad_and_value(
        lambda x: cross_entropy(intermediate(x), labels, reduction=reduction, backend="kernel")
    )(logits)
    assert_grad(grad, ref)
    assert_loss(value, ref)


def test_torch_func_vjp(device):
    logits, labels = problem(device, shape=(3, 4))
    cotangent = torch.rand(labels.shape, generator=torch.Generator().manual_seed(6)).to(device)
    value, vjp_fn = torch.func.vjp(lambda x: cross_entropy(x, labels, reduction="none", backend="kernel"), logits)
    (grad,) = vjp_fn(cotangent)
    ref = expected(logits, labels, reduction="none", upstream=cotangent)
    assert_loss(value, ref)
    assert_grad(grad, ref)


def test_torch_func_unsupported_transforms_raise_clear_errors(device):
    logits, labels = problem(device)

    def loss(x, reduction="mean"):
        return cross_entropy(x, labels, reduction=reduction, backend="kernel")

    batched = torch.stack([logits, logits.flip(0)])
    with pytest.raises(RuntimeError, match="vmap.*flatten"):
        torch.func.vmap(loss)(batched)
    with pytest.raises(RuntimeError, match="vmap.*flatten"):
        torch.func.vmap(torch.func.grad(loss))(batched)
    # The reference backend composes with all of them.
    hessian_diag = torch.func.vmap(torch.func.grad(lambda x: cross_entropy(x, labels, backend="reference")))(batched)
    assert hessian_diag.shape == batched.shape


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_func_higher_order_and_forward_mode_through_the_kernel(device, reduction):
    """Grad of grad, jacrev (the backward under vmap), forward mode (jvp, jacfwd, forward_ad) and what combines them
    (jvp of grad, hessian) through the kernel path equal the reference backend's."""
    logits, labels = problem(device, shape=(2, 3), vocab=17)
    tangent = torch.randn(logits.shape, generator=torch.Generator().manual_seed(8)).to(device)
    options = dict(z_loss=1e-3, logit_scaling=1.5, label_smoothing=0.1, logit_softcapping=4.0)

    def loss(backend):
        def f(x):
            out = cross_entropy(x, labels, reduction=reduction, backend=backend, **options)
            return (
                out
                if reduction == "mean"
                else (out * torch.linspace(0.5, 2.0, out.numel(), device=out.device).view(out.shape)).sum()
            )

        return f

    def forward_ad(f):
        def run(x):
            with torch.autograd.forward_ad.dual_level():
                return torch.autograd.forward_ad.unpack_dual(f(torch.autograd.forward_ad.make_dual(x, tangent)))[1]

        return run

    transforms = {
        "grad_of_grad": lambda f: torch.func.grad(lambda x: torch.func.grad(f)(x).pow(2).sum()),
        "jacrev_of_grad": lambda f: torch.func.jacrev(torch.func.grad(f)),
        "jvp": lambda f: lambda x: torch.func.jvp(f, (x,), (tangent,))[1],
        "jvp_of_grad": lambda f: lambda x: torch.func.jvp(torch.func.grad(f), (x,), (tangent,))[1],
        "jacfwd": torch.func.jacfwd,
        "hessian": torch.func.hessian,
        "forward_ad": forward_ad,
    }
    for name, transform in transforms.items():
        got, want = transform(loss("kernel"))(logits), transform(loss("reference"))(logits)
        scale = float(want.abs().max())
        assert scale > 1e-5, name
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * scale, msg=name)


# --- batch invariance ------------------------------------------------------------------------------------------


def test_batch_invariance_with_several_chunks(device):
    """A row's loss and gradient are bitwise the same alone and inside batches of other sizes, with the rows split
    into several chunks (small tiles and chunks passed to the launchers, so V=300 takes five chunks of 64)."""
    forward_config = launch.forward_config(VOCAB, block=32, chunk=64)
    backward_config = launch.backward_config(VOCAB, block=32)
    assert forward_config.n_chunks == 5
    logits, labels = problem(device, shape=(70,), seed=8)
    options = Options(label_smoothing=0.1)

    def run(rows):
        x, y = logits[rows].contiguous(), labels[rows].contiguous()
        loss, lse, _ = launch.forward(x, y, options, config=forward_config)
        grad = torch.empty_like(x)
        launch.backward(torch.ones_like(loss), x, y, lse, grad, options, config=backward_config)
        return loss, grad

    full_loss, full_grad = run(list(range(70)))  # more than one group of 64 rows
    for rows in ([5], [5, 69, 0], list(range(69, -1, -2))):
        loss, grad = run(rows)
        assert torch.equal(loss, full_loss[rows]) and torch.equal(grad, full_grad[rows])


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [32000, 128256, 256000])
def test_batch_invariance_large_batch_vs_subset(device, vocab):
    """N=8192 against a 4-row subset, bitwise (the decomposition of a row depends on V alone)."""
    generator = torch.Generator(device=device).manual_seed(9)
    logits = torch.randn(8192, vocab, device=device, dtype=torch.bfloat16, generator=generator)
    labels = torch.randint(0, vocab, (8192,), device=device, generator=generator)
    labels[::7] = -100

    def run(x, y):
        leaf = x.clone().requires_grad_()
        loss = cross_entropy(leaf * 1.0, y, reduction="none", z_loss=1e-4)
        loss.backward(torch.ones_like(loss))
        return loss.detach(), leaf.grad

    rows = [0, 1, 4097, 8191]
    full_loss, full_grad = run(logits, labels)
    loss, grad = run(logits[rows], labels[rows])
    assert torch.equal(loss, full_loss[rows]) and torch.equal(grad, full_grad[rows])


# --- devices and streams (GPU) -----------------------------------------------------------------------------------


def _two_gpus():
    return pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@pytest.mark.gpu
@_two_gpus()
@pytest.mark.parametrize("compiled", [False, True])
def test_logits_on_the_second_gpu_while_the_first_is_current(compiled):
    torch.cuda.set_device(0)
    logits, labels = problem(torch.device("cuda:1"), shape=(64,), vocab=32000, dtype=torch.bfloat16)
    leaf = logits.clone().requires_grad_()

    def step(x):
        return cross_entropy(x * 1.0, labels, z_loss=1e-4)

    fn = torch.compile(step, fullgraph=True) if compiled else step
    loss = fn(leaf)
    loss.backward()
    assert torch.cuda.current_device() == 0 and loss.device == leaf.grad.device == torch.device("cuda:1")
    ref = expected(logits, labels, z_loss=1e-4, reduction="mean")
    assert_loss(loss, ref)
    assert_grad(leaf.grad, ref)


@pytest.mark.gpu
def test_launches_follow_the_current_stream(device):
    """The logits come from work queued on a side stream; the loss, called on that stream, must wait for it."""
    logits, labels = problem(device, shape=(512,), vocab=32000)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keep the stream busy so that a launch on another stream would race
        x = logits * 1.0
        loss = cross_entropy(x, labels, reduction="none")
    torch.cuda.current_stream().wait_stream(side)
    assert_loss(loss, expected(logits, labels, reduction="none"))


# --- CUDA graphs ---------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay(device):
    """torch.cuda.graph over forward+backward after the documented warm-up; replays with new data copied into the
    static inputs match the reference."""
    n_rows, vocab = 256, 32000
    static_logits = torch.zeros(n_rows, vocab, device=device, requires_grad=True)
    static_labels = torch.zeros(n_rows, dtype=torch.long, device=device)

    def step():
        loss = cross_entropy(static_logits * 1.0, static_labels, z_loss=1e-4)
        (grad,) = torch.autograd.grad(loss, static_logits)
        return loss, grad

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss, static_grad = step()
    for seed in (10, 11, 12):
        logits, labels = problem(device, shape=(n_rows,), vocab=vocab, seed=seed)
        with torch.no_grad():
            static_logits.copy_(logits)
        static_labels.copy_(labels)
        graph.replay()
        ref = expected(logits, labels, z_loss=1e-4, reduction="mean")
        assert_loss(static_loss, ref)
        assert_grad(static_grad, ref)


@pytest.mark.gpu
def test_first_launch_inside_a_capture_names_the_warm_up(device):
    """A kernel variant that never ran (here: label smoothing 0.123 with softcapping, a fresh combination of
    flags) cannot be compiled inside a capture; the error says to warm up."""
    logits, labels = problem(device, shape=(8,), vocab=1000)
    forget_launches()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="warm-up"):
        with torch.cuda.graph(graph):
            cross_entropy(logits, labels, label_smoothing=0.123, logit_softcapping=7.0)


# --- transformers: the Trainer's own loss scaling, MoE router losses, device placement ---------------------------

try:
    import transformers
except ImportError:  # pragma: no cover
    transformers = None


@pytest.fixture
def unpatched():
    if transformers is None:
        pytest.skip("transformers is not installed")
    fastce_torch.unpatch_transformers()
    yield
    fastce_torch.unpatch_transformers()


def tiny_llama(device, seed=0):
    return tiny_causal_lm("LlamaConfig", "LlamaForCausalLM", VOCAB, device, seed)


def tiny_moe(device, seed=0):
    moe = dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.05)
    return tiny_causal_lm("MixtralConfig", "MixtralForCausalLM", VOCAB, device, seed, **moe)


def token_batch(device, seed=1, shape=(2, 12)):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, shape, generator=generator)
    labels = ids.clone()
    labels[0, :4] = -100
    return ids.to(device), labels.to(device)


def loss_and_grads(model, ids, labels, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, **kwargs)
    loss = out.loss
    loss *= 2.0  # the Trainer's `loss *= num_processes` when tokens are averaged across devices
    loss.backward()
    return loss.detach(), out, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_training(got, want, rtol=1e-4, atol=1e-6):
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert got[2].keys() == want[2].keys()
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_moe_router_aux_loss_is_added_in_place(device, unpatched, backend):
    """Mixtral adds `loss += router_aux_loss_coef * aux_loss` to the loss the patch returns."""
    model = tiny_moe(device)
    ids, labels = token_batch(device)
    want = loss_and_grads(model, ids, labels, num_items_in_batch=torch.tensor(17, device=device))
    assert want[1].aux_loss is not None and float(want[1].aux_loss.detach()) > 0
    fastce_torch.patch_transformers(backend=backend)
    got = loss_and_grads(model, ids, labels, num_items_in_batch=torch.tensor(17, device=device))
    assert_same_training(got, want)
    assert any("router" in name or "gate" in name for name in got[2])  # the aux loss reached the router


def test_trainer_steps_match_unpatched(device, unpatched, tmp_path):
    """A few steps of transformers' Trainer (default TrainingArguments: tokens averaged across devices, so the
    Trainer multiplies the loss in place; gradient accumulation, so num_items_in_batch is passed)."""
    pytest.importorskip("accelerate")

    def train(patched):
        if patched:
            fastce_torch.patch_transformers(backend="kernel")
        model = tiny_llama(device)
        data = []
        for seed in range(8):
            ids, labels = token_batch("cpu", seed=seed, shape=(1, 12))
            data.append({"input_ids": ids[0], "labels": labels[0]})
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / ("patched" if patched else "plain")),
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            max_steps=2,
            logging_steps=1,
            report_to="none",
            save_strategy="no",
            use_cpu=device.type == "cpu",
            seed=0,
        )
        assert args.average_tokens_across_devices
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        fastce_torch.unpatch_transformers()
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        return losses, {name: p.detach().clone() for name, p in model.named_parameters()}

    want_losses, want_params = train(False)
    losses, params = train(True)
    assert len(losses) == 2 and losses == pytest.approx(want_losses, rel=1e-5)
    for name, p in want_params.items():
        torch.testing.assert_close(params[name], p, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.gpu
@_two_gpus()
def test_patched_llama_on_the_second_gpu(unpatched):
    torch.cuda.set_device(0)
    device = torch.device("cuda:1")
    model = tiny_llama(device)
    ids, labels = token_batch(device)
    want = loss_and_grads(model, ids, labels)
    fastce_torch.patch_transformers()
    got = loss_and_grads(model, ids, labels)
    assert torch.cuda.current_device() == 0
    assert_same_training(got, want)
