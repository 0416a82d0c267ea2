"""Issue 37's per-token RL surface in both packages, on the same buffers (DLPack), against the float64 reference
(reference.log_probs): log_probs with and without the entropy, at a temperature, with soft-capping, scaling,
ignore_index and shift; the gradients of a nonlinear RL objective through it (a clipped importance ratio with
per-token advantages, an entropy bonus and a KL term to a reference policy's log-probs); and the two packages against
each other. linear_log_probs and logits_dtype: test_rl_linear.py (which reuses the objective defined here).

Tolerances are the shared model's (tolerances.py):
  log-probs:  RTOL M_t (the loss's own error: logprob = -loss);   entropy: 2 RTOL M_t (as test_outputs.py)
  gradient:   RTOL (grad_scale + grad_scale'') + ulps of the dtype, grad_scale from the reference with the objective's
              cotangents (d J / d logprob_t, d J / d entropy_t), grad_scale'' the same magnitudes with the cotangents
              |d^2 J / d logprob_t^2|: the package's own log-probs (within RTOL M_t of the exact ones) feed the
              objective, so its cotangents move by up to |J''| RTOL M_t.
The objective's clipped ratios are kept at least 0.01 from the clip edges (the old policy's log-probs are built from
the exact ones), so float32 rounding never picks the other branch of the min.
"""

import dataclasses

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
