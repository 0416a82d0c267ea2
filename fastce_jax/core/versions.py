"""The jax releases fastce_jax is tested on; importing fastce_jax on another one warns once.

Tested: jax and jaxlib 0.10.2 (CI, Pallas interpret mode) and 0.11.2 (the H200 machine, compiled). jax 0.12 is
supported by reading its source only (docs/jax-backends.md): its CPU wheels need Python >= 3.12, which CI lacks, and
the H200 machine has 0.11.2; so importing on 0.12 warns. Newer releases may work; they have not been run here.
"""

import importlib.metadata
import re
import warnings

__all__ = [
    "TESTED",
    "UntestedReleaseWarning",
    "major_minor",
    "untested",
    "tested_range",
    "installed_versions",
    "warn_if_untested",
]

# Inclusive (major, minor) bounds per distribution.
TESTED = {"jax": ((0, 10), (0, 11)), "jaxlib": ((0, 10), (0, 11))}


class UntestedReleaseWarning(UserWarning):
    """An installed jax or jaxlib release lies outside the range fastce_jax is tested on."""


warned = False  # whether this process has warned already (the tests reset it)


def major_minor(version):
    """(major, minor) of a version string such as '0.10.2' or '0.12.0.1', or None when it has no such prefix."""
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
            f"fastce_jax is tested on {ranges}; installed: {', '.join(outside)}. It may work, but no test has run "
            "on this release (silence with warnings.filterwarnings('ignore', category="
            "fastce_jax.versions.UntestedReleaseWarning)).",
            UntestedReleaseWarning,
            stacklevel=3,
        )
    return outside
