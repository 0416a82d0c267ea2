"""linear_log_probs (issue 37) in both packages, on the same inputs, against the float64 reference
(reference.linear_log_probs): with and without the entropy, temperature, soft-capping, scaling, ignore_index, shift,
a bias, bf16, a linear objective and the nonlinear RL objective of test_rl.py, the rows in several chunks; and
logits_dtype="float32" on bf16 operands (the log-probs within float32 rounding of float64, far closer than the bf16
logits give). Tolerances: test_linear_cross_entropy.py's model (u = K unit roundoffs of the logits' precision, E_t
the size of the logits' products), plus the RL objective's cotangent error as in test_rl.py.
"""

import dataclasses
import sys

import numpy as np
import pytest
import torch

from . import exchange, reference
from .harness import as_f64
from .test_linear_cross_entropy import K_FACTOR, UNIT_ROUNDOFF, assert_within
from .test_rl import (
    ALL,
    PACKAGES,
    T7,
    TORCH_DTYPE,
    linear_objective,
    lp_kwargs,
    objective_cotangents,
    package_or_skip,
    packages_with,
    rl_objective,
    rl_setup,
    skip_if_partial,
    upstreams,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")

fastce_torch = pytest.importorskip("fastce_torch")


# --- linear_log_probs -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LinearLogProbCase:
    name: str
    shape: tuple = (2, 7)
    width: int = 24
    vocab: int = 130
    dtype: str = "float32"
    bias: bool = False
    opts: reference.Options = T7
    shift: int = 0
    entropy: bool = True
    rl: bool = False  # the nonlinear RL objective instead of a linear one
    logits_dtype: str | None = None
    seed: int = 0


LINEAR_CASES = [
    LinearLogProbCase("plain", opts=reference.Options(), seed=31),
    LinearLogProbCase("temperature-bias", bias=True, seed=32),
    LinearLogProbCase("no-entropy", entropy=False, seed=33),
    LinearLogProbCase("softcap-scaling-shift", opts=ALL, shift=1, bias=True, seed=34),
    LinearLogProbCase("ignore-7", opts=reference.Options(ignore_index=7, temperature=0.8), seed=35),
    LinearLogProbCase("rl", rl=True, seed=36),
    LinearLogProbCase("rl-shift-softcap", rl=True, shift=1, opts=ALL, bias=True, seed=37),
    LinearLogProbCase("bf16", dtype="bfloat16", bias=True, seed=38),
    LinearLogProbCase("bf16-rl", dtype="bfloat16", rl=True, shift=1, seed=39),
    LinearLogProbCase("bf16-float32-logits", dtype="bfloat16", logits_dtype="float32", seed=40),
    LinearLogProbCase("bf16-float32-logits-rl", dtype="bfloat16", logits_dtype="float32", rl=True, opts=ALL, seed=41),
]
CHUNK_ROWS = 5  # several chunks of rows, the last one partial (torch) or clamped (JAX)


def linear_inputs(case, device):
    gen = torch.Generator().manual_seed(case.seed)
    dtype = TORCH_DTYPE[case.dtype]
    n = int(np.prod(case.shape))
    hidden = torch.randn((*case.shape, case.width), generator=gen)
    weight = torch.randn((case.vocab, case.width), generator=gen) * (2.0 / case.width**0.5)
    bias = torch.randn(case.vocab, generator=gen) * 0.5 if case.bias else None
    tokens = torch.randint(0, case.vocab, (n,), generator=gen)
    tokens[1::4] = case.opts.ignore_index
    tokens = tokens.reshape(case.shape)
    as_dtype = lambda t: None if t is None else t.to(device=device, dtype=dtype)  # noqa: E731
    return as_dtype(hidden), as_dtype(weight), as_dtype(bias), tokens.to(device)


def linear_kwargs(case):
    kwargs = dict(shift=case.shift, return_entropy=case.entropy, chunk_rows=CHUNK_ROWS, **lp_kwargs(case.opts))
    if case.logits_dtype is not None:
        kwargs["logits_dtype"] = case.logits_dtype
    return kwargs


def run_torch_linear(case, hidden, weight, bias, tokens, objective):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
    out = fastce_torch.linear_log_probs(
        leaves[0], leaves[1], tokens, bias=leaves[2], backend="kernel", **linear_kwargs(case)
    )
    logprobs, ent = (out.logprobs, out.entropy) if case.entropy else (out, None)
    objective(logprobs, ent, torch).backward()
    return logprobs.detach(), None if ent is None else ent.detach(), [None if t is None else t.grad for t in leaves]


def run_jax_linear(case, hidden, weight, bias, tokens, objective):
    import jax
    import jax.numpy as jnp

    fastce_jax = package_or_skip("jax", "linear_log_probs")
    h, w = exchange.to_jax(hidden), exchange.to_jax(weight)
    b = None if bias is None else exchange.to_jax(bias)
    y = exchange.labels_to_jax(tokens)

    def run(h, w, b):
        out = fastce_jax.linear_log_probs(h, w, y, bias=b, backend="kernel", **linear_kwargs(case))
        logprobs, ent = (out.logprobs, out.entropy) if case.entropy else (out, None)
        return objective(logprobs, ent, jnp), (logprobs, ent)

    with jax.default_matmul_precision("float32"):
        grads, (logprobs, ent) = jax.grad(run, argnums=(0, 1, 2), has_aux=True)(h, w, b)
    to_torch = exchange.to_torch
    return (
        to_torch(logprobs),
        None if ent is None else to_torch(ent),
        [None if v is None else to_torch(v) for v in grads],
    )


LINEAR_RUNNERS = {"torch": run_torch_linear, "jax": run_jax_linear}


def linear_bounds(case, exact, hidden, weight, curvature):
    """test_linear_cross_entropy's model: u = K unit roundoffs of the logits' precision; E_t = max_j (|h||W|^T+|b|);
    log-probs u (M_t + 2 E_t), entropy twice that; d logits S = grad_scale + 2 E grad_terms (+ the cotangents'
    error: |J''| u (M + 2 E) times the terms); d hidden u (S + |G|) |W|, d weight and d bias (1 + chunks) times."""
    logits_precision = "float32" if case.logits_dtype == "float32" else case.dtype
    u = UNIT_ROUNDOFF[logits_precision] * K_FACTOR[logits_precision]
    r = exact.logits
    n_rows, vocab = int(np.prod(case.shape)), case.vocab
    logit_error = 2.0 * exact.logits_abs.max(axis=-1)  # (N,) per row of the full hidden
    scored = logit_error.reshape(case.shape)[..., : r.logprobs.shape[-1]]
    lp_bound = u * (r.logprob_scale + scored)
    grad = np.abs(np.nan_to_num(r.grad.reshape(n_rows, vocab)))
    terms = np.nan_to_num(r.grad_terms.reshape(n_rows, vocab))
    S = np.nan_to_num(r.grad_scale.reshape(n_rows, vocab)) + terms * logit_error[:, None]
    if curvature is not None:
        m_full = np.zeros(case.shape)
        m_full[..., : r.logprobs.shape[-1]] = r.logprob_scale + scored
        S = S + np.nan_to_num(curvature.logits.grad_terms.reshape(n_rows, vocab)) * m_full.reshape(-1)[:, None]
    chunks = -(-n_rows // CHUNK_ROWS)
    # The gradient products take the gradient chunk in the inputs' dtype: their unit roundoff is the inputs'.
    ug = UNIT_ROUNDOFF[case.dtype] * K_FACTOR[case.dtype]
    h_abs = np.abs(hidden.detach().double().cpu().numpy().reshape(n_rows, case.width))
    w_abs = np.abs(weight.detach().double().cpu().numpy())
    return dict(
        logprobs=lp_bound,
        entropy=2 * lp_bound,
        hidden=(max(u, ug) * ((S + grad) @ w_abs)).reshape(hidden.shape),
        weight=max(u, ug) * (1 + chunks) * ((S + grad).T @ h_abs),
        bias=max(u, ug) * (1 + chunks) * (S + grad).sum(axis=0),
    )


def check_linear(what, got, exact, bounds):
    logprobs, entropy, (g_hidden, g_weight, g_bias) = got
    assert logprobs.dtype == torch.float32
    assert_within(logprobs, exact.logits.logprobs, bounds["logprobs"], f"{what} log-probs")
    if entropy is not None:
        assert_within(entropy, exact.logits.entropy, bounds["entropy"], f"{what} entropy")
    assert_within(g_hidden, exact.grad_hidden, bounds["hidden"], f"{what} d hidden")
    assert_within(g_weight, exact.grad_weight, bounds["weight"], f"{what} d weight")
    if exact.grad_bias is not None:
        assert_within(g_bias, exact.grad_bias, bounds["bias"], f"{what} d bias")


def linear_problem(case, device):
    """Inputs, the objective (linear or RL), the exact result with its cotangents, and the tolerances."""
    hidden, weight, bias, tokens = linear_inputs(case, device)
    as64 = lambda t: None if t is None else t.detach().double().cpu().numpy()  # noqa: E731
    args = (as64(hidden), as64(weight), tokens.cpu().numpy())
    values = reference.linear_log_probs(*args, bias=as64(bias), opts=case.opts, shift=case.shift).logits
    curvature_result = None
    if case.rl:
        setup = rl_setup(values.logprobs, case.seed)
        torch_objective = rl_objective(*setup, torch)
        entropy = values.entropy if case.entropy else np.zeros_like(values.entropy)
        g, h, curvature = objective_cotangents(torch_objective, values.logprobs, entropy, *setup)

        def objective(logprobs, ent, xp):
            return rl_objective(*setup, xp)(logprobs, ent if case.entropy else None)

        curvature_result = reference.linear_log_probs(
            *args, bias=as64(bias), opts=case.opts, shift=case.shift, upstream_logprobs=curvature
        )
    else:
        g, h = (t.numpy() for t in upstreams(values.logprobs.shape, case.seed, case.entropy))
        objective = linear_objective(torch.tensor(g), torch.tensor(h))
    h = h if case.entropy else np.zeros_like(h)
    exact = reference.linear_log_probs(
        *args, bias=as64(bias), opts=case.opts, shift=case.shift, upstream_logprobs=g, upstream_entropy=h
    )
    bounds = linear_bounds(case, exact, hidden, weight, curvature_result)
    return (hidden, weight, bias, tokens), objective, exact, bounds


@pytest.mark.parametrize("case", LINEAR_CASES, ids=lambda c: f"{c.name}-{c.dtype}")
def test_linear_log_probs_match_the_reference(case, device):
    found = packages_with("linear_log_probs")
    inputs, objective, exact, bounds = linear_problem(case, device)
    outs = {p: LINEAR_RUNNERS[p](case, *inputs, objective) for p in found}
    for package, got in outs.items():
        check_linear(package, got, exact, bounds)
    skip_if_partial(found, "linear_log_probs")
    # The packages against each other: each is within the bounds of the exact value, so twice them apart at most.
    doubled = {k: 2 * v for k, v in bounds.items()}
    t_out, j_out = outs["torch"], outs["jax"]
    assert_within(t_out[0], as_f64(j_out[0]), doubled["logprobs"], "torch vs jax log-probs")
    for got, want, name in zip(t_out[2], j_out[2], ("hidden", "weight", "bias")):
        if got is not None:
            assert_within(got, as_f64(want), doubled[name], f"torch vs jax d {name}")


@pytest.mark.parametrize("package", PACKAGES)
def test_float32_logits_are_closer_to_float64_than_bf16_logits(package, device):
    """bf16 hidden states and head: logits_dtype="float32" keeps the GEMM's float32 result, so the log-probs are
    within float32 rounding of the float64 ones; the bf16 logits (the default) are rounded to bf16 first."""
    module = package_or_skip(package, "linear_log_probs")
    base = LinearLogProbCase("compare", shape=(64,), width=64, vocab=300, dtype="bfloat16", entropy=False, seed=42)
    errors = {}
    for logits_dtype in (None, "float32"):
        case = dataclasses.replace(base, logits_dtype=logits_dtype)
        inputs, objective, exact, bounds = linear_problem(case, device)
        got = LINEAR_RUNNERS[package](case, *inputs, objective)
        check_linear(package, got, exact, bounds)
        errors[logits_dtype] = float(np.nanmax(np.abs(as_f64(got[0]) - exact.logits.logprobs)))
    assert errors["float32"] * 20 < errors[None], errors
    # The framework's own float32 dtype object is accepted as well as the string.
    dtype_object = torch.float32 if package == "torch" else sys.modules["jax.numpy"].float32
    inputs, objective, exact, _ = linear_problem(dataclasses.replace(base, logits_dtype="float32"), device)
    got = LINEAR_RUNNERS[package](dataclasses.replace(base, logits_dtype=dtype_object), *inputs, objective)
    assert float(np.nanmax(np.abs(as_f64(got[0]) - exact.logits.logprobs))) == errors["float32"], module.__name__
