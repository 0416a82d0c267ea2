"""A distillation step in PyTorch with fastce_torch.linear_jsd, checked step by step against the same step computed
with plain float32 log-softmax of both models' logits (TRL's generalized JSD).

    python examples/distill_torch.py                       # CPU: the plain-torch path of the same contract
    python examples/distill_torch.py --backend kernel      # CPU: the Triton kernels through Triton's interpreter
    python examples/distill_torch.py --vocab 32000 --student-dim 512 --teacher-dim 1024 --batch 8 --seq-len 256

A frozen teacher and a smaller student (tiny causal LMs made here; the teacher's head is padded to a larger
vocabulary, as checkpoints often are, its bias -inf on the padding rows) read the same token sequences; the student
learns to match the teacher's next-token distribution on the completion tokens (the prompt positions are
ignore_index) at temperature T:
  loss = mean over completion positions of beta KL(p_t || m) + (1 - beta) KL(p_s || m),  m = (1 - beta) p_s + beta p_t
(beta = 0: KL(p_t || p_s), forward KL; beta = 1: KL(p_s || p_t), reverse KL). Two copies of the student from the same
initialisation take the same optimizer steps: one through fastce_torch.linear_jsd on the two LM heads (no tokens x
vocabulary logits of either model are kept; skip_ignored_rows=True: the prompt positions' rows cost no matmul), one
through float32 logits and log_softmax, the way trainers compute it today. Their losses agree at every step.
"""

import argparse
import copy
import math
import sys

import comparison  # examples/comparison.py: the step-by-step check against plain log_softmax
import torch
import torch.nn.functional as F

import fastce_torch

IGNORE = -100


class Block(torch.nn.Module):
    """One causal attention head and an MLP, pre-norm, residual."""

    def __init__(self, dim):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.RMSNorm(dim), torch.nn.RMSNorm(dim)
        self.qkv, self.out = torch.nn.Linear(dim, 3 * dim, bias=False), torch.nn.Linear(dim, dim, bias=False)
        self.up, self.down = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x):
        q, k, v = self.qkv(self.norm1(x)).unsqueeze(1).chunk(3, dim=-1)
        x = x + self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).squeeze(1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyCausalLM(torch.nn.Module):
    def __init__(self, vocab, dim, layers, max_len, head_bias=False):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.randn(max_len, dim) * 0.02)
        self.blocks = torch.nn.Sequential(*(Block(dim) for _ in range(layers)))
        self.norm = torch.nn.RMSNorm(dim)
        self.lm_head = torch.nn.Linear(dim, vocab, bias=head_bias)

    def hidden_states(self, tokens):
        """The final normalised hidden states (B, T, D): what the LM head reads."""
        return self.norm(self.blocks(self.embed(tokens) + self.pos[: tokens.shape[1]]))


def make_teacher(args):
    """The teacher: wider, its head padded to teacher_vocab rows whose bias is -inf (no mass on the padding)."""
    teacher = TinyCausalLM(args.teacher_vocab, args.teacher_dim, args.layers, args.seq_len, head_bias=True)
    with torch.no_grad():
        teacher.lm_head.weight.mul_(3.0)  # a peakier teacher distribution than the student's initial one
        teacher.lm_head.bias[args.vocab :] = float("-inf")
    return teacher.requires_grad_(False).eval().to(args.device)


def fastce_loss(student, teacher_hidden, teacher, tokens, labels, args):
    """linear_jsd on the two heads: position t's distributions, scored where labels[:, t + 1] is not ignored."""
    hidden = student.hidden_states(tokens)[:, :-1]
    return fastce_torch.linear_jsd(
        hidden,
        student.lm_head.weight,
        teacher_hidden[:, :-1],
        teacher.lm_head.weight,  # (teacher_vocab, D_t): its first `vocab` rows are compared
        labels[:, 1:],
        teacher_bias=teacher.lm_head.bias,
        beta=args.beta,
        temperature=args.temperature,
        skip_ignored_rows=True,  # the prompt positions are ignored: their rows cost no matmul (the kernels)
        backend=args.backend,
    )


def plain_loss(student, teacher_hidden, teacher, tokens, labels, args):
    """The same from float32 logits of both models and log_softmax (TRL's generalized_jsd_loss)."""
    student_logits = student.lm_head(student.hidden_states(tokens)[:, :-1]).float()
    teacher_logits = teacher.lm_head(teacher_hidden[:, :-1])[..., : args.vocab].float()
    ls = F.log_softmax(student_logits / args.temperature, dim=-1)
    lt = F.log_softmax(teacher_logits / args.temperature, dim=-1)
    if args.beta == 0:
        per_token = F.kl_div(ls, lt, reduction="none", log_target=True).sum(-1)
    elif args.beta == 1:
        per_token = F.kl_div(lt, ls, reduction="none", log_target=True).sum(-1)
    else:
        mixture = torch.logaddexp(ls + math.log1p(-args.beta), lt + math.log(args.beta))
        kl_teacher = F.kl_div(mixture, lt, reduction="none", log_target=True).sum(-1)
        kl_student = F.kl_div(mixture, ls, reduction="none", log_target=True).sum(-1)
        per_token = args.beta * kl_teacher + (1 - args.beta) * kl_student
    mask = labels[:, 1:] != IGNORE
    return (per_token * mask).sum() / mask.sum().clamp_min(1)


def train(args):
    torch.manual_seed(args.seed)
    teacher = make_teacher(args)
    base = TinyCausalLM(args.vocab, args.student_dim, args.layers, args.seq_len).to(args.device)
    methods = {"fastce": fastce_loss, "plain": plain_loss}
    students = {name: copy.deepcopy(base) for name in methods}
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.0) for name, m in students.items()}
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=generator, device=args.device)
    labels = tokens.clone()
    labels[:, : args.prompt_len] = IGNORE  # the prompt is not scored
    with torch.no_grad():  # the teacher: no graph, nothing kept for a backward
        teacher_hidden = teacher.hidden_states(tokens)
    losses = {name: [] for name in methods}
    for _ in range(args.steps):
        for name, loss_fn in methods.items():
            optimizers[name].zero_grad()
            loss = loss_fn(students[name], teacher_hidden, teacher, tokens, labels, args)
            loss.backward()
            optimizers[name].step()
            losses[name].append(float(loss.detach()))
    assert all(p.grad is None for p in teacher.parameters())  # the teacher got no gradient
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
    parser.add_argument("--backend", default="auto", choices=["auto", "kernel", "reference"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    comparison.add_arguments(parser)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    losses, students = train(args)
    params = zip(students["fastce"].parameters(), students["plain"].parameters())
    param_gap = max(float((a - b).detach().abs().max()) for a, b in params)
    return comparison.report(args, losses, param_gap)


if __name__ == "__main__":
    sys.exit(0 if main()["match"] else 1)
