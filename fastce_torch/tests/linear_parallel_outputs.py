"""linear_parallel_check's extra checks of the column-parallel head (--mode tp --size small), one process per rank:
the refused arguments, the extra outputs (return_*), issue 37's RL keywords and linear_log_probs, each against the
same call on the gathered head."""

import torch
import torch.distributed as dist

import fastce_torch


def run_refusals(device, backend):
    """What the vocab-parallel path refuses, on every rank alike (no rank left waiting in a collective)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(5)
    hidden, labels = torch.randn(6, 4, generator=gen).to(device), torch.randint(0, 8 * world, (6,)).to(device)

    def refused(error, match, weight, **kwargs):
        try:
            fastce_torch.linear_cross_entropy(hidden, weight, labels, backend=backend, process_group=group, **kwargs)
        except error as caught:
            assert match in str(caught), caught
            return
        raise AssertionError(f"no {error.__name__} ({match})")

    # Unequal widths without vocab_start: the ranks' chunkings would differ.
    refused(ValueError, "the same number", torch.randn(8 + (rank == 0), 4).to(device))
    # Slices that do not tile [0, V).
    refused(ValueError, "tile", torch.randn(8, 4).to(device), vocab_start=rank * 7)
    weight = torch.randn(8, 4, device=device, requires_grad=True)
    loss = fastce_torch.linear_cross_entropy(hidden, weight, labels, backend=backend, process_group=group)
    # Under torch.compile the call runs eagerly (a graph break), with the same loss and gradient.
    compiled = torch.compile(fastce_torch.linear_cross_entropy, backend="eager")
    again = compiled(hidden, weight, labels, backend=backend, process_group=group)
    assert torch.equal(again, loss), (again, loss)
    assert torch.equal(*(torch.autograd.grad(x, weight)[0] for x in (again, loss)))
    loss = fastce_torch.linear_cross_entropy(hidden, weight, labels, backend=backend, process_group=group)
    try:
        torch.autograd.grad(loss, weight, create_graph=True)
    except NotImplementedError as caught:
        assert "create_graph" in str(caught)
    else:
        raise AssertionError("create_graph=True was not refused")


def random_head(gen, n_rows, width, vocab, ignore_every):
    """(hidden, weight, bias, labels) on the CPU from `gen`, every `ignore_every`-th label ignored."""
    hidden = torch.randn(n_rows, width, generator=gen)
    weight = torch.randn(vocab, width, generator=gen) * 0.5
    bias = torch.randn(vocab, generator=gen)
    labels = torch.randint(0, vocab, (n_rows,), generator=gen)
    labels[::ignore_every] = -100
    return hidden, weight, bias, labels


def dtensor_head(hidden, weight, bias, device):
    """The DTensor vocab-parallel inputs on every rank: (hidden as a leaf, that leaf as a Replicate DTensor, weight
    and bias as Shard(0) DTensor leaves, the mesh)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (dist.get_world_size(),))
    h = hidden.clone().to(device).requires_grad_()
    w, b = (distribute_tensor(t.clone().to(device), mesh, [Shard(0)]).requires_grad_() for t in (weight, bias))
    return h, DTensor.from_local(h, mesh, [Replicate()], run_check=False), w, b, mesh


def check_against(out, grads, want, want_grads, names, local):
    """The named output fields and (d hidden, this rank's d weight / d bias rows `local`) against the float64
    single-process call's."""
    for name in names:
        torch.testing.assert_close(getattr(out, name).double().cpu(), getattr(want, name).cpu(), rtol=2e-5,
                                   atol=2e-6, msg=name)  # fmt: skip
    torch.testing.assert_close(grads[0].double().cpu(), want_grads[0].cpu(), rtol=2e-5, atol=2e-6)
    for got, full in zip(grads[1:], want_grads[1:]):
        torch.testing.assert_close(got.double().cpu(), full[local].cpu(), rtol=2e-5, atol=2e-6)


