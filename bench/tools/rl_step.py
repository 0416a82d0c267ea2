"""The LM head of an RL step (issues 37, 47): a clipped-ratio policy-gradient objective with per-token advantages, an
entropy bonus and a sampling temperature, from hidden states; forward + backward into the hidden states and weight.

    python -m bench.tools.rl_step [--shapes 8192x3584x152064] [--frameworks torch,jax] [--json PATH]

Per shape (bf16, every 7th token ignored), rows as in `python -m bench --linear` (bench.linear.measure: do_bench
medians, the peak beyond the inputs and beyond the gradients, the gradients' errors against float32; TFLOP/s of the
6 NHV of a fused step, of the forward product's rate): fastce_torch.linear_log_probs + the objective (also with
float32 logits, without the entropy, at several workspace_bytes), linear_token_objective with it per token (issue
47), linear_policy_loss's "grpo" (KL beta 0.04, the bonus; errors against its own float32 reference),
linear_cross_entropy "mean" (the targets' floor) and "sum" with the advantages as token_weights (a linear objective),
TRL's eager recipe and its torch.compile, Liger's fused GRPO loss (one advantage per 1024-token sequence, no entropy
bonus, no KL); fastce_jax's linear_log_probs, token objective, "grpo" and "mean", XLA's log_softmax + gather, under
jit(value_and_grad) (host-timed, XLA's temp size). Log-prob errors: the largest |log-prob - float64| over the first
64 rows, float64 from the same inputs.
"""

import argparse
import sys
from functools import partial

import torch

import fastce_torch

from .. import envinfo, jax_setup, linear, linear_shapes
from ..linear_shapes import SEQUENCE, parse_linear_shapes, to_jax
from ..progress import measure_rows, optional
from ..report import RL_COLUMNS, linear_table, rl_targets, write_json
from ..shapes import IGNORE_INDEX

TEMPERATURE, CLIP, ENTROPY_BONUS, BETA, ERROR_ROWS = 0.7, 0.2, 0.01, 0.04, 64
SHAPES = "8192x3584x152064,16384x4096x128256"
WORKSPACES = {"256MiB": 256 << 20, "1GiB": 1 << 30, "4GiB": 4 << 30}
# The float32 reference of the rows whose loss is not the objective: none, or the "grpo" preset's (KL, per sequence).
OTHER = ("fastce_torch_no_entropy", "fastce_torch_ce_mean", "fastce_torch_ce_token_weights", "liger_grpo")
REFERENCE = dict.fromkeys((*OTHER, "fastce_jax_ce_mean")) | {"fastce_torch_grpo": "grpo", "fastce_jax_grpo": "grpo"}


def token_losses(xp, logprobs, entropy, old, advantages, weights):
    """The objective per token times weights: -min(r A, clip(r) A) - 0.01 entropy with r = exp(logprobs - old) (no
    bonus when entropy is None); xp: torch or jax.numpy. The linear_token_objective rows' per-chunk function."""
    ratio = xp.exp(logprobs - old)
    per_token = -xp.minimum(ratio * advantages, xp.clip(ratio, 1 - CLIP, 1 + CLIP) * advantages)
    return (per_token if entropy is None else per_token - ENTROPY_BONUS * entropy) * weights


def objective(xp, logprobs, entropy, old, advantages, mask, kept=None):
    """token_losses over the kept tokens / their number (kept: the whole batch's number for some of its rows)."""
    return token_losses(xp, logprobs, entropy, old, advantages, mask).sum() / (mask.sum() if kept is None else kept)


def from_logits(logits, tokens):
    """TRL's recipe from float32 (or float64) logits: log_softmax at the temperature, gather; the entropy from the
    probabilities."""
    log_p = (logits / TEMPERATURE).log_softmax(-1)
    return log_p.gather(-1, tokens.clamp_min(0)[:, None])[:, 0], -(log_p.exp() * log_p).sum(-1)


def trl_log_probs(hidden, weight, tokens):
    return from_logits((hidden @ weight.t()).float(), tokens)


