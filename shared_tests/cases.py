"""The table of shared cases: every option of the contract, edge shapes, ignore patterns, bad labels, -inf padding,
non-finite rows, strided rows, and the chunked 256K vocabularies (few rows: the CPU interpreters are slow)."""

from .harness import Case
from .reference import Options

DTYPES = ("float32", "bfloat16", "float16")
ALL = Options(logit_softcapping=30.0, logit_scaling=0.5, label_smoothing=0.1, z_loss=1e-3)


def _each_dtype(case, dtypes=DTYPES):
    return [Case(**{**case.__dict__, "dtype": d}) for d in dtypes]


_BASE = [
    # reductions
    Case("mean", seed=1),
    Case("sum", reduction="sum", seed=2),
    Case("none", reduction="none", seed=3),  # random upstream cotangent per token
    # each option alone, then all together
    Case("softcap", opts=Options(logit_softcapping=5.0), std=4.0, seed=4),  # |z| near the cap: tanh saturates
    Case("scaling", opts=Options(logit_scaling=0.25), seed=5),
    Case("scaling-negative", opts=Options(logit_scaling=-1.5), reduction="none", seed=6),
    Case("smoothing", opts=Options(label_smoothing=0.1), seed=7),
    Case("z-loss", opts=Options(z_loss=1e-2), offset=20.0, seed=8),  # lse ~ 25: z-loss term dominates
    Case("all-options", opts=ALL, reduction="none", seed=9),
    Case("all-options-3d", shape=(2, 3), opts=ALL, seed=10),
    # n_items overrides the denominator of "mean" and "sum"
    Case("n-items-int", n_items=7, seed=11),
    Case("n-items-float", n_items=2.5, opts=Options(label_smoothing=0.2), seed=12),
    Case("n-items-tensor", n_items=("tensor", 23), seed=13),
    Case("n-items-float-tensor", n_items=("tensor", 9.5), seed=14),
    Case("n-items-sum", reduction="sum", n_items=("tensor", 6), opts=Options(z_loss=1e-3), seed=45),
    # ignore patterns
    Case("all-ignored", ignore="all", seed=15),  # mean: 0 with a zero gradient
    Case("all-ignored-sum", ignore="all", reduction="sum", opts=ALL, seed=16),
    Case("none-ignored", ignore="none", seed=17),
    Case("ignore-real-class", ignore="class", opts=Options(ignore_index=3), vocab=50, shape=(12,), seed=18),
    Case("ignore-minus-one", opts=Options(ignore_index=-1), bad_labels=(-100,), reduction="none", seed=19),
    # out-of-range labels: NaN loss and NaN gradient row, other rows untouched
    Case("bad-labels-none", bad_labels=(-1, 1000, 1007, -(2**31), 2**31 - 1), reduction="none", seed=20),
    Case("bad-labels-mean", bad_labels=(1000,), seed=21),
    Case("bad-labels-int32", bad_labels=(-5, 2**31 - 1), label_dtype="int32", reduction="none", seed=22),
    # -inf padding: finite loss, zero gradient at -inf (but label smoothing makes mean(z) = -inf: loss +inf)
    Case("neg-inf-tail", neg_inf="tail", reduction="none", seed=23),
    Case("neg-inf-scatter", neg_inf="scatter", opts=Options(z_loss=1e-3), seed=24),
    Case(
        "neg-inf-softcap-smoothing", neg_inf="tail", opts=Options(logit_softcapping=20.0, label_smoothing=0.1), seed=25
    ),  # softcap maps -inf to -20: finite mean(z), finite loss
    Case("neg-inf-smoothing", neg_inf="tail", opts=Options(label_smoothing=0.1), reduction="none", seed=26),
    # NaN / +inf in a row: that row's loss NaN, others untouched; an ignored NaN row stays 0
    Case("nonfinite-rows", nonfinite_rows=True, reduction="none", seed=27),
    Case("nonfinite-rows-mean", nonfinite_rows=True, seed=28),
    # strided rows (a view of a wider buffer whose extra columns are NaN), 2-D and 3-D
    Case("strided", row_pad=24, inplace=False, opts=Options(label_smoothing=0.1), seed=29),
    Case("strided-3d", shape=(2, 3), row_pad=3, inplace=False, reduction="none", seed=30),
    # large offsets: the max-shift must keep exp in range
    Case("offset-large", offset=60.0, std=8.0, opts=Options(z_loss=1e-4), seed=31),
    Case("offset-negative", offset=-80.0, reduction="sum", seed=32),
    # label dtypes, non-inplace
    Case("int32-labels", label_dtype="int32", seed=33),
    Case("not-inplace", inplace=False, opts=ALL, seed=34),
    # jax under jit (n_items as an array constant, the custom_vjp's backward inside a jitted transpose)
    Case("jit-mean", jit=True, n_items=("tensor", 5), opts=Options(label_smoothing=0.1), seed=43),
    Case("jit-none", jit=True, reduction="none", opts=ALL, bad_labels=(1000,), seed=44),
    # edge shapes
    Case("n0", shape=(0,), seed=35),
    Case("n0-3d-none", shape=(2, 0), reduction="none", seed=36),
    Case("v1", vocab=1, shape=(5,), opts=Options(label_smoothing=0.1, z_loss=1e-3), seed=37),
    Case("v2", vocab=2, shape=(7,), reduction="none", seed=38),
    Case("v-odd", vocab=4097, shape=(3,), opts=ALL, seed=39),  # one past a tile
    Case("v-odd-small", vocab=13, shape=(4, 2), seed=40),
    Case("4d", shape=(2, 2, 2), vocab=33, reduction="none", opts=Options(label_smoothing=0.3), seed=41),
    Case("one-token", shape=(1,), vocab=70000, seed=42),  # chunked row
]

CASES = [c for base in _BASE for c in _each_dtype(base)]

# The chunked 256K vocabularies: few rows, so the forward splits each row into many chunks (CONTRACT.md: chunks
# shrink while N*C < 1024), fixed seeds.
BIG = [
    Case("v256000", shape=(2,), vocab=256000, seed=100),
    Case("v256000-all", shape=(2,), vocab=256000, dtype="bfloat16", opts=ALL, reduction="none", seed=101),
    Case("v256000-smoothing", shape=(2,), vocab=256000, dtype="float16", opts=Options(label_smoothing=0.1), seed=102),
    Case(
        "v262147-bad-labels",
        shape=(3,),
        vocab=262147,
        dtype="bfloat16",
        bad_labels=(262147,),
        opts=Options(logit_softcapping=30.0),
        reduction="none",
        seed=103,
    ),
    Case(
        "v262147-neg-inf-strided",
        shape=(2,),
        vocab=262147,
        row_pad=5,
        neg_inf="tail",
        inplace=False,
        opts=Options(z_loss=1e-3),
        seed=104,
    ),
    Case(
        "v262147-3d-ignore",
        shape=(1, 3),
        vocab=262147,
        dtype="float16",
        label_dtype="int32",
        opts=Options(logit_scaling=2.0, label_smoothing=0.05),
        seed=105,
    ),
]

# GPU only: enough rows that the chunk width stays at its maximum (65536), i.e. the other end of the heuristic.
GPU_BIG = [
    Case("v256000-many-rows", shape=(264,), vocab=256000, dtype="bfloat16", opts=ALL, seed=200),
    Case("v262147-many-rows", shape=(8, 33), vocab=262147, dtype="float32", reduction="none", seed=201),
]
