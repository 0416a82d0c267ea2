"""patch_transformers(): a tiny random LlamaForCausalLM trains identically with and without the patch (CPU: fastce's
torch reference and the Triton kernels in the interpreter; --gpu: CUDA)."""

import os
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.loss import loss_utils  # noqa: E402

import fastce_torch  # noqa: E402
from fastce_torch.transformers import fastce_for_causal_lm_loss  # noqa: E402

from .checks import tiny_causal_lm  # noqa: E402

# Triton's interpreter warns on masked lanes (log of 0) and on numpy scalar conversions; neither is ours.
pytestmark = pytest.mark.filterwarnings(
    "ignore:divide by zero:RuntimeWarning",
    "ignore:invalid value:RuntimeWarning",
    "ignore:Conversion of an array:DeprecationWarning",
)

VOCAB = 1000  # not a power of two: the kernels' last tile is partial
BACKENDS = ["reference", "kernel"]
# What patch_transformers() is given: fastce's torch reference, and the kernels (Triton's interpreter on the CPU).
PATCHES = [dict(backend="reference"), dict(backend="kernel")]
PATCH_IDS = ["reference", "kernel"]
ORIGINAL = loss_utils.ForCausalLMLoss


@pytest.fixture(autouse=True)
def unpatched():
    """Every test starts and ends with transformers untouched, whatever it asserted."""
    fastce_torch.unpatch_transformers()
    yield
    fastce_torch.unpatch_transformers()


def tiny_llama(device, dtype=torch.float32, seed=0):
    larger = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    return tiny_causal_lm(
        "LlamaConfig", "LlamaForCausalLM", VOCAB, device, seed, dtype, num_key_value_heads=2,
        max_position_embeddings=64, **larger,
    )  # fmt: skip


def batch(device, batch_size=2, seq_len=16, seed=1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch_size, seq_len), generator=generator)
    labels = ids.clone()
    labels[0, :5] = -100  # a masked prompt
    labels[1, -3:] = -100  # padding
    return ids.to(device), labels.to(device)


def loss_and_grads(model, ids, labels, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, **kwargs)
    out.loss.backward()
    return out.loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def assert_grads_close(grads, expected, rtol, atol):
    assert grads.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(grads[name], expected[name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("patch", PATCHES, ids=PATCH_IDS)
def test_loss_and_gradients_match_transformers(device, patch):
    model = tiny_llama(device)
    ids, labels = batch(device)
    expected_loss, expected_grads = loss_and_grads(model, ids, labels)
    fastce_torch.patch_transformers(**patch)
    assert model.loss_function is fastce_for_causal_lm_loss
    loss, grads = loss_and_grads(model, ids, labels)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-6)
    assert_grads_close(grads, expected_grads, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("num_items", [7, "tensor", "float tensor"])
@pytest.mark.parametrize("patch", PATCHES, ids=PATCH_IDS)
def test_num_items_in_batch(device, patch, num_items):
    """transformers divides the summed loss by num_items_in_batch (gradient accumulation across micro-batches)."""
    num_items = {"tensor": torch.tensor(7), "float tensor": torch.tensor(3.5)}.get(num_items, num_items)
    model = tiny_llama(device)
    ids, labels = batch(device)
    expected_loss, expected_grads = loss_and_grads(model, ids, labels, num_items_in_batch=num_items)
    mean_loss, _ = loss_and_grads(model, ids, labels)
    fastce_torch.patch_transformers(**patch)
    loss, grads = loss_and_grads(model, ids, labels, num_items_in_batch=num_items)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-6, atol=1e-6)
    assert_grads_close(grads, expected_grads, rtol=1e-4, atol=1e-6)
    counted = int((labels[:, 1:] != -100).sum())  # the shifted labels that count
    torch.testing.assert_close(loss, mean_loss * counted / float(num_items), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_function_arguments(device, backend):
    """The function itself against transformers' on every argument: shift_labels, ignore_index, num_items_in_batch
    as int / 0-d / 1-element tensor, 3-D and flattened logits, labels on another device."""
    fastce_torch.patch_transformers(backend=backend)
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 9, VOCAB, generator=generator).to(device)
    labels = torch.randint(0, VOCAB, (3, 9), generator=generator).to(device)
    labels[1, 2:6] = -100
    other_ignore = torch.where(labels == -100, -1, labels)
    shift = torch.randint(0, VOCAB, (3, 9), generator=generator).to(device)
    shift[2, :4] = -100
    cases = [
        (labels, dict()),
        (other_ignore, dict(ignore_index=-1)),
        (labels, dict(num_items_in_batch=11)),
        (labels, dict(num_items_in_batch=torch.tensor(11))),
        (labels, dict(num_items_in_batch=torch.tensor([11.0]))),  # DataParallel's shape: a (1,) loss
        (labels, dict(shift_labels=shift)),
        (labels, dict(shift_labels=shift, num_items_in_batch=5)),
        (labels, dict(some_model_kwarg=True)),
    ]
    for case_labels, kwargs in cases:
        x = logits.clone().requires_grad_()
        expected = ORIGINAL(x, case_labels, VOCAB, **kwargs)
        (expected_grad,) = torch.autograd.grad(expected.sum(), x)
        y = logits.clone().requires_grad_()
        # y * 1.0 is a non-leaf, like lm_head's output, so the in-place backward runs; labels come from the CPU.
        loss = fastce_for_causal_lm_loss(y * 1.0, case_labels.cpu(), VOCAB, **kwargs)
        (grad,) = torch.autograd.grad(loss.sum(), y)
        assert loss.shape == expected.shape, kwargs
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6, msg=str(kwargs))
        torch.testing.assert_close(grad, expected_grad, rtol=1e-4, atol=1e-7, msg=str(kwargs))
    # Flattened (tokens, V) logits with flattened labels, as some models call it.
    x = logits.clone().requires_grad_()
    torch.testing.assert_close(
        fastce_for_causal_lm_loss(x.view(-1, VOCAB), labels.view(-1), VOCAB),
        ORIGINAL(x.view(-1, VOCAB), labels.view(-1), VOCAB),
        rtol=1e-5,
        atol=1e-6,
    )


