"""linear_policy_loss in both packages on the same buffers (torch tensors handed to JAX through DLPack,
exchange.py), backend="kernel" (interpreted on the CPU), against the float64 reference (reference_policy.py) and
against each other: the loss, TRL's metrics and the gradients of hidden, weight and bias. Ratios far outside the clip
range on both sides, ignored tokens, a float mask, temperature and soft-capping, beta and entropy_coef."""

import dataclasses

import numpy as np
import pytest
import torch

from . import exchange, reference, reference_policy
from .harness import optional_jax

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::RuntimeWarning")

fastce_torch = pytest.importorskip("fastce_torch")

B, T, H, V = 3, 6, 16, 67
WORKSPACE = 8 * V * 4  # 8 rows per chunk: several chunks, the last one clamped
METRICS = ("kl", "entropy", "clip_ratio_low", "clip_ratio_high", "clip_ratio_region")
LOSS_TOL = dict(rtol=1e-4, atol=1e-5)
GRAD_RTOL = 1e-3


@dataclasses.dataclass(frozen=True)
class PolicyCase:
    name: str
    policy: reference_policy.PolicyOptions
    ce: reference.Options
    float_mask: bool = False
    seed: int = 0


CASES = [
    PolicyCase(
        "grpo_beta_entropy_t07_softcap",
        reference_policy.PolicyOptions(beta=0.04, entropy_coef=0.05, delta=1.6, epsilon_high=0.28),
        reference.Options(temperature=0.7, logit_softcapping=5.0),
        seed=41,
    ),
    PolicyCase(
        "cispo_float_mask_items",
        reference_policy.PolicyOptions(loss_type="cispo", epsilon_high=2.0, num_items_in_batch=9.0),
        reference.Options(temperature=1.2),
        float_mask=True,
        seed=42,
    ),
]


def _inputs(case, device):
    rng = np.random.default_rng(case.seed)
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    hidden, weight, bias = f32(rng.standard_normal((B, T, H))), f32(rng.standard_normal((V, H)) / 2), f32(
        rng.standard_normal(V) * 0.5
    )  # fmt: skip
    tokens = rng.integers(0, V, (B, T)).astype(np.int32)
    tokens[0, -2:] = case.ce.ignore_index
    adv = f32(rng.standard_normal(B))
    adv[1] = 0.0
    adv[0] = -abs(adv[0]) - 0.5
    mask = f32(rng.uniform(0.2, 1.5, (B, T))) if case.float_mask else None
    current = reference_policy.linear_policy_loss(hidden, weight, tokens, adv, bias=bias, ce_opts=case.ce).logp
    old = f32(current + rng.permutation(np.resize([-1.0, 1.0, -0.05, 0.05], B * T)).reshape(B, T))
    ref = f32(current + rng.uniform(-0.5, 0.5, (B, T)))
    arrays = dict(hidden=hidden, weight=weight, bias=bias, tokens=tokens, advantages=adv, mask=mask, old=old, ref=ref)
    tensors = {k: None if v is None else torch.from_numpy(v).to(device) for k, v in arrays.items()}
    return arrays, tensors


def _kwargs(case):
    kwargs = dict(case.policy.as_kwargs())
    kwargs.update(temperature=case.ce.temperature, logit_softcapping=case.ce.logit_softcapping)
    return dict(kwargs, backend="kernel", workspace_bytes=WORKSPACE)


def _torch_side(t, case):
    params = [t["hidden"].clone().requires_grad_(), t["weight"].clone().requires_grad_(),
              t["bias"].clone().requires_grad_()]  # fmt: skip
    out = fastce_torch.linear_policy_loss(
        params[0], params[1], t["tokens"], t["advantages"], bias=params[2], mask=t["mask"], old_log_probs=t["old"],
        ref_log_probs=t["ref"], **_kwargs(case),
    )  # fmt: skip
    out.loss.backward()
    values = [float(out.loss.detach())] + [float(getattr(out, m)) for m in METRICS]
    return values, [p.grad.detach().cpu().double().numpy() for p in params]


def _jax_side(fastce_jax, t, case):
    import jax

    j = {k: None if v is None else (exchange.labels_to_jax(v) if k == "tokens" else exchange.to_jax(v))
         for k, v in t.items()}  # fmt: skip

    def f(h, w, b):
        out = fastce_jax.linear_policy_loss(
            h, w, j["tokens"], j["advantages"], bias=b, mask=j["mask"], old_log_probs=j["old"],
            ref_log_probs=j["ref"], **_kwargs(case),
        )  # fmt: skip
        return out.loss, out

    with jax.default_matmul_precision("float32"):
        (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(
            j["hidden"], j["weight"], j["bias"]
        )
    values = [float(out.loss)] + [float(getattr(out, m)) for m in METRICS]
    return values, [torch.from_dlpack(g).cpu().double().numpy() for g in grads]


def _close(got, want, rtol, atol, what):
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=rtol, atol=atol,
                               err_msg=what)  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_policy_loss_both_packages(case, device):
    arrays, tensors = _inputs(case, device)
    want = reference_policy.linear_policy_loss(
        arrays["hidden"], arrays["weight"], arrays["tokens"], arrays["advantages"], bias=arrays["bias"],
        mask=arrays["mask"], old_log_probs=arrays["old"], ref_log_probs=arrays["ref"], opts=case.policy,
        ce_opts=case.ce,
    )  # fmt: skip
    assert np.any(want.policy.ratio < 0.5) and np.any(want.policy.ratio > 2.0)
    want_values = [want.policy.loss] + [getattr(want.policy, m) for m in METRICS]
    want_grads = [want.grad_hidden, want.grad_weight, want.grad_bias]
    sides = {}
    if callable(getattr(fastce_torch, "linear_policy_loss", None)):
        sides["torch"] = _torch_side(tensors, case)
    fastce_jax = optional_jax()
    if fastce_jax is not None and callable(getattr(fastce_jax, "linear_policy_loss", None)):
        sides["jax"] = _jax_side(fastce_jax, tensors, case)
    if not sides:
        pytest.skip("no package has linear_policy_loss yet")
    for name, (values, grads) in sides.items():
        for what, got, ref in zip(("loss",) + METRICS, values, want_values):
            _close(got, ref, what=f"{name} {what}", **LOSS_TOL)
        for what, got, ref in zip(("dhidden", "dweight", "dbias"), grads, want_grads):
            scale = np.abs(ref).max()
            _close(got, ref, GRAD_RTOL, GRAD_RTOL * 0.1 * scale, f"{name} {what}")
    if len(sides) < 2:
        pytest.skip(f"only {list(sides)} have linear_policy_loss: checked that side, skipped the pair comparison")
    (tv, tg), (jv, jg) = sides["torch"], sides["jax"]
    for what, a, b in zip(("loss",) + METRICS, tv, jv):
        _close(a, b, what=f"torch vs jax {what}", **LOSS_TOL)
    for what, a, b in zip(("dhidden", "dweight", "dbias"), tg, jg):
        _close(a, b, GRAD_RTOL, GRAD_RTOL * 0.1 * np.abs(a).max(), f"torch vs jax {what}")
