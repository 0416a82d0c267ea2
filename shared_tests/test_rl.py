"""Issue 37's per-token RL surface in both packages, on the same buffers (DLPack), against the float64 reference
(reference.log_probs / linear_log_probs): log_probs and linear_log_probs with and without the entropy, at a
temperature, with soft-capping, scaling, ignore_index and shift; the gradients of a nonlinear RL objective through
them (a clipped importance ratio with per-token advantages, an entropy bonus and a KL term to a reference policy's
log-probs); logits_dtype="float32" (bf16 operands, float32 logits: the log-probs closer to float64 than the bf16
logits give); and the two packages against each other.

Tolerances are the shared model's (tolerances.py; for the linear entry points test_linear_cross_entropy's):
  log-probs:  RTOL M_t (the loss's own error: logprob = -loss);   entropy: 2 RTOL M_t (as test_outputs.py)
  gradient:   RTOL (grad_scale + grad_scale'') + ulps of the dtype, grad_scale from the reference with the objective's
              cotangents (d J / d logprob_t, d J / d entropy_t), grad_scale'' the same magnitudes with the cotangents
              |d^2 J / d logprob_t^2|: the package's own log-probs (within RTOL M_t of the exact ones) feed the
              objective, so its cotangents move by up to |J''| RTOL M_t.
The objective's clipped ratios are kept at least 0.01 from the clip edges (the old policy's log-probs are built from
the exact ones), so float32 rounding never picks the other branch of the min.
"""

import dataclasses
import sys

import numpy as np
import pytest
import torch

from . import exchange, reference
from .harness import Case, as_f64, make_inputs, optional_jax, torch_ulps_reference
from .tolerances import FLOOR, RTOL, ULPS_PAIR, check, ulp

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")

fastce_torch = pytest.importorskip("fastce_torch")
PACKAGES = ["torch", "jax"]
CLIP, KL_COEF, ENTROPY_COEF = 0.2, 0.05, 0.01


def package_or_skip(package, name):
    module = fastce_torch if package == "torch" else optional_jax()
    if module is None or not hasattr(module, name):
        pytest.skip(f"fastce_{package} has no {name} yet")
    return module


def packages_with(name):
    """The packages that have `name` (the other one's side is skipped at the end of the test, as harness.run_case
    does without jax), or a skip when neither has it."""
    modules = {"torch": fastce_torch, "jax": optional_jax()}
    found = [p for p in PACKAGES if callable(getattr(modules[p], name, None))]  # not the submodule of that name
    if not found:
        pytest.skip(f"no package has {name} yet")
    return found


def skip_if_partial(found, name):
    if len(found) < len(PACKAGES):
        pytest.skip(f"only {found} have {name}: checked that side, skipped the other and the pair comparison")


def lp_kwargs(opts):
    """The options log_probs takes (it has no label smoothing or z-loss)."""
    kwargs = dict(
        ignore_index=opts.ignore_index,
        logit_softcapping=opts.logit_softcapping,
        logit_scaling=opts.logit_scaling,
        temperature=opts.temperature,
    )
    return kwargs


@dataclasses.dataclass(frozen=True)
class LogProbCase:
    name: str
    shape: tuple = (2, 6)
    vocab: int = 37
    dtype: str = "float32"
    opts: reference.Options = dataclasses.field(default_factory=lambda: reference.Options(temperature=0.7))
    shift: int = 0
    entropy: bool = True
    ignore: str = "some"
    bad_labels: tuple = ()
    neg_inf: str = ""
    inplace: bool = False  # torch: the logits are a non-leaf (the backward may write into their buffer)
    seed: int = 0


