"""Train a tiny Flax NNX causal LM with optax, its loss from fastce_jax's fused linear cross-entropy on the model's
own nnx.Linear head, and again with the plain optax loss, from the same initialisation on the same batches: the two
loss curves agree to float32 rounding, step by step.

    python examples/train_flax_nnx.py                  # CPU: the Pallas kernels in interpret mode
    python examples/train_flax_nnx.py --vocab 32000 --steps 100 --dim 256 --backend auto   # on a GPU

The one change in the training step (the model is untouched; `model.hidden` is its forward without the head):

    logits = model(tokens)                                                       # (B, T, V)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    loss = jnp.sum(jnp.where(mask, losses, 0.0)) / jnp.sum(mask)
  becomes
    kernel = model.lm_head.kernel[...]                                           # (H, V), as nnx.Linear stores it
    loss = fastce_jax.linear_cross_entropy(model.hidden(tokens), kernel, labels, where=mask, weight_layout="hv")

weight_layout="hv" reads the (H, V) kernel as stored (no transposed copy) and gives its gradient (H, V), which
nnx.value_and_grad hands to the optimizer like any other; where= is optax's mask (False tokens are left out of the
loss and of the mean). No (B, T, V) logits exist in the fused step.
"""

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import fastce_jax

# --- model: a pre-norm transformer decoder in Flax NNX -------------------------------------------------------------


class Block(nnx.Module):
    def __init__(self, dim, heads, dtype, rngs):
        self.norm1 = nnx.RMSNorm(dim, dtype=dtype, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, dim, dtype=dtype, decode=False, rngs=rngs)
        self.norm2 = nnx.RMSNorm(dim, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, dtype=dtype, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.norm1(x), mask=mask)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class TinyLM(nnx.Module):
    def __init__(self, vocab, dim, layers, heads, seq_len, dtype, rngs):
        self.embed = nnx.Embed(vocab, dim, dtype=dtype, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (seq_len, dim)) * 0.02)
        self.blocks = nnx.List([Block(dim, heads, dtype, rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(dim, dtype=dtype, rngs=rngs)
        self.lm_head = nnx.Linear(dim, vocab, use_bias=False, dtype=dtype, rngs=rngs)  # kernel (dim, vocab)

    def hidden(self, tokens):
        """The final normalised hidden states (B, T, dim): what the head reads."""
        x = self.embed(tokens) + self.pos[...][: tokens.shape[1]].astype(self.embed.dtype or jnp.float32)
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.norm(x)

    def __call__(self, tokens):
        return self.lm_head(self.hidden(tokens))


# --- the two losses ---------------------------------------------------------------------------------------------


def optax_loss(model, tokens, labels, mask, backend):
    losses = optax.softmax_cross_entropy_with_integer_labels(model(tokens).astype(jnp.float32), labels)
    return jnp.sum(jnp.where(mask, losses, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


def fastce_loss(model, tokens, labels, mask, backend):
    hidden = model.hidden(tokens)
    kernel = model.lm_head.kernel[...].astype(hidden.dtype)  # the head computes in its dtype, as nnx.Linear does
    return fastce_jax.linear_cross_entropy(hidden, kernel, labels, where=mask, weight_layout="hv", backend=backend)


LOSSES = {"optax": optax_loss, "fastce": fastce_loss}


# --- data: a random bigram language with padded documents --------------------------------------------------------


def make_batches(seed, steps, batch, seq_len, vocab):
    """(tokens, labels, mask) per step: next-token labels of a fixed bigram language over 64 active tokens, and a
    mask that leaves out each row's padded tail (variable-length documents)."""
    rng = np.random.default_rng(seed)
    active = rng.choice(vocab, min(vocab, 64), replace=False)
    successors = active[rng.integers(0, len(active), (vocab, 4))]
    batches = []
    for _ in range(steps):
        tokens = np.empty((batch, seq_len + 1), np.int32)
        tokens[:, 0] = rng.choice(active, batch)
        for t in range(seq_len):
            tokens[:, t + 1] = successors[tokens[:, t], rng.integers(0, 4, batch)]
        lengths = rng.integers(seq_len // 2, seq_len + 1, batch)
        mask = np.arange(seq_len)[None, :] < lengths[:, None]
        batches.append((jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:]), jnp.asarray(mask)))
    return batches


def train(loss_name, args, batches):
    dtype = jnp.dtype(args.dtype)
    model = TinyLM(args.vocab, args.dim, args.layers, args.heads, args.seq_len, dtype, nnx.Rngs(args.seed))
    optimizer = nnx.Optimizer(model, optax.adamw(args.lr, weight_decay=0.01), wrt=nnx.Param)
    loss_fn = LOSSES[loss_name]

    @nnx.jit
    def step(model, optimizer, tokens, labels, mask):
        loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, labels, mask, args.backend)
        optimizer.update(model, grads)
        return loss

    return [float(step(model, optimizer, *batch)) for batch in batches]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's dtype")
    parser.add_argument(
        "--backend",
        default="kernel",
        choices=["auto", "kernel", "reference"],
        help="fastce_jax backend; 'kernel' off a GPU runs Pallas in interpret mode",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--rtol", type=float, default=None, help="allowed relative gap (default: 1e-4 float32, 5e-3 bfloat16)"
    )
    parser.add_argument("--json", help="write the curves here")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    rtol = args.rtol if args.rtol is not None else (1e-4 if args.dtype == "float32" else 5e-3)
    batches = make_batches(args.seed, args.steps, args.batch, args.seq_len, args.vocab)
    curves = {name: train(name, args, batches) for name in LOSSES}
    reference = np.array(curves["optax"])
    gap = float(np.max(np.abs(np.array(curves["fastce"]) - reference) / np.abs(reference)))
    print(f"{'step':>5} {'optax':>10} {'fastce':>10}")
    for i in range(args.steps):
        if i % max(1, args.steps // 10) == 0 or i == args.steps - 1:
            print(f"{i:5d} {curves['optax'][i]:10.5f} {curves['fastce'][i]:10.5f}")
    print(f"max relative gap fastce / optax: {gap:.2e} (allowed {rtol:.0e})")
    result = {
        "args": vars(args),
        "curves": curves,
        "max_relative_gap": gap,
        "rtol": rtol,
        "devices": [str(d) for d in jax.devices()],
        "match": gap <= rtol,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["match"] else 1)
