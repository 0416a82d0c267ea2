"""fastce_torch.linear_policy_loss (the GRPO-family presets) and linear_token_objective against the float64
references (shared_tests/reference_policy.py; autograd through float64 materialised logits) and against TRL's own
GRPOTrainer._compute_loss; bad inputs; gradients computed in the forward; torch.compile(fullgraph=True) through the
presets' custom op. The kernels on the `device` fixture's device (CPU: Triton's interpreter), small shapes, several
chunks per call (workspace_bytes)."""

import math
import sys
import types

import numpy as np
import pytest
import torch

from fastce_torch import PolicyLossOutput, linear_policy_loss, linear_token_objective
from shared_tests import reference_policy as rp
from shared_tests.reference import Options, linear_log_probs

pytestmark = pytest.mark.filterwarnings(
    "ignore:divide by zero:RuntimeWarning",
    "ignore:invalid value:RuntimeWarning",
    "ignore:overflow:RuntimeWarning",
    "ignore:Conversion of an array:DeprecationWarning",
)

IGNORE = -100
B, T, H, V = 3, 6, 16, 40
CHUNK = dict(workspace_bytes=5 * V * 4)  # 5 rows per chunk: 4 chunks over the 18 rows
RATIOS = (0.3, 0.62, 0.97, 1.0, 1.07, 1.45, 3.0)  # far outside the clip range on both sides, inside, and exactly 1


def f64(t):
    return None if t is None else t.detach().cpu().double().numpy()


