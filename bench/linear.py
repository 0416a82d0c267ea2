"""`python -m bench --linear`: fused linear + cross-entropy, the loss from hidden states and the LM-head weight.

Each implementation computes mean CE(hidden @ weight.T, labels) in bf16 (every 7th label ignored) and its
gradients for hidden and weight; timed is forward + backward (`torch.autograd.grad(loss, (hidden, weight))`), as
triton.testing.do_bench medians. Reported per row: time, effective TFLOP/s = 6·N·H·V / time (the three matmuls of
a forward + backward; implementations that recompute logits do more work than that), its ratio to a plain bf16
matmul measured in the same run (2·N·H·V flops of hidden @ weight.T), and the peak memory above the inputs
(torch.cuda.max_memory_allocated during one call; the gradients of hidden and weight are part of it, and
`extra beyond grads` subtracts them).

Implementations (torch): fastce_torch.linear_cross_entropy in the FASTCE_SETTINGS configurations, which both
packages are timed in (fastce_torch_linear: the defaults, a 256 MiB workspace and the weight gradient summed in
bf16; ..._f32acc: the float32 weight-gradient accumulator; ..._1GiB: a 1 GiB workspace), matmul +
fastce_torch.cross_entropy (logits materialised, gradient in place), torch.compile of matmul + F.cross_entropy on
upcast logits, Liger's fused linear CE and Apple's Cut Cross-Entropy (skipped when not installed). Then
bench.jax_linear's JAX rows on the same shapes (fastce_jax_linear, ..._f32acc, ..._1GiB, XLA matmul + CE, matmul +
fastce_jax.cross_entropy, the three matmuls alone), host-timed as there, with XLA's temp size as memory.

`python -m bench --linear --quick`: one shape (8192, 4096, 128256), fastce_torch only, and a correctness check of
its loss and gradients against a float32 computation (chunked, so it fits): exit status 1 when it fails.
"""

import contextlib
import gc
import json
import sys
from dataclasses import dataclass

from .progress import Unavailable, error_text, failure, say

IGNORE_INDEX = -100
MiB = 1 << 20
DEVICE = "cuda"  # the CPU tests of this module set "cpu" (with the CUDA timers stubbed)


@dataclass(frozen=True)
class LinearShape:
    N: int
    H: int
    V: int
    dtype: str = "bfloat16"

    @property
    def flops(self) -> float:
        return 6.0 * self.N * self.H * self.V

    def __str__(self):
        return f"N={self.N} H={self.H} V={self.V} {self.dtype}"


LINEAR_SHAPES = (LinearShape(8192, 4096, 128256), LinearShape(8192, 2304, 256000), LinearShape(32768, 4096, 128256))
QUICK_SHAPE = LinearShape(8192, 4096, 128256)


# The configurations both packages' linear_cross_entropy are timed in, as row-name suffixes and module settings
# (bench.jax_linear uses the same table): the defaults, the float32 weight-gradient accumulator, a 1 GiB workspace.
FASTCE_SETTINGS = {
    "": {},
    "_f32acc": {"ACCUMULATE_WEIGHT_GRAD_IN_FLOAT32": True},
    "_1GiB": {"WORKSPACE_BYTES": 1 << 30},
}


@contextlib.contextmanager
def package_settings(module, settings):
    """The module's settings (e.g. WORKSPACE_BYTES) changed for the duration, then restored."""
    saved = {name: getattr(module, name) for name in settings}
    for name, value in settings.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


# --- implementations: each (hidden, weight, labels) -> mean loss ----------------------------------------------


def fastce_linear(settings):
    """fastce_torch.linear_cross_entropy with `settings` (see FASTCE_SETTINGS) applied to its module for each call."""
    import fastce_torch

    module = sys.modules["fastce_torch.linear_cross_entropy"]

    def loss_fn(hidden, weight, labels):
        with package_settings(module, settings):
            return fastce_torch.linear_cross_entropy(hidden, weight, labels)

    return loss_fn


