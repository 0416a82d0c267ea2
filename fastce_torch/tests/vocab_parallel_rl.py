"""The RL keywords on vocab-parallel logits, run on every rank by vocab_parallel_check.py's `--rl` argument set:
temperature, token_weights and the entropy's gradient (the global mz) through process_group= (equal widths, or
explicit vocab_start) and a DTensor sharded on the vocabulary, every reduction, against the float64 reference
(shared_tests/reference.py: reference.differentiated) of the full logits; temperature and token weights under
torch.compile(fullgraph=True) (the traced path); and create_graph through the entropy refused with
NotImplementedError. Returns (cases run, failure lines)."""

import torch
import torch.distributed as dist

import fastce_torch
from fastce_torch.tests.checks import as_float64, gather_columns
from shared_tests import reference as ref64

OPTIONS = dict(logit_softcapping=5.0, logit_scaling=0.9, label_smoothing=0.1, z_loss=1e-3)
FIELDS = {"loss": 1.0, "entropy": -0.3, "z_loss": 2.0}


def problem(vocab, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 3, vocab, generator=generator, dtype=torch.float64) * 2.0
    labels = torch.randint(0, vocab, (2, 3), generator=generator)
    labels[0, 0] = labels[1, 2] = -100
    weights = torch.randn(2, 3, generator=generator)
    return logits.float().to(device), labels.to(device), weights.to(device)


def objective(out, fields, get=getattr):
    return sum(coefficient * get(out, name).sum() for name, coefficient in fields.items())


def expected_gradient(logits, labels, fields, reduction="mean", token_weights=None, **options):
    """({loss, z_loss, entropy} and d objective / d logits) in float64, as torch tensors."""
    upstream = tuple(fields.get(name, 0.0) for name in ("loss", "z_loss", "entropy"))
    ref = ref64.differentiated(
        as_float64(logits), labels.cpu().numpy(), reduction=reduction, opts=ref64.Options(**options),
        token_weights=None if token_weights is None else as_float64(token_weights), upstream=upstream,
    )  # fmt: skip
    values = dict(loss=ref.loss.loss, z_loss=ref.z_loss, entropy=ref.entropy.loss)
    return {name: torch.as_tensor(value) for name, value in values.items()}, torch.as_tensor(ref.loss.grad)


def assert_close(got, expected, what, tol=2e-5):
    expected = expected.detach()
    scale = max(expected.abs().max().item(), 1e-30)
    torch.testing.assert_close(got.detach().cpu().double(), expected, rtol=tol, atol=tol * scale, msg=what)


def group_case(device, widths, explicit, group, backend, reduction, fields, compile_backend=""):
    rank = dist.get_rank(group)
    start, width = sum(widths[:rank]), widths[rank]
    logits, labels, weights = problem(sum(widths), device, seed=len(fields) + len(reduction))
    asked = {f"return_{name}": True for name in fields if name != "loss"}
    keywords = dict(reduction=reduction, temperature=0.7, token_weights=weights, **OPTIONS)

    def run(local):
        out = fastce_torch.cross_entropy(
            local * 1, labels, process_group=group, vocab_start=start if explicit else None, backend=backend,
            **asked, **keywords,
        )  # fmt: skip
        return out if asked else fastce_torch.CrossEntropyOutput(out)

    leaf = logits[..., start : start + width].clone().requires_grad_()
    run_now = torch.compile(run, fullgraph=True, backend=compile_backend) if compile_backend else run
    out = run_now(leaf)
    objective(out, fields).backward()
    reference, grad = expected_gradient(logits, labels, fields, **keywords)
    for name in fields:
        assert_close(getattr(out, name), reference[name], name)
    assert_close(gather_columns(leaf.grad, widths, group), grad, "grad")


def dtensor_case(device, mesh, backend, reduction):
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    logits, labels, weights = problem(37, device, seed=7)
    keywords = dict(reduction=reduction, temperature=1.4, token_weights=weights, **OPTIONS)
    sharded = distribute_tensor(logits, mesh, [Shard(logits.dim() - 1)]).requires_grad_()
    out = fastce_torch.cross_entropy(
        sharded, labels, backend=backend, return_entropy=True, return_z_loss=True, **keywords
    )
    objective(out, FIELDS, lambda o, name: getattr(o, name).to_local()).backward()
    reference, grad = expected_gradient(logits, labels, FIELDS, **keywords)
    for name in FIELDS:
        assert_close(getattr(out, name).to_local(), reference[name], f"DTensor {name}")
    assert isinstance(sharded.grad, DTensor)
    assert_close(sharded.grad.full_tensor(), grad, "DTensor grad")