T7 = reference.Options(temperature=0.7)
ALL = reference.Options(logit_softcapping=5.0, logit_scaling=0.8, temperature=0.6)
CASES = [
    LogProbCase("plain", opts=reference.Options(), seed=1),
    LogProbCase("temperature", seed=2),
    LogProbCase("non-leaf-logits", inplace=True, opts=ALL, seed=17),
    LogProbCase("no-entropy", entropy=False, seed=3),
    LogProbCase("hot", opts=reference.Options(temperature=1.7), seed=4),
    LogProbCase("softcap-scaling-temperature", opts=ALL, seed=5),
    LogProbCase("shift", shift=1, opts=ALL, seed=6),
    LogProbCase("shift-2-no-entropy", shift=2, entropy=False, seed=7),
    LogProbCase("ignore-minus-one", opts=reference.Options(ignore_index=-1, temperature=0.7), seed=8),
    LogProbCase("ignore-real-class", ignore="class", opts=reference.Options(ignore_index=3, temperature=0.9), seed=9),
    LogProbCase("all-ignored", ignore="all", seed=10),
    LogProbCase("bad-tokens", bad_labels=(37, -5), seed=11),
    LogProbCase("neg-inf-tail", neg_inf="tail", opts=ALL, seed=12),
    LogProbCase("1d", shape=(7,), seed=13),
    LogProbCase("bf16", dtype="bfloat16", opts=ALL, shift=1, seed=14),
    LogProbCase("f16", dtype="float16", seed=15),
    LogProbCase("wide", shape=(3,), vocab=300, seed=16),
]


def logits_case(case):
    """The harness's Case that makes this case's logits and tokens (make_inputs)."""
    return Case(
        case.name,
        shape=case.shape,
        vocab=case.vocab,
        dtype=case.dtype,
        opts=case.opts,
        ignore=case.ignore,
        bad_labels=case.bad_labels,
        neg_inf=case.neg_inf,
        seed=case.seed,
    )


def upstreams(shape, seed, entropy):
    """Random cotangents of the log-probs and (with entropy) the entropy, shaped like the scored tokens."""
    gen = torch.Generator().manual_seed(seed + 1000)
    g = torch.randn(shape, generator=gen, dtype=torch.float64)
    h = torch.randn(shape, generator=gen, dtype=torch.float64) if entropy else torch.zeros(shape, dtype=torch.float64)
    return g, h


# --- runners: (logprobs, entropy or None, d objective / d logits) as torch tensors --------------------------------


def run_torch_log_probs(logits, tokens, opts, shift, entropy, objective, inplace=False):
    leaf = logits.detach().requires_grad_()
    x = leaf.clone() if inplace else leaf
    out = fastce_torch.log_probs(x, tokens, shift=shift, return_entropy=entropy, backend="kernel", **lp_kwargs(opts))
    logprobs, ent = (out.logprobs, out.entropy) if entropy else (out, None)
    assert type(out).__name__ == "LogProbOutput" if entropy else isinstance(out, torch.Tensor)
    objective(logprobs, ent, torch).backward()
    grad = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
    return logprobs.detach(), None if ent is None else ent.detach(), grad


def run_jax_log_probs(logits, tokens, opts, shift, entropy, objective, inplace=False):
    import jax
    import jax.numpy as jnp

    fastce_jax = package_or_skip("jax", "log_probs")
    x, y = exchange.to_jax(logits), exchange.labels_to_jax(tokens)

    def run(a):
        out = fastce_jax.log_probs(a, y, shift=shift, return_entropy=entropy, backend="kernel", **lp_kwargs(opts))
        logprobs, ent = (out.logprobs, out.entropy) if entropy else (out, None)
        return objective(logprobs, ent, jnp), (logprobs, ent)

    grad, (logprobs, ent) = jax.grad(run, has_aux=True)(x)
    to_torch = exchange.to_torch
    return to_torch(logprobs), None if ent is None else to_torch(ent), to_torch(grad)


RUNNERS = {"torch": run_torch_log_probs, "jax": run_jax_log_probs}


def linear_objective(g, h):
    """sum_t g_t logprob_t + h_t entropy_t, in whichever framework (`xp` is torch or jax.numpy)."""

    def objective(logprobs, entropy, xp):
        total = (logprobs * as_framework(g, xp, logprobs)).sum()
        if entropy is not None:
            total = total + (entropy * as_framework(h, xp, entropy)).sum()
        return total

    return objective


def as_framework(tensor, xp, like=None):
    """A float64 CPU tensor as a float32 constant of the framework (on `like`'s device in torch; JAX places an
    uncommitted array with the arrays it meets)."""
    if xp is torch:
        return tensor.to(torch.float32 if like is None else like.dtype).to(None if like is None else like.device)
    return xp.asarray(tensor.numpy(), xp.float32 if like is None else like.dtype)


# --- checks -----------------------------------------------------------------------------------------------------


