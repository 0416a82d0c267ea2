"""bench/tools/outside_suites.py and its plugin without liger_kernel: the plugin hands Liger's positional arguments to
fastce_torch.liger (whose mapping fastce_torch/tests/test_liger.py checks) and keeps Liger's label assertion, the
pytest summary parser, and the exit without CUDA."""

import subprocess
import sys

import pytest
import torch

from bench.tools import outside_liger_plugin as plugin
from bench.tools import outside_suites


def inputs(n=13, v=37, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, dtype=torch.float64, generator=generator) * 3
    target = torch.randint(0, v, (n,), generator=generator)
    target[:3] = -100
    weight = torch.rand(v, dtype=torch.float64, generator=generator) + 0.25
    return logits, target, weight


def test_plugin_is_fastce_torch_liger():
    """The plugin's adapters are fastce_torch.liger's entry points (whose mapping fastce_torch/tests/test_liger.py
    checks) with the plugin's backend: the same numbers, positional Liger arguments passed through."""
    from fastce_torch import liger

    logits, target, weight = inputs()
    args = (target, weight, -100, 1e-2, 0.1, "mean", 10.0, True, True, True)
    got = plugin.cross_entropy_apply(logits, *args, backend="reference")
    want = liger.LigerCrossEntropyFunction.apply(logits, *args, backend="reference")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    hidden, head = logits[:, :8].contiguous(), torch.randn(37, 8, dtype=torch.float64)
    linear_args = (head, target, None, weight, -100, 1e-2, 0.0, "sum", None, True, None, True, True, False)
    got = plugin.linear_cross_entropy_apply(hidden, *linear_args, None, None, 1, backend="reference")
    want = liger.LigerFusedLinearCrossEntropyFunction.apply(hidden, *linear_args, backend="reference")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(NotImplementedError, match="return_predicted_tokens"):
        plugin.linear_cross_entropy_apply(hidden, head, target, return_predicted_tokens=True)


def test_out_of_bounds_labels_raise_as_liger():
    """Liger's logits loss asserts on labels outside [0, V) (its tests check the message); fastce gives NaN."""
    logits, target, _ = inputs()
    target[5] = 37
    with pytest.raises(AssertionError, match="out of bounds"):
        plugin.cross_entropy_apply(logits, target, backend="reference")


def test_plugin_and_tool_do_not_import_liger():
    code = (
        "import sys, bench.tools.outside_suites, bench.tools.outside_liger_plugin; print('liger_kernel' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize(
    "text, counts",
    [
        ("...\n=== 3 failed, 10 passed, 2 skipped, 4 warnings in 4.10s ===\n", dict(failed=3, passed=10, skipped=2)),
        ("FAILED a.py::t - x\n1 failed, 2 errors in 0.5s\n", dict(failed=1, errors=2)),
        ("72 skipped, 5 deselected in 1.00s", dict(skipped=72, deselected=5)),
        ("==== 1 passed, 1 error in 2s ====", dict(passed=1, errors=1)),
        ("no tests ran in 0.01s", {}),
    ],
)
def test_parse_summary(text, counts):
    assert outside_suites.parse_summary(text) == dict(dict.fromkeys(outside_suites.OUTCOMES, 0), **counts)


def test_parse_summary_without_summary():
    assert outside_suites.parse_summary("Traceback (most recent call last):\nImportError: boom\n") is None
    assert outside_suites.failure_reasons("x\nFAILED a::b - c\nERROR d - e\n") == ["FAILED a::b - c", "ERROR d - e"]


def test_exits_2_without_cuda(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert outside_suites.main(["--liger-tests", str(tmp_path)]) == 2
    assert "CUDA" in capsys.readouterr().err
