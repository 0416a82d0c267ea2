"""A GRPO training step in JAX + optax with fastce_jax.linear_policy_loss, checked step by step against the same step
computed with jax.nn.log_softmax.

    python examples/grpo_jax.py                          # CPU: the Pallas kernels in interpret mode
    python examples/grpo_jax.py --objective custom       # the same loss through linear_token_objective
    python examples/grpo_jax.py --vocab 32000 --dim 512 --completions 8 --length 128   # on a GPU

A tiny causal LM (made here) samples a group of completions per prompt at temperature 0.7; a toy reward scores each
completion (the share of its tokens in a "preferred" quarter of the vocabulary); the advantages are the rewards
normalised within each prompt's group. The old policy's and the reference model's (the initial parameters) log-probs
come once per round from plain fastce_jax.linear_log_probs calls (not differentiated: the custom_vjp's forward rule,
which keeps residuals for a backward, is not used), then a few optimizer steps minimise TRL's GRPO loss
(loss_type="grpo") with a KL penalty and an entropy bonus:
  per token  l = -min(r A, clip(r, 1 - eps, 1 + eps) A) + beta (exp(ref - logp) - (ref - logp) - 1),
  r = exp(logp - old);
  loss = mean over completions of (mean over its tokens of l) - entropy_coef * (mean over all tokens of the entropy).
Two copies of the parameters train on the same samples: one through fastce_jax.linear_policy_loss on the model's own
LM head (no tokens x vocabulary logits are kept, and the gradients are formed inside the loss's one pass over the
vocabulary), one through jax.nn.log_softmax + take_along_axis of float32 logits under jit. Their losses agree at
every step.

Any other objective that is elementwise in each token's log-prob and entropy (with per-token inputs known before the
pass) runs the same way through fastce_jax.linear_token_objective (jax.vjp of the function inside the pass, under jit
and grad): `--objective custom` passes the GRPO loss above as such a function (grpo_token_losses), with its
normalisation as per-token weights. Objectives that are not per token (a sequence-level ratio, DPO's sequence sums)
take linear_log_probs' log-probs instead.
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


def grpo_weights(mask, entropy_coef):
    """TRL's "grpo" normalisation as per-token weights: w of each token's l (its completion's mean, then the mean over
    completions) and e of its entropy (minus the bonus over all completion tokens)."""
    w = mask / (mask.shape[0] * jnp.maximum(mask.sum(axis=1, keepdims=True), 1.0))
    return w, -entropy_coef * mask / jnp.maximum(mask.sum(), 1.0)


def token_losses(clip, beta):
    """The GRPO loss per token as fastce_jax.linear_token_objective calls it: 1-D vectors of a chunk's tokens (its
    log-probs and entropies, and each of `inputs` sliced alike). Any elementwise objective can be written here; made
    once (the function is a static argument: a new one per step would compile again)."""

    def grpo_token_losses(logprobs, entropy, old, ref, advantages, w, e):
        ratio = jnp.exp(logprobs - old)
        clipped = -jnp.minimum(ratio * advantages, jnp.clip(ratio, 1 - clip, 1 + clip) * advantages)
        kl = jnp.exp(ref - logprobs) - (ref - logprobs) - 1
        return w * (clipped + beta * kl) + e * entropy

    return grpo_token_losses


def make_steps(name, args, optimizer):
    """(log-probs of the old and reference policies, one optimizer step) for the "fastce" or the "plain" copy."""
    log_probs = {"fastce": fastce_log_probs, "plain": plain_log_probs}[name]
    grpo_token_losses = token_losses(args.clip, args.beta)

    def plain_loss(params, sequences, targets, old, ref, advantages, mask):
        logprobs, entropy = plain_log_probs(params, sequences, targets, args.temperature, args.heads)
        w, e = grpo_weights(mask, args.entropy_coef)
        a = jnp.broadcast_to(advantages[:, None], logprobs.shape)
        return grpo_token_losses(logprobs, entropy, old, ref, a, w, e).sum(), None

    def fastce_loss(params, sequences, targets, old, ref, advantages, mask):
        """From the hidden states and the LM head: position t scores targets[:, t + 1]. The preset returns TRL's
        metrics with the loss."""
        hidden, labels = hidden_states(params, sequences, args.heads)[:, :-1], targets[:, 1:]
        if args.objective == "custom":
            w, e = grpo_weights(mask, args.entropy_coef)
            inputs = (old, ref, jnp.broadcast_to(advantages[:, None], old.shape), w, e)
            loss = fastce_jax.linear_token_objective(hidden, params["lm_head"], labels, grpo_token_losses, inputs,
                                                     with_entropy=True, temperature=args.temperature,
                                                     ignore_index=IGNORE, backend=args.backend)  # fmt: skip
            return loss, None
        out = fastce_jax.linear_policy_loss(
            hidden, params["lm_head"], labels, advantages, mask=mask, old_log_probs=old, ref_log_probs=ref,
            loss_type="grpo", epsilon_low=args.clip, beta=args.beta, entropy_coef=args.entropy_coef,
            temperature=args.temperature, ignore_index=IGNORE, backend=args.backend,
        )  # fmt: skip
        return out.loss, out._replace(loss=None)

    @jax.jit
    def policy_log_probs(params, sequences, targets):  # not differentiated: no residuals, no backward
        return log_probs(params, sequences, targets, args.temperature, args.heads, args.backend)[0]

    @jax.jit
    def step(params, state, *batch):
        loss_fn = fastce_loss if name == "fastce" else plain_loss
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, *batch)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss, metrics

    return policy_log_probs, step


def train(args):
    key = jax.random.PRNGKey(args.seed)
    key, init_key = jax.random.split(key)
    base = init_params(init_key, args.vocab, args.dim, args.layers, args.prompt_len + args.length)
    optimizer = optax.adamw(args.lr, weight_decay=0.0)
    methods = ("fastce", "plain")
    params = {name: base for name in methods}  # base: also the reference model's parameters
    states = {name: optimizer.init(base) for name in methods}
    steps = {name: make_steps(name, args, optimizer) for name in methods}
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
            policy_log_probs, step = steps[name]
            old, ref = (policy_log_probs(p, sequences, targets) for p in (params[name], base))
            for _ in range(args.steps):
                batch = (sequences, targets, old, ref, advantages, mask)
                params[name], states[name], loss, metrics = step(params[name], states[name], *batch)
                losses[name].append(float(loss))
            if metrics is not None:  # TRL's logged metrics, from the same pass as the loss
                print(
                    f"round {len(mean_rewards)}, last step: kl {float(metrics.kl):.5f}, entropy "
                    f"{float(metrics.entropy):.3f}, clipped {float(metrics.clip_ratio_region):.1%} of the tokens"
                )
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
    parser.add_argument("--beta", type=float, default=0.04, help="the KL penalty's coefficient (0: no reference)")
    parser.add_argument("--objective", default="preset", choices=["preset", "custom"],
                        help="preset: linear_policy_loss(loss_type='grpo'); custom: the same loss per token through "
                        "linear_token_objective")  # fmt: skip
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
