"""fastce_torch.liger.LigerFusedLinearGRPOLoss against Liger-Kernel 0.8.5's own math: its
LigerFusedLinearGRPOFunction.ppo_loss_fn applied to float64 log-probs of materialised logits (loss, metrics, and the
gradients of hidden, weight, bias by autograd through them) and its whole module (compiled=False: plain torch, runs
on the CPU) when liger_kernel imports; without it, its formulas as liger_ppo_loss_fn below states them (checked against
the real one when liger_kernel imports). Also Liger's
signatures and every refusal's message. The kernels on the `device` fixture's device (CPU: Triton's interpreter)."""

import inspect

import numpy as np
import pytest
import torch

from fastce_torch import liger
from fastce_torch.core.launch import INTERPRETED

try:  # the wheel is pure Python apart from its Triton kernels, which the chunked GRPO loss does not use
    from liger_kernel.chunked_loss.grpo_loss import LigerFusedLinearGRPOFunction as RealFunction
    from liger_kernel.chunked_loss.grpo_loss import LigerFusedLinearGRPOLoss as RealLoss
except ImportError:  # pragma: no cover - depends on the environment
    RealFunction = RealLoss = None

pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value:RuntimeWarning", "ignore:Conversion of an array:DeprecationWarning"
)
needs_liger = pytest.mark.skipif(RealFunction is None, reason="liger_kernel is not importable")

B, T, H, V = 3, 6, 16, 40
CHUNK = dict(workspace_bytes=5 * V * 4)  # 5 rows per chunk: 4 chunks over the 18 rows
RATIOS = (0.3, 0.62, 0.97, 1.0, 1.07, 1.45, 3.0)  # outside the clip range on both sides, inside, exactly 1


def problem(seed=0):
    """(hidden, weight, bias) float32 leaves, tokens, an integer attention mask (right padding), advantages of both
    signs and zero, old log-probs placed so that the ratios are RATIOS, reference log-probs near the policy's."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) / H**0.5 * 2
    bias = torch.randn(V, generator=gen) * 0.3
    tokens = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.int64)
    mask[1, 4:] = 0
    mask[2, 5] = 0
    advantages = torch.tensor([1.3, -0.7, 0.0])
    logp = log_probs(hidden.double(), weight.double(), bias.double(), tokens, 1.0).detach()
    old = (logp - torch.tensor(np.resize(np.array(RATIOS), (B, T))).log()).float()
    ref = (logp + torch.tensor(np.resize(np.array([-0.4, 0.2, 0.7, -0.1, 0.05]), (B, T)))).float()
    return [t.requires_grad_() for t in (hidden, weight, bias)], tokens, mask, advantages, old, ref


def log_probs(hidden, weight, bias, tokens, temperature):
    logits = (hidden @ weight.T + bias) / temperature
    return torch.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def liger_ppo_loss_fn(
    per_token_logps, attention_mask, advantages, full_attention_mask, ref_per_token_logps=None,
    old_per_token_logps=None, epsilon_low=0.2, epsilon_high=0.2, beta=0.04, loss_type="dapo",
    max_completion_length=None, delta=None, num_items_in_batch=None, **unused,
):  # fmt: skip
    """Liger 0.8.5's GRPO loss and metrics on given log-probs (token level, one process), written here from its
    documented formulas: TRL's per-token clipped ratio (cispo: the detached capped ratio times A log p), the k3 KL,
    the loss type's normaliser, and its two metrics (the KL and the clipped fraction, the ratio taken before the
    delta clamp) over the full mask's token count."""
    logp, m, a = per_token_logps, attention_mask, advantages[:, None]
    ref = logp.detach() if ref_per_token_logps is None else ref_per_token_logps
    ratio = torch.exp(logp - (logp.detach() if old_per_token_logps is None else old_per_token_logps))
    if loss_type == "cispo":
        clipped = (ratio > epsilon_high) & (a > 0)
        terms = -ratio.clamp(max=epsilon_high).detach() * a * logp
    else:
        clipped = ((ratio < 1 - epsilon_low) & (a < 0)) | ((ratio > 1 + epsilon_high) & (a > 0))
        capped = ratio if delta is None else ratio.clamp(max=delta)
        terms = -torch.min(capped * a, ratio.clamp(1 - epsilon_low, 1 + epsilon_high) * a)
    kl = torch.exp(ref - logp) - (ref - logp) - 1.0
    if beta != 0.0:
        terms = terms + beta * kl
    rows, tokens = full_attention_mask.shape[0], full_attention_mask.sum().clamp(min=1.0)
    if loss_type == "grpo":
        loss = ((terms * m).sum(-1) / m.sum(-1).clamp(min=1.0)).sum() / rows
    else:
        divisor = {
            "bnpo": tokens,
            "dr_grpo": rows * (max_completion_length or 1),
        }.get(loss_type, torch.tensor(float(num_items_in_batch if num_items_in_batch is not None else m.sum())))
        loss = (terms * m).sum() / torch.as_tensor(divisor, dtype=torch.float32).clamp(min=1.0)
    metrics = [(kl * m).sum() / tokens] if beta != 0.0 else []
    return loss, [*metrics, (clipped * m).sum() / tokens]


