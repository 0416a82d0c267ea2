"""Environment JAX must see before its first import (kept apart so importing it has no side effects)."""

import os


def configure(interpret_only=False):
    # Allocate on demand instead of grabbing 75% of the GPU up front: bench tests and tools run torch beside JAX.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if interpret_only:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
