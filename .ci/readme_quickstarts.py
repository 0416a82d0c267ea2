"""Run every ```python block of README.md and docs/*.md, each in a fresh interpreter, against the INSTALLED package.

    python .ci/readme_quickstarts.py [--jobs N] [--timeout SECONDS] [--list] [--from-source] [markdown files...]
    (default: README.md; CI: README.md docs/*.md)

Each block is written to a temporary directory and run from there (cwd and sys.path[0] are that directory), with any
PYTHONPATH entry that points into this clone removed, so `import fastce_torch` finds the installed wheel, not the
sources next to this script; after the block runs, the driver checks that fastce_torch / fastce_jax (when the block
imported them) came from outside the clone. Any error, non-zero exit or timeout fails the run (exit status 1) with
the block's file, line and output. Shell blocks (```bash: the test and bench commands) are not run.

Fragments: a block that cannot run on a CPU in CI (it needs a tokenizer or data set from the hub, several GPUs, a
long training run) is fenced ```python fragment (GitHub still highlights it as python). It is only compiled
(compile(code, label, "exec")): a syntax error fails the run. Any other word after ```python is refused, so that a
misspelt marker does not skip a block. The last line reports both counts.

--from-source: for a local run against this clone's sources, with PYTHONPATH pointing at the clone (e.g.
`PYTHONPATH=$PWD python .ci/readme_quickstarts.py --from-source README.md docs/*.md` from the clone's root). The
PYTHONPATH entries are kept and the check is reversed: fastce_torch / fastce_jax must come from this clone (not from
another checkout's editable install).
"""

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CLONE_ROOT = Path(__file__).resolve().parent.parent
# ```python, then an optional info word (only "fragment" is accepted), then the code up to the closing fence.
FENCE = re.compile(r"^```python(?:[ \t]+([^\n]*?))?[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
FRAGMENT = "fragment"
PACKAGES = ("fastce_torch", "fastce_jax")

# Runs the block as __main__, then refuses a fastce package imported from the clone's source folders (the check the
# run exists for; a venv inside the clone, as CI's, is an installed package). With --from-source (argv[3] == "source")
# the check is reversed: the packages must come from the clone's source folders.
DRIVER = f"""
import os, runpy, sys
block, clone, mode = sys.argv[1], os.path.realpath(sys.argv[2]), sys.argv[3]
sys.argv = [block]
runpy.run_path(block, run_name="__main__")
for name in {PACKAGES!r}:
    module = sys.modules.get(name)
    if module is None:
        continue
    in_clone = os.path.realpath(module.__file__).startswith(os.path.join(clone, name) + os.sep)
    if mode == "installed" and in_clone:
        sys.exit(f"{{name}} was imported from the clone ({{module.__file__}}), not from the installed package")
    if mode == "source" and not in_clone:
        sys.exit(f"--from-source: {{name}} was imported from {{module.__file__}}, not from {{clone}} (PYTHONPATH?)")
"""


def python_blocks(markdown_path):
    """(first line number of the code, is_fragment, code) for each ```python block of the file."""
    text = markdown_path.read_text(encoding="utf-8")
    blocks = []
    for match in FENCE.finditer(text):
        line, info = text.count("\n", 0, match.start(2)) + 1, match.group(1) or ""
        if info not in ("", FRAGMENT):
            sys.exit(f"{markdown_path}:{line}: ```python {info}: only ```python or ```python {FRAGMENT}")
        blocks.append((line, info == FRAGMENT, match.group(2)))
    return blocks


def environment_without_clone():
    """os.environ with the PYTHONPATH entries that resolve into this clone (or to the working directory) dropped."""
    env = dict(os.environ)
    kept = []
    for entry in env.get("PYTHONPATH", "").split(os.pathsep):
        if not entry or entry == ".":
            continue
        resolved = Path(entry).resolve()
        if resolved == CLONE_ROOT or CLONE_ROOT in resolved.parents:
            print(f"  (PYTHONPATH entry {entry} is inside the clone: dropped)")
            continue
        kept.append(entry)
    if kept:
        env["PYTHONPATH"] = os.pathsep.join(kept)
    else:
        env.pop("PYTHONPATH", None)
    return env


def compile_fragment(label, code):
    """A fragment is only compiled: None, or the syntax error's text."""
    try:
        compile(code, label, "exec")
    except SyntaxError as error:  # IndentationError included
        return f"{type(error).__name__}: {error.msg}, line {error.lineno} of the block"
    return None


def run_block(label, code, timeout, env, mode):
    """Run one block in a fresh interpreter from an empty temporary directory; return (ok, seconds, output)."""
    with tempfile.TemporaryDirectory(prefix="fastce-quickstart-") as workdir:
        block_file = Path(workdir) / "quickstart.py"
        block_file.write_text(code, encoding="utf-8")
        command = [sys.executable, "-c", DRIVER, str(block_file), str(CLONE_ROOT), mode]
        start = time.perf_counter()
        try:
            done = subprocess.run(
                command, cwd=workdir, env=env, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired as expired:
            output = (expired.stdout or "") + (expired.stderr or "")
            if isinstance(output, bytes):
                output = output.decode(errors="replace")
            return False, time.perf_counter() - start, f"{label}: timed out after {timeout} s\n{output}"
        seconds = time.perf_counter() - start
        return done.returncode == 0, seconds, done.stdout + done.stderr


FRONT_PAGE_BYTES = 16_000


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", default=[str(CLONE_ROOT / "README.md")])
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per block (default 180)")
    parser.add_argument("--jobs", type=int, default=2, help="blocks run at once (default 2; each is one process)")
    parser.add_argument("--list", action="store_true", help="print the blocks and exit")
    parser.add_argument(
        "--from-source", action="store_true", help="run against the clone's sources on PYTHONPATH (a local run)"
    )
    args = parser.parse_args()

    front_page_bytes = (CLONE_ROOT / "README.md").stat().st_size
    if front_page_bytes > FRONT_PAGE_BYTES:  # behaviour details belong in docs/, history in bench/NOTES.md
        sys.exit(f"README.md is {front_page_bytes} bytes, over the front page's {FRONT_PAGE_BYTES}")
    blocks = [
        (f"{path}:{line}", fragment, code)
        for path in map(Path, args.files)
        for line, fragment, code in python_blocks(path)
    ]
    if not blocks:
        sys.exit(f"no ```python blocks in {args.files}")
    if args.list:
        for label, fragment, code in blocks:
            print(f"--- {label}{' (fragment: compiled only)' if fragment else ''}\n{code}")
        return

    if args.from_source:
        env, mode = dict(os.environ), "source"
        print(f"  (--from-source: PYTHONPATH={env.get('PYTHONPATH', '')!r} kept; fastce must come from {CLONE_ROOT})")
    else:
        env, mode = environment_without_clone(), "installed"
    failures, total = [], time.perf_counter()
    runnable = [(label, code) for label, fragment, code in blocks if not fragment]
    fragments = [(label, code) for label, fragment, code in blocks if fragment]
    # Threads only wait on the subprocesses; results are reported in the files' order.
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        runs = {label: pool.submit(run_block, label, code, args.timeout, env, mode) for label, code in runnable}
        for label, fragment, code in blocks:
            if fragment:
                error = compile_fragment(label, code)
                ok, seconds, output, kind = error is None, 0.0, error, "compiled"
            else:
                (ok, seconds, output), kind = runs[label].result(), "ran"
            print(f"{'ok  ' if ok else 'FAIL'} {seconds:6.1f} s  {kind:8s} {label}", flush=True)
            if not ok:
                failures.append(label)
                print(f"----- {label} output -----\n{output.rstrip()}\n-----", flush=True)
    ran_ok = sum(label not in failures for label, _ in runnable)
    compiled_ok = sum(label not in failures for label, _ in fragments)
    print(
        f"{ran_ok} of {len(runnable)} blocks ran, {compiled_ok} of {len(fragments)} fragments compiled, "
        f"in {time.perf_counter() - total:.1f} s"
    )
    if failures:
        sys.exit("failed: " + ", ".join(failures))


if __name__ == "__main__":
    main()
