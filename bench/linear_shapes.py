"""The fused linear bench's shapes and the fastce configurations it times, shared by its torch rows (bench.linear)
and its JAX rows (bench.jax_linear)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class LinearShape:
    N: int
    H: int
    V: int
    dtype: str = "bfloat16"

    @property
    def flops(self) -> float:
        return 6.0 * self.N * self.H * self.V

    def __str__(self):
        return f"N={self.N} H={self.H} V={self.V} {self.dtype}"


LINEAR_SHAPES = (
    LinearShape(4096, 4096, 128256),
    LinearShape(8192, 4096, 128256),
    LinearShape(8192, 3584, 152064),
    LinearShape(8192, 2304, 256000),
    LinearShape(32768, 4096, 128256),
)
QUICK_SHAPE = LinearShape(8192, 4096, 128256)

# The configurations both packages' linear_cross_entropy are timed in, as row-name suffixes and the keyword
# arguments of the call: the defaults, the float32 weight-gradient accumulator, a 1 GiB workspace.
FASTCE_SETTINGS = {
    "": {},
    "_f32acc": {"accumulate_in_float32": True},
    "_1GiB": {"workspace_bytes": 1 << 30},
}


def parse_linear_shapes(text):
    """'NxHxV[:dtype],...' -> LinearShapes (dtype defaults to bfloat16)."""
    shapes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        dims, _, dtype = item.partition(":")
        parts = dims.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"--linear-shapes: cannot read {item!r}; expected NxHxV or NxHxV:dtype")
        shapes.append(LinearShape(*map(int, parts), dtype or "bfloat16"))
    return tuple(shapes)
