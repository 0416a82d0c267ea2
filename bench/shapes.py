"""Benchmark shapes: (N tokens, V vocabulary, logits dtype), and the label every implementation ignores."""

from dataclasses import dataclass

# Every bench input ignores every 7th token with this label.
IGNORE_INDEX = -100

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "f16": "float16", "fp32": "float32", "f32": "float32"}


@dataclass(frozen=True)
class Shape:
    N: int
    V: int
    dtype: str = "bfloat16"

    @property
    def logits_bytes(self) -> int:
        return self.N * self.V * DTYPE_BYTES[self.dtype]

    def __str__(self) -> str:
        return f"{self.N}x{self.V} {self.dtype}"


# The standard set: a vocabulary sweep at N=8192 bf16, a short batch with a huge vocabulary, and float32.
STANDARD_SHAPES = (Shape(8192, 32000), Shape(8192, 128256), Shape(8192, 256000), Shape(512, 256000),
                   Shape(8192, 128256, "float32"))  # fmt: skip
# --quick on a GPU: one shape whose logits (256 MiB) are still far larger than the 60 MB L2.
QUICK_GPU_SHAPES = (Shape(4096, 32000),)
# CPU demo (interpreted kernels): tiny, V not a power of two so the masked tail tiles run.
CPU_DEMO_SHAPES_QUICK = (Shape(16, 3000, "float32"), Shape(16, 3000, "bfloat16"))
CPU_DEMO_SHAPES = (Shape(64, 5000, "float32"), Shape(32, 20000, "bfloat16"))


def parse_shapes(text: str, make=Shape, flag="--shapes", form="NxV") -> tuple:
    """'8192x32000,512x256000:float32' -> Shapes (dtype defaults to bfloat16); make, flag and form: another shape
    class with more sizes (bench.linear_shapes: NxHxV)."""
    shapes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        dims, _, dtype = item.partition(":")
        sizes, dtype = dims.lower().split("x"), DTYPE_ALIASES.get(dtype, dtype) or "bfloat16"
        if dtype not in DTYPE_BYTES or len(sizes) != form.count("x") + 1 or not all(n.isdigit() for n in sizes):
            raise ValueError(f"{flag}: cannot read {item!r}; expected {form} or {form}:dtype (bfloat16/float32)")
        shapes.append(make(*map(int, sizes), dtype))
    if not shapes:
        raise ValueError(f"{flag}: no shape given")
    return tuple(shapes)