def check_against_reference(what, got, ref, dtype, grad_scale_extra=0.0, ulps=0.5):
    logprobs, entropy, grad = got
    assert logprobs.dtype == torch.float32, f"{what}: log-probs dtype {logprobs.dtype}"
    assert grad.dtype == TORCH_DTYPE[dtype]
    lp = as_f64(logprobs)
    check(lp, ref.logprobs, RTOL * ref.logprob_scale + FLOOR, f"{what} log-probs")
    ignored_zero = ref.logprobs == 0
    assert not np.signbit(lp[ignored_zero & (lp == 0)]).any(), f"{what}: -0.0 log-prob where ignored"
    if entropy is not None:
        assert entropy.dtype == torch.float32
        check(as_f64(entropy), ref.entropy, 2 * RTOL * ref.logprob_scale + FLOOR, f"{what} entropy")
    g = as_f64(grad)
    magnitude = np.maximum(np.abs(np.nan_to_num(g)), np.abs(np.nan_to_num(ref.grad)))
    bound = RTOL * (ref.grad_scale + grad_scale_extra) + ulps * ulp(magnitude, dtype) + FLOOR
    check(g, ref.grad, bound, f"{what} gradient")


def check_pair(t_out, j_out, ref, dtype, grad_scale_extra=0.0):
    for a, b, scale, name in (
        (t_out[0], j_out[0], ref.logprob_scale, "log-probs"),
        (t_out[1], j_out[1], 2 * ref.logprob_scale, "entropy"),
    ):
        if a is not None:
            check(as_f64(a), as_f64(b), RTOL * scale + FLOOR, f"torch vs jax {name}")
    ga, gb = as_f64(t_out[2]), as_f64(j_out[2])
    both = np.maximum(np.abs(np.nan_to_num(ga)), np.abs(np.nan_to_num(gb)))
    bound = RTOL * (ref.grad_scale + grad_scale_extra) + ULPS_PAIR * ulp(both, dtype) + FLOOR
    check(ga, gb, bound, "torch vs jax gradient")


TORCH_DTYPE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def run_both(case, device, objective, ref, grad_scale_extra=0.0):
    """Both packages on the same inputs against `ref`, then against each other."""
    inputs = make_inputs(logits_case(case), device)
    found = packages_with("log_probs")
    outs = {}
    for package in found:
        args = (inputs.logits, inputs.labels, case.opts, case.shift, case.entropy, objective, case.inplace)
        got = RUNNERS[package](*args)
        ulps = torch_ulps_reference(inputs, logits_case(case)) if package == "torch" else 0.5
        check_against_reference(package, got, ref, case.dtype, grad_scale_extra, ulps)
        outs[package] = got
    skip_if_partial(found, "log_probs")
    check_pair(outs["torch"], outs["jax"], ref, case.dtype, grad_scale_extra)


def exact_inputs(case, device):
    inputs = make_inputs(logits_case(case), device)
    return inputs, inputs.logits.detach().to("cpu", torch.float64).numpy(), inputs.labels.cpu().numpy()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.name}-{c.dtype}")
def test_log_probs_match_the_reference(case, device):
    _, x, y = exact_inputs(case, device)
    kept = y[..., case.shift :].shape
    g, h = upstreams(kept, case.seed, case.entropy)
    ref = reference.log_probs(
        x, y, opts=case.opts, shift=case.shift, upstream_logprobs=g.numpy(), upstream_entropy=h.numpy()
    )
    run_both(case, device, linear_objective(g, h), ref)


# --- a nonlinear RL objective: clipped importance ratio, per-token advantages, entropy bonus, KL to a reference ---


def rl_objective(old, ref_policy, advantages, mask, xp):
    """The GRPO / PPO token-level loss, written once for torch and jax.numpy (`xp`):
    mean over scored tokens of -min(r A, clip(r, 1 - CLIP, 1 + CLIP) A) + KL_COEF k3(ref || policy) - ENTROPY_COEF H,
    r = exp(logprob - old), k3 = exp(ref - logprob) - (ref - logprob) - 1."""

    def objective(logprobs, entropy, _xp=None):
        namespace = _xp or xp
        o, rp, a, m = (as_framework(v, namespace, logprobs) for v in (old, ref_policy, advantages, mask))
        ratio = namespace.exp(logprobs - o)
        clipped = namespace.clip(ratio, 1 - CLIP, 1 + CLIP)
        policy = -namespace.minimum(ratio * a, clipped * a)
        kl = namespace.exp(rp - logprobs) - (rp - logprobs) - 1
        per_token = policy + KL_COEF * kl
        if entropy is not None:
            per_token = per_token - ENTROPY_COEF * entropy
        return (per_token * m).sum() / max(float(mask.sum()), 1.0)

    return objective


