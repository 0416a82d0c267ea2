"""Distillation's LM heads (issue 38): the generalized JSD between a student's and a teacher's next-token
distributions from both models' hidden states, forward + backward into the student's hidden states and head.

    python -m bench.tools.distill_step [--shapes 8192x1536x3584x151936] [--frameworks torch,jax] [--json PATH]

Per shape (N x H_student x H_teacher x V, bf16, every 7th token ignored) and (beta, temperature) in CONFIGS:
fastce_torch.linear_jsd; TRL's recipe in plain torch (both heads' logits by matmul, float32 log_softmax of both, the
generalized JSD, "batchmean" over the counted tokens) eager and under torch.compile; Liger's LigerFusedLinearJSD (its
jsd_beta weighs the mixture as this beta does, beta p_t + (1 - beta) p_s: 0 is KL(p_t || p_s), 1 is KL(p_s || p_t));
fastce_jax.linear_jsd and the recipe in jnp under jit(value_and_grad) (host-timed, XLA's temp size); the floor: the
four bare bf16 products the loss needs (both heads' logits, the student's d hidden and d weight) as torch.mm calls.
Rows as bench.linear.measure's (do_bench medians, the peak beyond the inputs and the student's gradients); errors over
the first ERROR_ROWS rows (each implementation run on them) against float64 from the same inputs: |loss - float64|
and the rms relative errors of d hidden and d weight.
"""

import math
import sys
from dataclasses import dataclass
from functools import partial

from .. import envinfo, jax_linear, linear, torch_measure
from ..linear_shapes import LinearShape, rel_rms, to_jax
from ..progress import measure_rows, optional, say
from ..report import distill_markdown
from ..shapes import IGNORE_INDEX, parse_shapes
from .rl_step import tool_main

SHAPES = "8192x1536x3584x151936,8192x2048x4096x128256"
CONFIGS = ((0.0, 1.0), (0.5, 1.0), (1.0, 1.0), (0.5, 2.0))  # (beta, temperature)
AT_ANY_TEMPERATURE = ("fastce_torch", "trl_eager", "liger_jsd", "fastce_jax")  # at T != 1: no compiles
ERROR_ROWS = 64


@dataclass(frozen=True)
class DistillShape:
    N: int
    H: int  # the student's hidden size (bench.linear.measure's gradients are the student's)
    Ht: int
    V: int
    dtype: str = "bfloat16"

    @property
    def flops(self) -> float:  # the floor's four products
        return 2.0 * self.N * self.V * (3 * self.H + self.Ht)

    def __str__(self):
        return f"N={self.N} Hs={self.H} Ht={self.Ht} V={self.V} {self.dtype}"


def make_inputs(shape, device):
    """(student hidden, student weight, teacher hidden, teacher weight, labels): the fused linear bench's values
    (bench.linear_shapes), the teacher's from another seed and without gradients."""
    from ..linear_shapes import make_inputs as linear_inputs

    hidden, weight, labels = linear_inputs(LinearShape(shape.N, shape.H, shape.V, shape.dtype), device)
    teacher_hidden, teacher_weight, _ = linear_inputs(LinearShape(shape.N, shape.Ht, shape.V, shape.dtype), device, 1)
    return hidden, weight, teacher_hidden.detach(), teacher_weight.detach(), labels


def generalized_jsd(xp, log_softmax, student, teacher, keep, beta, temperature):
    """The generalized JSD per token from two logits tensors, summed over the kept tokens and divided by their number;
    xp: torch or jax.numpy, log_softmax over the last axis."""
    ls, lt = log_softmax(student / temperature), log_softmax(teacher / temperature)
    if beta == 0:
        per_token = (xp.exp(lt) * (lt - ls)).sum(-1)
    elif beta == 1:
        per_token = (xp.exp(ls) * (ls - lt)).sum(-1)
    else:  # log of the mixture (1 - beta) p_s + beta p_t
        mixture = xp.logaddexp(ls + math.log(1 - beta), lt + math.log(beta))
        per_token = beta * (xp.exp(lt) * (lt - mixture)).sum(-1) + (1 - beta) * (xp.exp(ls) * (ls - mixture)).sum(-1)
    return xp.where(keep, per_token, 0.0).sum() / keep.sum().clip(1)


def torch_implementations(beta, temperature, backend):
    """name -> loader of loss(student hidden, student weight, teacher hidden, teacher weight, labels)."""
    import torch

    import fastce_torch

    fastce = partial(fastce_torch.linear_jsd, beta=beta, temperature=temperature, backend=backend)

    def trl(hs, ws, ht, wt, y):
        logits = (hs @ ws.t()).float(), (ht @ wt.t()).float()
        return generalized_jsd(torch, partial(torch.log_softmax, dim=-1), *logits, y != IGNORE_INDEX, beta, temperature)

    def liger():
        fused = optional("liger_kernel.transformers", "LigerFusedLinearJSD", "liger-kernel")
        return fused(jsd_beta=beta, ignore_index=IGNORE_INDEX, temperature=temperature)

    compiled = lambda: torch.compile(trl, dynamic=False)
    return {"fastce_torch": lambda: fastce, "trl_eager": lambda: trl, "trl_compile": compiled, "liger_jsd": liger}


def jax_implementations(beta, temperature, backend):
    import jax
    import jax.numpy as jnp

    import fastce_jax

    def xla(hs, ws, ht, wt, y):
        logits = (hs @ ws.T).astype(jnp.float32), (ht @ wt.T).astype(jnp.float32)
        return generalized_jsd(jnp, partial(jax.nn.log_softmax, axis=-1), *logits, y != IGNORE_INDEX, beta, temperature)

    fastce = partial(fastce_jax.linear_jsd, beta=beta, temperature=temperature, backend=backend)
    return {"fastce_jax": lambda: fastce, "xla_jsd": lambda: xla}


