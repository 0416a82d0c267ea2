"""fastce_jax's results against the repository's float64 reference, with its one tolerance model: the logic is
shared_tests' (reference.expected, tolerances.assert_loss / assert_grad); this module only turns arrays into host
float64 arrays. The same names as fastce_torch/tests/checks.py."""

import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from shared_tests import reference, tolerances

# The option sets the kernel and fused linear tests run (each a set of cross_entropy keywords).
OPTION_SETS = {
    "plain": {},
    "smoothing": dict(label_smoothing=0.1),
    "z_loss": dict(z_loss=1e-2),
    "softcap": dict(logit_softcapping=4.0),
    "scaling": dict(logit_scaling=0.5),
    "ignore5": dict(ignore_index=5),
    "all": dict(label_smoothing=0.2, z_loss=1e-3, logit_softcapping=7.0, logit_scaling=1.3),
}


def as_float64(array):
    """The values an array holds (bf16 / fp16 / fp32 are exact in float64), on the host."""
    return np.asarray(jnp.asarray(array).astype(jnp.float32), np.float64)


def expected(logits, labels, reduction="none", n_items=None, upstream=None, **options):
    """The float64 reference on exactly the values the kernels read (logits already rounded to their dtype)."""
    upstream = None if upstream is None else np.asarray(upstream, np.float64)
    return reference.expected(as_float64(logits), np.asarray(labels), reduction, n_items, upstream, **options)


def assert_loss(loss, ref, what="loss"):
    return tolerances.assert_loss(as_float64(loss), ref, what, dtype=loss.dtype)


def assert_grad(grad, ref, what="grad"):
    """The gradient against the reference, in ulps of its own dtype."""
    return tolerances.assert_grad(as_float64(grad), ref, grad.dtype, what)


def run_on_4_cpu_devices(use_gpu, targets, timeout=3000):
    """Runs the tests named in `targets` (pytest node ids or files, relative to the repository root) in one child
    process with 4 CPU devices (XLA's host platform split in four), for tests that need several devices; returns the
    child's pytest output (with the reason of every skip, -rs). One child for every such test of the suite: each
    child pays jax's start and a collection. Skips in a GPU run or where this process already has several devices
    (the tests then run in it directly)."""
    if use_gpu or len(jax.devices("cpu")) >= 2:
        pytest.skip("this process has several devices: the tests run here")
    # The device count added to the caller's XLA flags (CI's among them), not in their place.
    flags = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), "--xla_force_host_platform_device_count=4"]))
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-x", *targets]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-8000:] + done.stderr[-4000:]
    assert re.search(r"\d+ passed", done.stdout) and " failed" not in done.stdout, done.stdout[-3000:]
    return done.stdout
