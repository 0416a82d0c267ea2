"""bench/tools/outside_suites.py and its plugin without liger_kernel: the adapters' keyword mapping (Liger's
positional signatures and semantics, computed by fastce's reference backend on CPU float64 tensors) against torch's
F.cross_entropy plus Liger's unweighted z-loss term, the pytest summary parser, and the exit without CUDA."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from bench.tools import outside_liger_plugin as plugin
from bench.tools import outside_suites


def liger_expected(logits, target, weight, ignore_index, scale, smoothing, reduction, softcap):
    """Liger's semantics as its tests define them: torch's CE over the soft-capped logits, plus scale * lse^2 on the
    non-ignored rows, unweighted, its "mean" over the count of non-ignored rows."""
    z = softcap * torch.tanh(logits / softcap) if softcap is not None else logits
    ce = F.cross_entropy(
        z, target, weight=weight, ignore_index=ignore_index, reduction=reduction, label_smoothing=smoothing
    )
    kept = target != ignore_index
    z_loss = torch.where(kept, scale * torch.logsumexp(z, -1) ** 2, 0.0)
    z_loss = {"mean": z_loss.sum() / kept.sum(), "sum": z_loss.sum(), "none": z_loss}[reduction]
    hits = (z.argmax(-1) == target) & kept
    accuracy = hits.double() if reduction == "none" else hits.sum() / kept.sum()
    return ce + z_loss, z_loss, accuracy


def inputs(n=13, v=37, ignore_index=-100, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, v, dtype=torch.float64, generator=generator) * 3
    target = torch.randint(0, v, (n,), generator=generator)
    target[torch.randperm(n, generator=generator)[:4]] = ignore_index
    weight = torch.rand(v, dtype=torch.float64, generator=generator) + 0.25
    return logits, target, weight


# (weight?, ignore_index, lse_square_scale, label_smoothing, softcap): the weighted z-loss cases take the two-call path.
OPTIONS = [
    (False, -100, 0.0, 0.0, None),
    (False, 3, 1e-2, 0.1, 30.0),
    (True, -100, 0.0, 0.0, None),
    (True, 3, 1e-2, 0.0, None),
    (True, -100, 1e-2, 0.1, 5.0),
]


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted, ignore_index, scale, smoothing, softcap", OPTIONS)
def test_cross_entropy_apply(weighted, ignore_index, scale, smoothing, softcap, reduction):
    logits, target, weight = inputs(ignore_index=ignore_index)
    weight = weight if weighted else None
    x = logits.clone().requires_grad_(True)
    args = (target, weight, ignore_index, scale, smoothing, reduction, softcap, True, True, False)
    loss, z_loss, accuracy, predicted = plugin.cross_entropy_apply(x, *args, backend="reference")
    y = logits.clone().requires_grad_(True)
    want_loss, want_z, want_accuracy = liger_expected(
        y, target, weight, ignore_index, scale, smoothing, reduction, softcap
    )
    assert predicted is None and loss.dtype == logits.dtype
    torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(z_loss, want_z, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(accuracy.double(), want_accuracy.double(), rtol=0, atol=1e-6)
    grad = torch.randn_like(want_loss)
    loss.backward(grad)
    want_loss.backward(grad)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-9, atol=1e-12)


def test_cross_entropy_apply_loss_only_and_dtype():
    logits, target, _ = inputs()
    loss, z_loss, accuracy, predicted = plugin.cross_entropy_apply(logits.float(), target, backend="reference")
    assert z_loss is None and accuracy is None and predicted is None and loss.dtype == torch.float32
    torch.testing.assert_close(loss.double(), F.cross_entropy(logits.float(), target).double(), rtol=1e-5, atol=1e-6)


def test_adapters_refuse_what_fastce_lacks():
    logits, target, _ = inputs()
    with pytest.raises(NotImplementedError, match="return_predicted_tokens"):
        plugin.cross_entropy_apply(logits, target, None, -100, 0.0, 0.0, "mean", None, False, False, True)
    head = torch.randn(37, 8, dtype=torch.float64)
    hidden = torch.randn(13, 8, dtype=torch.float64)
    for position, name in ((12, "use_token_scaling"), (14, "return_predicted_tokens")):
        args = [hidden, head, target, None, None, -100, 0.0, 0.0, "mean", None, False, None, False, False, False]
        args[position] = True
        with pytest.raises(NotImplementedError, match=name):
            plugin.linear_cross_entropy_apply(*args, backend="reference")
    with pytest.raises(NotImplementedError, match="accum_dtype"):
        plugin.linear_cross_entropy_apply(hidden, head, target, accum_dtype=torch.bfloat16, backend="reference")


def test_out_of_bounds_labels_raise_as_liger():
    logits, target, _ = inputs()
    target[0] = 37
    with pytest.raises(AssertionError, match="out of bounds"):
        plugin.cross_entropy_apply(logits, target, backend="reference")


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("weighted, scale", [(False, 1e-2), (True, 0.0), (True, 1e-2)])
def test_linear_cross_entropy_apply(weighted, scale, reduction):
    logits, target, weight = inputs(ignore_index=-100)
    weight = weight if weighted else None
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(13, 8, dtype=torch.float64, generator=generator)
    head = torch.randn(37, 8, dtype=torch.float64, generator=generator)
    bias = torch.randn(37, dtype=torch.float64, generator=generator)
    h1, h2 = hidden.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    args = (head, target, bias, weight, -100, scale, 0.1, reduction, 20.0, True, None, False, True, False)
    loss, z_loss, accuracy, _ = plugin.linear_cross_entropy_apply(h1, *args, backend="reference")
    want = liger_expected(F.linear(h2, head, bias), target, weight, -100, scale, 0.1, reduction, 20.0)
    torch.testing.assert_close(loss, want[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(z_loss, want[1], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(accuracy.double(), want[2].double(), rtol=0, atol=1e-6)
    grad = torch.randn_like(want[0])
    loss.backward(grad)
    want[0].backward(grad)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-9, atol=1e-12)


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