PPO_LOSS_FNS = [pytest.param(liger_ppo_loss_fn, id="formulas")]
PPO_LOSS_FNS.append(pytest.param(RealFunction and RealFunction.ppo_loss_fn, id="liger", marks=needs_liger))

CASES = {
    "grpo-kl-temperature": dict(loss_type="grpo", beta=0.04, temperature=0.7),
    "bnpo-clip-higher": dict(loss_type="bnpo", beta=0.0, epsilon_high=0.28),
    "dr_grpo-delta": dict(loss_type="dr_grpo", beta=0.0, max_completion_length=8, delta=1.5),
    "dapo-kl": dict(loss_type="dapo", beta=0.04),
    "dapo-num_items": dict(loss_type="dapo", beta=0.0, num_items_in_batch=29),
    "cispo-kl": dict(loss_type="cispo", beta=0.04, epsilon_high=1.2),
    "grpo-no-ref-model": dict(loss_type="grpo", beta=0.04, use_ref_model=False),
}
CALL_ONLY = ("num_items_in_batch",)  # forward arguments; the rest are the constructor's


def liger_expected(ppo_loss_fn, leaves, tokens, mask, advantages, old, ref, case):
    """Liger's loss and metrics on float64 log-probs, and autograd's gradients through them (float64)."""
    hidden, weight, bias = (t.detach().double().requires_grad_() for t in leaves)
    settings = {k: v for k, v in case.items() if k not in ("temperature", "use_ref_model")}
    logp = log_probs(hidden, weight, bias, tokens, case.get("temperature", 1.0))
    ref = ref.double() if case.get("use_ref_model", True) else None
    mask = mask.double()
    loss, metrics = ppo_loss_fn(
        per_token_logps=logp, attention_mask=mask, advantages=advantages.double(), full_attention_mask=mask,
        ref_per_token_logps=ref, old_per_token_logps=old.double(), **settings,
    )  # fmt: skip
    return loss, metrics, torch.autograd.grad(loss, [hidden, weight, bias])


def fastce_call(leaves, tokens, mask, advantages, old, ref, case, backend="kernel", flat_input=False, **extra):
    """The drop-in's (loss, metrics, grads) from Liger's constructor and forward arguments."""
    init = {k: v for k, v in case.items() if k not in CALL_ONLY}
    loss_fn = liger.LigerFusedLinearGRPOLoss(**init, backend=backend, **extra)
    hidden, weight, bias = leaves
    _input = hidden.reshape(B * T, H) if flat_input else hidden
    loss, metrics = loss_fn(
        _input, weight, tokens, mask, advantages, bias=bias, ref_per_token_logps=ref, old_per_token_logps=old,
        num_items_in_batch=case.get("num_items_in_batch"),
    )  # fmt: skip
    return loss, metrics, torch.autograd.grad(loss, leaves)


