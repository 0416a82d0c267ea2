"""fastce_jax.linear_policy_loss and linear_token_objective against the float64 reference
(shared_tests/reference_policy.py; the objective against autodiff through materialised logits). CPU: backend="kernel"
runs the Pallas kernels in interpret mode, several chunks (a small workspace); backend="reference" is the jnp path.
Every loss_type, ratios far outside the clip range from both sides, zero / negative / NaN advantages, float masks,
ignored tokens, temperature and soft-capping, beta and entropy_coef on and off, jit and grad; bad inputs."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fastce_jax import PolicyLossOutput, linear_policy_loss, linear_token_objective
from shared_tests import reference as ref64
from shared_tests import reference_policy as refp

from .checks import as_float64
from .test_linear_cross_entropy import assert_close, grad_tol


@pytest.fixture(autouse=True)
def _exact_float32_matmuls():
    with jax.default_matmul_precision("float32"):
        yield


B, T, H, V = 3, 6, 16, 67
ROWS = 8  # rows per chunk through the workspace budget: 18 rows in 3 chunks, the last one clamped
WORKSPACE = ROWS * V * 4
LOSS_TOL = dict(rtol=1e-4, atol=1e-5)
GRAD_RTOL = 1e-3
METRICS = ("kl", "entropy", "clip_ratio_low", "clip_ratio_high", "clip_ratio_region")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    policy: refp.PolicyOptions = refp.PolicyOptions()
    ce: ref64.Options = ref64.Options()
    old: bool = True  # old log-probs e^{+-1} and e^{+-0.05} away from the current ones (ratios outside the clip)
    ref: bool = False
    mask: str = "default"  # "default" (tokens != ignore_index), "float" (random weights, some zeros)
    adv_2d: bool = False
    bias: bool = True
    seed: int = 0


CASES = [
    Case("grpo_default_old", old=False, seed=1),
    Case("grpo", seed=2),
    Case("grpo_delta_float_mask", refp.PolicyOptions(delta=1.5, epsilon_high=0.28), mask="float", seed=3),
    Case("bnpo_adv2d", refp.PolicyOptions(loss_type="bnpo"), adv_2d=True, seed=4),
    Case("dr_grpo", refp.PolicyOptions(loss_type="dr_grpo", max_completion_length=9), seed=5),
    Case("dapo", refp.PolicyOptions(loss_type="dapo"), seed=6),
    Case("dapo_items", refp.PolicyOptions(loss_type="dapo", num_items_in_batch=11.0), mask="float", seed=7),
    Case("cispo", refp.PolicyOptions(loss_type="cispo", epsilon_high=2.0), seed=8),
    Case(
        "grpo_beta_entropy_temperature_softcap",
        refp.PolicyOptions(beta=0.04, entropy_coef=0.05),
        ref64.Options(temperature=0.7, logit_softcapping=5.0),
        ref=True,
        seed=9,
    ),
    Case(
        "cispo_beta_entropy_scaling",
        refp.PolicyOptions(loss_type="cispo", epsilon_high=3.0, beta=0.1, entropy_coef=-0.02),
        ref64.Options(temperature=1.3, logit_scaling=0.8),
        ref=True,
        bias=False,
        seed=10,
    ),
]


def make_case(put, case: Case):
    """(package keywords' arrays, the float64 reference's arrays, the reference result)."""
    rng = np.random.default_rng(case.seed)
    hidden = put(rng.standard_normal((B, T, H)), jnp.float32)
    weight = put(rng.standard_normal((V, H)) * (2.0 / np.sqrt(H)), jnp.float32)
    bias = put(rng.standard_normal(V) * 0.5, jnp.float32) if case.bias else None
    tokens = rng.integers(0, V, (B, T))
    tokens[0, -2:] = case.ce.ignore_index  # padding
    tokens[2, 1] = case.ce.ignore_index
    adv = rng.standard_normal((B, T) if case.adv_2d else (B,))
    adv[1] = 0.0  # a zero advantage: no policy gradient for that sequence
    adv.reshape(-1)[0] = -abs(adv.reshape(-1)[0]) - 0.5  # a negative one
    mask = None
    if case.mask == "float":
        mask = rng.uniform(0.2, 1.5, (B, T))
        mask[1, 2] = 0.0
    h64, w64 = as_float64(hidden), as_float64(weight)
    b64 = None if bias is None else as_float64(bias)
    current = refp.linear_policy_loss(h64, w64, tokens, adv, bias=b64, ce_opts=case.ce).logp
    old = ref = None
    if case.old:
        old = current + rng.permutation(np.resize([-1.0, 1.0, -0.05, 0.05], B * T)).reshape(B, T)
        old = as_float64(put(old, jnp.float32))
    if case.ref:
        ref = as_float64(put(current + rng.uniform(-0.5, 0.5, (B, T)), jnp.float32))
    want = refp.linear_policy_loss(
        h64, w64, tokens, adv, bias=b64, mask=mask, old_log_probs=old, ref_log_probs=ref, opts=case.policy,
        ce_opts=case.ce,
    )  # fmt: skip
    kwargs = dict(case.policy.as_kwargs())
    kwargs.update({k: v for k, v in case.ce.as_kwargs().items() if k not in ("label_smoothing", "z_loss") and v != 0.0})
    arrays = dict(
        tokens=put(tokens, jnp.int32), advantages=put(adv, jnp.float32),
        mask=None if mask is None else put(mask, jnp.float32),
        old_log_probs=None if old is None else put(old, jnp.float32),
        ref_log_probs=None if ref is None else put(ref, jnp.float32),
    )  # fmt: skip
    return (hidden, weight, bias), arrays, kwargs, want


def run(params, arrays, kwargs, backend, upstream=1.7, jit=True):
    """PolicyLossOutput and the gradients of upstream * loss with respect to hidden, weight (and bias)."""
    tokens, adv = arrays["tokens"], arrays["advantages"]
    rest = {k: v for k, v in arrays.items() if k not in ("tokens", "advantages") and v is not None}

    def f(h, w, b):
        out = linear_policy_loss(
            h, w, tokens, adv, bias=b, backend=backend, workspace_bytes=WORKSPACE, **rest, **kwargs
        )  # fmt: skip
        return upstream * out.loss, out

    fn = jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)
    if jit:
        fn = jax.jit(fn)
    (_, out), grads = fn(*params)
    return out, grads


def compare(out, grads, want, upstream=1.7):
    assert isinstance(out, PolicyLossOutput)
    assert out.loss.shape == () and out.loss.dtype == jnp.float32
    assert_close(out.loss, want.policy.loss, what="loss", **LOSS_TOL)
    for name in METRICS:
        got = getattr(out, name)
        assert got.dtype == jnp.float32 and got.shape == ()
        assert_close(got, getattr(want.policy, name), what=name, **LOSS_TOL)
    for name, got, ref in zip(("dhidden", "dweight", "dbias"), grads, (want.grad_hidden, want.grad_weight,
                                                                     want.grad_bias)):  # fmt: skip
        if ref is None:
            assert got is None
            continue
        ref = upstream * ref
        assert_close(got, ref, what=name, **grad_tol(ref, GRAD_RTOL))


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_policy_kernel(put, case):
    params, arrays, kwargs, want = make_case(put, case)
    if case.old:  # the ratios do cross the clip range on both sides
        assert np.any(want.policy.ratio < 0.5) and np.any(want.policy.ratio > 2.0)
    out, grads = run(params, arrays, kwargs, "kernel")
    compare(out, grads, want)


@pytest.mark.parametrize("case", CASES[1::2], ids=[c.name for c in CASES[1::2]])
def test_policy_reference_backend(put, case):
    params, arrays, kwargs, want = make_case(put, case)
    out, grads = run(params, arrays, kwargs, "reference")
    compare(out, grads, want)


def test_policy_eager_and_no_grad(put):
    """Eager (no jit) with the loss alone: no gradient pass; the same loss as under grad."""
    params, arrays, kwargs, want = make_case(put, CASES[2])
    rest = {k: v for k, v in arrays.items() if k not in ("tokens", "advantages") and v is not None}
    out = linear_policy_loss(*params[:2], arrays["tokens"], arrays["advantages"], bias=params[2], backend="kernel",
                             workspace_bytes=WORKSPACE, **rest, **kwargs)  # fmt: skip
    assert_close(out.loss, want.policy.loss, what="loss", **LOSS_TOL)
    jaxpr = str(jax.make_jaxpr(
        lambda h: linear_policy_loss(h, params[1], arrays["tokens"], arrays["advantages"], backend="kernel").loss
    )(params[0]))  # fmt: skip
    assert "custom_vjp" in jaxpr


def test_nan_advantage_poisons_its_own_tokens(put):
    params, arrays, kwargs, want = make_case(put, CASES[1])
    adv = np.asarray(arrays["advantages"]).copy()
    adv[2] = np.nan
    arrays = dict(arrays, advantages=put(adv, jnp.float32))
    out, grads = run(params, arrays, kwargs, "kernel")
    assert np.isnan(float(out.loss))
    dh = np.asarray(grads[0])
    assert np.all(np.isfinite(dh[:2])) and np.isnan(dh[2]).any()
    for name in ("clip_ratio_low", "clip_ratio_high", "clip_ratio_region", "entropy"):
        assert np.isfinite(float(getattr(out, name))), name
    # A NaN advantage on a token outside the mask changes nothing.
    adv = np.asarray(make_case(put, CASES[1])[1]["advantages"]).copy()
    tokens = np.asarray(arrays["tokens"]).copy()
    tokens[:, 0] = -100
    adv2d = np.broadcast_to(adv[:, None], (B, T)).copy()
    adv2d[:, 0] = np.nan
    a = run(params, dict(arrays, tokens=put(tokens, jnp.int32), advantages=put(adv2d, jnp.float32)), kwargs, "kernel")
    b = run(params, dict(arrays, tokens=put(tokens, jnp.int32), advantages=put(adv, jnp.float32)), kwargs, "kernel")
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.array_equal(np.asarray(x), np.asarray(y))


def test_weight_layout_hv(put):
    params, arrays, kwargs, want = make_case(put, CASES[1])
    hidden, weight, bias = params
    tokens, adv = arrays["tokens"], arrays["advantages"]

    def f(h, w):
        return linear_policy_loss(h, w, tokens, adv, bias=bias, old_log_probs=arrays["old_log_probs"],
                                  backend="kernel", workspace_bytes=WORKSPACE, weight_layout="hv").loss  # fmt: skip

    loss, (dh, dwt) = jax.value_and_grad(f, argnums=(0, 1))(hidden, weight.T)
    assert_close(loss, want.policy.loss, what="loss", **LOSS_TOL)
    assert_close(dwt.T, want.grad_weight, what="dweight", **grad_tol(want.grad_weight, GRAD_RTOL))


# --- linear_token_objective -------------------------------------------------------------------------------------


def _objective(logp, entropy, a, c):
    return -a * jnp.exp(logp) * logp + c * entropy**2


def _materialised(hidden, weight, bias, tokens, a, c, temperature, softcap):
    """The same objective through materialised logits and jax.nn.log_softmax, plain autodiff."""
    z = hidden @ weight.T + bias
    z = softcap * jnp.tanh(z / softcap) / temperature
    logsm = jax.nn.log_softmax(z, axis=-1)
    kept = tokens != -100
    logp = jnp.take_along_axis(logsm, jnp.where(kept, tokens, 0)[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logsm) * logsm, axis=-1)
    logp, entropy = jnp.where(kept, logp, 0.0), jnp.where(kept, entropy, 0.0)
    return jnp.sum(jnp.where(kept, _objective(logp, entropy, a, c), 0.0))


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_token_objective_against_autodiff(put, backend):
    params, arrays, _, _ = make_case(put, CASES[0])
    hidden, weight, bias = params
    tokens = arrays["tokens"]
    rng = np.random.default_rng(3)
    a, c = put(rng.standard_normal((B, T)), jnp.float32), put(rng.uniform(0.1, 1.0, (B, T)), jnp.float32)

    def ours(h, w, b):
        return linear_token_objective(h, w, tokens, _objective, (a, c), bias=b, with_entropy=True, temperature=0.7,
                                      logit_softcapping=5.0, workspace_bytes=WORKSPACE, backend=backend)  # fmt: skip

    def theirs(h, w, b):
        return _materialised(h, w, b, tokens, a, c, 0.7, 5.0)

    got, got_g = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2)))(hidden, weight, bias)
    want, want_g = jax.value_and_grad(theirs, argnums=(0, 1, 2))(hidden, weight, bias)
    assert got.shape == () and got.dtype == jnp.float32
    assert_close(got, want, what="loss", rtol=1e-5, atol=1e-5)
    for g, w in zip(got_g, want_g):
        assert_close(g, w, what="grad", **grad_tol(np.asarray(w), 1e-4))
    # Ignored tokens get no gradient.
    assert np.all(np.asarray(got_g[0])[0, -2:] == 0.0)


def test_token_objective_without_entropy_matches_log_probs(put):
    """objective = g * logp: the gradient of linear_log_probs' g-weighted sum; entropy is None inside."""
    from fastce_jax import linear_log_probs

    params, arrays, _, _ = make_case(put, CASES[0])
    hidden, weight, _ = params
    tokens = arrays["tokens"]
    g = put(np.random.default_rng(4).uniform(-1, 1, (B, T)), jnp.float32)
    seen = []

    def objective(logp, entropy, gt):
        seen.append(entropy)
        return gt * logp

    ours = jax.grad(lambda h: linear_token_objective(h, weight, tokens, objective, (g,), backend="kernel",
                                                     workspace_bytes=WORKSPACE))(hidden)  # fmt: skip
    theirs = jax.grad(lambda h: jnp.sum(g * linear_log_probs(h, weight, tokens, backend="kernel")))(hidden)
    assert seen and all(e is None for e in seen)
    assert_close(ours, theirs, what="dhidden", **grad_tol(np.asarray(theirs), 1e-5))


