"""patch_transformers(fused_linear=True): tiny random models of every FUSED_MODELS family train with the same loss
and gradients as transformers' own forward, without logits (CPU: fastce's torch reference and the Triton kernels in
the interpreter; --gpu: CUDA)."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fastce_torch  # noqa: E402
from fastce_torch.integrations import transformers as patch_module  # noqa: E402

from .checks import tiny_causal_lm  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    "ignore:divide by zero:RuntimeWarning",
    "ignore:invalid value:RuntimeWarning",
    "ignore:Conversion of an array:DeprecationWarning",
)

VOCAB = 300
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16)),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    ),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", dict(head_dim=16)),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(head_dim=16, final_logit_softcapping=3.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=16, final_logit_softcapping=3.0)),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0)),
}
MOE = {"mixtral": "router_aux_loss_coef", "qwen3_moe": "router_aux_loss_coef"}


@pytest.fixture(autouse=True)
def unpatched():
    fastce_torch.unpatch_transformers()
    yield
    fastce_torch.unpatch_transformers()


def tiny(family, device, seed=0):
    config_name, class_name, extra = FAMILIES[family]
    if family in MOE:
        extra = dict(extra, output_router_logits=True)  # the auxiliary loss must still be added by the model
    model = tiny_causal_lm(config_name, class_name, VOCAB, device, seed, **extra)
    if getattr(model.config, "final_logit_softcapping", None):
        with torch.no_grad():  # logits well beyond the cap, so a cap applied twice or not at all shows
            model.lm_head.weight.mul_(30.0)
    return model.train()


def batch(device, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (2, 8), generator=gen)
    labels = ids.clone()
    labels[0, :3] = -100
    labels[1, -2:] = -100
    return ids.to(device), labels.to(device)


def loss_and_grads(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    return out, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_training_step(model, inputs, patch, rtol=1e-5, atol=1e-6):
    expected, expected_grads = loss_and_grads(model, **inputs)
    fastce_torch.patch_transformers(fused_linear=True, **patch)
    got, grads = loss_and_grads(model, **inputs)
    assert got.logits is None and "logits" not in got.keys()
    torch.testing.assert_close(got.loss, expected.loss, rtol=rtol, atol=atol)
    assert grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    return got


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_stock_training_step(family, device):
    model = tiny(family, device)
    ids, labels = batch(device)
    got = assert_same_training_step(model, dict(input_ids=ids, labels=labels), dict(backend="kernel"))
    if family in MOE:
        assert got.aux_loss is not None and got.aux_loss > 0


@pytest.mark.parametrize(
    "extra",
    [
        dict(num_items_in_batch=7),
        dict(num_items_in_batch=torch.tensor(7)),
        dict(num_items_in_batch=torch.tensor([7.0])),
        dict(shift_labels="given"),
        dict(ignore_index=5),
    ],
    ids=["n_items", "n_items-tensor", "n_items-1-element", "shift_labels", "ignore_index"],
)
@pytest.mark.parametrize("backend", ["reference", "kernel"])
def test_loss_keywords(extra, backend, device):
    model = tiny("llama", device)
    ids, labels = batch(device)
    if extra.get("shift_labels") == "given":
        gen = torch.Generator().manual_seed(9)
        extra = dict(shift_labels=torch.randint(0, VOCAB, (2, 8), generator=gen).to(device))
        extra["shift_labels"][0, :4] = -100
    if "ignore_index" in extra:
        labels = torch.where(labels == -100, extra["ignore_index"], labels)
    assert_same_training_step(model, dict(input_ids=ids, labels=labels, **extra), dict(backend=backend))


def test_gemma2_softcap_is_fused_once(device):
    """With the weights scaled, capped and uncapped losses differ a lot; the fused loss equals the stock one."""
    model = tiny("gemma2", device)
    ids, labels = batch(device)
    got = assert_same_training_step(model, dict(input_ids=ids, labels=labels), dict(backend="kernel"))
    with torch.no_grad():
        uncapped = torch.nn.functional.cross_entropy(
            model.lm_head(model.model(input_ids=ids).last_hidden_state)[:, :-1].reshape(-1, VOCAB),
            labels[:, 1:].reshape(-1),
        )
    assert abs(uncapped.item() - got.loss.item()) > 1.0


def test_eval_and_no_labels_are_unchanged(device):
    model = tiny("llama", device)
    ids, labels = batch(device)
    model.eval()
    expected = model(input_ids=ids, labels=labels)
    fastce_torch.patch_transformers(fused_linear=True, backend="kernel")
    got = model(input_ids=ids, labels=labels)
    torch.testing.assert_close(got.logits, expected.logits)
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-5, atol=1e-6)
    model.train()
    no_labels = model(input_ids=ids)
    assert no_labels.loss is None and no_labels.logits.shape == (2, 8, VOCAB)


def test_return_dict_false_drops_the_logits(device):
    model = tiny("llama", device)
    ids, labels = batch(device)
    expected = model(input_ids=ids, labels=labels, return_dict=False)
    fastce_torch.patch_transformers(fused_linear=True, backend="kernel")
    got = model(input_ids=ids, labels=labels, return_dict=False)
    assert len(got) == len(expected) - 1 and all(
        t is None or t.shape[-1] != VOCAB for t in got[1:] if torch.is_tensor(t)
    )
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)


def test_unpatch_and_repatch_restore_the_forwards():
    classes = list(patch_module.fused_model_classes())
    assert len(classes) == len(patch_module.FUSED_MODELS)
    originals = {cls: cls.forward for cls in classes}
    fastce_torch.patch_transformers(fused_linear=True)
    assert all(cls.forward is not originals[cls] for cls in classes)
    fastce_torch.patch_transformers(fused_linear=True)  # idempotent: wrapped once
    assert all(cls.forward.__fastce_original__ is originals[cls] for cls in classes)
    fastce_torch.patch_transformers()  # without fused_linear: the forwards go back
    assert all(cls.forward is originals[cls] for cls in classes)
    fastce_torch.patch_transformers(fused_linear=True)
    fastce_torch.unpatch_transformers()
    assert all(cls.forward is originals[cls] for cls in classes)


def test_lm_head_hooks_still_run(device):
    """lm_head is still called through nn.Module.__call__ (what FSDP's parameter gathering relies on)."""
    model = tiny("llama", device)
    ids, labels = batch(device)
    seen = []
    model.lm_head.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape))
    fastce_torch.patch_transformers(fused_linear=True, backend="kernel")
    model(input_ids=ids, labels=labels).loss.backward()
    assert seen == [(2, 8, 32)]
    fastce_torch.unpatch_transformers()
    assert "forward" not in vars(model.lm_head)  # the dispatching forward goes with the patch


