"""Distillation's LM heads (issue 38): the generalized JSD of a student's and a teacher's next-token distributions from
both models' hidden states, forward + backward into the student's hidden states and head.

    python -m bench.tools.distill_step [--shapes 8192x1536x3584x151936] [--frameworks torch,jax] [--json PATH]

Per shape (N x H_student x H_teacher x V, bf16, every 7th token ignored) and (beta, temperature) in CONFIGS:
fastce_torch.linear_jsd (also with skip_ignored_rows=True: the _skip rows, the ignored tokens' matmuls skipped);
TRL's recipe in plain torch (both heads' logits by matmul, float32 log_softmax of both, the
generalized JSD, "batchmean" over the counted tokens) eager and under torch.compile; Liger's LigerFusedLinearJSD (its
jsd_beta is this beta: mixture beta p_t + (1 - beta) p_s, 0 = KL(p_t || p_s), 1 = KL(p_s || p_t)); fastce_jax.linear_jsd
and the recipe in jnp under jit(value_and_grad); the floor: the bare torch.mm calls of the four products the loss needs
(both heads' logits, the student's d hidden and d weight), and matmul_floor_kept: the same over the kept tokens' rows
only (the _skip rows' floor). Timing and memory as bench.linear.measure's and
bench.jax_linear.measure's; errors over the first ERROR_ROWS rows (each row's code run on them) against float64 from
the same inputs (shared_tests.reference_distill): |loss - float64|, rms relative error of d hidden and d weight.
matmul_chunked and matmul_chunked_448mib: the same four products in linear_jsd's chunks at its default and the wide
workspace, without the row kernels (what the chunking costs by itself).
"""

import importlib
import math
import sys
from collections import namedtuple
from functools import partial

import torch

from .. import envinfo, jax_linear, linear, linear_shapes, torch_measure
from ..linear_shapes import LinearShape, rel_rms, to_jax
from ..progress import measure_rows, optional, say
from ..report import distill_markdown
from ..shapes import IGNORE_INDEX, parse_shapes
from .rl_step import tool_main

SHAPES = "8192x1536x3584x151936,8192x2048x4096x128256"
CONFIGS = ((0.0, 1.0), (0.5, 1.0), (1.0, 1.0), (0.5, 2.0))  # (beta, temperature)
ANY_TEMPERATURE = ("fastce_torch", "trl_eager", "liger_jsd", "fastce_jax")  # the rows at T != 1 (no more compiles)
ERROR_ROWS = 64
WIDE_WORKSPACE = 448 << 20
# H: the student's hidden size (bench.linear.measure differentiates the first two inputs, the student's).
DistillShape = namedtuple("DistillShape", "N H Ht V dtype", defaults=("bfloat16",))


def make_inputs(shape, device):
    """(student hidden, weight, teacher hidden, weight, labels): the fused linear bench's values, the teacher's from
    another seed and without gradients."""
    hidden, weight, labels = linear_shapes.make_inputs(LinearShape(shape.N, shape.H, shape.V, shape.dtype), device)
    teacher = linear_shapes.make_inputs(LinearShape(shape.N, shape.Ht, shape.V, shape.dtype), device, seed=1)
    return hidden, weight, teacher[0].detach(), teacher[1].detach(), labels


def generalized_jsd(xp, log_softmax, student, teacher, keep, beta, temperature):
    """TRL's generalized JSD per token from two logits tensors, summed over the kept tokens and divided by their
    number; xp: torch or jax.numpy."""
    ls, lt = log_softmax(student / temperature), log_softmax(teacher / temperature)
    if beta == 0:
        per_token = (xp.exp(lt) * (lt - ls)).sum(-1)
    elif beta == 1:
        per_token = (xp.exp(ls) * (ls - lt)).sum(-1)
    else:  # the mixture's log-probabilities, log((1 - beta) p_s + beta p_t)
        mixture = xp.logaddexp(ls + math.log(1 - beta), lt + math.log(beta))
        per_token = beta * (xp.exp(lt) * (lt - mixture)).sum(-1) + (1 - beta) * (xp.exp(ls) * (ls - mixture)).sum(-1)
    return xp.where(keep, per_token, 0.0).sum() / keep.sum().clip(1)


