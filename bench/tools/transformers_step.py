"""Training-step time and peak memory of a Hugging Face Llama with transformers' own loss and with
fastce_torch.patch_transformers(): same weights, same batches, same optimizer.

    python -m bench.tools.transformers_step --json bench/results/transformers-step-h200.json

Defaults: Llama-3.2-1B's shape cut to 2 layers, bf16, AdamW, 8 x 1024 tokens, so the logits dominate the step; the
median CUDA-event step time after --warmup steps and the peak memory. `--device cpu`: a tiny smoke run.
"""

import argparse
import gc
import statistics
import sys

import torch
import transformers

import fastce_torch

from .. import envinfo
from ..progress import aligned
from ..report import write_json
from ..torch_measure import timed

MODES = {
    "transformers": None,  # transformers' ForCausalLMLoss (float32 upcast, F.cross_entropy)
    "fastce": dict(inplace_backward=True),
    "fastce-no-inplace": dict(inplace_backward=False),
    "fastce_fused": dict(fused_linear=True),  # lm_head + loss from the hidden states, no logits (linear_cross_entropy)
    # Liger-Kernel's fused linear cross-entropy on this model only (its RoPE / RMSNorm / SwiGLU kernels left off, so
    # that only the loss differs); skipped when liger_kernel does not import
    "liger_flce": "liger",
}


def liger_available():
    """None when liger_kernel imports, else why not."""
    try:
        import liger_kernel.transformers  # noqa: F401
    except Exception as error:  # noqa: BLE001 - any import failure means the mode is skipped
        return f"liger_kernel does not import: {error!r}"
    return None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    sizes = dict(hidden=2048, layers=2, heads=16, kv_heads=8, intermediate=8192, vocab=128256, batch=8, seq_len=1024)
    for name, default in (sizes | dict(steps=20, warmup=3, seed=0)).items():
        add("--" + name.replace("_", "-"), type=int, default=default)
    precision = "bf16: bf16 weights; autocast: float32 weights under bf16 autocast (Trainer's bf16=True)"
    add("--precision", choices=["bf16", "autocast"], default="bf16", help=precision)
    add("--tie-embeddings", action="store_true", help="tie lm_head to the embedding (Llama 3.2)")
    add("--modes", default="transformers,fastce,fastce_fused,liger_flce", help=f"comma-separated, from {list(MODES)}")
    add("--device", default="cuda")
    add("--json", help="write the results here")
    args = parser.parse_args(argv)
    args.modes = args.modes.split(",")
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}; choose from {list(MODES)}")
    return args


def build_model(args):
    config = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(args.seq_len, 128), tie_word_embeddings=args.tie_embeddings)  # fmt: skip
    torch.manual_seed(args.seed)  # every mode starts from the same weights
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    model = transformers.LlamaForCausalLM(config).to(device=args.device, dtype=dtype)
    model.config.use_cache = False
    model.train()
    return model


def make_batches(args, count):
    generator = torch.Generator().manual_seed(args.seed + 1)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=generator)
        labels = ids.clone()
        labels[:, : args.seq_len // 8] = -100  # a masked prompt, as in instruction tuning
        batches.append((ids.to(args.device), labels.to(args.device)))
    return batches


def run_mode(mode, args, batches):
    fastce_torch.unpatch_transformers()
    if isinstance(MODES[mode], dict):
        fastce_torch.patch_transformers(**MODES[mode])
    model = build_model(args)
    if MODES[mode] == "liger":  # an instance patch of the loss only: nothing global to undo
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(rope=False, rms_norm=False, swiglu=False, cross_entropy=False,
                                    fused_linear_cross_entropy=True, model=model)  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    device_type = torch.device(args.device).type
    cuda, autocast = device_type == "cuda", torch.autocast(device_type, torch.bfloat16, args.precision == "autocast")

    def step(ids, labels):
        with autocast:
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    losses, times = [], []
    for i, (ids, labels) in enumerate(batches):
        if i == args.warmup and cuda:
            torch.cuda.synchronize()
            resident = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        loss, ms = timed(lambda: step(ids, labels), cuda)
        losses.append(loss.item())
        if i >= args.warmup:
            times.append(ms)
    result = {"median_ms": statistics.median(times), "mean_ms": statistics.fmean(times), "min_ms": min(times),
              "times_ms": times, "losses": losses, "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
              "resident_bytes": resident if cuda else None}  # fmt: skip
    if cuda:
        result["step_working_bytes"] = result["peak_bytes"] - resident
    fastce_torch.unpatch_transformers()
    del model, optimizer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


def environment(args):
    info = {"device": torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else "cpu",
            "torch": torch.__version__, "transformers": transformers.__version__}  # fmt: skip
    info.update(commit=envinfo.git_commit(), versions=envinfo.versions({"transformers": transformers.__version__}))
    return info


def main(argv=None):
    args = parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        sys.exit("no CUDA device: use --device cpu (with small sizes) for a smoke run")
    batches = make_batches(args, args.warmup + args.steps)
    skipped = {}
    if "liger_flce" in args.modes:
        why = "its kernels need CUDA" if torch.device(args.device).type != "cuda" else liger_available()
        if why is not None:
            skipped["liger_flce"] = why
            print(f"liger_flce skipped: {skipped['liger_flce']}", file=sys.stderr)
    results = {mode: run_mode(mode, args, batches) for mode in args.modes if mode not in skipped}

    gib = 2.0**-30
    print(f"Llama {args.layers} layers, hidden {args.hidden}, V={args.vocab}, {args.batch}x{args.seq_len} tokens, "
          f"{args.precision}, AdamW; {args.steps} timed steps")  # fmt: skip
    # Against transformers' own loss where it ran: step speed and the first step's loss (relative difference).
    base = results.get("transformers")
    rows = [("mode", "median ms", "min ms", "peak GiB", "step GiB", "first/last loss", "speed", "first loss diff")]
    for mode, r in results.items():
        memory = ["-" if r["peak_bytes"] is None else f"{r[k] * gib:.2f}" for k in ("peak_bytes", "step_working_bytes")]
        versus = [f"{base['median_ms'] / r['median_ms']:.3f}x", f"{abs(r['losses'][0] / base['losses'][0] - 1):.1e}"]
        losses = f"{r['losses'][0]:.5f} / {r['losses'][-1]:.5f}"
        rows.append((mode, f"{r['median_ms']:.2f}", f"{r['min_ms']:.2f}", *memory, losses, *(versus if base else "--")))
    print(aligned(rows))
    if args.json:
        record = {"benchmark": "transformers_step", "args": vars(args), "environment": environment(args)}
        write_json(record | {"results": results, "skipped": skipped}, args.json)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
