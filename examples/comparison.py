"""The step-by-step check of the GRPO and distillation examples (grpo_*.py, distill_*.py): two copies of a model
from the same initialisation take the same optimizer steps, one through fastce's loss ("fastce"), one through plain
log_softmax ("plain"); this prints their losses side by side and returns whether every step agrees. Framework-free:
each example measures its own largest parameter difference."""

import json


def add_arguments(parser):
    """The check's command-line options: --rtol (the allowed gap per step) and --json (where to write the result)."""
    parser.add_argument("--rtol", type=float, default=1e-4, help="allowed |gap| / max(1, |plain loss|) per step")
    parser.add_argument("--json", help="write the losses here")


def report(args, losses, param_gap, **extra):
    """Prints the "fastce" and "plain" losses per step and the largest gaps; returns the result record (args,
    losses, the `extra` entries, max_gap, max_param_diff, match), written to args.json when given. match: every
    step's |fastce - plain| / max(1, |plain|) is at most args.rtol."""
    gaps = [abs(a - b) / max(1.0, abs(b)) for a, b in zip(losses["fastce"], losses["plain"])]
    print(f"{'step':>5} {'fastce':>12} {'plain':>12}")
    for i, (a, b) in enumerate(zip(losses["fastce"], losses["plain"])):
        print(f"{i:5d} {a:12.7f} {b:12.7f}")
    print(f"max loss gap {max(gaps):.2e} (rtol {args.rtol:g}); max parameter difference {param_gap:.2e}")
    result = {"args": vars(args), "losses": losses, **extra, "max_gap": max(gaps), "max_param_diff": param_gap}
    result["match"] = max(gaps) <= args.rtol
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result
