"""Run every ```python block of README.md, each in a fresh interpreter, against the INSTALLED fastce packages.

    python .ci/readme_quickstarts.py [--jobs N] [--timeout SECONDS] [--list] [markdown files...]   (default: README.md)

Each block is written to a temporary directory and run from there (cwd and sys.path[0] are that directory), with any
PYTHONPATH entry that points into this clone removed, so `import fastce_torch` finds the installed wheel, not the
sources next to this script; after the block runs, the driver checks that fastce_torch / fastce_jax (when the block
imported them) came from outside the clone. Any error, non-zero exit or timeout fails the run (exit status 1) with
the block's README line and its output. Shell blocks (```bash: the test and bench commands) are not run.
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
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
PACKAGES = ("fastce_torch", "fastce_jax")

# Runs the block as __main__, then refuses a fastce package imported from the clone's source folders (the check the
# run exists for; a venv inside the clone, as CI's, is an installed package).
DRIVER = f"""
import os, runpy, sys
block, clone = sys.argv[1], os.path.realpath(sys.argv[2])
sys.argv = [block]
runpy.run_path(block, run_name="__main__")
for name in {PACKAGES!r}:
    module = sys.modules.get(name)
    if module is not None and os.path.realpath(module.__file__).startswith(os.path.join(clone, name) + os.sep):
        sys.exit(f"{{name}} was imported from the clone ({{module.__file__}}), not from the installed package")
"""


def python_blocks(markdown_path):
    """(first line number of the code, code) for each ```python block of the file."""
    text = markdown_path.read_text(encoding="utf-8")
    return [(text.count("\n", 0, match.start(1)) + 1, match.group(1)) for match in FENCE.finditer(text)]


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


def run_block(label, code, timeout, env):
    """Run one block in a fresh interpreter from an empty temporary directory; return (ok, seconds, output)."""
    with tempfile.TemporaryDirectory(prefix="fastce-quickstart-") as workdir:
        block_file = Path(workdir) / "quickstart.py"
        block_file.write_text(code, encoding="utf-8")
        command = [sys.executable, "-c", DRIVER, str(block_file), str(CLONE_ROOT)]
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
    args = parser.parse_args()

    front_page_bytes = (CLONE_ROOT / "README.md").stat().st_size
    if front_page_bytes > FRONT_PAGE_BYTES:  # behaviour details belong in docs/, history in bench/NOTES.md
        sys.exit(f"README.md is {front_page_bytes} bytes, over the front page's {FRONT_PAGE_BYTES}")
    blocks = [(f"{path}:{line}", code) for path in map(Path, args.files) for line, code in python_blocks(path)]
    if not blocks:
        sys.exit(f"no ```python blocks in {args.files}")
    if args.list:
        for label, code in blocks:
            print(f"--- {label}\n{code}")
        return

    env = environment_without_clone()
    failures, total = [], time.perf_counter()
    # Threads only wait on the subprocesses; results are reported in README order.
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        runs = [pool.submit(run_block, label, code, args.timeout, env) for label, code in blocks]
        for (label, _), run in zip(blocks, runs):
            ok, seconds, output = run.result()
            print(f"{'ok  ' if ok else 'FAIL'} {seconds:6.1f} s  {label}", flush=True)
            if not ok:
                failures.append(label)
                print(f"----- {label} output -----\n{output.rstrip()}\n-----", flush=True)
    print(f"{len(blocks) - len(failures)} of {len(blocks)} blocks passed in {time.perf_counter() - total:.1f} s")
    if failures:
        sys.exit("failed: " + ", ".join(failures))


if __name__ == "__main__":
    main()