def close(got, want, what, rtol=2e-5):
    got, want = got.detach().double().cpu().numpy(), want.detach().double().cpu().numpy()
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * max(np.abs(want).max(), 1e-3), err_msg=what)


def check(got, want):
    (loss, metrics, grads), (want_loss, want_metrics, want_grads) = got, want
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert isinstance(metrics, tuple) and len(metrics) == len(want_metrics)
    close(loss, want_loss, "loss")
    for i, (metric, want_metric) in enumerate(zip(metrics, want_metrics)):
        assert metric.dtype == torch.float32 and metric.dim() == 0 and not metric.requires_grad
        close(metric, want_metric, f"metric {i}")
    for name, grad, want_grad in zip(("hidden", "weight", "bias"), grads, want_grads):
        close(grad, want_grad, f"d {name}", rtol=1e-4)


@pytest.mark.parametrize("ppo_loss_fn", PPO_LOSS_FNS)
@pytest.mark.parametrize("name", list(CASES))
def test_against_liger_ppo_loss_fn(device, ppo_loss_fn, name):
    leaves, *rest = problem()
    want = liger_expected(ppo_loss_fn, leaves, *rest, CASES[name])
    leaves = [t.detach().to(device).requires_grad_() for t in leaves]
    got = fastce_call(leaves, *(t.to(device) for t in rest), CASES[name], **CHUNK)
    check(got, want)


def test_reference_backend_and_flat_input():
    """backend="reference" (plain torch) and Liger's docstring's (B*T, H) _input give the same answer."""
    leaves, *rest = problem(seed=1)
    case = CASES["grpo-kl-temperature"]
    want = liger_expected(liger_ppo_loss_fn, leaves, *rest, case)
    check(fastce_call(leaves, *rest, case, backend="reference", flat_input=True), want)


@needs_liger
def test_formulas_are_liger_s():
    leaves, tokens, mask, advantages, old, ref = problem(seed=2)
    for case in CASES.values():
        got = liger_expected(liger_ppo_loss_fn, leaves, tokens, mask, advantages, old, ref, case)
        want = liger_expected(RealFunction.ppo_loss_fn, leaves, tokens, mask, advantages, old, ref, case)
        check((got[0].float(), tuple(m.detach().float() for m in got[1]), got[2]), want)


@needs_liger
@pytest.mark.parametrize("name", ["grpo-kl-temperature", "dapo-num_items", "cispo-kl", "dr_grpo-delta"])
def test_against_liger_s_module(name):
    """Liger's own LigerFusedLinearGRPOLoss (compiled=False: plain torch on the CPU), float32, the same call."""
    leaves, tokens, mask, advantages, old, ref = problem(seed=3)
    case = CASES[name]
    init = {k: v for k, v in case.items() if k not in CALL_ONLY}
    real = RealLoss(**init, compiled=False)
    loss, metrics = real(
        leaves[0], leaves[1], tokens, mask, advantages, bias=leaves[2], ref_per_token_logps=ref,
        old_per_token_logps=old, num_items_in_batch=case.get("num_items_in_batch"),
    )  # fmt: skip
    want = (loss, tuple(metrics), torch.autograd.grad(loss, leaves))
    # Liger's module runs on the CPU; there fastce's kernels need Triton's interpreter (a GPU machine: the reference).
    backend = "kernel" if INTERPRETED else "reference"
    check(fastce_call(leaves, tokens, mask, advantages, old, ref, case, backend=backend, **CHUNK), want)


# Liger-Kernel 0.8.5's parameter names, in order (liger_kernel/chunked_loss/grpo_loss.py).
LIGER_085 = {
    "__init__": "beta compiled use_ref_model chunk_size epsilon_low epsilon_high loss_type max_completion_length "
    "importance_sampling_level sapo_temperature_pos sapo_temperature_neg temperature delta use_bias_correction_kl "
    "vespo_k_pos vespo_lambda_pos vespo_k_neg vespo_lambda_neg",
    "forward": "_input lin_weight selected_token_ids attention_mask advantages bias ref_per_token_logps "
    "old_per_token_logps ref_input ref_weight ref_bias vllm_is_ratio num_items_in_batch",
}
FUNCTION_085 = (
    "_input weight selected_token_ids attention_mask advantages bias ref_per_token_logps old_per_token_logps "
    "ref_input ref_weight ref_bias beta epsilon_low epsilon_high loss_type max_completion_length "
    "importance_sampling_level sapo_temperature_pos sapo_temperature_neg temperature compiled use_ref_model "
    "chunk_size vllm_is_ratio delta use_bias_correction_kl vespo_k_pos vespo_lambda_pos vespo_k_neg "
    "vespo_lambda_neg num_items_in_batch"
)