def test_bf16_logits_are_not_upcast_and_backward_is_in_place(device):
    """bf16 logits go to the kernel as they are (no float32 (tokens x V) copy is saved for backward), and the
    gradient is written into lm_head's output buffer: after backward, outputs.logits holds dL/dlogits."""
    model = tiny_llama(device, torch.bfloat16)
    ids, labels = batch(device)
    out = model(input_ids=ids, labels=labels)
    out.logits.retain_grad()
    out.loss.backward()
    expected_loss, expected_logits_grad = out.loss.detach(), out.logits.grad.float()
    expected_grads = {name: p.grad.float() for name, p in model.named_parameters()}

    fastce_torch.patch_transformers(backend="kernel")
    model.zero_grad(set_to_none=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, t.numel())) or t, lambda t: t):
        out = model(input_ids=ids, labels=labels)
    logits_size = ids.numel() * VOCAB
    assert out.logits.dtype == torch.bfloat16
    assert (torch.float32, logits_size) not in saved  # no upcast copy kept alive
    assert (torch.bfloat16, logits_size) in saved  # the kernel's residual: the bf16 logits themselves
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), expected_loss, rtol=1e-5, atol=1e-5)
    # Both gradients are float32-accurate and rounded once to bf16.
    torch.testing.assert_close(out.logits.detach().float(), expected_logits_grad, rtol=1.6e-2, atol=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.float(), expected_grads[name], rtol=5e-2, atol=1e-3, msg=name)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("patch", PATCHES, ids=PATCH_IDS)
def test_training_steps_reach_the_same_parameters(device, patch, optimizer):
    def train(patched):
        if patched:
            fastce_torch.patch_transformers(**patch)
        model = tiny_llama(device)
        make = {
            "sgd": lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9),
            "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01),
        }[optimizer]
        opt = make(model.parameters())
        losses = []
        for step in range(3):
            ids, labels = batch(device, seed=10 + step)
            loss = model(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(25)).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
        fastce_torch.unpatch_transformers()
        return losses, dict(model.named_parameters())

    expected_losses, expected_params = train(False)
    losses, params = train(True)
    assert losses == pytest.approx(expected_losses, rel=1e-5)
    for name, p in expected_params.items():
        torch.testing.assert_close(params[name], p, rtol=1e-4, atol=1e-5, msg=name)


def test_gemma2_softcapping_is_applied_once(device):
    """Gemma 2 softcaps its logits in forward, before the loss: the patched loss must not cap them again."""
    gemma2 = dict(hidden_size=64, intermediate_size=128, head_dim=32, final_logit_softcapping=3.0)
    model = tiny_causal_lm("Gemma2Config", "Gemma2ForCausalLM", VOCAB, device, max_position_embeddings=64, **gemma2)
    with torch.no_grad():
        model.lm_head.weight.mul_(50.0)  # logits well beyond the cap, so capping twice would change the loss
    ids, labels = batch(device)
    expected_loss, expected_grads = loss_and_grads(model, ids, labels)
    fastce_torch.patch_transformers(backend="kernel")
    loss, grads = loss_and_grads(model, ids, labels)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert_grads_close(grads, expected_grads, rtol=1e-4, atol=1e-6)


def test_patch_is_idempotent_and_unpatch_restores_exactly():
    import transformers.trainer as trainer_module  # holds its own `ForCausalLMLoss` name

    before = dict(loss_utils.LOSS_MAPPING)
    aliases = {key for key, fn in before.items() if fn is ORIGINAL}
    assert {"ForCausalLM", "ForConditionalGeneration"} <= aliases
    for _ in range(2):
        fastce_torch.patch_transformers()
        assert {k for k, fn in loss_utils.LOSS_MAPPING.items() if fn is fastce_for_causal_lm_loss} == aliases
        assert all(loss_utils.LOSS_MAPPING[k] is fn for k, fn in before.items() if k not in aliases)
        assert loss_utils.ForCausalLMLoss is fastce_for_causal_lm_loss
        assert trainer_module.ForCausalLMLoss is fastce_for_causal_lm_loss
    fastce_torch.patch_transformers(backend="reference")  # re-patching only changes the options
    assert loss_utils.LOSS_MAPPING["ForCausalLM"] is fastce_for_causal_lm_loss
    fastce_torch.unpatch_transformers()
    assert loss_utils.LOSS_MAPPING.keys() == before.keys()
    assert all(loss_utils.LOSS_MAPPING[k] is fn for k, fn in before.items())
    assert loss_utils.ForCausalLMLoss is ORIGINAL and trainer_module.ForCausalLMLoss is ORIGINAL
    fastce_torch.unpatch_transformers()  # unpatching twice is harmless
    assert loss_utils.LOSS_MAPPING == before


