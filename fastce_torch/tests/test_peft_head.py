"""patch_transformers(fused_linear=True) with PEFT on lm_head: a LoRA adapter is part of the fused loss exactly (the
loss and every gradient equal PEFT's own forward, dropout included), a modules_to_save copy is the head used, and
what cannot be fused (DoRA, other adapter types, a head with its own forward) raises before any number."""

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import fastce_torch  # noqa: E402

from .checks import tiny_causal_lm  # noqa: E402
from .test_transformers_fused import VOCAB, batch  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore:divide by zero:RuntimeWarning")


@pytest.fixture(autouse=True)
def unpatched():
    fastce_torch.unpatch_transformers()
    yield
    fastce_torch.unpatch_transformers()


def peft_model(device, **config):
    model = tiny_causal_lm("LlamaConfig", "LlamaForCausalLM", VOCAB, device)
    # init_lora_weights=False: B random, not zero, so an adapter the loss skipped would show.
    settings = dict(r=4, lora_alpha=8, target_modules=["lm_head", "q_proj"], init_lora_weights=False, **config)
    torch.manual_seed(3)
    return peft.get_peft_model(model, peft.LoraConfig(**settings)).train()


def step(model, ids, labels, seed=7):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the same dropout masks for both forwards
    out = model(input_ids=ids, labels=labels)
    if out.loss.requires_grad:  # not with merged adapters: PEFT's frozen base weights are all the forward uses
        out.loss.backward()
    return out, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_step(model, device, patch):
    ids, labels = batch(device)
    expected, expected_grads = step(model, ids, labels)
    fastce_torch.patch_transformers(fused_linear=True, **patch)
    got, grads = step(model, ids, labels)
    assert "logits" not in got.keys()
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    return got, grads


@pytest.mark.parametrize(
    "config, backend",
    [(dict(), "kernel"), (dict(lora_dropout=0.3), "reference"), (dict(lora_bias=True), "reference")],
    ids=["lora", "dropout", "lora_bias"],
)
def test_lora_on_lm_head_matches_peft(config, backend, device):
    model = peft_model(device, **config)
    got, grads = assert_same_step(model, device, dict(backend=backend))
    b_grads = [name for name in grads if "lm_head.lora_B" in name]
    assert b_grads and all(grads[name].abs().max() > 0 for name in b_grads)
    with model.disable_adapter(), torch.no_grad():  # the adapter changes the loss: skipping it would be caught
        base_loss = model(input_ids=batch(device)[0], labels=batch(device)[1]).loss
    assert abs(base_loss.item() - got.loss.item()) > 1e-3


def test_merged_and_two_adapters(device):
    model = peft_model(device)
    model.add_adapter("second", peft.LoraConfig(r=2, target_modules=["lm_head"], init_lora_weights=False))
    model.base_model.set_adapter(["default", "second"])  # both active: two low-rank terms in the product
    assert_same_step(model, device, dict(backend="reference"))
    fastce_torch.unpatch_transformers()
    model.merge_adapter()
    assert_same_step(model, device, dict(backend="reference"))


def test_modules_to_save_head(device):
    model = tiny_causal_lm("LlamaConfig", "LlamaForCausalLM", VOCAB, device)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    with torch.no_grad():  # the trained copy differs from the original head
        model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(3.0)
    _, grads = assert_same_step(model.train(), device, dict(backend="reference"))
    assert any("modules_to_save.default" in name for name in grads)


class QuantizedLikeLinear(torch.nn.Linear):
    """A head whose forward is its own (what bitsandbytes' layers are): its weight alone is not its output."""

    def forward(self, x):
        return super().forward(x) * 2.0


@pytest.mark.parametrize("head", ["dora", "ia3", "own_forward"])
def test_heads_that_cannot_be_fused_raise(head, device):
    model = tiny_causal_lm("LlamaConfig", "LlamaForCausalLM", VOCAB, device)
    if head == "dora":
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["lm_head"], use_dora=True))
        match = "LoRA variant"
    elif head == "ia3":
        config = peft.IA3Config(target_modules=["lm_head"], feedforward_modules=[])
        model = peft.get_peft_model(model, config)
        match = "other than LoRA"
    else:
        model.lm_head.__class__ = QuantizedLikeLinear
        match = "not nn.Linear's"
    fastce_torch.patch_transformers(fused_linear=True)
    with pytest.raises(TypeError, match=match):
        model.train()(input_ids=batch(device)[0], labels=batch(device)[1])
