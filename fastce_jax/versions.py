"""Compatibility module: ``fastce_jax.versions`` as users import it today (``UntestedReleaseWarning`` is
documented: docs/jax-backends.md). The code lives in fastce_jax/core/versions.py."""

from .core.versions import (
    TESTED,
    UntestedReleaseWarning,
    installed_versions,
    major_minor,
    tested_range,
    untested,
    warn_if_untested,
)

__all__ = [
    "TESTED",
    "UntestedReleaseWarning",
    "installed_versions",
    "major_minor",
    "tested_range",
    "untested",
    "warn_if_untested",
]
