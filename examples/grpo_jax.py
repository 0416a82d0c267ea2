"""A GRPO-style training step in JAX + optax with fastce_jax.linear_log_probs, checked step by step against the same
step computed with jax.nn.log_softmax.

    python examples/grpo_jax.py                          # CPU: the Pallas kernels in interpret mode
    python examples/grpo_jax.py --vocab 32000 --dim 512 --completions 8 --length 128   # on a GPU

A tiny causal LM (made here) samples a group of completions per prompt at temperature 0.7; a toy reward scores each
completion (the share of its tokens in a "preferred" quarter of the vocabulary); the advantages are the rewards
normalised within each prompt's group. The old policy's log-probs come from a plain call (not differentiated: the
custom_vjp's forward rule, which keeps residuals for a backward, is not used), then a few optimizer steps minimise
the clipped-ratio objective with an entropy bonus:
  loss = mean over completion tokens of -min(r A, clip(r, 1 - eps, 1 + eps) A) - beta H,   r = exp(logprob - old).
Two copies of the parameters train on the same samples: one through fastce_jax.linear_log_probs on the model's own
LM head (no tokens x vocabulary logits are kept), one through jax.nn.log_softmax + take_along_axis of float32
logits under jit. Their losses agree at every step.
"""

import argparse
import math
import sys
from functools import partial

import comparison  # examples/comparison.py: the step-by-step check against plain log_softmax
import jax
import jax.numpy as jnp
import optax

import fastce_jax

IGNORE = -100


def init_params(key, vocab, dim, layers, max_len):
    keys = iter(jax.random.split(key, 3 + 4 * layers))

    def dense(shape):
        return jax.random.normal(next(keys), shape, jnp.float32) / math.sqrt(shape[0])

    return {
        "embed": jax.random.normal(next(keys), (vocab, dim), jnp.float32),
        "pos": jax.random.normal(next(keys), (max_len, dim), jnp.float32) * 0.02,
        "blocks": [
            {
                "qkv": dense((dim, 3 * dim)),
                "out": dense((dim, dim)),
                "up": dense((dim, 4 * dim)),
                "down": dense((4 * dim, dim)),
            }
            for _ in range(layers)
        ],
        "lm_head": jax.random.normal(next(keys), (vocab, dim), jnp.float32) / math.sqrt(dim),  # (V, D), nn.Linear's
    }


def rms_norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def hidden_states(params, tokens, heads):
    """The final normalised hidden states (B, T, D): what the LM head reads."""
    length = tokens.shape[1]
    x = params["embed"][tokens] + params["pos"][:length]
    causal = jnp.tril(jnp.ones((length, length), bool))
    for block in params["blocks"]:
        q, k, v = jnp.split(rms_norm(x) @ block["qkv"], 3, axis=-1)
        split = lambda t: t.reshape(*t.shape[:2], heads, -1).transpose(0, 2, 1, 3)  # noqa: E731
        q, k, v = split(q), split(k), split(v)
        scores = jnp.where(causal, q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1]), -jnp.inf)
        attn = jax.nn.softmax(scores, axis=-1) @ v
        x = x + attn.transpose(0, 2, 1, 3).reshape(x.shape) @ block["out"]
        x = x + jax.nn.gelu(rms_norm(x) @ block["up"]) @ block["down"]
    return rms_norm(x)


@partial(jax.jit, static_argnames=("heads",))
def next_token_logits(params, sequences, position, heads):
    """The logits at `position` of fixed-length buffers (causal: the tokens after it do not matter)."""
    hidden = jax.lax.dynamic_index_in_dim(hidden_states(params, sequences, heads), position, axis=1, keepdims=False)
    return hidden @ params["lm_head"].T


def sample_groups(params, prompts, args, key):
    """`completions` completions of `length` tokens per prompt, sampled from softmax(logits / temperature)."""
    sequences = jnp.repeat(prompts, args.completions, axis=0)
    sequences = jnp.concatenate([sequences, jnp.zeros((sequences.shape[0], args.length), sequences.dtype)], axis=1)
    for i in range(args.length):
        position = args.prompt_len + i
        logits = next_token_logits(params, sequences, position - 1, args.heads)
        key, sub = jax.random.split(key)
        token = jax.random.categorical(sub, logits / args.temperature, axis=-1)
        sequences = sequences.at[:, position].set(token.astype(sequences.dtype))
    return sequences


def group_advantages(rewards, group):
    r = rewards.reshape(-1, group)
    return ((r - r.mean(axis=1, keepdims=True)) / (r.std(axis=1, ddof=1, keepdims=True) + 1e-4)).reshape(-1)


