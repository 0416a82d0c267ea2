"""bench.tools.jax_dispatch on a CPU: every row, fastce_jax's and plain jax.numpy's, runs eager and jitted, and the
plain rows compute the same loss as fastce_jax's."""

import jax
import numpy as np

from bench.tools import jax_dispatch


def test_every_row_runs_and_plain_rows_agree_with_fastce(capsys):
    jax_dispatch.main(["--backend", "reference", "--number", "1", "--repeat", "1", "--rows", "8", "--vocab", "50"])
    out = capsys.readouterr().out
    for name in ("cross_entropy", "plain cross_entropy", "grad linear_cross_entropy", "grad plain linear + cross"):
        for mode in ("eager", "jit"):
            assert any(line.startswith(name) and f" {mode} " in line for line in out.splitlines()), (name, mode)
    values = {}
    for name, mode, fn, args in jax_dispatch.rows("reference", 8, 50, 16):
        if mode == "jit":
            values[name] = jax.tree_util.tree_leaves(fn(*args))
    for fastce_name, plain_name in (
        ("cross_entropy", "plain cross_entropy"),
        ("grad linear_cross_entropy", "grad plain linear + cross_entropy"),
    ):
        for got, expected in zip(values[fastce_name], values[plain_name], strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-6)
