"""The PyTorch implementations under test, each a function (logits, labels) -> mean loss, and their inputs."""

import torch
import torch.nn.functional as F

from . import fastce_loss
from .progress import optional
from .shapes import IGNORE_INDEX

TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _fill(logits, shape, device, seed):
    """The seeded values (the same for every implementation and for both input kinds) and the labels."""
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        logits.normal_(generator=gen)
    labels = torch.randint(0, shape.V, (shape.N,), generator=gen, device=device, dtype=torch.int64)
    labels[::7] = IGNORE_INDEX
    return labels


def make_inputs(shape, device, seed=0):
    """Fresh random logits as a *non-leaf* tensor with its own storage (as lm_head's output, where fastce_torch
    writes its gradient in place), and labels with every 7th token ignored. The autograd node above the logits (an
    expand+copy of a 0-d anchor) records the current stream: the CUDA-graph pass makes the inputs on its capture
    stream."""
    dtype = TORCH_DTYPES[shape.dtype]
    anchor = torch.zeros((), dtype=dtype, device=device, requires_grad=True)
    logits = anchor.expand(shape.N, shape.V).contiguous()
    labels = _fill(logits, shape, device, seed)
    assert not logits.is_leaf and logits.requires_grad
    return logits, labels


def make_leaf_inputs(shape, device, seed=0):
    """The same values as make_inputs, as a *leaf* tensor that requires grad (`loss.backward()` into logits.grad)."""
    logits = torch.empty(shape.N, shape.V, dtype=TORCH_DTYPES[shape.dtype], device=device)
    labels = _fill(logits, shape, device, seed)
    logits.requires_grad_(True)
    assert logits.is_leaf
    return logits, labels


def torch_eager_fp32_loss():
    """What transformers' ForCausalLMLoss does: upcast the whole logits to float32 first."""
    return lambda logits, labels: F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX)


def torch_eager_loss():
    """F.cross_entropy straight on the bf16 logits (log_softmax in bf16 storage)."""
    return lambda logits, labels: F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)


def torch_compile_loss():
    """torch.compile of the upcast version; dynamic=False so each shape gets its own specialised kernels."""
    return torch.compile(torch_eager_fp32_loss(), dynamic=False)


def liger_loss():
    # The cross_entropy module directly: it needs neither transformers nor peft.
    loss = optional("liger_kernel.transformers.cross_entropy", "LigerCrossEntropyLoss", "liger-kernel")
    return loss(ignore_index=IGNORE_INDEX, reduction="mean")


LOADERS = {"fastce_torch": lambda: fastce_loss("fastce_torch"), "torch_eager_fp32": torch_eager_fp32_loss,
           "torch_eager": torch_eager_loss, "torch_compile": torch_compile_loss, "liger": liger_loss}  # fmt: skip