def implementations(framework, beta, temperature, backend):
    """name -> loader of loss(student hidden, weight, teacher hidden, weight, labels), a framework's rows."""
    fastce = partial(importlib.import_module(f"fastce_{framework}").linear_jsd, beta=beta, temperature=temperature)
    fastce = partial(fastce, backend=backend)
    # The memory allowance (512 MiB beyond the gradients) spent on the chunks: fewer, longer chunks; float32
    # logits (Liger 0.8.5's precision), at the default workspace; the ignored tokens' rows skipped, at both workspaces.
    variants = {"448mib": partial(fastce, workspace_bytes=WIDE_WORKSPACE),
                "f32logits": partial(fastce, logits_dtype="float32"), "skip": partial(fastce, skip_ignored_rows=True),
                "448mib_skip": partial(fastce, workspace_bytes=WIDE_WORKSPACE, skip_ignored_rows=True)}  # fmt: skip
    if framework == "jax":
        import jax

        def xla(hs, ws, ht, wt, y):
            logits = (hs @ ws.T).astype("float32"), (ht @ wt.T).astype("float32")
            return generalized_jsd(jax.numpy, jax.nn.log_softmax, *logits, y != IGNORE_INDEX, beta, temperature)

        return {"fastce_jax": lambda: fastce, "xla_jsd": lambda: xla} | with_variants("fastce_jax", variants)

    def trl(hs, ws, ht, wt, y):
        logits = (hs @ ws.t()).float(), (ht @ wt.t()).float()
        return generalized_jsd(torch, partial(torch.log_softmax, dim=-1), *logits, y != IGNORE_INDEX, beta, temperature)

    def liger():
        fused = optional("liger_kernel.transformers", "LigerFusedLinearJSD", "liger-kernel")
        return fused(jsd_beta=beta, ignore_index=IGNORE_INDEX, temperature=temperature)

    compiled = lambda: torch.compile(trl, dynamic=False)
    rows = {"fastce_torch": lambda: fastce, "trl_eager": lambda: trl, "trl_compile": compiled, "liger_jsd": liger}
    return rows | with_variants("fastce_torch", variants)


def with_variants(name, variants):
    return {f"{name}_{suffix}": (lambda loss=loss: loss) for suffix, loss in variants.items()}


def float64_reference(hidden, weight, teacher_hidden, teacher_weight, labels, beta, temperature):
    """(loss, d hidden, d weight) in float64 from the same (rounded) inputs: the logits' loss and gradient from
    shared_tests' reference, the products in float64 on the inputs' device."""
    from shared_tests.reference_distill import jsd

    h64, w64 = hidden.detach().double(), weight.detach().double()
    logits = (t.cpu().numpy() for t in (h64 @ w64.t(), teacher_hidden.double() @ teacher_weight.double().t(), labels))
    loss, grad = jsd(*logits, beta=beta, temperature=temperature, ignore_index=IGNORE_INDEX)
    grad = torch.as_tensor(grad, device=h64.device)
    return float(loss), grad @ w64, grad.t() @ h64


def float64_errors(loss_fn, framework, inputs, reference) -> dict:
    """loss_fn's loss and gradients on inputs (its framework's autodiff) against float64_reference's."""
    if framework == "jax":
        import jax

        loss, grads = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))(*to_jax(*inputs))
        grads = [torch.from_dlpack(g) for g in grads]
    else:
        hidden = inputs[0].detach().requires_grad_()
        loss = loss_fn(hidden, *inputs[1:])
        loss, grads = loss.detach(), torch.autograd.grad(loss, (hidden, inputs[1]))
    dh, dw = (rel_rms(got, want) for got, want in zip(grads, reference[1:]))
    return {"loss_error": abs(float(loss) - reference[0]), "grad_hidden_rel_rms": dh, "grad_weight_rel_rms": dw}


def matmul_floor(shape, inputs, kept_only=False) -> dict:
    """The four products the loss needs, each a bare torch.mm at its shape in the inputs' dtype (do_bench medians);
    kept_only: over the rows whose label is not ignored (matmul_floor_kept, the skip_ignored_rows rows' floor)."""
    hidden, weight, teacher_hidden, teacher_weight, labels = (t.detach() for t in inputs)
    if kept_only:
        kept = labels != IGNORE_INDEX
        hidden, teacher_hidden = hidden[kept], teacher_hidden[kept]
    grad = torch.randn(hidden.shape[0], shape.V, device=hidden.device, dtype=hidden.dtype)  # d student logits
    products = {"student_logits": (hidden, weight.t()), "teacher_logits": (teacher_hidden, teacher_weight.t()),
                "d_hidden": (grad, weight), "d_weight": (grad.t(), hidden)}  # fmt: skip
    with torch.no_grad():
        ms = {key: torch_measure.bench_ms(partial(torch.mm, *ab), 100, 500) for key, ab in products.items()}
    impl = "matmul_floor_kept" if kept_only else "matmul_floor"
    say(f"{impl} {shape}: {sum(ms.values()):.2f} ms ({', '.join(f'{k} {v:.2f}' for k, v in ms.items())})")
    return {"impl": impl, "fwdbwd_ms": sum(ms.values()), "matmul_ms": ms, "product_rows": hidden.shape[0]}


