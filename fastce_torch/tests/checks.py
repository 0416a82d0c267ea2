"""fastce_torch's results against the repository's float64 reference, with its one tolerance model: the logic is
shared_tests' (reference.expected, tolerances.assert_loss / assert_grad); this module only turns tensors into
host arrays. The same names as fastce_jax/tests/checks.py. Also the collectives the vocab-parallel rank checks
(*_check.py under torch.distributed.run) gather their results with."""

import contextlib
import os
import sys

import torch

import fastce_torch  # noqa: F401  (before triton: chooses Triton's interpreter on a CPU machine)
from shared_tests import harness, interpreter_patching, reference, tolerances

# Here too for the rank processes (torch.distributed.run), which load no conftest.
interpreter_patching.install()


@contextlib.contextmanager
def poisoned_allocations():
    """Every buffer allocated with torch.empty / empty_like starts as NaN (integers as -2**30), so an element a
    kernel forgets to write shows up instead of a lucky zero."""
    empty, empty_like = torch.empty, torch.empty_like

    def poisoned(out):
        return out.fill_(float("nan")) if out.is_floating_point() else out.fill_(-(2**30))

    torch.empty = lambda *args, **kwargs: poisoned(empty(*args, **kwargs))
    torch.empty_like = lambda *args, **kwargs: poisoned(empty_like(*args, **kwargs))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like


def as_float64(tensor):
    """The values a tensor holds (bf16 / fp16 / fp32 are exact in float64), on the host."""
    return tensor.detach().to("cpu", torch.float64).numpy()


def expected(logits, labels, reduction="none", n_items=None, upstream=None, **options):
    """The float64 reference on exactly the values the kernels read (logits already rounded to their dtype)."""
    upstream = None if upstream is None else as_float64(upstream)
    return reference.expected(as_float64(logits), labels.cpu().numpy(), reduction, n_items, upstream, **options)


def assert_loss(loss, ref, what="loss"):
    return tolerances.assert_loss(as_float64(loss), ref, what, dtype=loss.dtype)


def assert_grad(grad, ref, what="grad"):
    """The gradient against the reference, in ulps of its own dtype (Triton's interpreter truncates to bfloat16:
    tolerances.reference_ulps)."""
    from fastce_torch.core.launch import INTERPRETED

    ulps = tolerances.reference_ulps(grad.dtype, truncating_bf16=INTERPRETED and not grad.is_cuda)
    return tolerances.assert_grad(as_float64(grad), ref, grad.dtype, what, ulps=ulps)


# A one-layer decoder small enough for Triton's interpreter; the tests override what they exercise.
TINY_DECODER = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=32,
)


def tiny_causal_lm(config_name, class_name, vocab, device, seed=0, dtype=torch.float32, **config):
    """A tiny random transformers causal LM (e.g. "LlamaConfig", "LlamaForCausalLM"), seeded."""
    import transformers

    settings = {**TINY_DECODER, "vocab_size": vocab, **config}
    model_config = getattr(transformers, config_name)(**settings)
    torch.manual_seed(seed)
    return getattr(transformers, class_name)(model_config).to(device=device, dtype=dtype)


def gather_columns(local, widths, group):
    """The full (..., V) tensor from every rank's columns (all_gather needs one size: pad to the widest)."""
    widest = max(widths)
    padded = torch.zeros((*local.shape[:-1], widest), dtype=local.dtype, device=local.device)
    padded[..., : local.shape[-1]] = local
    pieces = [torch.empty_like(padded) for _ in widths]
    torch.distributed.all_gather(pieces, padded.contiguous(), group=group)
    return torch.cat([p[..., :w] for p, w in zip(pieces, widths)], dim=-1)


def same_on_every_rank(tensor, group):
    pieces = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(pieces, tensor.contiguous(), group=group)
    return all(torch.equal(harness.bits(p), harness.bits(pieces[0])) for p in pieces)


def argument_sets(parser, argv):
    """`--then` separates argument sets that one torch.distributed.run launch runs in turn (one set of processes
    paying the imports and the interpreter's warm-up once): each set parsed by `parser`, all on one device."""
    sets, current = [], []
    for arg in [*argv, "--then"]:
        if arg != "--then":
            current.append(arg)
            continue
        sets.append(parser.parse_args(current))
        current = []
    if len({args.device for args in sets}) != 1:
        raise SystemExit("every argument set runs on the same device")
    return sets


def exit_skipping_teardown(failed):
    """Wait for every rank, then leave without tearing the process groups down: gloo's teardown sometimes aborts at
    exit ("terminate called without an active exception") after every check has passed, which would fail the run
    for nothing. The exit status says whether this rank saw a failure."""
    torch.distributed.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failed else 0)


def chunk_logits_rows(monkeypatch, module):
    """The rows of every logits matmul that the chunk loops run through `module`'s chunk_logits (the LM-head engine's,
    linear/engine.py), in call order (a list that fills as the loop runs): the skip_ignored_rows tests count what was
    actually computed."""
    rows = []
    original = module.chunk_logits

    def spy(workspace, hidden_chunk, weight, bias):
        rows.append(hidden_chunk.shape[0])
        return original(workspace, hidden_chunk, weight, bias)

    monkeypatch.setattr(module, "chunk_logits", spy)
    return rows
