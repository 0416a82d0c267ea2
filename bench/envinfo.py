"""Where and with what a run happened: date, device, commit, package versions."""

import datetime
import importlib.metadata
import os
import platform
import re
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
# Distribution names whose versions go into the JSON (absent ones are recorded as "absent").
DISTRIBUTIONS = ("torch", "triton", "jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "liger-kernel", "numpy",
                 "matplotlib", "fastce")  # fmt: skip


def today() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")


def git_commit() -> str:
    """HEAD's sha, with '-dirty' appended when tracked files differ from it (as `git describe --dirty` does).
    Where the tree is a copy without .git, set BENCH_COMMIT to the sha it was copied from."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]

    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        return git("rev-parse", "HEAD") + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def versions(extra: dict | None = None) -> dict:
    found = {"python": platform.python_version()}
    for dist in DISTRIBUTIONS:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            if dist in ("torch", "triton", "jax", "jaxlib", "liger-kernel"):
                found[dist] = "absent"
    try:
        import torch

        found["torch_cuda"] = torch.version.cuda or "none"
    except ImportError:
        pass
    found.update(extra or {})
    return found


def device_slug(device: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200' (for file names)."""
    return re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-") or "device"