def chunked_floor(shape, inputs, workspace_bytes=None, name="matmul_chunked") -> dict:
    """The same four products chunk by chunk as linear_jsd runs them at workspace_bytes (its rows_per_chunk for two
    logits chunks in the inputs' dtype; the weight gradient accumulated with addmm_), with no row kernel between
    them: what the chunking alone costs over matmul_floor."""
    from fastce_torch.linear.engine import rows_per_chunk

    hidden, weight, teacher_hidden, teacher_weight, _ = (t.detach() for t in inputs)
    step = rows_per_chunk(shape.N, shape.V, 2 * hidden.element_size(), workspace_bytes)
    student_chunk, teacher_chunk = (hidden.new_empty(step, shape.V) for _ in range(2))
    grad_hidden, grad_weight = torch.empty_like(hidden), torch.empty_like(weight)

    def products():
        for start in range(0, shape.N, step):
            rows = slice(start, min(start + step, shape.N))
            logits = student_chunk[: rows.stop - start]  # stands in for the d logits written over it
            torch.mm(hidden[rows], weight.t(), out=logits)
            torch.mm(teacher_hidden[rows], teacher_weight.t(), out=teacher_chunk[: rows.stop - start])
            torch.mm(logits, weight, out=grad_hidden[rows])
            grad_weight.addmm_(logits.t(), hidden[rows], beta=0 if start == 0 else 1)

    with torch.no_grad():
        ms = torch_measure.bench_ms(products, 100, 500)
    say(f"{name} {shape}: {ms:.2f} ms ({step} rows a chunk)")
    return {"impl": name, "fwdbwd_ms": ms, "chunk_rows": step}


def floor_rows(shape, inputs, impls) -> list:
    """matmul_floor and matmul_floor_kept (always), then the chunked products at the default and the wide workspace
    (where impls asks for them)."""
    chunked = {"matmul_chunked": None, "matmul_chunked_448mib": WIDE_WORKSPACE}
    wanted = {name: size for name, size in chunked.items() if impls is None or name in impls}
    floors = [matmul_floor(shape, inputs), matmul_floor(shape, inputs, kept_only=True)]
    return floors + [chunked_floor(shape, inputs, size, name) for name, size in wanted.items()]


def config_rows(shape, inputs, beta, temperature, frameworks, impls, backend, failures) -> list:
    """The rows of one (beta, temperature), with their float64 errors but torch.compile's (on fewer rows it would
    compile again; its formula is trl_eager's)."""
    first = [t[:ERROR_ROWS] if i in (0, 2, 4) else t for i, t in enumerate(inputs)]
    reference, rows = float64_reference(*first, beta, temperature), []
    for framework in frameworks:
        timed = partial(linear.measure, shape=shape, inputs=inputs)
        if framework == "jax":
            timed = partial(jax_linear.measure, inputs=to_jax(*inputs))

        def measure(impl, loss_fn, framework=framework, timed=timed):
            errors = {} if impl == "trl_compile" else float64_errors(loss_fn, framework, first, reference)
            return timed(loss_fn) | errors

        loaders = implementations(framework, beta, temperature, backend).items()
        loaders = {i: loader for i, loader in loaders if impls is None or i in impls}
        loaders = {i: loader for i, loader in loaders.items() if temperature == 1 or i in ANY_TEMPERATURE}
        rows += measure_rows(f"{shape} beta={beta} T={temperature}", loaders, measure, failures)
    return [row | {"beta": beta, "temperature": temperature} for row in rows]


def run(shapes, frameworks=("torch", "jax"), impls=None, backend="auto") -> dict:
    """Every row at every shape and (beta, temperature) in CONFIGS (impls: a subset of the rows; the two floors are
    always measured), failures recorded."""
    rows, failures = [], []
    for shape in shapes:
        inputs = make_inputs(shape, linear.DEVICE)
        found = floor_rows(shape, inputs, impls)
        floor = found[0]
        for beta, temperature in CONFIGS:
            found += config_rows(shape, inputs, beta, temperature, frameworks, impls, backend, failures)
        rows += [shape._asdict() | row | {"over_floor": row["fwdbwd_ms"] / floor["fwdbwd_ms"]} for row in found]
        del inputs
        torch.cuda.empty_cache()
    device = torch.cuda.get_device_name() if linear.DEVICE == "cuda" else linear.DEVICE
    return {"mode": "distill_step", "device": device, "date": envinfo.today(), "commit": envinfo.git_commit(),
            "torch": torch.__version__, "versions": envinfo.versions(), "configs": CONFIGS, "error_rows": ERROR_ROWS,
            "rows": rows, "failures": failures}  # fmt: skip


def main(argv=None):
    parse = partial(parse_shapes, make=DistillShape, flag="--shapes", form="NxHsxHtxV")
    return tool_main(argv, __doc__, SHAPES, parse, run, lambda result: distill_markdown(result, "this run"))


if __name__ == "__main__":
    sys.exit(main())