def float64_reference(hidden, weight, teacher_hidden, teacher_weight, labels, beta, temperature):
    """(loss, d hidden, d weight) in float64 from the same (rounded) inputs: the logits' gradient from shared_tests'
    reference_distill where it is, else from the formula above in float64 (torch autograd)."""
    import torch

    h64, w64 = hidden.detach().double(), weight.detach().double()
    student, teacher = h64 @ w64.t(), teacher_hidden.double() @ teacher_weight.double().t()
    try:
        from shared_tests.reference_distill import jsd
    except ImportError:
        student.requires_grad_()
        softmax = partial(torch.log_softmax, dim=-1)
        loss = generalized_jsd(torch, softmax, student, teacher, labels != IGNORE_INDEX, beta, temperature)
        grad = torch.autograd.grad(loss, student)[0]
    else:
        numpy = (t.cpu().numpy() for t in (student, teacher, labels))
        loss, grad = jsd(*numpy, beta=beta, temperature=temperature, ignore_index=IGNORE_INDEX)
        grad = torch.as_tensor(grad, device=h64.device)
    return float(loss), grad @ w64, grad.t() @ h64


def float64_errors(step, inputs, reference) -> dict:
    """step(*inputs) -> (loss, d hidden, d weight) against float64_reference's."""
    loss, *grads = step(*inputs)
    errors = [rel_rms(got, want) for got, want in zip(grads, reference[1:])]
    return {"loss_error": abs(loss - reference[0]), "grad_hidden_rel_rms": errors[0], "grad_weight_rel_rms": errors[1]}


def torch_step(loss_fn):
    import torch

    def step(hidden, weight, *rest):
        hidden = hidden.detach().requires_grad_()
        loss = loss_fn(hidden, weight, *rest)
        return float(loss), *torch.autograd.grad(loss, (hidden, weight))

    return step


def jax_step(loss_fn):
    import jax
    import torch

    jitted = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1)))

    def step(*inputs):
        loss, grads = jitted(*to_jax(*inputs))
        return float(loss), *map(torch.from_dlpack, grads)

    return step


def matmul_floor(shape, inputs) -> dict:
    """The four bare products the loss needs, each a torch.mm at its shape in the inputs' dtype (do_bench medians)."""
    import torch

    hidden, weight, teacher_hidden, teacher_weight, _ = (t.detach() for t in inputs)
    grad = torch.randn(shape.N, shape.V, device=hidden.device, dtype=hidden.dtype)  # d student logits
    products = {"student_logits": (hidden, weight.t()), "teacher_logits": (teacher_hidden, teacher_weight.t()),
                "d_hidden": (grad, weight), "d_weight": (grad.t(), hidden)}  # fmt: skip
    with torch.no_grad():
        ms = {
            key: torch_measure.bench_ms(lambda a=a, b=b: torch.mm(a, b), 100, 500) for key, (a, b) in products.items()
        }
    say(f"matmul_floor {shape}: {sum(ms.values()):.2f} ms ({', '.join(f'{k} {v:.2f}' for k, v in ms.items())})")
    return {"impl": "matmul_floor", "fwdbwd_ms": sum(ms.values()), "matmul_ms": ms}


def config_rows(shape, inputs, beta, temperature, frameworks, impls, backend, failures) -> list:
    """The rows of one (beta, temperature) at one shape, each with its float64 errors but torch.compile's (another
    row count would compile again; its formula is trl_eager's)."""
    rows, what = slice(0, ERROR_ROWS), f"{shape} beta={beta} T={temperature}"
    first = (inputs[0][rows], inputs[1], inputs[2][rows], inputs[3], inputs[4][rows])
    reference = float64_reference(*first, beta, temperature)

    def chosen(loaders):
        keep = lambda i: (impls is None or i in impls) and (temperature == 1 or i in AT_ANY_TEMPERATURE)
        return {impl: loader for impl, loader in loaders.items() if keep(impl)}

    def torch_row(impl, loss_fn):
        row = linear.measure(loss_fn, shape, inputs=inputs)
        return row if impl == "trl_compile" else row | float64_errors(torch_step(loss_fn), first, reference)

    def jax_row(impl, loss_fn):
        return jax_linear.measure(loss_fn, jax_inputs) | float64_errors(jax_step(loss_fn), first, reference)

    found = []
    if "torch" in frameworks:
        found += measure_rows(what, chosen(torch_implementations(beta, temperature, backend)), torch_row, failures)
    if "jax" in frameworks:
        jax_inputs = to_jax(*inputs)
        found += measure_rows(what, chosen(jax_implementations(beta, temperature, backend)), jax_row, failures)
    return [row | {"beta": beta, "temperature": temperature} for row in found]


def run(shapes, frameworks=("torch", "jax"), impls=None, backend="auto") -> dict:
    """Every row at every shape and (beta, temperature) in CONFIGS (impls: a subset of the rows), failures recorded."""
    import torch

    rows, failures = [], []
    for shape in shapes:
        inputs = make_inputs(shape, linear.DEVICE)
        floor = matmul_floor(shape, inputs)
        found = [floor]
        for beta, temperature in CONFIGS:
            found += config_rows(shape, inputs, beta, temperature, frameworks, impls, backend, failures)
        base = {"N": shape.N, "H": shape.H, "Ht": shape.Ht, "V": shape.V, "dtype": shape.dtype}
        for row in found:
            ms = row["fwdbwd_ms"]
            rows.append(
                base | row | {"over_floor": ms / floor["fwdbwd_ms"], "effective_TFLOPs": shape.flops / ms / 1e9}
            )
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