# --- bad inputs -------------------------------------------------------------------------------------------------


def _policy_args(put):
    params, arrays, _, _ = make_case(put, CASES[0])
    return params[0], params[1], arrays["tokens"], arrays["advantages"]


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(loss_type="ppo"), ValueError, "loss_type"),
        (dict(loss_type="dr_grpo"), ValueError, "max_completion_length"),
        (dict(max_completion_length=0), ValueError, "max_completion_length"),
        (dict(beta=0.1), ValueError, "ref_log_probs"),
        (dict(epsilon_low=-0.1), ValueError, "epsilon_low"),
        (dict(epsilon_high=float("nan")), ValueError, "epsilon_high"),
        (dict(delta=0.0), ValueError, "delta"),
        (dict(entropy_coef="0.1"), TypeError, "entropy_coef"),
        (dict(num_items_in_batch=0), ValueError, "num_items_in_batch"),
        (dict(temperature=0.0), ValueError, "temperature"),
        (dict(backend="triton"), ValueError, "backend"),
        (dict(weight_layout="vv"), ValueError, "weight_layout"),
        (dict(workspace_bytes=0), ValueError, "workspace_bytes"),
        (dict(mask=np.ones((B, T + 1))), ValueError, "mask"),
        (dict(mask=np.ones((B, T), np.int32)), TypeError, "mask"),
        (dict(old_log_probs=np.zeros((B, T - 1), np.float32)), ValueError, "old_log_probs"),
        (dict(ref_log_probs=np.zeros((B, T), np.int32), beta=0.1), TypeError, "ref_log_probs"),
    ],
)
def test_bad_policy_inputs(put, kwargs, error, match):
    hidden, weight, tokens, adv = _policy_args(put)
    with pytest.raises(error, match=match):
        linear_policy_loss(hidden, weight, tokens, adv, **{"backend": "kernel", **kwargs})


