"""The fused linear bench's shapes, the fastce configurations it times, the float32 reference its rows' errors are
measured against and their text, shared by its torch rows (bench.linear) and its JAX rows (bench.jax_linear)."""

import dataclasses
from dataclasses import dataclass

import numpy as np

from .shapes import IGNORE_INDEX, parse_shapes

# Every 7th label is ignored unless a shape says otherwise (LinearShape.ignored).
IGNORE_EVERY = 7
# With LinearShape.ignored: the rows are sequences of this many tokens, each starting with its ignored part (a
# prompt, as in supervised fine-tuning), so the kept rows come in blocks.
SEQUENCE = 1024


@dataclass(frozen=True)
class LinearShape:
    N: int
    H: int
    V: int
    dtype: str = "bfloat16"
    ignored: float | None = None  # the fraction of ignored labels (None: every IGNORE_EVERY-th)

    @property
    def flops(self) -> float:
        """The full problem's 6·N·H·V, whatever is ignored (rows skipping ignored rows can exceed the card's peak)."""
        return 6.0 * self.N * self.H * self.V

    @property
    def dense(self):
        """The shape without its ignored fraction (the matmul the rows are compared with)."""
        return dataclasses.replace(self, ignored=None)

    def __str__(self):
        ignored = "" if self.ignored is None else f" {self.ignored:.0%} ignored"
        return f"N={self.N} H={self.H} V={self.V} {self.dtype}{ignored}"


def ignored_rows(shape):
    """A boolean mask (N,) of the ignored labels: every IGNORE_EVERY-th row, or each sequence's ignored prefix."""
    index = np.arange(shape.N)
    if shape.ignored is None:
        return index % IGNORE_EVERY == 0
    length = min(SEQUENCE, shape.N)
    return index % length < round(shape.ignored * length)


def accuracy_text(r):
    """A row's gradient errors for the progress lines (empty without them)."""
    if "grad_weight_rel_rms" not in r:
        return ""
    return f", dW err {r['grad_weight_rel_rms']:.1e}, dh err {r['grad_hidden_rel_rms']:.1e}"


def make_inputs(shape, device, seed=0):
    """hidden and weight (leaves that require grad; logits of unit scale, as a trained LM head gives roughly) and the
    labels, torch tensors: both packages' rows take the same values (the JAX rows through to_jax)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = getattr(torch, shape.dtype)
    hidden = torch.randn(shape.N, shape.H, device=device, generator=gen).to(dtype).requires_grad_()
    weight = (torch.randn(shape.V, shape.H, device=device, generator=gen) / shape.H**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, shape.V, (shape.N,), device=device, generator=gen)
    labels[torch.from_numpy(ignored_rows(shape)).to(device)] = IGNORE_INDEX
    return hidden, weight, labels


def to_jax(*tensors) -> list:
    """torch tensors as JAX arrays over the same memory (DLPack); int64 as int32 (JAX without x64)."""
    import jax.numpy as jnp
    import torch

    return [jnp.from_dlpack(t.detach().int() if t.dtype == torch.int64 else t.detach()) for t in tensors]


def float32_reference(hidden, weight, labels, chunk=1024, chunk_loss=None):
    """(loss, d hidden, d weight) in float32 (TF32 off), in row chunks so that it fits; torch tensors (JAX arrays come
    through DLPack). The loss: the sum of chunk_loss(float32 logits, rows) over the chunks, by default each chunk's
    share of the mean cross-entropy (fastce_torch's reference loss)."""
    import torch

    import fastce_torch

    h32, w32 = hidden.detach().float(), weight.detach().float()
    kept = (labels != IGNORE_INDEX).sum().clamp_min(1).float()
    loss = torch.zeros((), device=h32.device)
    grad_hidden = torch.empty_like(h32)
    grad_weight = torch.zeros_like(w32)
    tf32, torch.backends.cuda.matmul.allow_tf32 = torch.backends.cuda.matmul.allow_tf32, False
    try:
        for start in range(0, h32.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = (h32[rows] @ w32.t()).requires_grad_()
            if chunk_loss is None:
                share = fastce_torch.cross_entropy(logits, labels[rows], reduction="sum", backend="reference") / kept
            else:
                share = chunk_loss(logits, rows)
            (grad,) = torch.autograd.grad(share, logits)
            loss += share.detach()
            grad_hidden[rows] = grad @ w32
            grad_weight.addmm_(grad.t(), h32[rows])
            del logits, grad
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return loss, grad_hidden, grad_weight


def rel_rms(got, ref):
    """rms(got - ref) / rms(ref) of torch tensors, in float32."""
    return float((got.float() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt())


def parse_ignored(text):
    """'0,0.5,0.9' -> (0.0, 0.5, 0.9): fractions of ignored labels in [0, 1)."""
    fractions = tuple(float(item) for item in text.split(",") if item.strip())
    if not fractions or any(not 0.0 <= f < 1.0 for f in fractions):
        raise ValueError(f"--ignored: expected comma-separated fractions in [0, 1), got {text!r}")
    return fractions


LINEAR_SHAPES = (LinearShape(4096, 4096, 128256), LinearShape(8192, 4096, 128256), LinearShape(8192, 3584, 152064),
                 LinearShape(8192, 2304, 256000), LinearShape(32768, 4096, 128256))  # fmt: skip
QUICK_SHAPE = LinearShape(8192, 4096, 128256)

# The configurations both packages' linear_cross_entropy are timed in, as row-name suffixes and the keyword
# arguments of the call: the defaults, the float32 weight-gradient accumulator, a 1 GiB workspace, the matmuls over
# the kept rows only.
FASTCE_SETTINGS = {"": {}, "_f32acc": {"accumulate_in_float32": True}, "_1GiB": {"workspace_bytes": 1 << 30},
                   "_skip": {"skip_ignored_rows": True}}  # fmt: skip
# `--ignored`: each shape at each given fraction of ignored labels, these rows only (both packages at their defaults
# and skipping the ignored rows, and the other fused implementations).
IGNORED_IMPLS = ("fastce_torch_linear", "fastce_torch_linear_skip", "liger_flce", "cut_cross_entropy",
                 "torch_linear_ce")  # fmt: skip
IGNORED_JAX_IMPLS = ("fastce_jax_linear", "fastce_jax_linear_skip")
DEFAULT_IGNORED = (0.0, 0.5, 0.9)


def parse_linear_shapes(text):
    """'NxHxV[:dtype],...' -> LinearShapes (dtype defaults to bfloat16)."""
    return parse_shapes(text, LinearShape, "--linear-shapes", "NxHxV")