def test_unpatch_reaches_modules_imported_while_patched():
    """A module that does `from transformers.loss.loss_utils import ForCausalLMLoss` while patched gets fastce's
    function; unpatch finds it there too."""
    import sys
    import types

    fastce_torch.patch_transformers()
    late = types.ModuleType("transformers._fastce_test_late_import")
    late.ForCausalLMLoss = loss_utils.ForCausalLMLoss
    sys.modules[late.__name__] = late
    try:
        assert late.ForCausalLMLoss is fastce_for_causal_lm_loss
        fastce_torch.unpatch_transformers()
        assert late.ForCausalLMLoss is ORIGINAL
    finally:
        del sys.modules[late.__name__]


@pytest.mark.parametrize("backend", BACKENDS)
def test_extra_options_reach_the_loss(device, backend):
    """patch_transformers(label_smoothing=...) is passed on: torch's smoothed cross-entropy of the shifted labels."""
    fastce_torch.patch_transformers(backend=backend, label_smoothing=0.1)
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 7, VOCAB, generator=generator).to(device)
    labels = torch.randint(0, VOCAB, (2, 7), generator=generator).to(device)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    expected = torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), shifted.reshape(-1), label_smoothing=0.1)
    torch.testing.assert_close(fastce_for_causal_lm_loss(logits, labels, VOCAB), expected, rtol=1e-5, atol=1e-6)


def test_bad_options_are_rejected():
    with pytest.raises(ValueError, match="backend"):
        fastce_torch.patch_transformers(backend="cuda")
    with pytest.raises(TypeError, match="logit_softcapping"):  # the model caps its logits itself
        fastce_torch.patch_transformers(logit_softcapping=30.0)
    with pytest.raises(TypeError, match="reduction"):
        fastce_torch.patch_transformers(reduction="sum")
    with pytest.raises(TypeError, match="unexpected"):
        fastce_torch.patch_transformers(inplace=True)
    assert loss_utils.LOSS_MAPPING["ForCausalLM"] is ORIGINAL


def test_models_look_the_loss_up_on_each_call(device):
    """A model built while patched uses transformers' own loss again after unpatch."""
    fastce_torch.patch_transformers()
    model = tiny_llama(device)
    assert model.loss_function is fastce_for_causal_lm_loss
    fastce_torch.unpatch_transformers()
    assert model.loss_function is ORIGINAL


def test_patched_llama_compiles_without_graph_break(device):
    """torch.compile(fullgraph=True) over the whole patched model: the fused loss is custom ops in the graph."""
    model = tiny_llama(device)
    ids, labels = batch(device)
    expected_loss, expected_grads = loss_and_grads(model, ids, labels)
    fastce_torch.patch_transformers(backend="kernel")
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled.zero_grad(set_to_none=True)
    out = compiled(input_ids=ids, labels=labels)
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), expected_loss, rtol=1e-6, atol=1e-6)
    assert_grads_close({name: p.grad for name, p in model.named_parameters()}, expected_grads, rtol=1e-4, atol=1e-6)
    torch._dynamo.reset()


def test_unpatched_models_are_exactly_the_documented_ones():
    """Scan the installed transformers for *ForCausalLM classes whose forward builds CrossEntropyLoss itself instead
    of calling self.loss_function: the patch cannot reach them, and COMPUTE_THEIR_OWN_LOSS (and README) list them."""
    import inspect
    import pkgutil

    import transformers.models as models

    from fastce_torch.transformers import COMPUTE_THEIR_OWN_LOSS

    own_loss = set()
    for info in pkgutil.iter_modules(models.__path__):
        path = os.path.join(models.__path__[0], info.name, f"modeling_{info.name}.py")
        if not os.path.exists(path):
            continue
        source = open(path, encoding="utf-8").read()
        for match in re.finditer(r"\nclass (\w+ForCausalLM)\(.*?\):(.*?)(?=\nclass |\Z)", source, re.S):
            forward = match.group(2)[match.group(2).find("def forward") :]
            if ("CrossEntropyLoss" in forward or "cross_entropy(" in forward) and "self.loss_function" not in forward:
                own_loss.add(match.group(1))
    assert own_loss == set(COMPUTE_THEIR_OWN_LOSS)
    # And a patched Llama does go through fastce (the covered side of the line).
    fastce_torch.patch_transformers()
    assert inspect.unwrap(tiny_llama("cpu").loss_function) is fastce_for_causal_lm_loss