def matmul_fastce():
    import fastce_torch

    return lambda hidden, weight, labels: fastce_torch.cross_entropy(hidden @ weight.t(), labels)


def torch_compile_upcast():
    import torch
    import torch.nn.functional as F

    def loss_fn(hidden, weight, labels):
        return F.cross_entropy((hidden @ weight.t()).float(), labels, ignore_index=IGNORE_INDEX)

    return torch.compile(loss_fn, dynamic=False)


def liger():
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except ModuleNotFoundError as exc:
        raise Unavailable(f"liger-kernel is not installed ({exc})") from exc
    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="mean")
    return lambda hidden, weight, labels: loss(weight, hidden, labels)


def cut_cross_entropy():
    try:
        from cut_cross_entropy import linear_cross_entropy
    except ModuleNotFoundError as exc:
        raise Unavailable(f"cut-cross-entropy is not installed ({exc})") from exc
    return lambda hidden, weight, labels: linear_cross_entropy(hidden, weight, labels, ignore_index=IGNORE_INDEX)


LOADERS = {
    **{
        f"fastce_torch_linear{suffix}": (lambda settings=settings: fastce_linear(settings))
        for suffix, settings in FASTCE_SETTINGS.items()
    },
    "matmul+fastce_torch": matmul_fastce,
    "torch_compile": torch_compile_upcast,
    "liger_flce": liger,
    "cut_cross_entropy": cut_cross_entropy,
}


# --- measurement ----------------------------------------------------------------------------------------------


def make_inputs(shape, seed=0):
    import torch

    device = DEVICE
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, shape.dtype)
    hidden = torch.randn(shape.N, shape.H, device=device, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(shape.V, shape.H, device=device, generator=gen) / shape.H**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, shape.V, (shape.N,), device=device, generator=gen)
    labels[::7] = IGNORE_INDEX
    return hidden, weight, labels


def matmul_tflops(shape):
    """A plain bf16 hidden @ weight.T (cuBLAS) on this shape: the throughput the fused rows are compared with."""
    import torch

    from .torch_measure import bench_ms

    hidden, weight, _ = make_inputs(shape)
    out = torch.empty(shape.N, shape.V, device=DEVICE, dtype=hidden.dtype)
    with torch.no_grad():
        ms = bench_ms(lambda: torch.matmul(hidden, weight.t(), out=out), 100, 500)
    del hidden, weight, out
    torch.cuda.empty_cache()
    return 2.0 * shape.N * shape.H * shape.V / (ms * 1e-3) / 1e12


def measure(loss_fn, shape, quick=False):
    import torch

    from .torch_measure import bench_ms, peak_extra_bytes

    hidden, weight, labels = make_inputs(shape)

    def fwdbwd():
        return torch.autograd.grad(loss_fn(hidden, weight, labels), (hidden, weight))

    try:
        with torch.no_grad():
            loss = float(loss_fn(hidden, weight, labels))
        for _ in range(2):
            fwdbwd()  # compile, JIT, cuBLAS workspaces
        peak = peak_extra_bytes(fwdbwd)
        ms = bench_ms(fwdbwd, 50 if quick else 200, 300 if quick else 1500)
    finally:
        del hidden, weight, labels
        gc.collect()
        torch.cuda.empty_cache()
    gradients = shape.N * shape.H * 2 + shape.V * shape.H * 2
    return {"fwdbwd_ms": ms, "peak_extra_bytes": peak, "extra_beyond_grads_bytes": peak - gradients, "loss": loss}


