"""A GRPO training step in PyTorch with fastce_torch.linear_policy_loss, checked step by step against the same step
computed with plain log_softmax.

    python examples/grpo_torch.py                        # CPU: the plain-torch path of the same contract
    python examples/grpo_torch.py --backend kernel       # CPU: the Triton kernels through Triton's interpreter (slow)
    python examples/grpo_torch.py --objective custom     # the same loss through linear_token_objective
    python examples/grpo_torch.py --vocab 32000 --dim 512 --completions 8 --length 128   # on a GPU

A tiny causal LM (made here) samples a group of completions per prompt at temperature 0.7; a toy reward scores each
completion (the share of its tokens in a "preferred" quarter of the vocabulary); the advantages are the rewards
normalised within each prompt's group. The old policy's log-probs are taken once per round under torch.no_grad with
fastce_torch.linear_log_probs (nothing is saved for a backward), the reference model's (the frozen initial model) the
same way; then a few optimizer steps minimise TRL's GRPO loss (loss_type="grpo") with a KL penalty and an entropy bonus:
  per token  l = -min(r A, clip(r, 1 - eps, 1 + eps) A) + beta (exp(ref - logp) - (ref - logp) - 1),
  r = exp(logp - old);
  loss = mean over completions of (mean over its tokens of l) - entropy_coef * (mean over all tokens of the entropy).
Two copies of the model from the same initialisation train on the same samples: one through
fastce_torch.linear_policy_loss on the model's own LM head (no tokens x vocabulary logits are kept, and the gradients
are formed inside the loss's one pass over the vocabulary), one through log_softmax + gather of float32 logits, the
way RL trainers compute it today. Their losses agree at every step.

Any other objective that is elementwise in each token's log-prob and entropy (with per-token inputs known before the
pass) runs the same way through fastce_torch.linear_token_objective: `--objective custom` passes the GRPO loss above
as such a function (grpo_token_losses), with its normalisation as per-token weights. Objectives that are not per
token (a sequence-level ratio, DPO's sequence sums) take linear_log_probs' log-probs instead.
"""

import argparse
import copy
import sys
from functools import partial

import comparison  # examples/comparison.py: the step-by-step check against plain log_softmax
import torch
import torch.nn.functional as F

import fastce_torch

IGNORE = -100


class Block(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.RMSNorm(dim), torch.nn.RMSNorm(dim)
        self.qkv, self.out = torch.nn.Linear(dim, 3 * dim, bias=False), torch.nn.Linear(dim, dim, bias=False)
        self.up, self.down = torch.nn.Linear(dim, 4 * dim, bias=False), torch.nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        batch, length, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, dim // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.out(attn.transpose(1, 2).reshape(batch, length, dim))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyCausalLM(torch.nn.Module):
    def __init__(self, vocab, dim, heads, layers, max_len):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.randn(max_len, dim) * 0.02)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = torch.nn.RMSNorm(dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=False)

    def hidden_states(self, tokens):
        """The final normalised hidden states (B, T, D): what the LM head reads."""
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


@torch.no_grad()
def sample_groups(model, prompts, group, length, temperature, generator):
    """`group` completions of `length` tokens per prompt, sampled from softmax(logits / temperature)."""
    sequences = prompts.repeat_interleave(group, dim=0)
    for _ in range(length):
        logits = model.lm_head(model.hidden_states(sequences)[:, -1]).float() / temperature
        token = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        sequences = torch.cat([sequences, token], dim=1)
    return sequences


def rewards_of(sequences, prompt_len, vocab):
    """The toy task: the share of the completion's tokens in the first quarter of the vocabulary."""
    return (sequences[:, prompt_len:] < vocab // 4).float().mean(dim=1)


def group_advantages(rewards, group):
    """GRPO's advantages: each reward minus its group's mean, over its group's standard deviation."""
    r = rewards.view(-1, group)
    return ((r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, keepdim=True) + 1e-4)).view(-1)


def fastce_log_probs(model, sequences, targets, temperature, backend):
    """Log-probs and entropy of each completion token from the hidden states and the LM head's weight: position t
    scores targets[:, t + 1] (shift=1); prompt tokens are ignore_index, so 0 there."""
    hidden = model.hidden_states(sequences)
    out = fastce_torch.linear_log_probs(
        hidden,
        model.lm_head.weight,
        targets,
        temperature=temperature,
        shift=1,
        return_entropy=True,
        ignore_index=IGNORE,
        backend=backend,
    )
    return out.logprobs, out.entropy


def plain_log_probs(model, sequences, targets, temperature, backend=None):
    """The same with float32 log_softmax over the (B, T - 1, V) logits and a gather, as RL trainers do it."""
    logits = model.lm_head(model.hidden_states(sequences))[:, :-1].float() / temperature
    logp = F.log_softmax(logits, dim=-1)
    labels = targets[:, 1:]
    mask = labels != IGNORE
    logprobs = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return torch.where(mask, logprobs, 0.0), torch.where(mask, entropy, 0.0)


def grpo_weights(mask, entropy_coef):
    """TRL's "grpo" normalisation as per-token weights: w of each token's l (its completion's mean, then the mean over
    completions) and e of its entropy (minus the bonus over all completion tokens)."""
    w = mask / (mask.shape[0] * mask.sum(dim=1, keepdim=True).clamp(min=1))
    return w, -entropy_coef * mask / mask.sum().clamp(min=1)


