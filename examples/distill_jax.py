"""A distillation step in JAX + optax with fastce_jax.linear_jsd, checked step by step against the same step computed
with plain float32 jax.nn.log_softmax of both models' logits (TRL's generalized JSD).

    python examples/distill_jax.py                         # CPU: the Pallas kernels in interpret mode
    python examples/distill_jax.py --vocab 32000 --student-dim 512 --teacher-dim 1024 --batch 8 --seq-len 256

A frozen teacher and a smaller student (tiny causal LMs made here; the teacher's head is padded to a larger
vocabulary, as checkpoints often are, its bias -inf on the padding rows) read the same token sequences; the student
learns to match the teacher's next-token distribution on the completion tokens (the prompt positions are
ignore_index) at temperature T:
  loss = mean over completion positions of beta KL(p_t || m) + (1 - beta) KL(p_s || m),  m = (1 - beta) p_s + beta p_t
(beta = 0: KL(p_t || p_s), forward KL; beta = 1: KL(p_s || p_t), reverse KL). Two copies of the student parameters
take the same jitted optimizer steps: one through fastce_jax.linear_jsd on the two LM heads (no tokens x vocabulary
logits of either model are kept; skip_ignored_rows=True: the prompt positions' rows cost no matmul), one through
float32 logits and jax.nn.log_softmax. Their losses agree at every step. The teacher's parameters are an argument
of the step like the student's, and get no gradient (linear_jsd treats the teacher as a constant).
"""

import argparse
import math
import sys

import comparison  # examples/comparison.py: the step-by-step check against plain log_softmax
import jax
import jax.numpy as jnp
import optax

import fastce_jax

IGNORE = -100