def test_bad_policy_arrays(put):
    hidden, weight, tokens, adv = _policy_args(put)
    with pytest.raises(ValueError, match="advantages"):
        linear_policy_loss(hidden, weight, tokens, adv[:2])
    with pytest.raises(TypeError, match="advantages"):
        linear_policy_loss(hidden, weight, tokens, jnp.ones((B,), jnp.int32))
    with pytest.raises(ValueError, match="tokens"):
        linear_policy_loss(hidden, weight, tokens[:, :2], adv)
    with pytest.raises(TypeError, match="tokens"):
        linear_policy_loss(hidden, weight, tokens.astype(jnp.float32), adv)
    with pytest.raises(ValueError, match=r"\(B, T, H\)"):
        linear_policy_loss(hidden.reshape(B * T, H), weight, tokens.reshape(-1), adv)
    with pytest.raises(ValueError, match="weight"):
        linear_policy_loss(hidden, weight[:, :3], tokens, adv)


@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_bad_objective(put, backend):
    hidden, weight, tokens, _ = _policy_args(put)
    kw = dict(backend=backend, workspace_bytes=WORKSPACE)
    with pytest.raises(ValueError, match="objective"):
        linear_token_objective(hidden, weight, tokens, lambda lp, h: jnp.sum(lp), **kw)
    with pytest.raises(TypeError, match="objective"):
        linear_token_objective(hidden, weight, tokens, lambda lp, h: lp > 0, **kw)
    with pytest.raises(TypeError, match="objective"):
        linear_token_objective(hidden, weight, tokens, None, **kw)
    with pytest.raises(ValueError, match="inputs"):
        linear_token_objective(hidden, weight, tokens, lambda lp, h, a: a * lp, (jnp.ones((B,)),), **kw)
    with pytest.raises(TypeError, match="inputs"):
        linear_token_objective(hidden, weight, tokens, lambda lp, h, a: a * lp, jnp.ones((B, T)), **kw)
    with pytest.raises(TypeError, match="with_entropy"):
        linear_token_objective(hidden, weight, tokens, lambda lp, h: lp, with_entropy=1, **kw)
