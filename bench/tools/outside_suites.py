"""Liger-Kernel's own loss tests run against fastce_torch.liger: passed / skipped / failed counts.

    python -m bench.tools.outside_suites --liger-tests DIR [--json OUT] [--baseline] [-k EXPR] [--workers N]

DIR holds Liger's test tree (bench/NOTES.md says how to extract it; liger_kernel 0.8.5 importable); pytest runs its
cross-entropy files, and its fused linear JSD file where fastce_torch has linear_jsd, with
bench.tools.outside_liger_plugin loaded (`--baseline`: also on Liger). Needs CUDA. Liger's test_jsd.py is left out:
it compares gradients with respect to log-probabilities taken as free inputs, which fastce's jsd normalises
(fastce_torch/integrations/liger_jsd.py says why the loss and the logits' gradient are the same).
"""

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from ..progress import aligned

REPO = Path(__file__).resolve().parents[2]
PLUGIN = "bench.tools.outside_liger_plugin"
FILES = ("test/transformers/test_cross_entropy.py", "test/transformers/test_fused_linear_cross_entropy.py")
JSD_FILES = ("test/transformers/test_fused_linear_jsd.py",)
OUTCOMES = ("passed", "skipped", "failed", "errors", "xfailed", "xpassed", "deselected")


def parse_summary(text):
    """Counts from pytest's last summary line ('== 3 failed, 10 passed, 2 skipped in 4.1s =='); None if absent."""
    summary = re.compile(r"\b(passed|failed|skipped|error|errors|no tests ran)\b")
    lines = [line for line in text.splitlines() if summary.search(line)]
    for line in reversed(lines):
        found = re.findall(r"(\d+) (passed|skipped|failed|errors?|xfailed|xpassed|deselected|warnings?)\b", line)
        if found or "no tests ran" in line:
            counts = dict.fromkeys(OUTCOMES, 0)
            for number, word in found:
                word = "errors" if word.startswith("error") else word
                if word in counts:
                    counts[word] += int(number)
            return counts
    return None


def failure_reasons(text, limit=40):
    """The short test summary's FAILED / ERROR lines ('-rfE'), for the report."""
    return [line for line in text.splitlines() if line.startswith(("FAILED ", "ERROR "))][:limit]


def run_suite(liger_tests, files, with_plugin, extra, timeout):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(liger_tests), str(REPO), env.get("PYTHONPATH"))))
    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "--rootdir", str(liger_tests)]
    if with_plugin:
        command += ["-p", PLUGIN]
    command += [*extra, *files]
    try:
        done = subprocess.run(command, cwd=liger_tests, env=env, capture_output=True, text=True, timeout=timeout,
                              check=False)  # fmt: skip
        text, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        text = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
        text, code = text + f"\ntimed out after {timeout} s", None
    return {"implementation": "fastce" if with_plugin else "liger", "returncode": code, "counts": parse_summary(text),
            "failures": failure_reasons(text), "tail": text[-4000:]}  # fmt: skip


def table(results):
    rows = [[r["implementation"], *((r["counts"] or {}).get(k, "?") for k in OUTCOMES[:4])] for r in results]
    return aligned([["implementation", *OUTCOMES[:4]], *rows])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--liger-tests", required=True, type=Path, help="directory holding Liger's test/ tree")
    parser.add_argument("--json", type=Path, help="write counts and failure lines here")
    parser.add_argument("--baseline", action="store_true", help="also run the files on Liger itself")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument("--timeout", type=int, default=500, help="seconds per pytest run")
    parser.add_argument("--workers", type=int, default=0, help="pytest-xdist workers (-n); 0 runs in one process")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("outside_suites: Liger's tests run on CUDA and no CUDA device is visible; nothing ran", file=sys.stderr)
        return 2
    from fastce_torch import liger

    liger_tests = args.liger_tests.resolve()
    wanted = FILES + (JSD_FILES if hasattr(liger, "LigerFusedLinearJSD") else ())
    files = [f for f in wanted if (liger_tests / f).is_file()]
    if not files:
        print(f"outside_suites: none of {', '.join(FILES)} under {liger_tests}", file=sys.stderr)
        return 2
    extra = (["-k", args.keyword] if args.keyword else []) + (["-n", str(args.workers)] if args.workers else [])
    results = [run_suite(liger_tests, files, True, extra, args.timeout)]
    if args.baseline:
        results.append(run_suite(liger_tests, files, False, extra, args.timeout))
    print(f"Liger-Kernel tests ({', '.join(files)}), fastce_torch.liger substituted for Liger's losses:")
    print(table(results))
    for result in results:
        if result["counts"] is None:
            print(f"\n{result['implementation']}: no pytest summary; output tail:\n{result['tail']}")
        elif result["failures"]:
            print(f"\n{result['implementation']}: failures")
            print("\n".join(result["failures"]))
    if args.json:
        args.json.write_text(json.dumps({"files": files, "results": results}, indent=1))
    return 0 if all(r["counts"] is not None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