def fastce_log_probs(params, sequences, targets, temperature, heads, backend):
    """Log-probs and entropy of each completion token from the hidden states and the LM head: position t scores
    targets[:, t + 1] (shift=1); prompt tokens are ignore_index, so 0 there."""
    out = fastce_jax.linear_log_probs(
        hidden_states(params, sequences, heads),
        params["lm_head"],
        targets,
        temperature=temperature,
        shift=1,
        return_entropy=True,
        ignore_index=IGNORE,
        backend=backend,
    )
    return out.logprobs, out.entropy


def plain_log_probs(params, sequences, targets, temperature, heads, backend=None):
    """The same with float32 log_softmax over the (B, T - 1, V) logits and a gather."""
    logits = (hidden_states(params, sequences, heads) @ params["lm_head"].T)[:, :-1].astype(jnp.float32)
    logp = jax.nn.log_softmax(logits / temperature, axis=-1)
    labels = targets[:, 1:]
    mask = labels != IGNORE
    logprobs = jnp.take_along_axis(logp, jnp.where(mask, labels, 0)[..., None], axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return jnp.where(mask, logprobs, 0.0), jnp.where(mask, entropy, 0.0)


def grpo_loss(logprobs, entropy, old_logprobs, advantages, mask, clip, entropy_coef):
    ratio = jnp.exp(logprobs - old_logprobs)
    a = advantages[:, None]
    policy = -jnp.minimum(ratio * a, jnp.clip(ratio, 1 - clip, 1 + clip) * a)
    return jnp.sum((policy - entropy_coef * entropy) * mask) / jnp.sum(mask)


def make_steps(log_probs, args, optimizer):
    def objective(params, sequences, targets, old_logprobs, advantages, mask):
        logprobs, entropy = log_probs(params, sequences, targets, args.temperature, args.heads, args.backend)
        return grpo_loss(logprobs, entropy, old_logprobs, advantages, mask, args.clip, args.entropy_coef)

    @jax.jit
    def old_policy(params, sequences, targets):  # not differentiated: no residuals, no backward
        return log_probs(params, sequences, targets, args.temperature, args.heads, args.backend)[0]

    @jax.jit
    def step(params, state, *batch):
        loss, grads = jax.value_and_grad(objective)(params, *batch)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return old_policy, step


def train(args):
    key = jax.random.PRNGKey(args.seed)
    key, init_key = jax.random.split(key)
    base = init_params(init_key, args.vocab, args.dim, args.layers, args.prompt_len + args.length)
    optimizer = optax.adamw(args.lr, weight_decay=0.0)
    methods = {"fastce": fastce_log_probs, "plain": plain_log_probs}
    params = {name: base for name in methods}
    states = {name: optimizer.init(base) for name in methods}
    steps = {name: make_steps(fn, args, optimizer) for name, fn in methods.items()}
    losses = {name: [] for name in methods}
    mean_rewards = []
    for _ in range(args.iterations):
        key, prompt_key, sample_key = jax.random.split(key, 3)
        prompts = jax.random.randint(prompt_key, (args.prompts, args.prompt_len), 0, args.vocab)
        # Both copies train on the same samples (drawn from the fastce copy): the comparison is of the steps alone.
        sequences = sample_groups(params["fastce"], prompts, args, sample_key)
        rewards = jnp.mean((sequences[:, args.prompt_len :] < args.vocab // 4).astype(jnp.float32), axis=1)
        mean_rewards.append(float(rewards.mean()))
        advantages = group_advantages(rewards, args.completions)
        targets = sequences.at[:, : args.prompt_len].set(IGNORE)
        mask = (targets[:, 1:] != IGNORE).astype(jnp.float32)
        for name in methods:
            old_policy, step = steps[name]
            old_logprobs = old_policy(params[name], sequences, targets)
            for _ in range(args.steps):
                batch = (sequences, targets, old_logprobs, advantages, mask)
                params[name], states[name], loss = step(params[name], states[name], *batch)
                losses[name].append(float(loss))
    return losses, mean_rewards, params


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=3, help="sampling rounds")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per sampling round")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--completions", type=int, default=4, help="completions per prompt (the group)")
    parser.add_argument("--prompt-len", type=int, default=4)
    parser.add_argument("--length", type=int, default=8, help="tokens per completion")
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--entropy-coef", type=float, default=0.01)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--backend",
        default="kernel",
        choices=["auto", "kernel", "reference"],
        help="fastce_jax backend; 'kernel' off a GPU runs Pallas in interpret mode",
    )
    parser.add_argument("--seed", type=int, default=0)
    comparison.add_arguments(parser)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    losses, rewards, params = train(args)
    leaves = zip(jax.tree.leaves(params["fastce"]), jax.tree.leaves(params["plain"]))
    param_gap = max(float(jnp.max(jnp.abs(a - b))) for a, b in leaves)
    print(f"mean reward per round: {', '.join(f'{r:.3f}' for r in rewards)}")
    return comparison.report(args, losses, param_gap, mean_rewards=rewards, devices=[str(d) for d in jax.devices()])


if __name__ == "__main__":
    sys.exit(0 if main()["match"] else 1)
