"""Whether fastce_torch's kernel variants compile to the same sm_90 instructions as at another commit:

    TRITON_INTERPRET=0 PYTHONPATH=. python -m bench.tools.same_ptx BASE_COMMIT

Compares the kernel-body PTX of each compile_check variant (compiled for the H200 without a GPU) here and at
BASE_COMMIT, less parameters, register numbers, debug lines, labels and the kernel's name (a kernel whose leading
underscore was dropped is compared with the base's _name); new constexprs set False. Exit 1 when any variant differs.
"""

import os
import re
import subprocess
import sys
import tempfile

BODY_LINE = re.compile(r"%[a-z]+[0-9]+")
ENTRY_NAME = re.compile(r"\.entry\s+[A-Za-z_][A-Za-z0-9_]*")
TYPED_POINTERS = ("logits_ptr", "grad_ptr", "tensor_ptr", "student_ptr", "teacher_ptr")  # dtypes in the key


def kernel_body(ptx):
    start = ptx.index(".entry")
    end = ptx.find(".section", start)
    lines = []
    for line in ptx[start : end if end >= 0 else len(ptx)].splitlines():
        text = line.split("//")[0].strip()
        if text and "param" not in text and not text.startswith((".loc", ".file", "$L__tmp")):
            lines.append(ENTRY_NAME.sub(".entry KERNEL", BODY_LINE.sub("%", text)))
    return "\n".join(lines)


def digests(root, constexpr_names=None):
    """(variant, digest of its kernel body) for the tree at `root`, restricted to constexpr_names when given."""
    code = f"""
import hashlib, json, sys
sys.path.insert(0, {root!r})
from fastce_torch import compile_check
from bench.tools.same_ptx import TYPED_POINTERS, kernel_body
names = json.loads(sys.argv[1]) if len(sys.argv) > 1 else None
out = []
for fn, signature, constexprs, warps in compile_check.variants():
    name = fn.__name__ if names is None or fn.__name__ in names else "_" + fn.__name__
    if names is not None:
        base = set(names[name])
        mine = {{p.name for p in fn.params if p.is_constexpr}}
        constexprs = {{k: v for k, v in constexprs.items() if k in base}}
        constexprs.update({{k: False for k in mine - base}})
    key = name + " " + ",".join(f"{{k}}={{v}}" for k, v in sorted(constexprs.items() if names is None else
        ((k, v) for k, v in constexprs.items() if k in names[name]))) + f" warps={{warps}} " + ",".join(
        f"{{k}}={{v}}" for k, v in sorted(signature.items()) if k.endswith(TYPED_POINTERS) or "stride" in k)
    body = kernel_body(compile_check.compile_for_h200(fn, signature, constexprs, warps).asm["ptx"])
    out.append((key, hashlib.md5(body.encode()).hexdigest(),
                [p.name for p in fn.params if p.is_constexpr]))
print(json.dumps(out))
"""
    import json

    args = [sys.executable, "-c", code] + ([json.dumps(constexpr_names)] if constexpr_names else [])
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.getcwd())
    done = subprocess.run(args, capture_output=True, text=True, check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    base_commit = sys.argv[1]
    with tempfile.TemporaryDirectory() as base:
        archive = subprocess.run(["git", "archive", base_commit, "fastce_torch"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", base], input=archive.stdout, check=True)
        before = digests(base)
        names = {}
        for key, _, constexprs in before:
            names[key.split()[0]] = constexprs
        after = {key: digest for key, digest, _ in digests(".", names)}
    differ = [key for key, digest, _ in before if after.get(key) != digest]
    for key in differ:
        print(f"differs: {key}")
    print(f"{len(before) - len(differ)} of {len(before)} variants of {base_commit} compile to the same instructions")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