def policy_inputs(hidden, weight, tokens, seed=1):
    """(old log-probs, advantages, mask, reference log-probs): the policy's own log-probs (TRL's recipe) plus noise of
    0.1, so that both sides of the clip are taken; standard normal advantages per token; 1.0 where the token is kept;
    the policy's log-probs plus another noise of 0.1 (the KL's reference)."""
    mask = (tokens != IGNORE_INDEX).float()
    noise = torch.randn(3, len(mask), device=hidden.device, generator=torch.Generator(hidden.device).manual_seed(seed))
    with torch.no_grad():
        logp = trl_log_probs(hidden, weight, tokens)[0] * mask
    return logp + 0.1 * noise[0], noise[1], mask, logp + 0.1 * noise[2]


def preset_loss(package, backend, h, w, y, old, adv, mask, ref):
    """package.linear_policy_loss's "grpo" (KL to ref, the entropy bonus) on (sequences, tokens) views."""
    seq = lambda x: x.reshape(-1, min(SEQUENCE, h.shape[0]), *x.shape[1:])
    return package.linear_policy_loss(seq(h), w, seq(y), seq(adv), mask=seq(mask), old_log_probs=seq(old),
                                      ref_log_probs=seq(ref), loss_type="grpo", epsilon_low=CLIP, beta=BETA,
                                      entropy_coef=ENTROPY_BONUS, temperature=TEMPERATURE,
                                      backend=backend).loss  # fmt: skip


def token_objective(package, xp, backend, h, w, y, old, adv, mask, ref=None):
    """package.linear_token_objective of token_losses: the objective, its bonus and 1 / kept inside the chunk pass."""
    return package.linear_token_objective(h, w, y, partial(token_losses, xp), (old, adv, mask / mask.sum()),
                                          with_entropy=True, temperature=TEMPERATURE, backend=backend)  # fmt: skip


def torch_implementations(backend):
    """name -> loader of (loss(hidden, weight, tokens, old, advantages, mask, ref), None or the (hidden, weight,
    tokens) -> (log-probs, entropy or None) function whose log-probs the error column checks)."""

    def fastce(entropy=True, **settings):
        def log_probs(hidden, weight, tokens):
            out = fastce_torch.linear_log_probs(hidden, weight, tokens, temperature=TEMPERATURE, backend=backend,
                                                return_entropy=entropy, **settings)  # fmt: skip
            return tuple(out) if entropy else (out, None)

        return log_probs

    def policy(log_probs):
        return lambda h, w, y, *inputs: objective(torch, *log_probs(h, w, y), *inputs[:3])

    def cross_entropy(weighted=False):  # "mean", or the "sum" of the advantage-weighted token losses
        def loss(h, w, y, old, adv, mask, ref):
            weights = {"reduction": "sum", "token_weights": adv} if weighted else {}
            return fastce_torch.linear_cross_entropy(h, w, y, temperature=TEMPERATURE, backend=backend, **weights)

        return loss

    def liger():
        grpo = optional("liger_kernel.chunked_loss", "LigerFusedLinearGRPOLoss", "liger-kernel")
        grpo = grpo(beta=0.0, use_ref_model=False, loss_type="bnpo", epsilon_low=CLIP, epsilon_high=CLIP,
                    temperature=TEMPERATURE)  # fmt: skip

        def loss(h, w, y, old, adv, mask, ref):  # (sequences, tokens) with each sequence's first advantage
            rows = (-1, min(SEQUENCE, h.shape[0]))
            out = grpo(h.view(*rows, h.shape[1]), w, y.clamp_min(0).view(rows), mask.view(rows), adv.view(rows)[:, 0],
                       old_per_token_logps=old.view(rows))  # fmt: skip
            return out[0] if isinstance(out, tuple) else out

        return loss, None

    variants = {"": fastce(), "_f32_logits": fastce(logits_dtype="float32"), "_no_entropy": fastce(entropy=False)}
    variants |= {f"_ws{label}": fastce(workspace_bytes=size) for label, size in WORKSPACES.items()}
    return {f"fastce_torch{suffix}": (lambda f=f: (policy(f), f)) for suffix, f in variants.items()} | {
        "fastce_torch_ce_mean": lambda: (cross_entropy(), None),
        "fastce_torch_ce_token_weights": lambda: (cross_entropy(weighted=True), None),
        "fastce_torch_grpo": lambda: (partial(preset_loss, fastce_torch, backend), None),
        "fastce_torch_objective": lambda: (partial(token_objective, fastce_torch, torch, backend), None),
        "trl_eager": lambda: (policy(trl_log_probs), trl_log_probs), "liger_grpo": liger,
        "trl_compile": lambda: (torch.compile(policy(trl_log_probs), dynamic=False), None)}  # fmt: skip