def _graph_shapes(graphs):
    values = [node.meta.get("val", node.meta.get("example_value")) for gm in graphs for node in gm.graph.nodes]
    return [tuple(value.shape) for value in values if isinstance(value, torch.Tensor)]


def test_under_torch_compile_the_fused_route_is_kept(device):
    """fullgraph compile of a fused-patched model: no graph break, the stock loss and gradients, and no tensor with
    the vocabulary as a dimension in the traced graphs (forward and backward) except the head's weight."""
    from torch._dynamo.backends.common import aot_autograd

    stock = tiny("llama", device)
    ids, labels = batch(device)
    expected, expected_grads = loss_and_grads(stock, input_ids=ids, labels=labels)
    fastce_torch.patch_transformers(fused_linear=True, backend="kernel")
    # Made after the patch, as users load models (before torch 2.13 compile needs that, or one eager forward first).
    model = tiny("llama", device)
    model.load_state_dict(stock.state_dict())
    torch._dynamo.reset()
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    compiled = torch.compile(model, fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    model.zero_grad(set_to_none=True)
    got = compiled(input_ids=ids, labels=labels)
    got.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}  # the compiled wrapper shares them
    torch._dynamo.reset()
    assert "logits" not in got.keys()
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-5, atol=1e-6)
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    shapes = _graph_shapes(graphs)
    assert len(graphs) == 2 and (VOCAB, 32) in shapes  # the forward and backward graphs, which hold the weight
    assert not [shape for shape in shapes if VOCAB in shape and shape != (VOCAB, 32)], shapes


def test_compile_of_a_model_made_before_the_patch(device):
    """A model made before patch_transformers(fused_linear=True) and compiled before any eager call: torch >= 2.13
    keeps the fused route (the test above's path); older torch traces lm_head's stock forward, which fastce refuses
    with what to do rather than a silently unfused loss."""
    from fastce_torch.integrations import transformers as patch

    model = tiny("llama", device)
    ids, labels = batch(device)
    fastce_torch.patch_transformers(fused_linear=True, backend="kernel")
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    try:
        if patch.COMPILE_TRACES_OLD_FORWARD:
            with pytest.raises(Exception, match="create the model after"):
                compiled(input_ids=ids, labels=labels)
        else:
            assert "logits" not in compiled(input_ids=ids, labels=labels).keys()
    finally:
        torch._dynamo.reset()


def test_compile_check_sees_logits(device):
    """The graph check above can fail: unpatched, the compiled model's graphs hold (2, 8, V) logits."""
    model = tiny("llama", device)
    ids, labels = batch(device)
    graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=lambda gm, inputs: graphs.append(gm) or gm)
    compiled(input_ids=ids, labels=labels)
    torch._dynamo.reset()
    assert (2, 8, VOCAB) in _graph_shapes(graphs)