def problem(device, seed=0, ce=None, dtype=torch.float32):
    """Leaves (hidden, weight, bias), tokens with ignored ones, advantages of both signs and zero, a float mask, and
    old / ref log-probs placed so that the ratios are RATIOS (the float64 log-probs shifted)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) / H**0.5 * 2
    bias = torch.randn(V, generator=gen) * 0.3
    tokens = torch.randint(0, V, (B, T), generator=gen)
    tokens[0, 2] = tokens[2, 5] = IGNORE
    advantages = torch.tensor([1.3, -0.7, 0.0])
    mask = torch.ones(B, T)
    mask[1, 4] = 0.0
    mask[2, 0] = 0.5
    ce = Options() if ce is None else ce
    logp = linear_log_probs(f64(hidden), f64(weight), tokens.numpy(), bias=f64(bias), opts=ce).logits.logprobs
    ratios = np.resize(np.array(RATIOS), (B, T))
    old = torch.tensor(logp - np.log(ratios), dtype=torch.float32)
    ref = torch.tensor(logp + np.resize(np.array([-0.4, 0.2, 0.7, -0.1, 0.05]), (B, T)), dtype=torch.float32)
    leaves = [t.to(device=device, dtype=dtype).requires_grad_() for t in (hidden, weight, bias)]
    rest = [t.to(device) for t in (tokens, advantages, mask, old, ref)]
    return (*leaves, *rest)


def run(hidden, weight, bias, tokens, advantages, **kwargs):
    out = linear_policy_loss(hidden, weight, tokens, advantages, bias=bias, **kwargs)
    assert isinstance(out, PolicyLossOutput)
    grads = torch.autograd.grad(out.loss, [hidden, weight, bias])
    return out, grads


def expected(hidden, weight, bias, tokens, advantages, policy, ce, **kwargs):
    return rp.linear_policy_loss(
        f64(hidden), f64(weight), tokens.cpu().numpy(), f64(advantages), bias=f64(bias), opts=policy, ce_opts=ce,
        **{k: f64(v) for k, v in kwargs.items()},
    )  # fmt: skip


def close(got, want, what, rtol=1e-4):
    got, want = np.asarray(f64(got) if isinstance(got, torch.Tensor) else got), np.asarray(want)
    scale = np.nanmax(np.abs(want)) if want.size and np.isfinite(want).any() else 1.0
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale + 1e-6, err_msg=what)


def check(out, grads, ref):
    close(out.loss, ref.policy.loss, "loss")
    for name in ("kl", "entropy", "clip_ratio_low", "clip_ratio_high", "clip_ratio_region"):
        value = getattr(out, name)
        assert value.dtype == torch.float32 and not value.requires_grad, name
        close(value, getattr(ref.policy, name), name)
    for got, want, name in zip(grads, (ref.grad_hidden, ref.grad_weight, ref.grad_bias), ("hidden", "weight", "bias")):
        close(got, want, f"d {name}")


CASES = [
    dict(),
    dict(beta=0.05, entropy_coef=0.01, temperature=0.7, epsilon_high=0.28),
    dict(delta=1.3, logit_softcapping=2.5, logit_scaling=1.2, num_items_in_batch=11),
    dict(beta=0.1, with_old=False, temperature=1.6),
]


def split(case, loss_type):
    """(linear_policy_loss keywords, PolicyOptions, the transform's Options, with old_log_probs)."""
    case = dict(case)
    with_old = case.pop("with_old", True)
    ce = Options(**{k: case.pop(k) for k in ("temperature", "logit_softcapping", "logit_scaling") if k in case})
    policy = rp.PolicyOptions(loss_type=loss_type, max_completion_length=8, **case)
    kwargs = dict(policy.as_kwargs(), loss_type=loss_type, **{k: v for k, v in ce.as_kwargs().items() if v})
    kwargs.pop("ignore_index", None)
    return kwargs, policy, ce, with_old


@pytest.mark.parametrize("backend", ["kernel", "reference"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "defaults")
@pytest.mark.parametrize("loss_type", rp.LOSS_TYPES)
def test_presets_match_float64(loss_type, case, backend, device):
    kwargs, policy, ce, with_old = split(case, loss_type)
    hidden, weight, bias, tokens, advantages, mask, old, ref = problem(device, ce=ce)
    inputs = dict(mask=mask, ref_log_probs=ref, old_log_probs=old if with_old else None)
    out, grads = run(hidden, weight, bias, tokens, advantages, backend=backend, **CHUNK, **kwargs, **inputs)
    check(out, grads, expected(hidden, weight, bias, tokens, advantages, policy, ce, **inputs))
    if with_old and loss_type != "cispo":  # the ratios cross both clip boundaries
        assert 0 < out.clip_ratio_low < out.clip_ratio_region and 0 < out.clip_ratio_high < out.clip_ratio_region


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_defaults_and_per_token_advantages(loss_type, device):
    """No mask (tokens != ignore_index), no old log-probs (ratio 1), (B, T) advantages, weight_layout="hv", one
    chunk; the kernel path against the float64 reference and the plain-torch path."""
    hidden, weight, bias, tokens, _, _, _, _ = problem(device, seed=1)
    advantages = torch.randn(B, T, generator=torch.Generator().manual_seed(3)).to(device)
    kernel, kernel_grads = run(hidden, weight, bias, tokens, advantages, loss_type=loss_type, backend="kernel")
    policy = rp.PolicyOptions(loss_type=loss_type)
    check(kernel, kernel_grads, expected(hidden, weight, bias, tokens, advantages, policy, Options()))
    assert kernel.clip_ratio_region == 0.0 and kernel.kl == 0.0
    kernel_t = weight.detach().t().contiguous().requires_grad_()
    out = linear_policy_loss(hidden, kernel_t, tokens, advantages, bias=bias, loss_type=loss_type,
                             weight_layout="hv", backend="kernel")  # fmt: skip
    (grad_t,) = torch.autograd.grad(out.loss, [kernel_t])
    close(grad_t.t(), f64(kernel_grads[1]), "d weight, hv layout")


def test_nan_advantage_poisons_its_own_tokens_only(device):
    hidden, weight, bias, tokens, advantages, mask, old, _ = problem(device)
    advantages = advantages.clone()
    advantages[1] = float("nan")
    mask = mask.clone()
    mask[1, 1:] = 0.0  # one kept token of row 1
    out, (grad_hidden, grad_weight, _) = run(
        hidden, weight, bias, tokens, advantages, mask=mask, old_log_probs=old, backend="kernel", **CHUNK
    )
    assert torch.isnan(out.loss)
    assert torch.isnan(grad_hidden[1, 0]).all()
    rows = torch.ones(B, T, dtype=torch.bool)
    rows[1, 0] = False
    assert torch.isfinite(grad_hidden[rows]).all()
    for name in ("clip_ratio_low", "clip_ratio_high", "clip_ratio_region", "entropy"):
        assert torch.isfinite(getattr(out, name)), name
    # The same NaN advantage where every token of its row is masked out changes nothing.
    mask[1] = 0.0
    out, grads = run(hidden, weight, bias, tokens, advantages, mask=mask, old_log_probs=old, backend="kernel")
    assert torch.isfinite(out.loss) and all(torch.isfinite(g).all() for g in grads)


def test_everything_masked_gives_zero(device):
    hidden, weight, bias, tokens, advantages, mask, old, _ = problem(device)
    out, grads = run(hidden, weight, bias, tokens, advantages, mask=torch.zeros_like(mask), backend="kernel")
    assert out.loss == 0.0 and all((g == 0).all() for g in grads)
    assert out.entropy == 0.0 and out.clip_ratio_region == 0.0


def test_gradients_are_computed_in_the_forward(device):
    """The backward scales the stored gradients by the upstream scalar; a second backward raises."""
    hidden, weight, bias, tokens, advantages, mask, old, _ = problem(device)
    kwargs = dict(bias=bias, mask=mask, old_log_probs=old, backend="kernel")
    base = torch.autograd.grad(linear_policy_loss(hidden, weight, tokens, advantages, **kwargs).loss, [hidden])[0]
    loss = linear_policy_loss(hidden, weight, tokens, advantages, **kwargs).loss
    (loss * -2.5).backward(retain_graph=True)
    torch.testing.assert_close(hidden.grad, -2.5 * base)
    with pytest.raises(RuntimeError, match="handed over once"):
        loss.backward()
    with torch.no_grad():
        out = linear_policy_loss(hidden, weight, tokens, advantages, **kwargs)
    assert not out.loss.requires_grad


BAD = [
    (dict(loss_type="ppo"), ValueError, "loss_type"),
    (dict(loss_type="dr_grpo"), ValueError, "max_completion_length"),
    (dict(beta=0.1), ValueError, "ref_log_probs"),
    (dict(epsilon_low=-0.1), ValueError, "epsilon_low"),
    (dict(epsilon_high=float("nan")), TypeError, "epsilon_high"),
    (dict(delta=0.0), ValueError, "delta"),
    (dict(entropy_coef="0.1"), TypeError, "entropy_coef"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(num_items_in_batch="9"), TypeError, "num_items_in_batch"),
    (dict(num_items_in_batch=torch.ones(2)), TypeError, "num_items_in_batch"),
    (dict(backend="triton"), ValueError, "backend"),
    (dict(mask="ones"), ValueError, "mask"),
    (dict(old_log_probs=torch.zeros(B, T + 1)), ValueError, "old_log_probs"),
    (dict(ref_log_probs=torch.zeros(B, T, dtype=torch.int64), beta=0.1), TypeError, "ref_log_probs"),
    (dict(advantages=torch.zeros(B + 1)), ValueError, "advantages"),
    (dict(advantages=None), ValueError, "advantages"),
    (dict(tokens=torch.zeros(B, T, dtype=torch.float32)), TypeError, "labels must be int"),
    (dict(tokens=torch.zeros(B, T + 1, dtype=torch.int64)), ValueError, "leading shape"),
    (dict(hidden=torch.zeros(B * T, H)), ValueError, r"\(B, T, H\)"),
    (dict(weight=torch.zeros(V, H + 1)), ValueError, "weight must be"),
    (dict(weight_layout="vv"), ValueError, "weight_layout"),
]


@pytest.mark.parametrize("change, error, match", BAD, ids=lambda x: str(x)[:40] if isinstance(x, dict) else "")
def test_bad_policy_arguments_are_named(change, error, match, device):
    hidden, weight, bias, tokens, advantages, _, _, _ = problem(device)
    args = dict(hidden=hidden, weight=weight, tokens=tokens, advantages=advantages)
    kwargs = dict(bias=bias, backend="kernel")
    for key, value in change.items():
        target = args if key in args else kwargs
        if key == "tokens" and value.shape[:1] == (B * T,):
            value = value.view(-1)
        if key == "hidden":
            args["tokens"] = tokens.reshape(-1)
        target[key] = value.to(device) if isinstance(value, torch.Tensor) else value
    with pytest.raises(error, match=match):
        linear_policy_loss(args["hidden"], args["weight"], args["tokens"], args["advantages"], **kwargs)


def test_logits_are_computed_once_per_chunk(device, monkeypatch):
    """The gradients are complete after the forward: one logits matmul per chunk there, none in the backward."""
    engine = sys.modules["fastce_torch.linear.engine"]
    calls = []
    original = engine.chunk_logits
    monkeypatch.setattr(engine, "chunk_logits", lambda *args: calls.append(1) or original(*args))
    hidden, weight, bias, tokens, advantages, mask, old, _ = problem(device)
    out = linear_policy_loss(hidden, weight, tokens, advantages, bias=bias, mask=mask, old_log_probs=old,
                             entropy_coef=0.1, backend="kernel", **CHUNK)  # fmt: skip
    assert len(calls) == 4
    out.loss.backward()
    assert len(calls) == 4


def test_bf16_inputs(device):
    hidden, weight, bias, tokens, advantages, mask, old, ref = problem(device, dtype=torch.bfloat16)
    kwargs = dict(mask=mask, old_log_probs=old, ref_log_probs=ref, beta=0.04, entropy_coef=0.01, temperature=0.7)
    out, grads = run(hidden, weight, bias, tokens, advantages, backend="kernel", **CHUNK, **kwargs)
    assert [g.dtype for g in grads] == [torch.bfloat16] * 3
    policy = rp.PolicyOptions(beta=0.04, entropy_coef=0.01)
    want = expected(hidden, weight, bias, tokens, advantages, policy, Options(temperature=0.7), mask=mask,
                    old_log_probs=old, ref_log_probs=ref)  # fmt: skip
    close(out.loss, want.policy.loss, "loss", rtol=2e-2)
    for got, w, name in zip(grads, (want.grad_hidden, want.grad_weight, want.grad_bias), ("hidden", "weight", "bias")):
        close(got, w, f"d {name}", rtol=3e-2)


# --- TRL's own formula --------------------------------------------------------------------------------------------


def trl_loss(loss_type, logp, entropy, advantages, mask, old, ref, beta, entropy_coef, num_items, delta=None):
    """GRPOTrainer._compute_loss itself (TRL 1.16) with a stub trainer in eval mode (no accumulation scaling) whose
    _get_per_token_logps_and_entropies returns the given log-probs and entropies. Returns (loss, metrics)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    identity = lambda x, **_: x  # noqa: E731
    stub = types.SimpleNamespace(
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token", beta=beta,
        loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28, use_vllm=False, aux_loss_enabled=False,
        model=types.SimpleNamespace(training=False), current_gradient_accumulation_steps=1, max_completion_length=8,
        _entropy_bonus_enabled=entropy_coef != 0.0, use_adaptive_entropy=False, entropy_coef=entropy_coef,
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=delta, steps_per_generation=1),
        accelerator=types.SimpleNamespace(num_processes=1, gather=identity, reduce=identity,
                                          gather_for_metrics=identity, sync_gradients=True),
        _metrics={"eval": __import__("collections").defaultdict(list)},
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (logp, entropy, None),
    )  # fmt: skip
    inputs = dict(
        prompt_ids=torch.zeros(B, 1, dtype=torch.long), prompt_mask=torch.ones(B, 1), completion_ids=torch.zeros(
            B, T, dtype=torch.long), completion_mask=mask, advantages=advantages, old_per_token_logps=old,
        ref_per_token_logps=ref, num_items_in_batch=torch.tensor(float(num_items)),
    )  # fmt: skip
    loss = GRPOTrainer._compute_loss(stub, None, inputs)
    return loss, {k: v[-1] for k, v in stub._metrics["eval"].items()}


@pytest.mark.parametrize("loss_type", rp.LOSS_TYPES)
def test_trl_compute_loss(loss_type, device):
    """Our kernel path against GRPOTrainer._compute_loss fed the plain-torch log-probs and entropies (autograd
    through the materialised logits): the loss, the gradients and TRL's logged metrics."""
    pytest.importorskip("trl")
    beta, entropy_coef, num_items = 0.04, 0.02, 13
    hidden, weight, bias, tokens, advantages, mask, old, ref = problem(device)
    kwargs = dict(loss_type=loss_type, epsilon_high=0.28, beta=beta, entropy_coef=entropy_coef,
                  max_completion_length=8, num_items_in_batch=num_items, temperature=0.7)  # fmt: skip
    inputs = dict(mask=mask, old_log_probs=old, ref_log_probs=ref)
    out, grads = run(hidden, weight, bias, tokens, advantages, backend="kernel", **kwargs, **inputs)

    logits = (hidden @ weight.t() + bias).float() / 0.7
    log_p = torch.log_softmax(logits, -1)
    ignored = tokens == IGNORE
    logp = torch.where(ignored, 0.0, log_p.gather(-1, tokens.clamp(min=0)[..., None])[..., 0])
    entropy = torch.where(ignored, 0.0, -(log_p.exp() * log_p).sum(-1))
    trl_mask = torch.where(ignored, 0.0, mask)
    loss, metrics = trl_loss(loss_type, logp, entropy, advantages, trl_mask, old, ref, beta, entropy_coef, num_items)
    want = torch.autograd.grad(loss, [hidden, weight, bias])
    close(out.loss, loss.item(), "loss")
    for got, w, name in zip(grads, want, ("hidden", "weight", "bias")):
        close(got, f64(w), f"d {name}")
    close(out.kl, metrics["kl"], "kl")
    close(out.entropy, metrics["entropy"], "entropy")
    if loss_type == "cispo":
        close(out.clip_ratio_high, metrics["cispo_clip_ratio"], "cispo_clip_ratio")
    else:
        for ours, theirs in (("low", "low_mean"), ("high", "high_mean"), ("region", "region_mean")):
            close(getattr(out, f"clip_ratio_{ours}"), metrics[f"clip_ratio/{theirs}"], ours)


# --- linear_token_objective ---------------------------------------------------------------------------------------


def objective(log_probs, entropy, advantages, weights):
    """An elementwise objective of both statistics (the entropy may be None)."""
    loss = -advantages * log_probs + 0.3 * weights * log_probs**2
    return loss if entropy is None else loss - 0.05 * weights * entropy


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_token_objective_matches_float64_autograd(backend, with_entropy, device):
    hidden, weight, bias, tokens, _, mask, _, _ = problem(device)
    advantages = torch.randn(B, T, generator=torch.Generator().manual_seed(4)).to(device)
    kw = dict(bias=bias, with_entropy=with_entropy, temperature=0.8, logit_softcapping=3.0)
    got = linear_token_objective(hidden, weight, tokens, objective, (advantages, mask), backend=backend, **CHUNK, **kw)
    assert got.dtype == torch.float32 and got.dim() == 0
    grads = torch.autograd.grad(got, [hidden, weight, bias])
    leaves64 = [t.detach().double().requires_grad_() for t in (hidden, weight, bias)]
    kw64 = dict(kw, bias=leaves64[2])
    want = linear_token_objective(*leaves64[:2], tokens, objective, (advantages.double(), mask.double()), **kw64)
    assert want.dtype == torch.float64
    want_grads = torch.autograd.grad(want, leaves64)
    close(got, f64(want), "loss")
    for g, w, name in zip(grads, want_grads, ("hidden", "weight", "bias")):
        close(g, f64(w), f"d {name}")
    # The float64 path is itself autograd through materialised logits: check it once against a hand-written one.
    z = 3.0 * torch.tanh((leaves64[0] @ leaves64[1].t() + leaves64[2]) / 3.0) / 0.8
    log_p = torch.log_softmax(z, -1)
    ignored = tokens == IGNORE
    lp = torch.where(ignored, 0.0, log_p.gather(-1, tokens.clamp(min=0)[..., None])[..., 0])
    ent = torch.where(ignored, 0.0, -(log_p.exp() * log_p).sum(-1)) if with_entropy else None
    manual = torch.where(ignored, 0.0, objective(lp, ent, advantages.double(), mask.double())).sum()
    close(want, f64(manual), "float64 path")


def test_token_objective_gives_inputs_no_gradient(device):
    hidden, weight, bias, tokens, _, mask, _, _ = problem(device)
    advantages = torch.randn(B, T, device=device, requires_grad=True)
    loss = linear_token_objective(hidden, weight, tokens, objective, (advantages, mask), bias=bias, backend="kernel")
    loss.backward()
    assert advantages.grad is None and hidden.grad is not None


@pytest.mark.parametrize(
    "fn, inputs, error, match",
    [
        (lambda lp, h: lp.sum(), (), ValueError, "objective"),
        (lambda lp, h: lp > 0, (), TypeError, "objective"),
        (lambda lp, h: lp.tolist(), (), TypeError, "objective"),
        (lambda lp, h, x: lp * x, (torch.ones(B, T + 1),), ValueError, "inputs"),
        (lambda lp, h, x: lp * x, torch.ones(B, T), TypeError, "inputs"),
        (lambda lp, h, x: lp * x, (torch.ones(B, T, device="meta"),), ValueError, "inputs must be on the tokens"),
        ("not callable", (), TypeError, "objective"),
    ],
)
@pytest.mark.parametrize("backend", ["kernel", "reference"])
def test_token_objective_bad_inputs_are_named(fn, inputs, error, match, backend, device):
    hidden, weight, bias, tokens, _, _, _, _ = problem(device)
    with pytest.raises(error, match=match):
        linear_token_objective(hidden, weight, tokens, fn, inputs, bias=bias, backend=backend)


# --- torch.compile ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", ["grpo", "cispo"])
def test_fullgraph_compile_presets(loss_type, device):
    from fastce_torch.tests.test_compile import ops_in, recording_backend

    hidden, weight, bias, tokens, advantages, mask, old, ref = problem(device)

    def step(h, w, b):
        out = linear_policy_loss(h, w, tokens, advantages, bias=b, mask=mask, old_log_probs=old, ref_log_probs=ref,
                                 loss_type=loss_type, beta=0.04, entropy_coef=0.01, temperature=0.7,
                                 backend="kernel", **CHUNK)  # fmt: skip
        return out.loss * 2.0, out.clip_ratio_region, out.entropy

    def evaluate(fn):
        inputs = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
        loss, *metrics = fn(*inputs)
        return [loss.detach(), *metrics, *torch.autograd.grad(loss, inputs)]

    want = evaluate(step)
    torch._dynamo.reset()
    backend, graphs = recording_backend()
    got = evaluate(torch.compile(step, fullgraph=True, backend=backend))
    torch._dynamo.reset()
    assert "fastce.linear_policy_loss.default" in ops_in(graphs["forward"])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_token_objective_under_compile_runs_eagerly(device):
    hidden, weight, bias, tokens, _, mask, _, _ = problem(device)
    advantages = torch.randn(B, T, generator=torch.Generator().manual_seed(4)).to(device)

    def step(h, w, b):
        return linear_token_objective(h, w, tokens, objective, (advantages, mask), bias=b, backend="kernel") * 0.5

    inputs = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
    want = torch.autograd.grad(step(*inputs), inputs)
    torch._dynamo.reset()
    got = torch.autograd.grad(torch.compile(step, backend="aot_eager")(*inputs), inputs)
    torch._dynamo.reset()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert math.isfinite(float(want[0].sum()))


@pytest.mark.gpu
def test_presets_are_captured_in_a_cuda_graph(device):
    """The GRPO preset with KL and the entropy bonus, forward and backward, captured in a CUDA graph after a warm-up on
    a side stream: the replay gives the eager step's loss, metrics and gradients (no host synchronisation inside)."""
    hidden, weight, bias, tokens, advantages, mask, old, ref = problem(device, seed=7)
    static = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]

    def step():
        out, grads = run(*static, tokens, advantages, mask=mask, old_log_probs=old, ref_log_probs=ref, beta=0.04,
                         entropy_coef=0.01, temperature=0.7, backend="kernel", **CHUNK)  # fmt: skip
        return (out.loss.detach(), out.kl, out.clip_ratio_region, *grads)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    eager = step()
    torch.cuda.synchronize()
    for got, want in zip(captured, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
