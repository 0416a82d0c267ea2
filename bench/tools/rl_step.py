"""The LM head of an RL step (issues 37, 47): a clipped-ratio policy-gradient objective with per-token advantages, an
entropy bonus and a sampling temperature, from hidden states; forward + backward into the hidden states and weight.

    python -m bench.tools.rl_step [--shapes 8192x3584x152064] [--frameworks torch,jax] [--json PATH]

Per shape (bf16, every 7th token ignored), rows as `python -m bench --linear`'s (bench.linear.measure): the objective
through fastce_torch.linear_log_probs (also float32 logits, no entropy, several workspace_bytes) and per token through
linear_token_objective; linear_policy_loss's "grpo" (KL beta 0.04 to noisy reference log-probs, the bonus);
linear_cross_entropy "mean" (the floor) and "sum" with the advantages as token_weights; TRL's recipe eager and compiled;
Liger's fused GRPO (an advantage per 1024-token sequence, no bonus, no KL); the fastce rows and log_softmax + gather
in JAX. Gradient errors against float32 (REFERENCE: of which loss), log-prob errors: max |log-prob - float64| over the
first 64 rows.
"""

import argparse
import sys
from functools import partial

import torch

import fastce_torch

from .. import envinfo, jax_linear, jax_setup, linear, linear_shapes
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
    """The objective per token times weights: -min(r A, clip(r) A) - 0.01 entropy, r = exp(logprobs - old) (no bonus
    when entropy is None); xp: torch or jax.numpy. The objective: their sum with weights = mask, / mask.sum()."""
    ratio = xp.exp(logprobs - old)
    per_token = -xp.minimum(ratio * advantages, xp.clip(ratio, 1 - CLIP, 1 + CLIP) * advantages)
    return (per_token if entropy is None else per_token - ENTROPY_BONUS * entropy) * weights


def objective(xp, log_probs):  # the objective of log_probs(h, w, y)'s (log-probs, entropy or None)
    return lambda h, w, y, old, adv, mask, ref: token_losses(xp, *log_probs(h, w, y), old, adv, mask).sum() / mask.sum()


def from_logits(logits, tokens):
    """TRL's recipe from float32 (or float64) logits: log_softmax at the temperature, gather; the entropy."""
    log_p = (logits / TEMPERATURE).log_softmax(-1)
    return log_p.gather(-1, tokens.clamp_min(0)[:, None])[:, 0], -(log_p.exp() * log_p).sum(-1)


trl_log_probs = lambda hidden, weight, tokens: from_logits((hidden @ weight.t()).float(), tokens)


def policy_inputs(hidden, weight, tokens, seed=1):
    """(old log-probs, advantages, mask, reference log-probs): the policy's own log-probs (TRL's recipe) plus noise of
    0.1 (both sides of the clip are taken), standard normal advantages per token, 1.0 where the token is kept."""
    mask = (tokens != IGNORE_INDEX).float()
    noise = torch.randn(3, len(mask), device=hidden.device, generator=torch.Generator(hidden.device).manual_seed(seed))
    with torch.no_grad():
        logp = trl_log_probs(hidden, weight, tokens)[0] * mask
    return logp + 0.1 * noise[0], noise[1], mask, logp + 0.1 * noise[2]


as_sequences = lambda x, rows: x.reshape(-1, min(SEQUENCE, rows), *x.shape[1:])  # (sequences, tokens, ...)


def preset_loss(package, backend, h, w, y, old, adv, mask, ref):
    """package.linear_policy_loss's "grpo" (KL to ref, the entropy bonus) on (sequences, tokens) views."""
    h, y, adv, mask, old, ref = [as_sequences(x, h.shape[0]) for x in (h, y, adv, mask, old, ref)]
    return package.linear_policy_loss(h, w, y, adv, mask=mask, old_log_probs=old, ref_log_probs=ref, backend=backend,
                                      loss_type="grpo", epsilon_low=CLIP, beta=BETA, entropy_coef=ENTROPY_BONUS,
                                      temperature=TEMPERATURE).loss  # fmt: skip


def token_objective(package, xp, backend, h, w, y, old, adv, mask, ref=None):
    """package.linear_token_objective of token_losses: the objective, its bonus and 1 / kept inside the chunk pass."""
    return package.linear_token_objective(h, w, y, partial(token_losses, xp), (old, adv, mask / mask.sum()),
                                          with_entropy=True, temperature=TEMPERATURE, backend=backend)  # fmt: skip


