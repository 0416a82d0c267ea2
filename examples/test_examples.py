"""The examples run, small, on the CPU: fastce_jax's kernels in Pallas interpret mode against the XLA loss."""

import importlib.util
import json
import pathlib

import pytest

pytest.importorskip("optax", reason="the JAX example trains with optax")
pytest.importorskip("fastce_jax", reason="fastce_jax (the Pallas package) is not importable")

HERE = pathlib.Path(__file__).parent
SMALL = ["--steps", "12", "--batch", "4", "--seq-len", "16", "--layers", "1", "--dim", "32", "--vocab", "1000"]


def load(name):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_training_curves_match_xla(tmp_path, dtype):
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