def run_outputs(device, backend, reduction):
    """The return_* outputs (every one, with every option) through process_group=, against linear_cross_entropy on
    one process with the full weight in float64; the loss and the z_loss output both differentiated."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(11)
    n_rows = 13
    hidden, weight, bias, labels = random_head(gen, n_rows, 8, 12 * world, ignore_every=5)
    up_loss, up_z = torch.randn(n_rows, generator=gen), torch.randn(n_rows, generator=gen)
    if reduction != "none":
        up_loss, up_z = up_loss[0], up_z[0]
    options = dict(label_smoothing=0.1, z_loss=1e-2, logit_softcapping=6.0, reduction=reduction, chunk_rows=4)
    flags = dict(return_z_loss=True, return_lse=True, return_accuracy=True, return_entropy=True)
    local = slice(rank * 12, (rank + 1) * 12)

    def run(h, w, b, **kwargs):
        leaves = [t.detach().clone().to(device).requires_grad_() for t in (h, w, b)]
        out = fastce_torch.linear_cross_entropy(
            leaves[0], leaves[1], labels.to(device), bias=leaves[2], **options, **flags, **kwargs
        )
        ((out.loss * up_loss.to(device)).sum() + (out.z_loss * up_z.to(device)).sum()).backward()
        return out, [t.grad for t in leaves]

    def run_dtensor():
        h, hd, w, b, _ = dtensor_head(hidden, weight, bias, device)
        out = fastce_torch.linear_cross_entropy(hd, w, labels.to(device), bias=b, backend=backend, **options, **flags)
        out = type(out)(*(None if v is None else v.to_local() for v in out))
        ((out.loss * up_loss.to(device)).sum() + (out.z_loss * up_z.to(device)).sum()).backward()
        return out, [h.grad, w.grad.to_local(), b.grad.to_local()]

    want, want_grads = run(hidden.double(), weight.double(), bias.double(), backend="reference")
    for out, grads in (
        run(hidden, weight[local], bias[local], backend=backend, process_group=dist.group.WORLD),
        run_dtensor(),
    ):
        check_against(out, grads, want, want_grads, ("loss", "z_loss", "lse", "accuracy", "entropy"), local)


def run_rl_outputs(device, backend, reduction):
    """Issue 37's keywords through process_group= and the DTensor vocab-parallel path: temperature, token weights
    (either sign) and the entropy output differentiated together with the loss and the z_loss output, against
    linear_cross_entropy on one process with the full weight in float64."""
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(17)
    n_rows = 11
    hidden, weight, bias, labels = random_head(gen, n_rows, 8, 10 * world, ignore_every=4)
    token_weights = torch.randn(n_rows, generator=gen).to(device)
    ups = [torch.randn(n_rows, generator=gen).to(device) for _ in range(3)]
    if reduction != "none":
        ups = [up[0] for up in ups]
    options = dict(label_smoothing=0.1, z_loss=1e-2, logit_softcapping=6.0, reduction=reduction, chunk_rows=4,
                   temperature=0.7, token_weights=token_weights, return_z_loss=True, return_entropy=True)  # fmt: skip
    local = slice(rank * 10, (rank + 1) * 10)

    def objective(out):
        return sum((value * up).sum() for value, up in zip((out.loss, out.z_loss, out.entropy), ups))

    def run(h, w, b, **kwargs):
        leaves = [t.detach().clone().to(device).requires_grad_() for t in (h, w, b)]
        out = fastce_torch.linear_cross_entropy(leaves[0], leaves[1], labels.to(device), bias=leaves[2], **options,
                                                **kwargs)  # fmt: skip
        objective(out).backward()
        return out, [t.grad for t in leaves]

    def run_dtensor():
        from torch.distributed.tensor import DTensor, Replicate

        h, hd, w, b, mesh = dtensor_head(hidden, weight, bias, device)
        labels_d = DTensor.from_local(labels.to(device), mesh, [Replicate()], run_check=False)  # with plain weights
        out = fastce_torch.linear_cross_entropy(hd, w, labels_d, bias=b, backend=backend, **options)
        out = type(out)(*(None if v is None else v.to_local() for v in out))
        objective(out).backward()
        return out, [h.grad, w.grad.to_local(), b.grad.to_local()]

    want, want_grads = run(hidden.double(), weight.double(), bias.double(), backend="reference")
    if reduction == "none":
        run_log_probs(device, backend, hidden, weight, bias, labels, local)
    for out, grads in (
        run(hidden, weight[local], bias[local], backend=backend, process_group=dist.group.WORLD),
        run_dtensor(),
    ):
        check_against(out, grads, want, want_grads, ("loss", "z_loss", "entropy"), local)


def run_log_probs(device, backend, hidden, weight, bias, labels, local):
    """linear_log_probs with an entropy bonus through process_group= and DTensors (Replicate hidden and tokens,
    Shard(0) weight and bias) against one process with the full weight in float64."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    world = dist.get_world_size()
    mesh = torch.distributed.device_mesh.init_device_mesh(device.type, (world,))
    tokens = labels.to(device)
    upstream = torch.randn(labels.shape, generator=torch.Generator().manual_seed(23)).to(device)
    options = dict(temperature=0.8, return_entropy=True, chunk_rows=4, shift=1)

    def objective(out):
        return (torch.exp(out.logprobs) * upstream[1:]).sum() - 0.1 * out.entropy.sum()

    def plain(h, w, b, **kwargs):
        leaves = [t.detach().clone().to(device).requires_grad_() for t in (h, w, b)]
        out = fastce_torch.linear_log_probs(leaves[0], leaves[1], tokens, bias=leaves[2], **options, **kwargs)
        objective(out).backward()
        return out, [t.grad for t in leaves]

    want, want_grads = plain(hidden.double(), weight.double(), bias.double(), backend="reference")
    got, grads = plain(hidden, weight[local], bias[local], backend=backend, process_group=dist.group.WORLD)
    h = hidden.clone().to(device).requires_grad_()
    w, b = (distribute_tensor(t.clone().to(device), mesh, [Shard(0)]).requires_grad_() for t in (weight, bias))
    replicated = [DTensor.from_local(t, mesh, [Replicate()], run_check=False) for t in (h, tokens)]
    out = fastce_torch.linear_log_probs(replicated[0], w, replicated[1], bias=b, backend=backend, **options)
    assert all(isinstance(v, DTensor) for v in out), [type(v) for v in out]
    out = type(out)(*(v.to_local() for v in out))
    objective(out).backward()
    for result, result_grads in ((got, grads), (out, [h.grad, w.grad.to_local(), b.grad.to_local()])):
        for value, expected in zip(result, want):
            torch.testing.assert_close(value.double().cpu(), expected.cpu(), rtol=2e-5, atol=2e-6)
        torch.testing.assert_close(result_grads[0].double().cpu(), want_grads[0].cpu(), rtol=2e-5, atol=2e-6)
        for g, full in zip(result_grads[1:], want_grads[1:]):
            torch.testing.assert_close(g.double().cpu(), full[local].cpu(), rtol=2e-5, atol=2e-6)
