"""Train a tiny causal LM in plain JAX + optax with fastce_jax's fused loss, and again with the XLA loss
(optax.softmax_cross_entropy_with_integer_labels plus a mask), from the same initialisation on the same batches:
the two loss curves agree to float32 rounding.

    python examples/train_tiny_lm_jax.py                       # CPU: the Pallas kernels in interpret mode
    python examples/train_tiny_lm_jax.py --vocab 32000 --steps 100 --dtype bfloat16   # on a GPU

Four losses are trained side by side:
  xla        optax's per-token loss, masked and averaged by hand (what most JAX training loops do today)
  fastce     fastce_jax.cross_entropy(logits, labels): mean over the tokens whose label is not ignore_index
  per_token  fastce_jax.cross_entropy(..., reduction="none") dropped in where optax's per-token function was
             (same where/mask code around it), for loops that do their own masking and weighting
  fused      fastce_jax.linear_cross_entropy(hidden, lm_head_weight, labels): the loss straight from the final
             hidden states, so the step never holds the (tokens, vocabulary) logits or their gradient
"""

import argparse
import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fastce_jax

IGNORE = -100


# --- model: pre-norm transformer decoder, plain jax ------------------------------------------------------------


def init_params(key, vocab, dim, layers, seq_len):
    keys = iter(jax.random.split(key, 4 + 4 * layers))

    def dense(shape):
        return jax.random.normal(next(keys), shape, jnp.float32) / math.sqrt(shape[0])

    return {
        "embed": jax.random.normal(next(keys), (vocab, dim), jnp.float32) * 0.02,
        "pos": jax.random.normal(next(keys), (seq_len, dim), jnp.float32) * 0.02,
        "blocks": [
            {
                "norm1": jnp.ones(dim),
                "qkv": dense((dim, 3 * dim)),
                "out": dense((dim, dim)),
                "norm2": jnp.ones(dim),
                "up": dense((dim, 4 * dim)),
                "down": dense((4 * dim, dim)),
            }
            for _ in range(layers)
        ],
        "norm": jnp.ones(dim),
        "unembed": dense((dim, vocab)) * 0.1,  # near-uniform predictions at the start: loss ~ log(V)
    }


def rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def hidden_states(params, tokens, heads, dtype):
    """The final (normalised) hidden states (B, T, D) in `dtype`: what the LM head reads."""
    seq_len = tokens.shape[1]
    x = params["embed"][tokens] + params["pos"][:seq_len]
    causal = jnp.tril(jnp.ones((seq_len, seq_len), bool))
    for block in params["blocks"]:
        h = rms_norm(x, block["norm1"])
        q, k, v = jnp.split(h @ block["qkv"], 3, axis=-1)
        split = lambda t: t.reshape(*t.shape[:2], heads, -1).transpose(0, 2, 1, 3)  # noqa: E731
        q, k, v = split(q), split(k), split(v)
        scores = jnp.where(causal, q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1]), -jnp.inf)
        attn = jax.nn.softmax(scores, axis=-1) @ v
        x = x + attn.transpose(0, 2, 1, 3).reshape(x.shape) @ block["out"]
        x = x + jax.nn.gelu(rms_norm(x, block["norm2"]) @ block["up"]) @ block["down"]
    return rms_norm(x, params["norm"]).astype(dtype)


def forward(params, tokens, heads, dtype):
    """Logits (B, T, V) in `dtype`: the lm_head output, as a real model hands it to its loss."""
    return hidden_states(params, tokens, heads, dtype) @ params["unembed"].astype(dtype)


# --- the three losses ------------------------------------------------------------------------------------------


