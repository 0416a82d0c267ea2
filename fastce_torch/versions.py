"""Compatibility module: `fastce_torch.versions` (UntestedReleaseWarning, which the import-time warning names, and
warn_if_untested), the import path users have, as fastce_jax.versions. The code lives in core/versions.py."""

from .core.versions import *  # noqa: F403
from .core.versions import __all__  # noqa: F401
