"""The torch and Triton releases fastce_torch is tested on; importing fastce_torch on another one warns once.

Tested (the ranges pyproject.toml states): torch 2.11 (the H200 machine, CI's oldest-torch job), 2.13 (CI) and 2.14
(CI's release job); Triton 3.6 (CI, the H200 machine), 3.8 and 3.9 (CI's release jobs, interpreted and compiled for
sm_90), 3.7 once by hand. Newer releases may work; they have not been run here.
"""

import importlib.metadata
import re
import warnings

__all__ = [
    "TESTED",
    "UntestedReleaseWarning",
    "installed_versions",
    "major_minor",
    "tested_range",
    "untested",
    "warn_if_untested",
    "warned",
]

# Inclusive (major, minor) bounds per distribution.
TESTED = {"torch": ((2, 11), (2, 14)), "triton": ((3, 6), (3, 9))}


class UntestedReleaseWarning(UserWarning):
    """An installed torch or Triton release lies outside the range fastce_torch is tested on."""


warned = False  # set once the warning was given (once per process)


def major_minor(version):
    """(major, minor) of a version string such as '2.13.0+cpu' or '3.9.0', or None when it has no such prefix."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def untested(installed):
    """'name version' for each {name: version} entry outside TESTED (unknown names and versions are skipped)."""
    out = []
    for name, version in installed.items():
        release = major_minor(version) if version else None
        if name in TESTED and release is not None:
            low, high = TESTED[name]
            if not low <= release <= high:
                out.append(f"{name} {version}")
    return out


def tested_range(name):
    (low_major, low_minor), (high_major, high_minor) = TESTED[name]
    return f"{name} {low_major}.{low_minor} to {high_major}.{high_minor}"


def installed_versions():
    found = {}
    for name in TESTED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def warn_if_untested(installed=None):
    """Warn (once per process) when an installed release is outside the tested range."""
    global warned
    outside = untested(installed_versions() if installed is None else installed)
    if outside and not warned:
        warned = True
        ranges = ", ".join(tested_range(name) for name in TESTED)
        warnings.warn(
            f"fastce_torch is tested on {ranges}; installed: {', '.join(outside)}. It may work, but no test has run "
            "on this release (silence with warnings.filterwarnings('ignore', category="
            "fastce_torch.versions.UntestedReleaseWarning)).",
            UntestedReleaseWarning,
            stacklevel=3,
        )
    return outside