def xla_loss(logits, labels):
    mask = labels != IGNORE
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), jnp.where(mask, labels, 0))
    return jnp.sum(jnp.where(mask, per_token, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


def fastce_loss(logits, labels, backend):
    # No astype: the kernels read bf16 logits and compute in float32; ignored labels count neither way.
    return fastce_jax.cross_entropy(logits, labels, ignore_index=IGNORE, backend=backend)


def per_token_loss(logits, labels, backend):
    # The optax call site with fastce swapped in: per-token float32 losses, then the loop's own masking.
    mask = labels != IGNORE
    per_token = fastce_jax.cross_entropy(logits, jnp.where(mask, labels, 0), reduction="none", backend=backend)
    return jnp.sum(jnp.where(mask, per_token, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


def fused_loss(params, tokens, labels, heads, dtype, backend, chunk_rows=None):
    # The LM head's (V, D) weight is the transpose of this model's (D, V) unembedding; XLA folds the transpose
    # into the matmuls. Gradients reach the hidden states (so the whole model) and the unembedding.
    hidden = hidden_states(params, tokens, heads, dtype)
    weight = params["unembed"].astype(dtype).T
    return fastce_jax.linear_cross_entropy(
        hidden, weight, labels, ignore_index=IGNORE, backend=backend, chunk_rows=chunk_rows
    )


# --- data: a fixed random bigram language, so the model has something to learn ---------------------------------


def make_batches(seed, steps, batch, seq_len, vocab):
    rng = np.random.default_rng(seed)
    # 64 tokens of the vocabulary are in use and each has 4 possible successors: within a few dozen steps the loss
    # falls from log(V) towards log(64) (which tokens occur), then towards log(4) (which follow which).
    active = rng.choice(vocab, min(vocab, 64), replace=False)
    successors = active[rng.integers(0, len(active), (vocab, 4))]
    batches = []
    for _ in range(steps):
        tokens = np.empty((batch, seq_len + 1), np.int32)
        tokens[:, 0] = rng.choice(active, batch)
        for t in range(seq_len):
            tokens[:, t + 1] = successors[tokens[:, t], rng.integers(0, 4, batch)]
        labels = tokens[:, 1:].copy()
        # Variable-length documents: the padded tail of each row is ignored.
        lengths = rng.integers(seq_len // 2, seq_len + 1, batch)
        labels[np.arange(seq_len)[None, :] >= lengths[:, None]] = IGNORE
        batches.append((jnp.asarray(tokens[:, :-1]), jnp.asarray(labels)))
    return batches


def train(loss_name, args, batches):
    backend = args.backend
    dtype = jnp.dtype(args.dtype)
    logits_loss = {
        "xla": xla_loss,
        "fastce": lambda x, y: fastce_loss(x, y, backend),
        "per_token": lambda x, y: per_token_loss(x, y, backend),
    }

    def model_loss(p, tokens, labels):
        if loss_name == "fused":
            return fused_loss(p, tokens, labels, args.heads, dtype, backend, args.fused_chunk_rows)
        return logits_loss[loss_name](forward(p, tokens, args.heads, dtype), labels)

    params = init_params(jax.random.PRNGKey(args.seed), args.vocab, args.dim, args.layers, args.seq_len)
    optimizer = optax.adamw(args.lr, weight_decay=0.01)
    state = optimizer.init(params)

    @jax.jit
    def step(params, state, tokens, labels):
        loss, grads = jax.value_and_grad(model_loss)(params, tokens, labels)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for tokens, labels in batches:
        params, state, loss = step(params, state, tokens, labels)
        losses.append(float(loss))
    return losses


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="dtype of the logits (the loss is float32 either way)",
    )
    parser.add_argument(
        "--backend",
        default="kernel",
        choices=["auto", "kernel", "reference"],
        help="fastce_jax backend; 'kernel' off a GPU runs Pallas in interpret mode",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--rtol",
        type=float,
        default=None,
        help="allowed relative gap between curves (default: 1e-4 float32, 5e-3 bfloat16)",
    )
    parser.add_argument(
        "--fused-chunk-rows",
        type=int,
        default=None,
        help="rows per chunk of the fused loss (default: from its workspace budget, i.e. one chunk at these sizes)",
    )
    parser.add_argument("--json", help="write the curves here")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    rtol = args.rtol if args.rtol is not None else (1e-4 if args.dtype == "float32" else 5e-3)
    batches = make_batches(args.seed, args.steps, args.batch, args.seq_len, args.vocab)
    curves = {name: train(name, args, batches) for name in ("xla", "fastce", "per_token", "fused")}
    reference = np.array(curves["xla"])
    gaps = {name: float(np.max(np.abs(np.array(c) - reference) / np.abs(reference))) for name, c in curves.items()}
    print(f"{'step':>5} " + " ".join(f"{name:>10}" for name in curves))
    for i in range(args.steps):
        if i % max(1, args.steps // 10) == 0 or i == args.steps - 1:
            print(f"{i:5d} " + " ".join(f"{curves[name][i]:10.5f}" for name in curves))
    print("max relative gap to xla: " + ", ".join(f"{name} {gap:.2e}" for name, gap in gaps.items()))
    result = {
        "args": vars(args),
        "curves": curves,
        "max_relative_gap": gaps,
        "rtol": rtol,
        "devices": [str(d) for d in jax.devices()],
        "match": all(g <= rtol for g in gaps.values()),
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["match"] else 1)
