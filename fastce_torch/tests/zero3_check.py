"""patch_transformers(fused_linear=True) under a real DeepSpeed ZeRO-3 engine, one process per rank:

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m fastce_torch.tests.zero3_check
    torchrun --nproc-per-node 1 -m fastce_torch.tests.zero3_check --device cuda   # one GPU, NCCL

Each case builds the same seeded tiny Llama twice, wraps each in a ZeRO-3 engine (every parameter partitioned:
stage3_param_persistence_threshold 0, so lm_head's weight is an empty shard outside its module's forward) and
runs one training step on this rank's batch: once with the stock loss, once fused. The loss and every parameter's
full (reduce-scattered, then gathered) gradient must match, and so must the parameters after an SGD step. Cases:
plain head, tied embeddings, a PEFT LoRA adapter on lm_head, the plain head marked a ZeRO-3 leaf module, and
the LoRA head marked one (which must be refused); each with the backends DEFAULT_RUNS gives. Prints one line per
case and exits non-zero when any failed.
"""

import argparse
import functools
import os
import traceback

import torch

import fastce_torch
from fastce_torch.tests import checks
from fastce_torch.tests.checks import tiny_causal_lm

VOCAB = 300
# The plain-torch path ("reference": its backward reads the weight again) and the kernels' (gradients computed in
# the forward) for the plain and LoRA heads; the kernels' for the rest.
DEFAULT_RUNS = "plain:reference,plain:kernel,tied:kernel,lora:reference,lora:kernel,plain-leaf:kernel,lora-leaf:kernel"


def engine_for(model, device):
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
    }
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(params, lr=0.5), config=config)
    return engine


def build(case, device):
    model = tiny_causal_lm("LlamaConfig", "LlamaForCausalLM", VOCAB, device, tie_word_embeddings=case == "tied")
    if case.startswith("lora"):
        import peft

        torch.manual_seed(3)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["lm_head", "q_proj"], init_lora_weights=False)
        model = peft.get_peft_model(model, config)
    if case.endswith("-leaf"):
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, [type(model.get_output_embeddings())])
    return model.train()


def step(case, device, backend, rank):
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    engine = engine_for(build(case, device), device)
    if backend is not None:
        fastce_torch.patch_transformers(fused_linear=True, backend=backend)
    gen = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(1, VOCAB, (2, 8), generator=gen).to(device)
    labels = ids.clone()
    labels[0, :3] = -100
    out = engine(input_ids=ids, labels=labels)
    engine.backward(out.loss)
    named = [(name, p) for name, p in engine.module.named_parameters() if p.requires_grad]
    grads = {name: safe_get_full_grad(p).clone() for name, p in named}
    engine.step()
    params = {name: safe_get_full_fp32_param(p).clone() for name, p in named}
    fastce_torch.unpatch_transformers()
    return out, grads, params


@functools.cache
def stock_step(case, device, rank):
    """The stock loss's step, once per case for every backend checked against it."""
    return step(case, device, None, rank)


def check(case, device, backend, rank):
    if case == "lora-leaf":  # refused before any number (integrations/heads.py)
        try:
            step(case, device, backend, rank)
        except RuntimeError as error:
            assert "leaf module" in str(error), error
            fastce_torch.unpatch_transformers()
            return
        raise AssertionError("a LoRA head marked a ZeRO-3 leaf module was not refused")
    expected, expected_grads, expected_params = stock_step(case, device, rank)
    got, grads, params = step(case, device, backend, rank)
    assert "logits" not in got.keys(), "the fused route was not taken"
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == expected_grads.keys()
    lm_head = [name for name in grads if "lm_head" in name or (case == "tied" and "embed_tokens" in name)]
    assert lm_head and all(grads[name].abs().max() > 0 for name in lm_head), lm_head
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(params[name], expected_params[name], rtol=1e-4, atol=1e-6, msg=name)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runs", default=DEFAULT_RUNS, help="case:backend, comma-separated")
    args = parser.parse_args(argv)
    import deepspeed

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
    rank = torch.distributed.get_rank()
    failed = 0
    for run in args.runs.split(","):
        case, backend = run.split(":")
        try:
            check(case, device, backend, rank)
            print(f"zero3 {case} {backend} rank {rank}: ok", flush=True)
        except Exception as error:  # report every case, then fail
            failed += 1
            traceback.print_exc()
            print(f"zero3 {case} {backend} rank {rank}: FAIL {type(error).__name__}: {error}", flush=True)
    checks.exit_skipping_teardown(failed)


if __name__ == "__main__":
    main()
