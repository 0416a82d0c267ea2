"""The examples run, small, on the CPU: fastce_jax's kernels in Pallas interpret mode against the XLA loss; the GRPO
steps (examples/grpo_torch.py, grpo_jax.py) through linear_policy_loss's "grpo" preset with a KL penalty and an entropy
bonus, and the same loss as a per-token function through linear_token_objective, against plain log_softmax, step by
step; the
distillation steps (examples/distill_torch.py, distill_jax.py) through linear_jsd against plain log_softmax of both
models' logits, step by step; a Flax NNX model (examples/train_flax_nnx.py) through linear_cross_entropy on its own
(H, V) head against optax's loss."""

import importlib.util
import json
import pathlib

import pytest

HERE = pathlib.Path(__file__).parent
SMALL = ["--steps", "12", "--batch", "4", "--seq-len", "16", "--layers", "1", "--dim", "32", "--vocab", "1000"]


def load(name):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def needs_jax():
    pytest.importorskip("optax", reason="the JAX examples train with optax")
    pytest.importorskip("fastce_jax", reason="fastce_jax (the Pallas package) is not importable")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_training_curves_match_xla(tmp_path, dtype):
    needs_jax()
    example = load("train_tiny_lm_jax")
    out = tmp_path / "curves.json"
    # The fused loss in chunks of 24 rows: 64 tokens per batch make 3 chunks, the last one clamped.
    args = SMALL + ["--backend", "kernel", "--dtype", dtype, "--fused-chunk-rows", "24", "--json", str(out)]
    result = example.main(args)
    assert result["match"], result["max_relative_gap"]
    curves = result["curves"]
    assert set(curves) == {"xla", "fastce", "per_token", "fused"} and all(len(c) == 12 for c in curves.values())
    assert curves["fastce"][-1] < curves["fastce"][0] - 1.0  # it learns (log 1000 -> about log 64)
    assert json.loads(out.read_text())["match"]


def test_flax_nnx_fused_head_matches_optax(tmp_path):
    """A Flax NNX causal LM trained with optax: fastce_jax.linear_cross_entropy(..., where=mask, weight_layout="hv")
    on model.lm_head.kernel gives optax's masked loss at every step (float32 rounding)."""
    needs_jax()
    pytest.importorskip("flax", reason="the example is a Flax NNX model (flax is in the test extra)")
    args = ["--steps", "8", "--batch", "4", "--seq-len", "16", "--layers", "1", "--dim", "32", "--vocab", "1000"]
    result = load("train_flax_nnx").main(args + ["--backend", "kernel", "--json", str(tmp_path / "flax.json")])
    assert result["match"], result["max_relative_gap"]
    curves = result["curves"]
    assert set(curves) == {"optax", "fastce"} and all(len(c) == 8 for c in curves.values())
    assert curves["fastce"][-1] < curves["fastce"][0] - 1.0  # it learns (log 1000 -> towards log 64)


GRPO_SMALL = ["--iterations", "2", "--steps", "3", "--prompts", "2", "--completions", "4", "--length", "6"]


def check_grpo(result, steps=3):
    assert result["match"], (result["max_gap"], result["losses"])
    for losses in result["losses"].values():
        assert len(losses) == 2 * steps
        for start in range(0, len(losses), steps):  # each round's steps lower its objective
            assert losses[start + steps - 1] < losses[start], losses


@pytest.mark.parametrize("objective", ["preset", "custom"])
def test_grpo_torch_step_matches_log_softmax(tmp_path, objective):
    fastce_torch = pytest.importorskip("fastce_torch")
    if not callable(getattr(fastce_torch, "linear_policy_loss", None)):
        pytest.skip("fastce_torch has no linear_policy_loss yet")
    args = GRPO_SMALL + ["--objective", objective, "--backend", "kernel", "--json", str(tmp_path / "grpo.json")]
    check_grpo(load("grpo_torch").main(args))


@pytest.mark.parametrize("objective", ["preset", "custom"])
def test_grpo_jax_step_matches_log_softmax(tmp_path, objective):
    needs_jax()
    if not callable(getattr(__import__("fastce_jax"), "linear_policy_loss", None)):
        pytest.skip("fastce_jax has no linear_policy_loss yet")
    args = GRPO_SMALL + ["--objective", objective, "--backend", "kernel", "--json", str(tmp_path / "grpo.json")]
    check_grpo(load("grpo_jax").main(args))


DISTILL_SMALL = ["--steps", "3", "--batch", "2", "--seq-len", "12", "--vocab", "200", "--teacher-vocab", "208"]


def check_distill(result, steps=3):
    assert result["match"], (result["max_gap"], result["losses"])
    for losses in result["losses"].values():
        assert len(losses) == steps and losses[-1] < losses[0], losses  # the student moves towards the teacher


def test_distill_torch_step_matches_log_softmax(tmp_path):
    fastce_torch = pytest.importorskip("fastce_torch")
    if not callable(getattr(fastce_torch, "linear_jsd", None)):
        pytest.skip("fastce_torch has no linear_jsd yet")
    args = DISTILL_SMALL + ["--backend", "kernel", "--beta", "0.3", "--temperature", "1.5"]
    check_distill(load("distill_torch").main(args + ["--json", str(tmp_path / "distill.json")]))


def test_distill_jax_step_matches_log_softmax(tmp_path):
    needs_jax()
    if not callable(getattr(__import__("fastce_jax"), "linear_jsd", None)):
        pytest.skip("fastce_jax has no linear_jsd yet")
    args = DISTILL_SMALL + ["--backend", "kernel", "--beta", "1.0", "--temperature", "0.8"]
    check_distill(load("distill_jax").main(args + ["--json", str(tmp_path / "distill.json")]))