def float64_error(log_probs, hidden, weight, tokens):
    """max |log-prob - float64| over the first ERROR_ROWS rows, float64 computed from the same (rounded) inputs."""
    rows = slice(0, ERROR_ROWS)
    with torch.no_grad():
        got = log_probs(hidden[rows], weight, tokens[rows])[0].double()
        want = from_logits(hidden[rows].double() @ weight.double().t(), tokens[rows])[0]
        return float((got - want)[tokens[rows] != IGNORE_INDEX].abs().max())


def torch_rows(shape, inputs, impls, backend, failures):
    """The torch rows, each with its gradients' errors against its loss's float32 reference (REFERENCE); returned with
    the references {"objective": (loss, d hidden, d weight), "grpo": ...}."""
    hidden, weight, tokens, old, advantages, mask, ref = inputs
    sequences = mask.view(-1, min(SEQUENCE, len(mask)))  # "grpo": the mean over sequences of their kept tokens' mean
    w = (sequences / (len(sequences) * sequences.sum(-1, keepdim=True).clamp_min(1))).view(-1)

    def chunk_objective(logits, rows):  # a chunk's share of the objective, from float32 logits
        return objective(torch, *from_logits(logits, tokens[rows]), old[rows], advantages[rows], mask[rows], mask.sum())

    def chunk_preset(logits, rows):  # the same of the "grpo" preset: + beta times TRL's k3 KL, the bonus over all kept
        logp, entropy = from_logits(logits, tokens[rows])
        log_ratio = torch.where(w[rows] != 0, ref[rows] - logp, 0.0)  # (no overflow at the ignored tokens)
        per_token = token_losses(torch, logp, None, old[rows], advantages[rows], 1.0)
        per_token = per_token + BETA * (log_ratio.expm1() - log_ratio)
        return (w[rows] * per_token).sum() - ENTROPY_BONUS * (mask[rows] * entropy).sum() / mask.sum()

    references = {name: linear_shapes.float32_reference(hidden, weight, tokens, chunk_loss=chunk)
                  for name, chunk in (("objective", chunk_objective), ("grpo", chunk_preset))}  # fmt: skip

    def measure(impl, loaded):
        loss_fn, log_probs = loaded
        measured = linear.measure(lambda h, w, y: loss_fn(h, w, y, *inputs[3:]), shape, inputs=inputs[:3],
                                  reference=references.get(REFERENCE.get(impl, "objective")))  # fmt: skip
        if log_probs is not None:
            measured["logprob_error"] = float64_error(log_probs, hidden, weight, tokens)
        return measured

    loaders = {impl: loader for impl, loader in torch_implementations(backend).items() if impl in impls}
    return measure_rows(str(shape), loaders, measure, failures), references


def jax_rows(shape, inputs, references, backend, failures):
    """fastce_jax.linear_log_probs and XLA's log_softmax + gather, the same objective on the same values (DLPack);
    fastce_jax's "mean", "grpo" preset and linear_token_objective."""
    import jax
    import jax.numpy as jnp

    import fastce_jax

    from .. import jax_linear

    hidden, weight, tokens, *policy = to_jax(*inputs)
    fastce = partial(fastce_jax.linear_log_probs, temperature=TEMPERATURE, return_entropy=True, backend=backend)

    def xla(h, w, y):
        log_p, keep = jax.nn.log_softmax((h @ w.T).astype(jnp.float32) / TEMPERATURE), y != IGNORE_INDEX
        picked = jnp.take_along_axis(log_p, jnp.maximum(y, 0)[:, None], axis=-1)[:, 0]
        return jnp.where(keep, picked, 0.0), jnp.where(keep, -(jnp.exp(log_p) * log_p).sum(-1), 0.0)

    def measure(impl, loaded):  # loaded: (loss, None or the log-probs checked against float64)
        loss_fn, compared = lambda h, w, y: loaded[0](h, w, y, *policy), REFERENCE.get(impl, "objective")
        row = jax_linear.measure(loss_fn, (hidden, weight, tokens), reference=references.get(compared))
        if loaded[1] is not None:
            jitted = jax.jit(loaded[1])
            row["logprob_error"] = float64_error(lambda *t: [torch.from_dlpack(jitted(*to_jax(*t))[0])], *inputs[:3])
        return row

    policy_loss = lambda log_probs: lambda h, w, y, *inputs: objective(jnp, *log_probs(h, w, y), *inputs[:3])
    mean = lambda h, w, y, *_: fastce_jax.linear_cross_entropy(h, w, y, temperature=TEMPERATURE, backend=backend)
    loaders = {"fastce_jax": (policy_loss(fastce), fastce), "xla_log_softmax": (policy_loss(xla), xla),
               "fastce_jax_ce_mean": (mean, None), "fastce_jax_grpo": (partial(preset_loss, fastce_jax, backend), None),
               "fastce_jax_objective": (partial(token_objective, fastce_jax, jnp, backend), None)}  # fmt: skip
    return measure_rows(str(shape), {impl: lambda v=v: v for impl, v in loaders.items()}, measure, failures)


