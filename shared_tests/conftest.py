"""Fixtures of the shared (torch <-> JAX) suite.

Without --gpu: CPU tensors, fastce_torch through Triton's interpreter, fastce_jax through Pallas interpret mode.
With --gpu (the repository conftest.py defines it): CUDA tensors, handed to JAX GPU arrays through DLPack on the
device, compiled kernels in both packages.
"""

import json
import os

# Both frameworks share one GPU: JAX must not grab 75% of its memory when its backend starts. The variable is read
# when the GPU client is created (first device use, not import), and conftest files are imported at collection,
# before any test runs. Set before anything below imports jax all the same.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# fastce_torch must be imported before triton: on a machine without CUDA it switches Triton's interpreter on.
import fastce_torch  # noqa: E402,F401
from fastce_torch.core import launch as _torch_launch  # noqa: E402

from . import summary  # noqa: E402


@pytest.fixture(scope="session")
def device(request):
    if request.config.getoption("--gpu"):
        if not torch.cuda.is_available():
            pytest.fail("--gpu given but torch sees no CUDA device")
        try:
            import jax
        except ImportError:
            return torch.device("cuda")
        if not any(d.platform == "gpu" for d in jax.devices()):
            pytest.fail("--gpu given but JAX sees no GPU (is jax[cuda] installed?)")
        return torch.device("cuda")
    if not _torch_launch.INTERPRETED:
        pytest.skip(
            "CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before triton is imported); "
            "on a CUDA machine run with --gpu"
        )
    return torch.device("cpu")


COLUMNS = [
    ("max|loss diff|", "loss_abs_diff", ".3e"),
    ("max|grad diff|", "grad_abs_diff", ".3e"),
    ("grad ulps", "grad_diff_ulps", ".1f"),
    ("pair tol used", "pair_tol_used", ".2f"),
    ("torch-ref used", "torch_ref_tol_used", ".2f"),
    ("jax-ref used", "jax_ref_tol_used", ".2f"),
]


def pytest_sessionfinish(session):
    workeroutput = getattr(session.config, "workeroutput", None)  # a pytest-xdist worker: hand the summary over
    if workeroutput is not None:
        workeroutput["fastce_summary"] = json.dumps(summary.RESULTS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: fold each worker's summary into this process's."""
    for dtype, entry in json.loads(getattr(node, "workeroutput", {}).get("fastce_summary", "{}")).items():
        cases = entry.pop("cases")
        summary.record(dtype, entry.pop("device"), entry)
        summary.RESULTS[dtype]["cases"] += cases - 1


def pytest_terminal_summary(terminalreporter):
    if not summary.RESULTS:
        return
    write = terminalreporter.write_line
    terminalreporter.section("fastce: torch vs jax, largest differences per dtype")
    write(f"{'dtype':<10}{'device':<7}{'cases':>6}" + "".join(f"{title:>16}" for title, _, _ in COLUMNS))
    for dtype in sorted(summary.RESULTS):
        r = dict(summary.RESULTS[dtype])
        for what in ("pair", "torch_ref", "jax_ref"):
            r[f"{what}_tol_used"] = max(r.get(f"{what}_loss_tol_used", 0.0), r.get(f"{what}_grad_tol_used", 0.0))
        write(
            f"{dtype:<10}{r['device']:<7}{r['cases']:>6}"
            + "".join(f"{r.get(key, float('nan')):>16{fmt}}" for _, key, fmt in COLUMNS)
        )
    write("(absolute differences; 'tol used' = largest |difference| / tolerance, 1.00 = at the limit)")
    path = os.environ.get("FASTCE_SHARED_SUMMARY")
    if path:
        with open(path, "w") as f:
            json.dump(summary.RESULTS, f, indent=2, sort_keys=True)
        write(f"written to {path}")