def log_probs_case(device, widths, explicit, group, mesh, backend):
    """log_probs through process_group= and a DTensor: the values and the gradient of a KL-style objective."""
    from torch.distributed.tensor import Shard, distribute_tensor

    rank = dist.get_rank(group)
    start, width = sum(widths[:rank]), widths[rank]
    logits, labels, weights = problem(sum(widths), device, seed=11)
    keywords = dict(temperature=0.6, logit_softcapping=5.0)  # shift: not with DTensor inputs (CONTRACT.md)
    reference, grad = expected_gradient(logits, labels, {"loss": -1.0, "entropy": 0.1}, reduction="none", **keywords)
    leaf = logits[..., start : start + width].clone().requires_grad_()
    sharded = distribute_tensor(logits, mesh, [Shard(logits.dim() - 1)]).requires_grad_()
    for how, source in (("group", leaf), ("DTensor", sharded)):
        extra = dict(process_group=group, vocab_start=start if explicit else None) if how == "group" else {}
        out = fastce_torch.log_probs(source * 1, labels, return_entropy=True, backend=backend, **keywords, **extra)
        if how == "DTensor":
            out = fastce_torch.LogProbOutput(*(value.to_local() for value in out))
        (out.logprobs.sum() + 0.1 * out.entropy.sum()).backward()
        assert_close(out.logprobs, -reference["loss"], f"{how} logprobs")
        assert_close(out.entropy, reference["entropy"], f"{how} entropy")
    assert_close(gather_columns(leaf.grad, widths, group), grad, "group grad")
    assert_close(sharded.grad.full_tensor(), grad, "DTensor grad")


def refuses_create_graph(device, widths, explicit, group, backend):
    rank = dist.get_rank(group)
    start, width = sum(widths[:rank]), widths[rank]
    logits, labels, _ = problem(sum(widths), device)
    leaf = logits[..., start : start + width].clone().requires_grad_()
    out = fastce_torch.cross_entropy(
        leaf, labels, process_group=group, vocab_start=start if explicit else None, backend=backend,
        return_entropy=True,
    )  # fmt: skip
    try:
        torch.autograd.grad(out.entropy, leaf, create_graph=True)
    except NotImplementedError as error:
        assert "entropy" in str(error)
    else:
        raise AssertionError("create_graph=True through a vocab-parallel entropy did not raise")


def run_rl(device, widths, explicit, group, mesh, backend):
    ran, failures = 0, []
    cases = [
        (f"group {reduction} {'+'.join(fields)}", lambda r=reduction, f=fields: group_case(
            device, widths, explicit, group, backend, r, f))
        for reduction in ("mean", "sum", "none")
        for fields in (FIELDS, {"entropy": 1.0}, {"loss": 1.0, "entropy": 0.5})
    ]  # fmt: skip
    cases += [(f"dtensor {r}", lambda r=r: dtensor_case(device, mesh, backend, r)) for r in ("mean", "none")]
    if not explicit:  # vocab_start= is a graph break under torch.compile
        compiled = [(r, lambda r=r: group_case(device, widths, explicit, group, backend, r, {"loss": 1.0}, "aot_eager"))
                    for r in ("mean", "none")]  # fmt: skip
        cases += [(f"compiled {r}", run) for r, run in compiled]
    cases.append(("log_probs", lambda: log_probs_case(device, widths, explicit, group, mesh, backend)))
    cases.append(("create_graph refused", lambda: refuses_create_graph(device, widths, explicit, group, backend)))
    for name, case in cases:
        ran += 1
        try:
            case()
        except (AssertionError, RuntimeError, NotImplementedError, ValueError, TypeError) as error:
            failures.append(f"rl {name}: {type(error).__name__}: {error}")
        torch._dynamo.reset()
    return ran, failures