def rl_setup(exact_logprobs, seed):
    """Old-policy and reference-policy log-probs near the exact ones, advantages, the mask of scored tokens: the
    ratio r = exp(logprob - old) at least 0.01 away from the clip edges (the branch of the min is not a rounding)."""
    gen = np.random.default_rng(seed + 2000)
    mask = exact_logprobs != 0  # ignored tokens (and bad ones, NaN != 0 is True: the cases keep them out)
    ratio = gen.uniform(0.55, 1.45, exact_logprobs.shape)
    for edge in (1 - CLIP, 1 + CLIP):
        near = np.abs(ratio - edge) < 0.01
        ratio[near] = edge + np.where(ratio[near] < edge, -0.02, 0.02)
    old = np.where(mask, exact_logprobs - np.log(ratio), 0.0)
    ref_policy = np.where(mask, exact_logprobs + gen.normal(0, 0.3, exact_logprobs.shape), 0.0)
    advantages = gen.normal(0, 1, exact_logprobs.shape)
    return [torch.tensor(v) for v in (old, ref_policy, advantages, mask.astype(np.float64))]


def objective_cotangents(objective, logprobs, entropy, old, ref_policy, advantages, mask):
    """d J / d logprob_t, d J / d entropy_t by float64 torch autograd at the exact values, and |d^2 J / d logprob_t^2|
    (the size of the cotangents' own error, see the module's docstring)."""
    lp = torch.tensor(logprobs, requires_grad=True)
    ent = torch.tensor(entropy, requires_grad=True)
    g, h = torch.autograd.grad(objective(lp, ent, torch), (lp, ent))
    ratio = torch.exp(lp.detach() - old)
    unclipped = ratio * advantages <= ratio.clamp(1 - CLIP, 1 + CLIP) * advantages
    curvature = torch.where(unclipped, (ratio * advantages).abs(), 0.0) + KL_COEF * torch.exp(ref_policy - lp.detach())
    curvature = curvature * mask / max(float(mask.sum()), 1.0)
    return g.numpy(), h.numpy(), curvature.numpy()


RL_CASES = [
    LogProbCase("rl", shape=(3, 8), opts=T7, seed=21),
    LogProbCase("rl-shift-softcap", shape=(3, 8), shift=1, opts=ALL, seed=22),
    LogProbCase("rl-no-entropy", shape=(3, 8), entropy=False, seed=23),
    LogProbCase("rl-bf16", shape=(3, 8), dtype="bfloat16", shift=1, opts=ALL, seed=24),
]


@pytest.mark.parametrize("case", RL_CASES, ids=lambda c: f"{c.name}-{c.dtype}")
def test_rl_objective_gradient_through_log_probs(case, device):
    packages_with("log_probs")
    _, x, y = exact_inputs(case, device)
    exact = reference.log_probs(x, y, opts=case.opts, shift=case.shift)
    setup = rl_setup(exact.logprobs, case.seed)
    objective = rl_objective(*setup, torch)
    entropy = exact.entropy if case.entropy else np.zeros_like(exact.entropy)
    g, h, curvature = objective_cotangents(objective, exact.logprobs, entropy, *setup)
    h = h if case.entropy else np.zeros_like(h)
    ref = reference.log_probs(x, y, opts=case.opts, shift=case.shift, upstream_logprobs=g, upstream_entropy=h)
    extra = reference.log_probs(x, y, opts=case.opts, shift=case.shift, upstream_logprobs=curvature).grad_scale

    def package_objective(logprobs, ent, xp):
        return rl_objective(*setup, xp)(logprobs, ent if case.entropy else None)

    run_both(case, device, package_objective, ref, grad_scale_extra=extra)


# --- linear_log_probs -------------------------------------------------------------------------------------------

from .test_linear_cross_entropy import K_FACTOR, UNIT_ROUNDOFF, assert_within  # noqa: E402


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