def grpo_token_losses(logprobs, entropy, old, ref, advantages, w, e, clip=0.2, beta=0.04):
    """The GRPO loss per token, as fastce_torch.linear_token_objective calls it: 1-D vectors of a chunk's tokens (its
    log-probs and entropies, and each of `inputs` sliced alike); any elementwise objective can be written here."""
    ratio = torch.exp(logprobs - old)
    clipped = -torch.minimum(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)
    kl = torch.exp(ref - logprobs) - (ref - logprobs) - 1
    return w * (clipped + beta * kl) + e * entropy


def plain_loss(model, sequences, targets, batch, args):
    """The loss from plain log_softmax log-probs: grpo_token_losses summed (TRL's formula, per token)."""
    logprobs, entropy = plain_log_probs(model, sequences, targets, args.temperature)
    old, ref, advantages, mask = batch
    w, e = grpo_weights(mask, args.entropy_coef)
    a = advantages[:, None].expand_as(logprobs)
    return grpo_token_losses(logprobs, entropy, old, ref, a, w, e, args.clip, args.beta).sum(), None


def fastce_loss(model, sequences, targets, batch, args):
    """The loss from the hidden states and the LM head's weight: position t scores targets[:, t + 1]. The preset
    (linear_policy_loss) returns TRL's metrics with it; --objective custom: linear_token_objective."""
    hidden, labels = model.hidden_states(sequences)[:, :-1], targets[:, 1:]
    old, ref, advantages, mask = batch
    if args.objective == "custom":
        w, e = grpo_weights(mask, args.entropy_coef)
        losses = partial(grpo_token_losses, clip=args.clip, beta=args.beta)
        inputs = (old, ref, advantages[:, None].expand_as(old), w, e)
        loss = fastce_torch.linear_token_objective(hidden, model.lm_head.weight, labels, losses, inputs,
                                                   with_entropy=True, temperature=args.temperature,
                                                   ignore_index=IGNORE, backend=args.backend)  # fmt: skip
        return loss, None
    out = fastce_torch.linear_policy_loss(
        hidden, model.lm_head.weight, labels, advantages, mask=mask, old_log_probs=old, ref_log_probs=ref,
        loss_type="grpo", epsilon_low=args.clip, beta=args.beta, entropy_coef=args.entropy_coef,
        temperature=args.temperature, ignore_index=IGNORE, backend=args.backend,
    )  # fmt: skip
    return out.loss, out


def train(args):
    torch.manual_seed(args.seed)
    max_len = args.prompt_len + args.length
    base = TinyCausalLM(args.vocab, args.dim, args.heads, args.layers, max_len).to(args.device)  # the reference
    methods = {"fastce": (fastce_log_probs, fastce_loss), "plain": (plain_log_probs, plain_loss)}
    models = {name: copy.deepcopy(base) for name in methods}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.0) for name, m in models.items()}
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    losses = {name: [] for name in methods}
    mean_rewards = []
    for _ in range(args.iterations):
        prompts = torch.randint(0, args.vocab, (args.prompts, args.prompt_len), generator=generator, device=args.device)
        # Both copies train on the same samples (drawn from the fastce copy): the comparison is of the steps alone.
        sequences = sample_groups(models["fastce"], prompts, args.completions, args.length, args.temperature, generator)
        rewards = rewards_of(sequences, args.prompt_len, args.vocab)
        mean_rewards.append(float(rewards.mean()))
        advantages = group_advantages(rewards, args.completions)
        targets = sequences.clone()
        targets[:, : args.prompt_len] = IGNORE
        mask = (targets[:, 1:] != IGNORE).float()
        for name, (log_probs, loss_fn) in methods.items():
            model, optimizer = models[name], optimizers[name]
            with torch.no_grad():  # the old and the reference policy: no graph, nothing saved for a backward
                old, ref = (log_probs(m, sequences, targets, args.temperature, args.backend)[0] for m in (model, base))
            for _ in range(args.steps):
                optimizer.zero_grad()
                loss, metrics = loss_fn(model, sequences, targets, (old, ref, advantages, mask), args)
                loss.backward()
                optimizer.step()
                losses[name].append(float(loss.detach()))
            if metrics is not None:  # TRL's logged metrics, from the same pass as the loss
                print(
                    f"round {len(mean_rewards)}, last step: kl {float(metrics.kl):.5f}, entropy "
                    f"{float(metrics.entropy):.3f}, clipped {float(metrics.clip_ratio_region):.1%} of the tokens"
                )
    return losses, mean_rewards, models


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
    parser.add_argument("--backend", default="auto", choices=["auto", "kernel", "reference"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    comparison.add_arguments(parser)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    losses, rewards, models = train(args)
    params = zip(models["fastce"].parameters(), models["plain"].parameters())
    param_gap = max(float((a - b).detach().abs().max()) for a, b in params)
    print(f"mean reward per round: {', '.join(f'{r:.3f}' for r in rewards)}")
    return comparison.report(args, losses, param_gap, mean_rewards=rewards)


if __name__ == "__main__":
    sys.exit(0 if main()["match"] else 1)