def torch_implementations(backend):
    """name -> loader of (loss(hidden, weight, tokens, old, advantages, mask, ref), None or the (hidden, weight,
    tokens) -> (log-probs, entropy or None) function whose log-probs the error column checks)."""

    def fastce(entropy=True, **settings):  # log_probs(h, w, y) -> (log-probs, entropy or None)
        call = partial(fastce_torch.linear_log_probs, temperature=TEMPERATURE, backend=backend, return_entropy=entropy,
                       **settings)  # fmt: skip
        return (lambda h, w, y: tuple(call(h, w, y))) if entropy else (lambda h, w, y: (call(h, w, y), None))

    def cross_entropy(weighted=False):  # "mean", or the "sum" of the advantage-weighted token losses
        weights = lambda adv: {"reduction": "sum", "token_weights": adv} if weighted else {}
        return lambda h, w, y, old, adv, *_: fastce_torch.linear_cross_entropy(
            h, w, y, temperature=TEMPERATURE, backend=backend, **weights(adv))  # fmt: skip

    def liger():
        grpo = optional("liger_kernel.chunked_loss", "LigerFusedLinearGRPOLoss", "liger-kernel")
        grpo = grpo(beta=0.0, use_ref_model=False, loss_type="bnpo", epsilon_low=CLIP, epsilon_high=CLIP,
                    temperature=TEMPERATURE)  # fmt: skip

        def loss(h, w, y, old, adv, mask, ref):  # (sequences, tokens) with each sequence's first advantage
            seq = partial(as_sequences, rows=h.shape[0])
            out = grpo(seq(h), w, seq(y.clamp_min(0)), seq(mask), seq(adv)[:, 0], old_per_token_logps=seq(old))
            return out[0] if isinstance(out, tuple) else out

        return loss, None

    variants = {"": fastce(), "_f32_logits": fastce(logits_dtype="float32"), "_no_entropy": fastce(entropy=False)}
    variants |= {f"_ws{label}": fastce(workspace_bytes=size) for label, size in WORKSPACES.items()}
    trl = objective(torch, trl_log_probs)
    return {f"fastce_torch{suffix}": (lambda f=f: (objective(torch, f), f)) for suffix, f in variants.items()} | {
        "fastce_torch_ce_mean": lambda: (cross_entropy(), None),
        "fastce_torch_ce_token_weights": lambda: (cross_entropy(weighted=True), None),
        "fastce_torch_grpo": lambda: (partial(preset_loss, fastce_torch, backend), None),
        "fastce_torch_objective": lambda: (partial(token_objective, fastce_torch, torch, backend), None),
        "trl_eager": lambda: (trl, trl_log_probs), "liger_grpo": liger,
        "trl_compile": lambda: (torch.compile(trl, dynamic=False), None)}  # fmt: skip


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
    sequences = as_sequences(mask, len(mask))  # "grpo": the mean over sequences of their kept tokens' mean
    w, kept = (sequences / (len(sequences) * sequences.sum(-1, keepdim=True).clamp_min(1))).view(-1), mask.sum()

    def chunk_objective(logits, rows):  # a chunk's share of the objective, from float32 logits
        return token_losses(torch, *from_logits(logits, tokens[rows]), *(x[rows] for x in inputs[3:6])).sum() / kept

    def chunk_preset(logits, rows):  # the same of the "grpo" preset: + beta times TRL's k3 KL, the bonus over all kept
        logp, entropy = from_logits(logits, tokens[rows])
        d = torch.where(w[rows] != 0, ref[rows] - logp, 0.0)  # the k3 KL exp(d) - d - 1 (no overflow where ignored)
        terms = token_losses(torch, logp, None, old[rows], advantages[rows], w[rows]) + w[rows] * BETA * (d.expm1() - d)
        return terms.sum() - ENTROPY_BONUS * (mask[rows] * entropy).sum() / kept

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
    """The JAX rows (fastce_jax's and XLA's log_softmax + gather) on the same values (DLPack)."""
    import jax
    import jax.numpy as jnp

    import fastce_jax

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

    mean = lambda h, w, y, *_: fastce_jax.linear_cross_entropy(h, w, y, temperature=TEMPERATURE, backend=backend)
    loaders = {"fastce_jax": (objective(jnp, fastce), fastce), "xla_log_softmax": (objective(jnp, xla), xla),
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
    parser.add_argument("--impls", help="a comma-separated subset of the rows (rl_step: of the torch rows; distill_"
                        "step: of both frameworks', the matmul floors always measured; default: all)")  # fmt: skip
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    jax_setup.configure()
    if not torch.cuda.is_available():
        sys.exit(f"{prog} measures on a GPU (its test in bench/tests runs its code paths on a CPU)")
    result = run(parse_shapes(args.shapes), args.frameworks.split(","), args.impls.split(",") if args.impls else None)
    print(render(result) + (f"\nwrote {write_json(result, args.json)}" if args.json else ""))
    return 1 if any(f["impl"].startswith("fastce") and f["stage"] != "unavailable" for f in result["failures"]) else 0


def main(argv=None):
    render = lambda result: linear_table(result, RL_COLUMNS) + "\n\n" + "\n".join(rl_targets(result))
    return tool_main(argv, __doc__, SHAPES, parse_linear_shapes, run, render)


if __name__ == "__main__":
    sys.exit(main())