def names_and_defaults(function, skip=("self", "ctx", "cls")):
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    parameters = inspect.signature(function).parameters.values()
    return [(p.name, p.default) for p in parameters if p.kind in kinds and p.name not in skip]


def test_signatures_are_liger_085s():
    for method, names in LIGER_085.items():
        got = names_and_defaults(getattr(liger.LigerFusedLinearGRPOLoss, method))
        assert " ".join(name for name, _ in got) == names, method
        if RealLoss is not None:
            assert got == names_and_defaults(getattr(RealLoss, method)), method
    got = names_and_defaults(liger.LigerFusedLinearGRPOFunction.apply)
    assert " ".join(name for name, _ in got) == FUNCTION_085
    if RealFunction is not None:
        assert got == names_and_defaults(RealFunction.forward)
    assert liger.LigerFusedLinearGRPOLoss().loss_type == "dapo"  # Liger's defaults: dapo, beta 0.04


REFUSALS = [
    (dict(loss_type="sapo"), "loss_type='sapo'.*linear_token_objective"),
    (dict(loss_type="luspo"), "loss_type='luspo'.*linear_token_objective"),
    (dict(loss_type="vespo"), "loss_type='vespo'.*linear_log_probs"),
    (dict(loss_type="gspo"), "Unknown loss type"),
    (dict(importance_sampling_level="sequence"), 'importance_sampling_level="sequence".*linear_log_probs'),
    (dict(importance_sampling_level="batch"), "Unknown importance sampling level"),
    (dict(use_bias_correction_kl=True), "use_bias_correction_kl=True.*linear_token_objective"),
    (dict(delta=0.0), "delta must be positive"),
    (dict(sapo_temperature_pos=0.0), "sapo_temperature_pos must be positive"),
]


@pytest.mark.parametrize("settings, message", REFUSALS)
def test_refused_settings(settings, message):
    with pytest.raises(ValueError, match=message):
        liger.LigerFusedLinearGRPOLoss(**settings)


def test_refused_arguments():
    leaves, tokens, mask, advantages, old, ref = problem()
    hidden, weight, bias = leaves
    loss_fn = liger.LigerFusedLinearGRPOLoss(loss_type="grpo", backend="reference")
    with pytest.raises(ValueError, match="ref_input.*linear_log_probs.*ref_per_token_logps"):
        loss_fn(hidden, weight, tokens, mask, advantages, ref_input=hidden.detach(), ref_weight=weight.detach())
    with pytest.raises(ValueError, match="ref_per_token_logps or ref_input must be provided"):
        loss_fn(hidden, weight, tokens, mask, advantages)
    with pytest.raises(ValueError, match="vllm_is_ratio.*linear_token_objective"):
        loss_fn(hidden, weight, tokens, mask, advantages, ref_per_token_logps=ref, vllm_is_ratio=torch.ones(B, T))
    with pytest.raises(ValueError, match="max_completion_length"):
        liger.LigerFusedLinearGRPOLoss(loss_type="dr_grpo", beta=0.0)(hidden, weight, tokens, mask, advantages)
    with pytest.raises(TypeError, match="unexpected keyword.*chunk_rows.*workspace_bytes"):
        liger.LigerFusedLinearGRPOLoss(chunk_rows=4)
    with pytest.warns(UserWarning, match="Using ref_per_token_logps"):
        loss_fn(hidden, weight, tokens, mask, advantages, ref_per_token_logps=ref, ref_input=hidden.detach())