def init_params(key, vocab, dim, layers, max_len, head_bias=False):
    keys = iter(jax.random.split(key, 4 + 4 * layers))

    def dense(shape):
        return jax.random.normal(next(keys), shape, jnp.float32) / math.sqrt(shape[0])

    params = {
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
    if head_bias:
        params["lm_bias"] = jax.random.normal(next(keys), (vocab,), jnp.float32) * 0.1
    return params


def rms_norm(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def hidden_states(params, tokens):
    """The final normalised hidden states (B, T, D) of a one-head causal transformer: what the LM head reads."""
    length = tokens.shape[1]
    x = params["embed"][tokens] + params["pos"][:length]
    causal = jnp.tril(jnp.ones((length, length), bool))
    for block in params["blocks"]:
        q, k, v = jnp.split(rms_norm(x) @ block["qkv"], 3, axis=-1)
        scores = jnp.where(causal, q @ k.transpose(0, 2, 1) / math.sqrt(q.shape[-1]), -jnp.inf)
        x = x + (jax.nn.softmax(scores, axis=-1) @ v) @ block["out"]
        x = x + jax.nn.gelu(rms_norm(x) @ block["up"]) @ block["down"]
    return rms_norm(x)


def make_teacher(key, args):
    """The teacher: wider, its head padded to teacher_vocab rows whose bias is -inf (no mass on the padding)."""
    params = init_params(key, args.teacher_vocab, args.teacher_dim, args.layers, args.seq_len, head_bias=True)
    params["lm_head"] = params["lm_head"] * 3.0  # a peakier teacher distribution than the student's initial one
    params["lm_bias"] = params["lm_bias"].at[args.vocab :].set(-jnp.inf)
    return params


def fastce_loss(student, teacher, tokens, labels, args):
    """linear_jsd on the two heads: position t's distributions, scored where labels[:, t + 1] is not ignored."""
    return fastce_jax.linear_jsd(
        hidden_states(student, tokens)[:, :-1],
        student["lm_head"],
        hidden_states(teacher, tokens)[:, :-1],
        teacher["lm_head"],  # (teacher_vocab, D_t): its first `vocab` rows are compared
        labels[:, 1:],
        teacher_bias=teacher["lm_bias"],
        beta=args.beta,
        temperature=args.temperature,
        skip_ignored_rows=True,  # the prompt positions are ignored: their rows cost no matmul (the kernels)
        backend=args.backend,
    )


def plain_loss(student, teacher, tokens, labels, args):
    """The same from float32 logits of both models and log_softmax (TRL's generalized_jsd_loss)."""
    student_logits = hidden_states(student, tokens)[:, :-1] @ student["lm_head"].T
    teacher_logits = hidden_states(teacher, tokens)[:, :-1] @ teacher["lm_head"].T + teacher["lm_bias"]
    teacher_logits = jax.lax.stop_gradient(teacher_logits[..., : args.vocab])
    ls = jax.nn.log_softmax(student_logits.astype(jnp.float32) / args.temperature, axis=-1)
    lt = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / args.temperature, axis=-1)
    if args.beta == 0:
        per_token = jnp.sum(jnp.exp(lt) * (lt - ls), axis=-1)
    elif args.beta == 1:
        per_token = jnp.sum(jnp.exp(ls) * (ls - lt), axis=-1)
    else:
        mixture = jnp.logaddexp(ls + math.log1p(-args.beta), lt + math.log(args.beta))
        kl_teacher = jnp.sum(jnp.exp(lt) * (lt - mixture), axis=-1)
        kl_student = jnp.sum(jnp.exp(ls) * (ls - mixture), axis=-1)
        per_token = args.beta * kl_teacher + (1 - args.beta) * kl_student
    mask = labels[:, 1:] != IGNORE
    return jnp.sum(jnp.where(mask, per_token, 0.0)) / jnp.maximum(jnp.sum(mask), 1)


def make_step(loss_fn, args, optimizer):
    @jax.jit
    def step(student, state, teacher, tokens, labels):
        loss, (grads, teacher_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
            student, teacher, tokens, labels, args
        )
        updates, state = optimizer.update(grads, state, student)
        return optax.apply_updates(student, updates), state, loss, teacher_grads

    return step


def train(args):
    key = jax.random.PRNGKey(args.seed)
    student_key, teacher_key, data_key = jax.random.split(key, 3)
    teacher = make_teacher(teacher_key, args)
    base = init_params(student_key, args.vocab, args.student_dim, args.layers, args.seq_len)
    optimizer = optax.adamw(args.lr, weight_decay=0.0)
    methods = {"fastce": fastce_loss, "plain": plain_loss}
    students = {name: base for name in methods}
    states = {name: optimizer.init(base) for name in methods}
    steps = {name: make_step(fn, args, optimizer) for name, fn in methods.items()}
    tokens = jax.random.randint(data_key, (args.batch, args.seq_len), 0, args.vocab)
    labels = tokens.at[:, : args.prompt_len].set(IGNORE)  # the prompt is not scored
    losses = {name: [] for name in methods}
    for _ in range(args.steps):
        for name in methods:
            students[name], states[name], loss, teacher_grads = steps[name](
                students[name], states[name], teacher, tokens, labels
            )
            losses[name].append(float(loss))
            # The teacher is a constant of the loss: no gradient reaches any of its parameters.
            assert not any(bool(jnp.any(g != 0)) for g in jax.tree.leaves(teacher_grads)), name
    return losses, students


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=4, help="leading positions not scored (ignore_index)")
    parser.add_argument("--vocab", type=int, default=256, help="the student's vocabulary")
    parser.add_argument("--teacher-vocab", type=int, default=264, help="the teacher's padded head (>= --vocab)")
    parser.add_argument("--student-dim", type=int, default=32)
    parser.add_argument("--teacher-dim", type=int, default=48)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--beta", type=float, default=0.5, help="0: forward KL, 1: reverse KL, else the JSD mixture")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-2)
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
    losses, students = train(args)
    leaves = zip(jax.tree.leaves(students["fastce"]), jax.tree.leaves(students["plain"]))
    param_gap = max(float(jnp.max(jnp.abs(a - b))) for a, b in leaves)
    return comparison.report(args, losses, param_gap, devices=[str(d) for d in jax.devices()])


if __name__ == "__main__":
    sys.exit(0 if main()["match"] else 1)