def run(shapes, frameworks=("torch", "jax"), impls=None, backend="auto") -> dict:
    """Every row at every shape (impls: a subset of the torch rows), failures recorded."""
    rows, failures, peak = [], [], linear.peak_matmul_tflops()
    matmul = {str(shape): linear.matmul_tflops(shape) for shape in shapes}
    for shape in shapes:
        inputs = linear.make_inputs(shape)
        inputs = (*inputs, *policy_inputs(*inputs))
        torch_impls = (impls or list(torch_implementations(backend))) if "torch" in frameworks else []
        shape_rows, references = torch_rows(shape, inputs, torch_impls, backend, failures)
        if "jax" in frameworks:
            shape_rows += jax_rows(shape, inputs, references, backend, failures)
        shape_rows = [linear.table_row(r.pop("impl"), shape, r, matmul[str(shape)], peak) for r in shape_rows]
        mean = next((r["fwdbwd_ms"] for r in shape_rows if r["impl"] == "fastce_torch_ce_mean"), None)
        rows += [r | ({"of_ce_mean": r["fwdbwd_ms"] / mean} if mean else {}) for r in shape_rows]
        del inputs, references
        torch.cuda.empty_cache()
    device = torch.cuda.get_device_name() if linear.DEVICE == "cuda" else linear.DEVICE
    return {"mode": "rl_step", "device": device, "date": envinfo.today(), "commit": envinfo.git_commit(),
            "torch": torch.__version__, "versions": envinfo.versions(), "temperature": TEMPERATURE, "clip": CLIP,
            "entropy_bonus": ENTROPY_BONUS, "beta": BETA, "peak_matmul": {"shape": list(linear.PEAK_MATMUL),
            "TFLOPs": peak}, "matmul_TFLOPs": matmul, "rows": rows, "failures": failures}  # fmt: skip


def tool_main(argv, doc, shapes, parse_shapes, run, render) -> int:
    """The command line of this tool and of bench.tools.distill_step: the rows of run(shapes, frameworks, impls) at
    the given shapes, render(result) printed, the JSON written; 1 when a fastce row failed."""
    prog = f"python -m {run.__module__}"
    parser = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    parser.add_argument("--shapes", default=shapes, help="comma-separated shapes, :dtype appended (default bfloat16)")
    parser.add_argument("--frameworks", default="torch,jax", help="a subset of torch,jax")
    parser.add_argument(
        "--impls",
        help="comma-separated subset of the rows (default: all; rl_step: of the torch rows, distill_step: of "
        "both frameworks' rows, its matmul floors always measured)",
    )
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    jax_setup.configure()
    if not torch.cuda.is_available():
        sys.exit(f"{prog} measures on a GPU (its test in bench/tests runs its code paths on a CPU)")
    impls = args.impls.split(",") if args.impls else None
    result = run(parse_shapes(args.shapes), args.frameworks.split(","), impls)
    print(render(result))
    if args.json:
        print(f"wrote {write_json(result, args.json)}")
    return 1 if any(f["impl"].startswith("fastce") and f["stage"] != "unavailable" for f in result["failures"]) else 0


def main(argv=None):
    render = lambda result: linear_table(result, RL_COLUMNS) + "\n\n" + "\n".join(rl_targets(result))
    return tool_main(argv, __doc__, SHAPES, parse_linear_shapes, run, render)


if __name__ == "__main__":
    sys.exit(main())