def check_fastce(shape, chunk=1024):
    """fastce_torch.linear_cross_entropy at `shape` against float32 (logits in float32 row chunks, TF32 off):
    returns a dict of relative errors and whether they are within bf16 expectations."""
    import torch

    import fastce_torch

    hidden, weight, labels = make_inputs(shape)
    loss = fastce_torch.linear_cross_entropy(hidden, weight, labels)
    grad_hidden, grad_weight = torch.autograd.grad(loss, (hidden, weight))
    h32, w32 = hidden.detach().float(), weight.detach().float()
    kept = (labels != IGNORE_INDEX).sum().float()
    ref_loss = torch.zeros((), device=DEVICE)
    ref_gh = torch.empty_like(h32)
    ref_gw = torch.zeros_like(w32)
    previous_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for start in range(0, shape.N, chunk):
            rows = slice(start, start + chunk)
            logits = h32[rows] @ w32.t()
            y = labels[rows]
            ref_loss += torch.nn.functional.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum")
            grad = torch.softmax(logits, -1)
            kept_rows = y != IGNORE_INDEX
            grad[kept_rows, y[kept_rows]] -= 1
            grad[~kept_rows] = 0
            grad /= kept
            ref_gh[rows] = grad @ w32
            ref_gw += grad.t() @ h32[rows]
            del logits, grad
    finally:
        torch.backends.cuda.matmul.allow_tf32 = previous_tf32
    ref_loss /= kept

    def rel_rms(got, ref):
        return float((got.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())

    errors = {
        "loss_rel": abs(float(loss.detach()) - float(ref_loss)) / abs(float(ref_loss)),
        "grad_hidden_rel_rms": rel_rms(grad_hidden, ref_gh),
        "grad_weight_rel_rms": rel_rms(grad_weight, ref_gw),
    }
    # bf16 logits and gradients: one rounding each is ~2e-3 rms relative; the weight gradient adds one rounding per
    # chunk (see fastce_torch/linear_cross_entropy.py). A wrong formula is off by far more.
    errors["ok"] = (
        errors["loss_rel"] < 1e-3 and errors["grad_hidden_rel_rms"] < 1e-2 and errors["grad_weight_rel_rms"] < 2e-2
    )
    del hidden, weight, labels, grad_hidden, grad_weight, ref_gh, ref_gw
    torch.cuda.empty_cache()
    return errors


def _row(impl, shape, measured, matmul_tflops):
    tflops = shape.flops / (measured["fwdbwd_ms"] * 1e-3) / 1e12
    row = {"impl": impl, "N": shape.N, "H": shape.H, "V": shape.V, "dtype": shape.dtype, **measured}
    row.update(effective_TFLOPs=tflops, of_matmul=tflops / matmul_tflops)
    return row


def _add_jax_rows(shapes, matmul, rows, failures):
    """bench.jax_linear's rows on the same shapes, in this table's terms: of_matmul against the torch bf16 matmul
    measured above (their own three-matmul ceiling is kept as of_jax_matmuls); memory is XLA's temp size, which
    does not hold the gradients (outputs), so it is the extra beyond the gradients."""
    try:
        from . import jax_linear
        from .jax_measure import has_gpu

        if not has_gpu():
            raise Unavailable("jax sees no GPU")
        result = jax_linear.run(shapes=tuple(shapes), say=say)
    except Exception as exc:  # noqa: BLE001 - jax missing or broken must not lose the torch rows
        failures.append(failure("jax", None, "load", exc))
        say(f"JAX rows skipped: {failures[-1]['error']}")
        return
    for r in result["rows"]:
        shape = LinearShape(r["N"], r["H"], r["V"], r["dtype"])
        row = dict(r, impl="jax_three_matmuls" if r["impl"] == "matmul" else r["impl"])
        if "of_matmul" in row:
            row["of_jax_matmuls"] = row.pop("of_matmul")
        row.update(effective_TFLOPs=r["TFLOPs"], of_matmul=r["TFLOPs"] / matmul[str(shape)])
        row.setdefault("peak_extra_bytes", 0)
        row["extra_beyond_grads_bytes"] = row["peak_extra_bytes"]
        rows.append(row)
    failures.extend(result["failures"])


def run_linear(quick=False, impls=None, shapes=None, with_jax=None):
    import torch

    from . import envinfo

    shapes = shapes or ((QUICK_SHAPE,) if quick else LINEAR_SHAPES)
    with_jax = (not quick and DEVICE == "cuda") if with_jax is None else with_jax
    impls = impls or (
        ["fastce_torch_linear", "fastce_torch_linear_1GiB", "matmul+fastce_torch"] if quick else list(LOADERS)
    )
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE
    rows, failures = [], []
    matmul = {}
    for shape in shapes:
        matmul[str(shape)] = matmul_tflops(shape)
        say(f"bf16 matmul {shape}: {matmul[str(shape)]:.0f} TFLOP/s")
    for impl in impls:
        try:
            loss_fn = LOADERS[impl]()
        except Exception as exc:  # noqa: BLE001 - a missing package must not stop the run
            failures.append(failure(impl, None, "load", exc))
            say(f"{impl}: skipped ({failures[-1]['error']})")
            continue
        for shape in shapes:
            try:
                measured = measure(loss_fn, shape, quick=quick)
            except Exception as exc:  # noqa: BLE001 - OOM is a result too
                failures.append({"impl": impl, "shape": str(shape), "stage": "measure", "error": error_text(exc)})
                say(f"{impl} {shape}: FAILED {failures[-1]['error']}")
                continue
            rows.append(_row(impl, shape, measured, matmul[str(shape)]))
            r = rows[-1]
            say(
                f"{impl:28s} {shape}: {r['fwdbwd_ms']:.2f} ms, {r['effective_TFLOPs']:.0f} TFLOP/s "
                f"({r['of_matmul']:.0%} of matmul), peak extra {r['peak_extra_bytes'] / MiB:.0f} MiB "
                f"({r['extra_beyond_grads_bytes'] / MiB:.0f} beyond the gradients), loss {r['loss']:.5f}"
            )
    torch.cuda.empty_cache()
    if with_jax:
        _add_jax_rows(shapes, matmul, rows, failures)
    result = {
        "mode": "linear",
        "device": device,
        "date": envinfo.today(),
        "commit": envinfo.git_commit(),
        "matmul_TFLOPs": matmul,
        "rows": rows,
    }
    if failures:
        result["failures"] = failures
    if quick:
        result["check"] = check_fastce(shapes[0])
        say(f"fastce_torch.linear_cross_entropy vs float32 at {shapes[0]}: {result['check']}")
    return result


def text_table(result):
    header = ("impl", "N", "H", "V", "fwd+bwd ms", "TFLOP/s (6NHV)", "of matmul", "peak extra MiB", "beyond grads MiB")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in result["rows"]:
        cells = (
            r["impl"],
            r["N"],
            r["H"],
            r["V"],
            f"{r['fwdbwd_ms']:.2f}",
            f"{r['effective_TFLOPs']:.0f}",
            f"{r['of_matmul']:.0%}",
            f"{r['peak_extra_bytes'] / MiB:.0f}" + (" (temp)" if r.get("peak_extra_kind") == "xla_temp_size" else ""),
            f"{r['extra_beyond_grads_bytes'] / MiB:.0f}",
        )
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    matmul = ", ".join(f"{shape}: {tf:.0f}" for shape, tf in result["matmul_TFLOPs"].items())
    return "\n".join(lines) + f"\n\nbf16 matmul TFLOP/s in the same run: {matmul}"


def main_linear(quick, json_path=None) -> int:
    result = run_linear(quick=quick)
    print(f"\n{result['device']}, commit {result['commit']}\n")
    print(text_table(result))
    for f in result.get("failures", []):
        print(f"not measured: {f['impl']} {f.get('shape', '')} ({f['stage']}): {f['error']}")
    if json_path:
        with open(json_path, "w") as out:
            json.dump(result, out, indent=2)
        print(f"wrote {json_path}")
    bad = [f for f in result.get("failures", []) if f["impl"].startswith("fastce") and f["stage"] != "unavailable"]
    if quick and not result["check"]["ok"]:
        print(f"FAILED fastce_torch.linear_cross_entropy check: {result['check']}", file=sys.stderr)
        return 1
    return 1 if bad else 0
