"""bench.tools.rl_step on a CPU: a tiny float32 shape through the rows but torch.compile's and Liger's (CUDA), the
kernels interpreted (backend="kernel"), the GPU timers stubbed as in test_linear_bench. Skipped until issue 37's API
(linear_log_probs, temperature, token_weights, a differentiable entropy) is in fastce_torch and fastce_jax."""

import pytest

from bench import jax_setup

jax_setup.configure(interpret_only=True)

import fastce_torch  # noqa: E402
from bench import jax_measure, linear, report, torch_measure  # noqa: E402
from bench.linear_shapes import LinearShape  # noqa: E402
from bench.tools import rl_step  # noqa: E402

pytestmark = [
    # The interpreter evaluates masked-off lanes too (log(0) of an empty partial): numpy warns, the results are fine.
    pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:triton.runtime.interpreter"),
]


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(linear, "DEVICE", "cpu")
    monkeypatch.setattr(torch_measure, "bench_ms", lambda fn, warmup, rep: (fn(), 2.0)[1])
    monkeypatch.setattr(torch_measure, "peak_extra_bytes", lambda fn: (fn(), 3 << 20)[1])
    monkeypatch.setattr(jax_measure, "bench_ms", lambda call, batch_target_ms=50.0: (call(), 4.0)[1])


def test_a_failed_row_is_recorded(on_cpu, monkeypatch):
    """A torch row that raises while measured is a failure record with its shape as text (the GPU run's path for an
    OOM, or for the kernels on CPU tensors); the float32 reference is still returned."""
    loaders = rl_step.torch_implementations

    def out_of_memory(*args):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(rl_step, "torch_implementations", lambda b: loaders(b) | {"oom": lambda: (out_of_memory, None)})
    shape, failures = LinearShape(16, 8, 24, "float32"), []
    inputs = linear.make_inputs(shape)
    rows, reference = rl_step.torch_rows(shape, (*inputs, *rl_step.policy_inputs(*inputs)), ["oom"], "kernel", failures)
    assert rows == [] and reference is not None
    assert failures == [
        {"impl": "oom", "stage": "measure", "error": "RuntimeError: CUDA out of memory", "shape": str(shape)}
    ]


@pytest.mark.skipif(
    not fastce_torch.core.launch.INTERPRETED, reason="the kernels on CPU tensors need TRITON_INTERPRET=1"
)
def test_every_row_on_cpu(on_cpu, tmp_path, monkeypatch):
    # 16 rows: the interpreter runs one program per row, so the rows are the test's time.
    shape = LinearShape(16, 16, 96, "float32")
    # The "grpo" rows' sequences: 4 of 4 tokens with 0 or 1 ignored (rows 0, 7 and 14), so that its per-sequence
    # normalisation counts.
    monkeypatch.setattr(rl_step, "SEQUENCE", 4)
    # One workspace setting (the others take the same path); torch.compile's and Liger's rows are the GPU run's.
    skipped = ("trl_compile", "liger_grpo", "fastce_torch_ws1GiB", "fastce_torch_ws4GiB")
    impls = [i for i in rl_step.torch_implementations("kernel") if i not in skipped]
    result = rl_step.run((shape,), impls=impls, backend="kernel")
    assert result["failures"] == []
    rows = {r["impl"]: r for r in result["rows"]}
    new_jax = [f"fastce_jax_{suffix}" for suffix in ("ce_mean", "grpo", "objective")]
    assert set(rows) == {*impls, "fastce_jax", "xla_log_softmax", *new_jax}
    # float32 inputs: the log-probs within float32 rounding of float64, and the rows computing the objective give its
    # float32 value and gradients (the entropy bonus's gradient included).
    for impl in ("fastce_torch", "fastce_torch_f32_logits", "fastce_torch_no_entropy", "trl_eager", "fastce_jax"):
        assert rows[impl]["logprob_error"] < 1e-5, impl
    # Issue 47's rows: linear_token_objective with the objective per token against the objective's float32
    # reference, linear_policy_loss's "grpo" preset (KL, per-sequence normalisation) against its own.
    torch_rows = ("fastce_torch_f32_logits", "fastce_torch_ws256MiB", "fastce_torch_objective", "fastce_torch_grpo")
    for impl in ("fastce_torch", "trl_eager", *torch_rows):
        assert rows[impl]["loss_rel"] < 1e-5 and rows[impl]["grad_hidden_rel_rms"] < 1e-4, impl
    jax_rows = ("fastce_jax", "xla_log_softmax", "fastce_jax_objective", "fastce_jax_grpo")
    for impl in ("fastce_torch", "trl_eager", *torch_rows[1:], *jax_rows):
        assert rows[impl]["grad_weight_rel_rms"] < 1e-4 and rows[impl]["grad_hidden_rel_rms"] < 1e-4, impl
    for impl in jax_rows:
        assert rows[impl]["ok"], impl  # the loss within rounding of its float32 reference
    assert abs(rows["fastce_jax_grpo"]["loss"] - rows["fastce_torch_grpo"]["loss"]) < 1e-5
    assert abs(rows["fastce_torch_grpo"]["loss"] - rows["fastce_torch"]["loss"]) > 1e-4  # another loss
    assert abs(rows["fastce_jax_objective"]["loss"] - rows["trl_eager"]["loss"]) < 1e-5
    assert "grad_hidden_rel_rms" not in rows["fastce_torch_no_entropy"]  # another objective
    assert rows["fastce_torch_ce_mean"]["of_ce_mean"] == 1.0
    assert abs(rows["fastce_jax"]["loss"] - rows["trl_eager"]["loss"]) < 1e-5
    assert abs(rows["xla_log_softmax"]["loss"] - rows["trl_eager"]["loss"]) < 1e-5
    assert abs(rows["fastce_torch_no_entropy"]["loss"] - rows["fastce_torch"]["loss"]) > 1e-4  # the bonus counts
    # The RESULTS.md section: the newest rl-step JSON, the table and the targets.
    report.write_json(result, tmp_path / "2026-12-04-h200-rl-step-a-0000000.json")
    (found,) = report.newest_runs("*-rl-step-*.json", tmp_path)
    text = report.rl_markdown(report.read_json(found), found.name)
    assert "| fastce_torch | 16 | 16 | 96 |" in text and '/ "mean": 1.000x (target <= 1.35x)' in text
    assert 'linear_policy_loss "grpo" (KL, entropy) / "mean": 1.000x (target <= 1.05x)' in text
    assert 'JAX "grpo" / XLA\'s full logits: 1.000x (target < 1x)' in text
