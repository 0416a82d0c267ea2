"""fastce_torch.patch_trl(): TRL's SFTTrainer and GRPOTrainer take one training step on a tiny random Llama through
fastce's kernels (the CPU: Triton's interpreter; --gpu: CUDA) with the losses, metrics and the parameters after an
SGD step of TRL's own fused head, and fastce is what computed them."""

import pytest
import torch

pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import fastce_torch  # noqa: E402
from fastce_torch.integrations import trl as fastce_trl  # noqa: E402

from .checks import tiny_causal_lm  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")
VOCAB = 300
WORDS = [f"w{i}" for i in range(VOCAB - 3)]  # ids 3.. (0, 1, 2: pad, unk, eos)


@pytest.fixture(autouse=True)
def unpatched():
    fastce_torch.unpatch_trl()
    yield
    fastce_torch.unpatch_trl()


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, **{word: i + 3 for i, word in enumerate(WORDS)}}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")


@pytest.fixture
def calls(monkeypatch):
    """How many times fastce computed TRL's head."""
    seen = []
    compute = fastce_trl.linear_cross_entropy
    monkeypatch.setattr(fastce_trl, "linear_cross_entropy", lambda *a, **k: seen.append(1) or compute(*a, **k))
    return seen


def common_args(device):
    # bf16=False: TRL's configs default to bf16 autocast, whose rounding would hide a float32 difference.
    return dict(
        output_dir="unused", max_steps=1, learning_rate=0.5, optim="sgd", report_to=[], logging_steps=1,
        save_strategy="no", seed=0, bf16=False, use_cpu=device.type == "cpu", dataloader_num_workers=0,
        disable_tqdm=True,
    )  # fmt: skip


def train_one_step(make_trainer, device, patch):
    if patch:
        fastce_torch.patch_trl(backend="kernel" if device.type == "cpu" else "auto")
    model = tiny_causal_lm("LlamaConfig", "LlamaForCausalLM", VOCAB, device, pad_token_id=0, eos_token_id=2)
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    trainer = make_trainer(model)
    trainer.train()
    fastce_torch.unpatch_trl()
    params = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    return trainer.state.log_history[0], params, start


def assert_same_step(make_trainer, device, metrics):
    expected, expected_params, start = train_one_step(make_trainer, device, patch=False)
    got, params, _ = train_one_step(make_trainer, device, patch=True)
    for key in metrics:
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-6), key
    assert max((expected_params[n] - start[n]).abs().max() for n in start) > 1e-3  # the step moved the model
    for name, param in expected_params.items():
        torch.testing.assert_close(params[name], param, rtol=1e-5, atol=1e-6, msg=name)


def test_sft_step_matches_trl(tokenizer, calls, device, tmp_path):
    gen = torch.Generator().manual_seed(0)
    texts = [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (12,), generator=gen)) for _ in range(4)]
    data = datasets.Dataset.from_dict({"text": texts})
    config = trl.SFTConfig(**{**common_args(device), "output_dir": str(tmp_path)}, per_device_train_batch_size=4)

    def make_trainer(model):
        return trl.SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer)

    assert_same_step(make_trainer, device, ["loss", "grad_norm", "entropy", "mean_token_accuracy"])
    assert len(calls) == 1  # the patched step's one forward


def test_grpo_step_matches_trl(tokenizer, calls, device, tmp_path):
    prompts = datasets.Dataset.from_dict({"prompt": [" ".join(WORDS[k : k + 5]) for k in range(0, 8, 2)]})

    def reward(completions, completion_ids, **kwargs):  # differs between a prompt's two completions
        return [float(sum(ids)) for ids in completion_ids]

    config = trl.GRPOConfig(
        **{**common_args(device), "output_dir": str(tmp_path)}, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=4,
    )  # fmt: skip

    def make_trainer(model):
        return trl.GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=prompts,
                               processing_class=tokenizer)  # fmt: skip

    # The policy-gradient loss is 0 at the first step (importance ratio 1, advantages summing to 0): its gradient,
    # and so the parameters after the step, are what the head's log-probabilities decide.
    assert_same_step(make_trainer, device, ["loss", "grad_norm", "entropy", "reward"])
    assert calls  # the log-probabilities (and entropies) of the step came from fastce


def test_outputs_fastce_lacks_stay_trls(device):
    """mean_logits / log_sum_sq_probs (DPO, KTO) and a logit scale of 0 go to TRL's own function, exactly."""
    fastce_torch.patch_trl()
    original = fastce_trl.state["original"]
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(6, 32, generator=gen).to(device)
    weight = torch.randn(VOCAB, 32, generator=gen).to(device)
    targets = torch.randint(0, VOCAB, (6,), generator=gen).to(device)
    for scale, outputs in [(1.0, ("log_probs", "mean_logits")), (0.0, ("log_probs",))]:
        expected = original.apply(hidden, weight, None, targets, 1.0, 64, None, scale, outputs)
        got = trl.trainer.utils._ChunkedLogProbFunction.apply(
            hidden, weight, None, targets, 1.0, 64, None, scale, outputs
        )
        for a, b in zip(got, expected):
            assert (a is None and b is None) or torch.equal(a, b)


def test_patch_and_unpatch(device):
    original = trl.trainer.utils._ChunkedLogProbFunction
    fastce_torch.patch_trl()
    fastce_torch.patch_trl(backend="reference")  # idempotent: only the options change
    assert trl.trainer.utils._ChunkedLogProbFunction is fastce_trl.FastceLogProbs
    assert fastce_trl.state["original"] is original and fastce_trl.state["options"] == {"backend": "reference"}
    fastce_torch.unpatch_trl()
    assert trl.trainer.utils._ChunkedLogProbFunction is original
    with pytest.raises(ValueError, match="backend"):
        fastce_torch.patch_trl(backend="triton")
