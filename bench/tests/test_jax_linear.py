"""CPU check of bench.jax_linear's plumbing: every implementation runs (Pallas interpret mode) on a tiny shape,
rows carry the documented keys, the losses agree, and a failing implementation is recorded, not raised."""

import inspect

from bench import jax_setup

jax_setup.configure(interpret_only=True)

import jax  # noqa: E402
import pytest  # noqa: E402

import fastce_jax  # noqa: E402
from bench import jax_linear  # noqa: E402
from bench.linear_shapes import FASTCE_SETTINGS, LinearShape  # noqa: E402

# The _f32acc / _1GiB rows pass their settings as keywords of linear_cross_entropy; a package without them runs
# the default rows only.
KEYWORDS = set(inspect.signature(fastce_jax.linear_cross_entropy).parameters)
IMPLS = tuple(i for i in jax_linear.LINEAR_IMPLS if set(jax_linear.FASTCE_IMPLS.get(i, {})) <= KEYWORDS)

ROW_KEYS = {
    "impl",
    "N",
    "H",
    "V",
    "dtype",
    "fwd_ms",
    "fwdbwd_ms",
    "peak_extra_bytes",
    "extra_beyond_grads_bytes",
    "loss",
}
ROW_KEYS |= {"ok"}


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU plumbing check (the GPU bench runs the rest)")
def test_run_on_cpu():
    shape = LinearShape(40, 16, 300, "float32")
    result = jax_linear.run((shape,), IMPLS, batch_target_ms=1.0, backend="kernel", say=print)
    assert result["failures"] == []
    rows = {r["impl"]: r for r in result["rows"]}
    assert set(rows) == {"jax_three_matmuls", *IMPLS}
    for impl in IMPLS:
        assert ROW_KEYS <= set(rows[impl]) and rows[impl]["ok"] is True, rows[impl]
        assert isinstance(rows[impl]["peak_extra_bytes"], int) and rows[impl]["fwdbwd_ms"] > 0
        # float32 inputs: every implementation is the float32 computation up to float32 rounding.
        assert 0 <= rows[impl]["grad_weight_rel_rms"] < 1e-5 and 0 <= rows[impl]["grad_hidden_rel_rms"] < 1e-5
    assert abs(rows["fastce_jax_linear"]["loss"] - rows["xla_linear"]["loss"]) < 1e-4


def test_failure_is_recorded(monkeypatch):
    def broken(*args, **kwargs):
        raise MemoryError("out of memory")

    monkeypatch.setattr(jax_linear, "measure", broken)
    shape = LinearShape(8, 16, 50, "float32")
    result = jax_linear.run((shape,), ("fastce_jax_linear",), batch_target_ms=1.0, backend="kernel", say=print)
    assert [f["impl"] for f in result["failures"]] == ["fastce_jax_linear"]


def test_every_fastce_setting_is_a_row():
    assert set(jax_linear.FASTCE_IMPLS) == {f"fastce_jax_linear{suffix}" for suffix in FASTCE_SETTINGS}


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU plumbing check (the GPU bench runs the rest)")
def test_ignored_fraction_rows_on_cpu():
    impls = tuple(
        i for i in ("fastce_jax_linear", "fastce_jax_linear_skip") if set(jax_linear.FASTCE_IMPLS[i]) <= KEYWORDS
    )
    shape = LinearShape(40, 16, 300, "float32", ignored=0.5)
    result = jax_linear.run((shape,), impls, batch_target_ms=1.0, backend="kernel", say=print, accuracy=False)
    assert result["failures"] == []
    rows = {r["impl"]: r for r in result["rows"] if r["impl"] != "jax_three_matmuls"}
    assert set(rows) == set(impls) and all(r["ignored"] == 0.5 for r in rows.values())
    losses = [r["loss"] for r in rows.values()]
    assert max(losses) - min(losses) < 1e-5
